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
    /// Drop the tail that does not fill every rank equally (shards then are disjoint);
    /// otherwise the tail is padded with examples from the start, as torch does.
    pub drop_last: bool,
}

impl DistributedSampler {
    /// The full order of example indices for `epoch`, before dealing.
    pub fn global_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(epoch));
            order.shuffle(&mut rng);
        }
        if self.drop_last {
            order.truncate(self.len / self.world * self.world);
        } else if self.len > 0 {
            let target = self.len.div_ceil(self.world) * self.world;
            let mut i = 0;
            while order.len() < target {
                order.push(order[i]);
                i += 1;
            }
        }
        order
    }

    /// This rank's indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        self.global_order(epoch)
            .into_iter()
            .skip(self.rank)
            .step_by(self.world)
            .collect()
    }

    /// Examples each rank reads per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world
        } else {
            self.len.div_ceil(self.world)
        }
    }
}
