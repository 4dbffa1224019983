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
        let order = self.shuffled(epoch);
        let deal = self.deal(batch);
        (0..deal.rounds())
            .map(|round| {
                deal.rows(round, self.rank)
                    .into_iter()
                    .map(|i| order[i])
                    .collect()
            })
            .collect()
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
        let start = (round * self.world + rank) * self.batch;
        match self.world {
            1 => (start..(start + self.batch).min(self.len)).collect(),
            _ => (start..start + self.batch).map(|i| i % self.len).collect(),
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
