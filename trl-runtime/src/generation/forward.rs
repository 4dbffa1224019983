//! What generation needs from a model: [`CachedForward`].

use crate::error::Result;
use crate::nn::KvCache;
use candle_core::{Device, Tensor};
use std::sync::{Arc, Mutex};

/// What generation needs from a model.
pub trait CachedForward {
    /// Logits [batch, vocab] (f32, the whole vocabulary) at the last of `input_ids` [batch,
    /// seq] (u32) at `position_ids` [batch, seq] (i64). With a cache, attention runs over what
    /// it holds and the new keys join it (see [`KvCache::commit`]); without, the rows are
    /// whole.
    fn last_logits(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        cache: Option<&Arc<Mutex<KvCache>>>,
    ) -> Result<Tensor>;

    /// Where the inputs go.
    fn input_device(&self) -> Device;

    /// Whether every process generating together is done, `mine` saying whether this one is
    /// (its forwards are collective: each runs until all are). One process: `mine`.
    fn all_done(&self, mine: bool) -> Result<bool> {
        Ok(mine)
    }

    /// Whether its forward reads a cache's fixed steps (`KvCache::fix_steps`), so that its
    /// decode steps can be replayed as a CUDA graph.
    fn fixed_steps(&self) -> bool {
        false
    }
}
