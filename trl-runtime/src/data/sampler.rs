//! Which examples each data-parallel rank reads, epoch by epoch: a permutation seeded by
//! (seed, epoch), identical on every rank, dealt round-robin so that rank r gets positions
//! r, r + world, ... Deterministic, so a resumed run sees the same order.
//!
//! Round-robin dealing keeps a global batch the same set of examples however it is split:
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
    /// Leave out the rows past the last micro-batch every rank fills (shards then are
    /// disjoint); otherwise they are read, filled out with rows from the start as accelerate
    /// fills them (see [`Self::batches`]).
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

    /// Micro-batches of `batch` rows each rank reads per epoch, as transformers' Trainer gets
    /// them from accelerate's prepared DataLoader: with `drop_last`, the batches every rank
    /// fills; without, a single process also reads a smaller last batch, and several
    /// processes read as many batches as the last one needs (accelerate's `even_batches`).
    pub fn num_batches(&self, batch: usize) -> usize {
        let batches = self.len.div_ceil(batch.max(1));
        match (self.drop_last, self.world) {
            (true, world) => self.len / (batch.max(1) * world),
            (false, 1) => batches,
            (false, world) => batches.div_ceil(world),
        }
    }

    /// This rank's [`Self::num_batches`] micro-batches for `epoch`: the epoch's order cut to
    /// what they hold, or with several processes filled out with rows from its start (as
    /// accelerate fills the last batches), dealt round-robin and cut into batches.
    pub fn batches(&self, epoch: u64, batch: usize) -> Vec<Vec<usize>> {
        let mut order = self.shuffled(epoch);
        let rows = self.num_batches(batch) * batch * self.world;
        if self.world > 1 {
            let from_start: Vec<usize> = order.iter().copied().cycle().take(rows).collect();
            order = from_start;
        }
        order.truncate(rows);
        let mine: Vec<usize> = order
            .into_iter()
            .skip(self.rank)
            .step_by(self.world)
            .collect();
        mine.chunks(batch.max(1)).map(<[usize]>::to_vec).collect()
    }
}

/// Evaluation rows, in order, as accelerate's prepared DataLoader deals them: batches of
/// `batch`; one process reads them all (the last smaller), several read round by round, rank
/// r of round k the batch at k x world + r, the last ones filled from the start
/// (`even_batches`), so that every rank runs the same number of forwards; with `drop_last`
/// only the rounds of full batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalDeal {
    pub len: usize,
    pub batch: usize,
    pub world: usize,
    pub drop_last: bool,
}

impl EvalDeal {
    /// Batches each rank reads.
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
}
