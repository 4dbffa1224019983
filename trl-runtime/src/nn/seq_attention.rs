//! How one forward pass attends when its sequences may be split across ranks: whole on this
//! rank, Ulysses over an sp group (one chunk each), or a ring over a cp group (two balanced
//! chunks each). The mask is built once per forward, for every layer.

use super::attention::AttentionImpl;
use super::mask::AttentionMask;
use super::ring::{ring_attention, RingMask};
use super::ulysses::ulysses_attention;
use crate::comm::Communicator;
use crate::dist::mesh::Axis;
use crate::dist::DistContext;
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

/// Sequences split across a group: over a ring (cp) or by Ulysses (sp).
#[derive(Clone)]
pub struct SeqSplit {
    pub group: Arc<dyn Communicator>,
    pub ring: bool,
    /// Ulysses' all-to-alls carry activations (and their gradients) in this dtype
    /// (DeepSpeed's seq_parallel_communication_data_type); None: the compute dtype.
    pub comm_dtype: Option<DType>,
}

impl SeqSplit {
    /// The split the launch asks for: a ring over cp, Ulysses over sp, or none. Both at once
    /// is refused.
    pub fn from_context(ctx: &DistContext) -> crate::Result<Option<SeqSplit>> {
        let (sp, cp) = (ctx.group(&[Axis::Sp]), ctx.group(&[Axis::Cp]));
        let comm_dtype = ctx
            .plan()
            .deepspeed
            .as_ref()
            .and_then(|d| d.seq_parallel_communication_data_type.as_deref())
            .map(|t| match t {
                "bf16" => DType::BF16,
                "fp16" => DType::F16,
                _ => DType::F32,
            });
        Ok(match (sp.size(), cp.size()) {
            (1, 1) => None,
            (_, 1) => Some(SeqSplit {
                group: sp,
                ring: false,
                comm_dtype,
            }),
            (1, _) => Some(SeqSplit {
                group: cp,
                ring: true,
                comm_dtype: None,
            }),
            (s, c) => {
                return Err(crate::Error::Parallelism(format!(
                    "context and sequence parallelism together are not supported (cp = {c}, \
                     sp = {s}): set one of parallelism_config_cp_size / _sp_size to 1"
                )))
            }
        })
    }
}

/// One forward's attention, its mask built.
pub enum SeqAttention {
    Whole(AttentionMask, AttentionImpl),
    Ulysses(
        AttentionMask,
        AttentionImpl,
        Arc<dyn Communicator>,
        Option<DType>,
    ),
    Ring(RingMask),
}

impl SeqAttention {
    /// For this rank's `position_ids` [batch, len] (global positions of its part when split),
    /// within a sliding `window` of keys when given.
    pub fn new(
        split: Option<&SeqSplit>,
        position_ids: &Tensor,
        how: AttentionImpl,
        window: Option<usize>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(match split {
            None => SeqAttention::Whole(
                AttentionMask::windowed(position_ids, window, dtype, device)?,
                how,
            ),
            Some(SeqSplit {
                group, ring: true, ..
            }) => SeqAttention::Ring(RingMask::new(position_ids, group, window)?),
            Some(SeqSplit {
                group,
                ring: false,
                comm_dtype,
            }) => {
                // Documents span chunks: the mask is the whole sequence's.
                let everyone = group
                    .all_gather(&position_ids.to_dtype(DType::I64)?, 1)
                    .map_err(|e| e.into_candle())?;
                let mask = AttentionMask::windowed(&everyone, window, dtype, device)?;
                SeqAttention::Ulysses(mask, how, group.clone(), *comm_dtype)
            }
        })
    }

    /// Attention of `q` [b, heads, len, d] over `k`, `v` [b, kv_heads, len, d].
    pub fn apply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        match self {
            SeqAttention::Whole(mask, how) => how.apply(q, k, v, mask),
            SeqAttention::Ulysses(mask, how, group, comm) => {
                ulysses_attention(q, k, v, mask, *how, group, *comm)
            }
            SeqAttention::Ring(mask) => ring_attention(q, k, v, mask),
        }
    }
}

thread_local! {
    /// The attention of the forward running on this thread (see [`flash_attn`]).
    static CURRENT: std::cell::RefCell<Option<Arc<SeqAttention>>> =
        const { std::cell::RefCell::new(None) };
}

/// Makes `attention` what [`flash_attn`] runs on this thread until the guard drops (the
/// model's forward sets it around each layer, and again when a layer is recomputed).
pub fn enter(attention: Arc<SeqAttention>) -> CurrentAttention {
    CurrentAttention(CURRENT.with(|c| c.replace(Some(attention))))
}

/// Restores the attention that was current before [`enter`].
pub struct CurrentAttention(Option<Arc<SeqAttention>>);

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
