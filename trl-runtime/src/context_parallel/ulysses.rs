//! Ulysses sequence parallelism (DeepSpeed-Ulysses, as ALST uses it): each rank of the sp
//! group holds a chunk of the sequence. Around attention, an all-to-all turns sequence-split
//! q, k, v (all heads, one chunk) into head-split ones (some heads, the whole sequence); each
//! rank attends over the whole sequence for its heads, and a second all-to-all turns the
//! output back. Everything else in the model works token by token on the local chunk.
//!
//! Query heads must divide by the sp size. Key/value heads too, or, when there are fewer of
//! them than ranks, the group size must be a multiple of their count: each is then repeated so
//! that every rank gets the one its query heads read.

use crate::comm::autograd::all_to_all;
use crate::comm::Communicator;
use crate::nn::attention::AttentionImpl;
use crate::nn::mask::{AttentionMask, WithScoreMods};
use candle_core::{DType, Result, Tensor};
use std::sync::Arc;

/// Checks that `heads` query and `kv_heads` key/value heads can be split over `sp` ranks;
/// returns how many times each kv head is repeated (1 when they divide).
pub fn kv_repeats(heads: usize, kv_heads: usize, sp: usize) -> std::result::Result<usize, String> {
    if !heads.is_multiple_of(sp) {
        return Err(format!(
            "{heads} attention heads are not divisible by sp = {sp}: Ulysses gives each rank \
             the same number of heads; pick an sp size that divides {heads}"
        ));
    }
    if kv_heads.is_multiple_of(sp) {
        Ok(1)
    } else if sp.is_multiple_of(kv_heads) {
        Ok(sp / kv_heads)
    } else {
        Err(format!(
            "{kv_heads} key/value heads cannot be split over sp = {sp}: the sp size must divide \
             them or be a multiple of them"
        ))
    }
}

/// Attention of this rank's sequence chunk: `q` [b, heads, chunk, d], `k`, `v` [b, kv_heads,
/// chunk, d], chunks in rank order along the sequence. `mask` is the whole sequence's (built
/// from every rank's position ids). Returns [b, heads, chunk, d].
pub fn ulysses_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    how: AttentionImpl,
    sp: &Arc<dyn Communicator>,
    comm_dtype: Option<DType>,
) -> Result<Tensor> {
    let (heads, kv_heads) = (q.dim(1)?, k.dim(1)?);
    let repeats = kv_repeats(heads, kv_heads, sp.size()).map_err(candle_core::Error::Msg)?;
    // Sequence-split, all heads -> head-split, whole sequence.
    // In `comm_dtype` over the wire (a cast is differentiable: gradients travel the same way).
    let exchange = |t: &Tensor, split: usize, concat: usize| -> Result<Tensor> {
        let wire = match comm_dtype {
            Some(d) if d != t.dtype() => t.to_dtype(d)?,
            _ => t.clone(),
        };
        all_to_all(&wire, sp, split, concat)
            .map_err(|e| e.into_candle())?
            .to_dtype(t.dtype())
    };
    let spread = |t: &Tensor| exchange(t, 1, 2);
    // This rank attends for its share of the heads: their sinks.
    let local = heads / sp.size();
    let narrowed;
    let mask = match &mask.mods.sinks {
        Some(s) => {
            let mine = s.narrow(0, sp.rank() * local, local)?;
            narrowed = mask.clone().with_sinks(Some(mine));
            &narrowed
        }
        None => mask,
    };
    let q = spread(q)?;
    let k = spread(&repeat_heads(k, repeats)?)?;
    let v = spread(&repeat_heads(v, repeats)?)?;
    let out = how.apply(&q, &k, &v, mask)?;
    exchange(&out, 2, 1)
}

/// Each head of `t` [b, heads, s, d] `n` times in a row: [b, heads * n, s, d].
fn repeat_heads(t: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(t.clone());
    }
    let (b, h, s, d) = t.dims4()?;
    t.unsqueeze(2)?
        .broadcast_as((b, h, n, s, d))?
        .contiguous()?
        .reshape((b, h * n, s, d))
}
