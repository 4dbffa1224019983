//! A drop-in for `candle_flash_attn::flash_attn`, and the attention it runs: the one the
//! running forward entered (a strategy's, e.g. context_parallel's ring or Ulysses), or plain
//! causal attention over each whole row.

use super::attention::AttentionImpl;
use super::mask::AttentionMask;
use candle_core::{Result, Tensor};
use std::sync::Arc;

/// One forward's attention, its mask built: what [`flash_attn`] runs while it is current.
/// `q` [b, heads, len, d] attends over `k`, `v` [b, kv_heads, len, d].
pub trait Attend: Send + Sync {
    fn apply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
}

thread_local! {
    /// The attention of the forward running on this thread (see [`flash_attn`]).
    static CURRENT: std::cell::RefCell<Option<Arc<dyn Attend>>> =
        const { std::cell::RefCell::new(None) };
}

/// Makes `attention` what [`flash_attn`] runs on this thread until the guard drops (the
/// model's forward sets it around each layer, and again when a layer is recomputed).
pub fn enter(attention: Arc<dyn Attend>) -> CurrentAttention {
    CurrentAttention(CURRENT.with(|c| c.replace(Some(attention))))
}

/// Restores the attention that was current before [`enter`].
pub struct CurrentAttention(Option<Arc<dyn Attend>>);

impl Drop for CurrentAttention {
    fn drop(&mut self) {
        let previous = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// A drop-in for `candle_flash_attn::flash_attn` (same arguments and layout: `q` [batch,
/// seq, heads, head_dim], `k`, `v` [batch, seq, kv_heads, head_dim]), so that a Candle model
/// written for it runs under every strategy by changing its import. Inside a
/// `parallel::Model` forward it runs that forward's attention: the documents of packed rows
/// kept apart, ring attention or Ulysses when sequences are split. Elsewhere it is plain
/// causal attention over each whole row.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    if !causal {
        candle_core::bail!(
            "flash_attn: a causal language model attends causally (pass causal = true)"
        );
    }
    let (b, s, _, d) = q.dims4()?;
    // The attention kernels scale by 1/sqrt(head_dim); another scale goes into q.
    let rescale = softmax_scale as f64 * (d as f64).sqrt();
    let q = match (rescale - 1.0).abs() < 1e-6 {
        true => q.clone(),
        false => (q * rescale)?,
    };
    let heads_first = |t: &Tensor| t.transpose(1, 2)?.contiguous();
    let (q, k, v) = (heads_first(&q)?, heads_first(k)?, heads_first(v)?);
    let current = CURRENT.with(|c| c.borrow().clone());
    let out = match current {
        Some(attention) => attention.apply(&q, &k, &v)?,
        None => {
            let pos = Tensor::arange(0i64, s as i64, q.device())?
                .unsqueeze(0)?
                .repeat((b, 1))?;
            let mask = AttentionMask::causal(&pos, q.dtype(), q.device())?;
            AttentionImpl::default().apply(&q, &k, &v, &mask)?
        }
    };
    out.transpose(1, 2)?.contiguous()
}
