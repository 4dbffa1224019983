//! Generation from a model held whole on this process: every [`CausalModel`] is a
//! [`CachedForward`], its attention over the KV cache through [`LayerInputs`]. Under a
//! strategy, `crate::parallel::Model` is one instead.

use super::causal::{CausalModel, LayerInputs};
use crate::error::{Error, Result};
use crate::generation::{CachedForward, GenerationConfig};
use crate::nn::{AttentionImpl, KvCache, Weight};
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex};

/// The weights' dtype and device: the LM head's, held whole.
fn held(m: &impl CausalModel) -> Result<(DType, Device)> {
    match &m.lm_head().weight {
        Weight::Local(w) => Ok((w.dtype(), w.device().clone())),
        Weight::Sharded(_) => Err(Error::Parallelism(
            "the model's weights are sharded: run it through parallel::Model".into(),
        )),
    }
}

/// Hidden states [batch, seq, hidden] of `m` after its final norm (of the last position
/// alone, [batch, 1, hidden], when `last`), attending over `cache` when given.
pub(crate) fn hidden_states<M: CausalModel>(
    m: &M,
    (input_ids, position_ids): (&Tensor, &Tensor),
    cache: Option<&Arc<Mutex<KvCache>>>,
    last: bool,
) -> Result<Tensor> {
    let (dtype, device) = held(m)?;
    // Fixed steps (a CUDA graph's): positions from the cache, nothing read back.
    let fixed = cache.and_then(|c| {
        let c = c.lock().unwrap_or_else(|e| e.into_inner());
        c.fixed_positions().map(|p| (p, c.capacity()))
    });
    let mut cx = match fixed {
        Some((p, capacity)) => {
            LayerInputs::with_fixed_positions(position_ids, p, capacity, dtype, &device)?
        }
        None => LayerInputs::new(position_ids, None, AttentionImpl::default(), dtype, &device)?,
    };
    if let Some(c) = cache {
        cx = cx.with_cache(c.clone());
    }
    // What `nn::flash_attn` runs inside the layers.
    let _attention = crate::nn::flash_attn::enter(cx.attention.clone());
    let mut x = m.embed(input_ids, &cx)?;
    for l in 0..m.num_layers() {
        x = m.layer(l, &x, &cx)?;
    }
    if last {
        let s = x.dim(1)?;
        x = x.narrow(1, s - 1, 1)?;
    }
    Ok(m.final_norm(&x)?)
}

/// Logits [batch, seq, vocab] of `m` (or of the last position alone, [batch, 1, vocab], when
/// `last`), attending over `cache` when given.
pub(crate) fn logits<M: CausalModel>(
    m: &M,
    inputs: (&Tensor, &Tensor),
    cache: Option<&Arc<Mutex<KvCache>>>,
    last: bool,
) -> Result<Tensor> {
    let logits = m
        .lm_head()
        .forward(&hidden_states(m, inputs, cache, last)?)?;
    Ok(match m.logit_softcap() {
        Some(cap) => ((logits / cap)?.tanh()? * cap)?,
        None => logits,
    })
}

impl<M: CausalModel> CachedForward for M {
    fn last_logits(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        cache: Option<&Arc<Mutex<KvCache>>>,
    ) -> Result<Tensor> {
        crate::kernels::skinny::generation_forward(input_ids.device(), || {
            let l = logits(self, (input_ids, position_ids), cache, true)?;
            Ok(l.squeeze(1)?.to_dtype(DType::F32)?)
        })
    }

    fn input_device(&self) -> Device {
        held(self).map_or(Device::Cpu, |(_, d)| d)
    }

    fn fixed_steps(&self) -> bool {
        true
    }
}

/// Greedy or sampled continuations of left-padded prompts, as transformers'
/// `model.generate(input_ids, attention_mask=..., generation_config=...)`: what
/// [`crate::generation::generate`] does, as a method of every model held whole.
pub trait Generate: CachedForward + Sized {
    /// Tokens [batch, prompt + new] (u32).
    fn generate(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        cfg: &GenerationConfig,
    ) -> Result<Tensor> {
        crate::generation::generate(self, input_ids, attention_mask, cfg)
    }
}

impl<M: CausalModel> Generate for M {}
