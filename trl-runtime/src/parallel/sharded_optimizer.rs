//! What ZeRO-1/2 ([`super::zero`]) and ZeRO-3 / FSDP ([`super::fsdp`]) optimizers share: each
//! data-parallel rank keeps a slice of every parameter's AdamW state. Checkpoints, resumes,
//! offload, memory accounting and tensor parallelism go through this trait; only the step
//! differs (ZeRO reduces the trainer's gradients, FSDP's arrive reduced in its units).

use super::sharded_state::{Piece, ShardedReader};
use crate::alloc::StorageBytes;
use crate::error::Result;
use crate::models::Params;
use crate::optim::AdamW;
use crate::tp::TpGrads;

pub trait ShardedOptimizer {
    /// Clips by the norm over the tensor-parallel group too (the parameters are tp slices),
    /// and sums partial parameters' gradients over it.
    fn set_tp_grads(&mut self, tp: TpGrads) -> Result<()>;

    /// The AdamW state of this rank's slices.
    fn state(&self) -> &AdamW;

    fn state_mut(&mut self) -> &mut AdamW;

    /// Optimizer steps taken.
    fn step_count(&self) -> u64 {
        self.state().step
    }

    /// Keeps the optimizer state in host memory (CPU offload).
    fn offload_to_host(&mut self) -> Result<()> {
        super::offload::to_host(self.state_mut())
    }

    /// The whole optimizer state per parameter (collective: every rank calls it), as plain
    /// DDP keeps it, for full checkpoints.
    fn gather_full_state(&self) -> Result<AdamW>;

    /// Takes this rank's slices of a full per-parameter state (from any world size) and sets
    /// the parameters to its master weights.
    fn load_full_state(&mut self, full: &AdamW) -> Result<()>;

    /// This rank's slices as per-parameter pieces (SHARDED_STATE_DICT).
    fn pieces(&self) -> Result<Vec<Piece>>;

    /// Reads this rank's slices from a sharded checkpoint written under any world size, wrap
    /// policy or strategy, and sets `params` (those the strategy keeps whole) to them.
    fn load_sharded(&mut self, reader: &ShardedReader, params: &Params) -> Result<()>;

    /// Adds the storage of this rank's optimizer state to `held` (the master weights only
    /// where they are not the parameters themselves).
    fn add_storage(&self, held: &mut StorageBytes) {
        self.state().add_storage(held)
    }
}

/// Sets up a freshly built sharded optimizer: tensor-parallel gradients, a resumed run's
/// state (whole or by slices), offload.
pub fn prepare(
    opt: &mut dyn ShardedOptimizer,
    tp_grads: Option<&TpGrads>,
    full_state: Option<&AdamW>,
    sharded_state: Option<&ShardedReader>,
    params: &Params,
    offload: bool,
) -> Result<()> {
    if let Some(tp) = tp_grads {
        opt.set_tp_grads(tp.clone())?;
    }
    if let Some(full) = full_state {
        opt.load_full_state(full)?;
    }
    if let Some(reader) = sharded_state {
        opt.load_sharded(reader, params)?;
    }
    if offload {
        opt.offload_to_host()?;
    }
    Ok(())
}
