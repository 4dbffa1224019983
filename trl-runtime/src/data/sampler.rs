//! Which examples each data-parallel rank reads, epoch by epoch: a permutation seeded by
//! (seed, epoch), identical on every rank, dealt a batch per rank per round as accelerate
//! deals a DataLoader's batches. Deterministic, so a resumed run sees the same order.
//!
//! Dealing round by round keeps a global batch the same set of examples however it is split:
//! with 2 ranks x batch 2 the union of step k is the same 4 examples as 1 rank x batch 4.

use rand::seq::SliceRandom;
use rand::SeedableRng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DistributedSampler {
    pub len: usize,
    pub world: usize,
    pub rank: usize,
    pub seed: u64,
    pub shuffle: bool,
    /// Leave out the rows past the last round of micro-batches every rank fills (shards then
    /// are disjoint); otherwise they are read, filled out with rows from the start as
    /// accelerate fills them (see [`BatchDeal`]).
    pub drop_last: bool,
}

impl DistributedSampler {
    /// Every row once, in the epoch's order (seeded by seed and epoch, or as stored).
    fn shuffled(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(epoch));
            order.shuffle(&mut rng);
        }
        order
    }

    /// How an epoch of `batch`-row micro-batches is dealt (see [`BatchDeal`]).
    pub fn deal(&self, batch: usize) -> BatchDeal {
        BatchDeal {
            len: self.len,
            batch,
            world: self.world,
            drop_last: self.drop_last,
        }
    }

    /// This rank's micro-batches for `epoch`: the epoch's order dealt as [`BatchDeal`] deals
    /// positions.
    pub fn batches(&self, epoch: u64, batch: usize) -> Vec<Vec<usize>> {
        self.batches_from(epoch, batch, 0)
    }

    /// This rank's micro-batches for the rest of `epoch` from position `start` of its order
    /// on: positions `start..` dealt as [`BatchDeal`] deals an epoch (the last rounds filled
    /// from the epoch's start). A run resumed on another layout (world size, batch) goes on
    /// where the saved one stopped: with the same layout it is the saved run's own rounds
    /// from the round at `start`.
    pub fn batches_from(&self, epoch: u64, batch: usize, start: usize) -> Vec<Vec<usize>> {
        let order = self.shuffled(epoch);
        let rest = self.deal_from(batch, start);
        (0..rest.rounds())
            .map(|round| {
                rest.positions(round, self.rank)
                    .map(|i| order[(start + i) % self.len])
                    .collect()
            })
            .collect()
    }

    /// Optimizer steps of `accumulation` micro-batches of `batch` rows in the rest of an
    /// epoch from position `start` (the whole epoch from 0): the last takes what is left.
    pub fn steps_from(&self, batch: usize, accumulation: usize, start: usize) -> usize {
        self.deal_from(batch, start)
            .rounds()
            .div_ceil(accumulation.max(1))
    }

    /// How the rest of an epoch from position `start` is dealt (its rounds).
    pub fn deal_from(&self, batch: usize, start: usize) -> BatchDeal {
        BatchDeal {
            len: self.len.saturating_sub(start),
            ..self.deal(batch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// From a round's start the rest of an epoch is the epoch's own rounds on the same
    /// layout, and on another layout every row left once (filled from the epoch's start).
    #[test]
    fn the_rest_of_an_epoch_is_dealt_from_where_it_stopped() {
        let on = |world: usize, rank: usize| DistributedSampler {
            len: 37,
            world,
            rank,
            seed: 3,
            shuffle: true,
            drop_last: false,
        };
        for world in [1, 2, 3] {
            for rank in 0..world {
                let all = on(world, rank).batches(5, 4);
                let rest = on(world, rank).batches_from(5, 4, 2 * world * 4);
                assert_eq!(rest, all[2..].to_vec(), "world {world} rank {rank}");
            }
        }
        // 2 ranks stopped after 2 rounds (16 rows), 3 ranks go on: the 21 rows left once
        // each, and (2 rounds of 3 x 4) 3 more filled from the epoch's start.
        let order = on(1, 0).batches(5, 37).concat();
        let mut dealt: Vec<usize> = (0..3)
            .flat_map(|r| on(3, r).batches_from(5, 4, 16).concat())
            .collect();
        dealt.sort();
        let mut want: Vec<usize> = order[16..].iter().chain(&order[..3]).copied().collect();
        want.sort();
        assert_eq!(dealt, want);
    }
}

/// Positions 0..len dealt as accelerate's prepared DataLoader deals a dataset (training
/// and evaluation alike): batches of `batch`; one process reads them all (the last smaller),
/// several read round by round, rank r of round k the batch at k x world + r, the last ones
/// filled from the start (`even_batches`), so that every rank runs the same number of
/// forwards; with `drop_last` only the rounds of full batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchDeal {
    pub len: usize,
    pub batch: usize,
    pub world: usize,
    pub drop_last: bool,
}

impl BatchDeal {
    /// Batches each rank reads (transformers' len(dataloader)).
    pub fn rounds(&self) -> usize {
        let (batch, world) = (self.batch.max(1), self.world.max(1));
        match self.drop_last {
            true => self.len / batch / world,
            false => self.len.div_ceil(batch).div_ceil(world),
        }
    }

    /// The rows of rank `rank`'s batch in round `round`.
    pub fn rows(&self, round: usize, rank: usize) -> Vec<usize> {
        self.positions(round, rank).map(|i| i % self.len).collect()
    }

    /// [`Self::rows`] before the last rounds' wrap to the start: positions past `len` are
    /// the refill.
    pub fn positions(&self, round: usize, rank: usize) -> std::ops::Range<usize> {
        let start = (round * self.world + rank) * self.batch;
        match self.world {
            1 => start..(start + self.batch).min(self.len),
            _ => start..start + self.batch,
        }
    }

    /// The real rows of the last round when it holds fewer than world x batch (accelerate's
    /// `gather_for_metrics` cuts the last round's gathered values to them); None when full.
    pub fn rows_in_last_round(&self) -> Option<usize> {
        let rest = self.len % (self.batch * self.world).max(1);
        (rest > 0 && !self.drop_last).then_some(rest)
    }

    /// How many of [`Self::rows`] are the data's own, not the refill from the start: the
    /// first ones, which are also what `gather_for_metrics` keeps of per-row values.
    pub fn real_rows(&self, round: usize, rank: usize) -> usize {
        let start = (round * self.world + rank) * self.batch;
        self.len.saturating_sub(start).min(self.batch)
    }

    /// How many ranks' per-batch scalars `gather_for_metrics` keeps in `round`: all but in
    /// a short last round, whose gathered [world] tensor it cuts to the round's real rows.
    pub fn ranks_kept(&self, round: usize) -> usize {
        match self.rows_in_last_round() {
            Some(rest) if round + 1 == self.rounds() => rest.min(self.world),
            _ => self.world,
        }
    }
}
