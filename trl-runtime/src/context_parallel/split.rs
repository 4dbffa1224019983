//! How one forward pass attends when its sequences may be split across ranks: whole on this
//! rank, Ulysses over an sp group (one chunk each), or a ring over a cp group (two balanced
//! chunks each). The mask is built once per forward, for every layer; `nn::flash_attn` runs
//! it through [`Attend`].

use super::ring::{ring_attention, RingMask};
use super::ulysses::ulysses_attention;
use crate::comm::Communicator;
use crate::data::sequence::{lcm, split_columns};
use crate::data::Batch;
use crate::dist::mesh::Axis;
use crate::dist::DistContext;
use crate::nn::attention::AttentionImpl;
use crate::nn::flash_attn::Attend;
use crate::nn::mask::{AttentionMask, ScoreMods, WithScoreMods};
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
    /// Where each token of the ranks' parts of a row sits in the row, the parts of `local`
    /// tokens concatenated in rank order (what an all-gather or all-to-all along the sequence
    /// returns): Ulysses' chunks are in order already, ring attention's head-tail chunks not.
    pub fn row_order(&self, local: usize) -> Result<Vec<usize>> {
        let size = self.group.size();
        let parts = (0..size)
            .map(|r| split_columns(local * size, r, size, self.ring))
            .collect::<crate::Result<Vec<_>>>()
            .map_err(|e| e.into_candle())?;
        Ok(parts.concat())
    }

    /// The inverse of [`Self::row_order`]: for each position of the row, which of the
    /// gathered tokens holds it (an `index_select` by it puts gathered parts in row order).
    pub fn gathered_at(&self, local: usize) -> Result<Vec<u32>> {
        let order = self.row_order(local)?;
        let mut at = vec![0u32; order.len()];
        for (i, &position) in order.iter().enumerate() {
            at[position] = i as u32;
        }
        Ok(at)
    }

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
#[derive(Clone)]
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
        window: Option<crate::nn::Window>,
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
}

/// Soft-capping and sinks go into whichever mask the path keeps.
impl WithScoreMods for SeqAttention {
    fn mods_mut(&mut self) -> &mut ScoreMods {
        match self {
            SeqAttention::Whole(mask, _) | SeqAttention::Ulysses(mask, ..) => &mut mask.mods,
            SeqAttention::Ring(mask) => &mut mask.mods,
        }
    }
}

impl SeqAttention {
    /// [`Attend::apply`] with attention sinks [heads] (gpt-oss) when given: this layer's,
    /// on a copy of the attention every layer shares (cheap: its tables are shared).
    pub fn apply_with_sinks(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
    ) -> Result<Tensor> {
        match sinks {
            Some(s) => self.clone().with_sinks(Some(s.clone())).apply(q, k, v),
            None => self.apply(q, k, v),
        }
    }
}

impl Attend for SeqAttention {
    /// Attention of `q` [b, heads, len, d] over `k`, `v` [b, kv_heads, len, d].
    fn apply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        match self {
            SeqAttention::Whole(mask, how) => how.apply(q, k, v, mask),
            SeqAttention::Ulysses(mask, how, group, comm) => {
                ulysses_attention(q, k, v, mask, *how, group, *comm)
            }
            SeqAttention::Ring(mask) => ring_attention(q, k, v, mask),
        }
    }
}

impl Batch {
    /// This rank's part of the rows under `split`: one contiguous chunk (Ulysses) or two
    /// balanced chunks (ring); the batch itself when sequences are not split.
    pub fn part(&self, split: Option<&SeqSplit>) -> crate::Result<Batch> {
        match split {
            None => Ok(self.clone()),
            Some(s) if s.ring => self.balanced_chunks(s.group.rank(), s.group.size()),
            Some(s) => self.chunk(s.group.rank(), s.group.size()),
        }
    }
}

/// The columns of a row of `len` positions that this rank keeps under `split` (what
/// [`Batch::part`] keeps), or None when sequences are whole here.
pub fn kept_columns(split: Option<&SeqSplit>, len: usize) -> crate::Result<Option<Vec<usize>>> {
    split
        .map(|s| split_columns(len, s.group.rank(), s.group.size(), s.ring))
        .transpose()
}

/// The padding multiple rows need under `split` (sp chunks, or 2 x cp for the ring's
/// balance), combined with the one asked for.
pub fn pad_to_multiple(split: Option<&SeqSplit>, multiple: Option<usize>) -> Option<usize> {
    let parts = match split {
        Some(s) if s.ring => 2 * s.group.size(),
        Some(s) => s.group.size(),
        None => 1,
    };
    match parts {
        1 => multiple,
        n => Some(lcm(multiple.unwrap_or(1), n)),
    }
}
