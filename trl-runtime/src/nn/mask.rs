//! Which keys each query may see: causal, within the documents of packed rows (positions
//! that restart open a new document). Built once per forward from the position ids and shared
//! by every layer, by the whole-matrix, blockwise, fused and ring attention paths.

use super::memo::Memo;
use crate::kernels::cpu_flash::KeySpans;
use crate::kernels::precision;
use crate::kernels::softmax::RowRanges;
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

/// Which keys each query may see, derived from position ids: a position that does not follow
/// its predecessor (it restarts, typically at 0) opens a new document.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    /// First visible key of every (batch, row): the start of the row's document.
    pub(super) ranges: RowRanges,
    /// Where and in which dtype the additive masks are built: the activations' device and
    /// their softmax dtype.
    device: Device,
    softmax: DType,
    /// Whether the whole-matrix path uses the fused CPU softmax (then it needs no additive mask).
    pub(super) fused: bool,
    /// Additive masks (0 allowed, a large negative number elsewhere) by (first query, queries,
    /// first key, keys), built on first use and shared by every layer of one forward and its
    /// backward; None where every query sees every key. The whole matrix is one such pair.
    masks: Arc<Memo<BlockPair, Option<Tensor>>>,
    /// The same ranges as the fused kernels take them, built on first use and shared too.
    spans: Arc<std::sync::OnceLock<KeySpans>>,
    /// Soft-capping and sinks.
    pub mods: ScoreMods,
}

/// What a layer changes in its scores beyond which keys they see, carried by every path's
/// mask (this one, the ring's).
#[derive(Debug, Clone, Default)]
pub struct ScoreMods {
    /// Logit soft-capping (Gemma 2's `attn_logit_softcapping`): scores become
    /// `cap * tanh(scores / cap)` before the mask and the softmax (the fused kernels get it
    /// in their key spans).
    pub softcap: Option<f64>,
    /// Attention sinks [heads] (gpt-oss): each head's logit joins every row's softmax as a
    /// key with a zero value (`crate::kernels::sinks`). Per layer, not shared.
    pub sinks: Option<Tensor>,
}

/// A mask with [`ScoreMods`]: the same mask with scores soft-capped or with sinks.
pub trait WithScoreMods: Sized {
    fn mods_mut(&mut self) -> &mut ScoreMods;

    /// The same mask with scores soft-capped at `cap` (None: not capped).
    fn with_softcap(mut self, cap: Option<f64>) -> Self {
        self.mods_mut().softcap = cap;
        self
    }

    /// The same mask with sinks [heads] (None: none).
    fn with_sinks(mut self, sinks: Option<Tensor>) -> Self {
        self.mods_mut().sinks = sinks;
        self
    }
}

impl WithScoreMods for AttentionMask {
    fn mods_mut(&mut self) -> &mut ScoreMods {
        &mut self.mods
    }
}

/// (first query, queries, first key, keys).
type BlockPair = (usize, usize, usize, usize);

/// Added to masked scores: its exp() is 0, without the NaN that -inf - -inf would give.
pub(crate) const MASKED: f32 = -1e30;

/// `cap * tanh(scores / cap)` and, with `slope` (a backward needs it), its slope
/// `1 - tanh^2` (what the scores' gradient is multiplied by); the scores themselves and no
/// slope when `cap` is None.
pub(crate) fn soft_cap(
    scores: Tensor,
    cap: Option<f64>,
    slope: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    match cap {
        Some(cap) => {
            let t = (scores / cap)?.tanh()?;
            let s = slope.then(|| 1.0 - t.sqr()?).transpose()?;
            Ok(((t * cap)?, s))
        }
        None => Ok((scores, None)),
    }
}

/// Which earlier keys of its document a query sees beyond causality (None where a layer
/// attends to all of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Window {
    /// The `n` latest keys, itself included (sliding-window attention: Mistral, Gemma,
    /// `layer_types`' sliding_attention), as transformers' sliding mask: key j is visible
    /// from query i when i - n < j <= i.
    Sliding(usize),
    /// The keys of its own chunk of `n` positions, position p in chunk p / n (Llama 4's
    /// chunked_attention). Positions count from each document's start, so a packed document
    /// or a left-padded prompt has the chunks it has alone, as transformers' chunked mask
    /// counts them from a row's first real token.
    Chunked(usize),
}

impl Window {
    /// The first key that query `i` (at `position` in its document, which starts at index
    /// `start`) sees.
    pub fn first(self, i: usize, start: usize, position: usize) -> usize {
        match self {
            Window::Sliding(n) => start.max((i + 1).saturating_sub(n.max(1))),
            Window::Chunked(n) => start.max(i.saturating_sub(position % n.max(1))),
        }
    }
}

/// Document index of every token of one row of position ids.
pub fn document_ids(positions: &[i64]) -> Vec<u32> {
    let mut doc = 0u32;
    positions
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            if i > 0 && p != positions[i - 1] + 1 {
                doc += 1;
            }
            doc
        })
        .collect()
}

impl AttentionMask {
    /// Causal, document-aware mask for `position_ids` [batch, seq], for activations of `dtype`
    /// on `device` (the fused softmax on CPU, additive masks elsewhere).
    pub fn causal(position_ids: &Tensor, dtype: DType, device: &Device) -> Result<Self> {
        Self::windowed(position_ids, None, dtype, device)
    }

    /// [`Self::causal`], each query seeing only the keys of its document inside its
    /// `window` when one is given.
    pub fn windowed(
        position_ids: &Tensor,
        window: Option<Window>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::build(position_ids, window, dtype, device, device.is_cpu())
    }

    pub(super) fn build(
        position_ids: &Tensor,
        window: Option<Window>,
        dtype: DType,
        device: &Device,
        fused: bool,
    ) -> Result<Self> {
        let rows: Vec<Vec<i64>> = position_ids.to_dtype(DType::I64)?.to_vec2()?;
        Self::from_rows(&rows, window, dtype, device, fused)
    }

    /// [`Self::windowed`] of positions known on the host, `rows` [batch][seq].
    pub(crate) fn from_rows(
        rows: &[Vec<i64>],
        window: Option<Window>,
        dtype: DType,
        device: &Device,
        fused: bool,
    ) -> Result<Self> {
        let (b, s) = (rows.len(), rows.first().map_or(0, Vec::len));
        let mut starts = Vec::with_capacity(b * s);
        for row in rows {
            let docs = document_ids(row);
            let mut start = 0;
            for i in 0..s {
                if i > 0 && docs[i] != docs[i - 1] {
                    start = i;
                }
                // Every query sees the start of its document and, in a window, no further back.
                let first = match window {
                    Some(w) => w.first(i, start, row[i].max(0) as usize),
                    None => start,
                };
                starts.push(first as u32);
            }
        }
        Ok(AttentionMask {
            ranges: RowRanges {
                batch: b,
                rows: s,
                starts: Arc::new(starts),
            },
            device: device.clone(),
            softmax: precision::wide(dtype),
            fused,
            masks: Arc::default(),
            spans: Arc::default(),
            mods: ScoreMods::default(),
        })
    }

    /// `cap * tanh(scores / cap)` when capped (scores in the softmax dtype).
    pub(super) fn cap(&self, scores: Tensor) -> Result<Tensor> {
        Ok(soft_cap(scores, self.mods.softcap, false)?.0)
    }

    pub fn ranges(&self) -> &RowRanges {
        &self.ranges
    }

    /// Every row's visible keys as the fused kernels take them (causal within documents).
    pub fn key_spans(&self) -> &KeySpans {
        self.spans.get_or_init(|| KeySpans::causal(&self.ranges))
    }

    /// The additive mask of queries `q` (first, count) over keys `k` (first, count), [batch, 1,
    /// 1, q count, k count], built on the host and moved to the device.
    fn bias(&self, (q0, qn): (usize, usize), (k0, kn): (usize, usize)) -> Result<Tensor> {
        let r = &self.ranges;
        let mut out = Vec::with_capacity(r.batch * qn * kn);
        for row in r.starts.chunks(r.rows.max(1)) {
            for (q, &start) in (q0..).zip(&row[q0..q0 + qn]) {
                let start = start as usize;
                out.extend((k0..k0 + kn).map(|k| if k >= start && k <= q { 0.0 } else { MASKED }));
            }
        }
        Tensor::from_vec(out, (r.batch, 1, 1, qn, kn), &self.device)?.to_dtype(self.softmax)
    }

    /// Whether some query of block `q` may see a key of block `k`, for key blocks at or before
    /// the query block. Earlier key blocks are then invisible too.
    pub(crate) fn block_visible(&self, (q0, qn): (usize, usize), (k0, kn): (usize, usize)) -> bool {
        let last_key = k0 + kn - 1;
        let r = &self.ranges;
        r.starts
            .chunks(r.rows.max(1))
            .any(|row| row[q0..q0 + qn].iter().any(|&st| st as usize <= last_key))
    }

    /// The additive mask of queries `q` over keys `k`, or None when every query of `q` sees
    /// every key of `k` (a key block wholly before the query block and inside every query's
    /// document): most block pairs of long rows need no mask at all.
    pub(crate) fn block_bias(
        &self,
        q: (usize, usize),
        k: (usize, usize),
    ) -> Result<Option<Tensor>> {
        self.masks.get_or_build((q.0, q.1, k.0, k.1), || {
            let r = &self.ranges;
            let open = k.0 + k.1 <= q.0
                && r.starts
                    .chunks(r.rows.max(1))
                    .all(|row| row[q.0..q.0 + q.1].iter().all(|&st| st as usize <= k.0));
            match open {
                true => Ok(None),
                false => self.bias(q, k).map(Some),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunked attention starts each query at its chunk (positions counted in its document),
    /// a sliding window `n` keys back; both never before the document's start.
    #[test]
    fn windows_start_where_their_kind_says() {
        // A row of two documents: positions 0..7 then 0..5.
        let pos: Vec<i64> = (0..7).chain(0..5).collect();
        let pos = Tensor::from_vec(pos, (1, 12), &Device::Cpu).unwrap();
        let starts = |w| {
            let m = AttentionMask::windowed(&pos, w, DType::F32, &Device::Cpu).unwrap();
            m.ranges().starts.to_vec()
        };
        assert_eq!(
            starts(Some(Window::Chunked(3))),
            [0, 0, 0, 3, 3, 3, 6, 7, 7, 7, 10, 10]
        );
        assert_eq!(
            starts(Some(Window::Sliding(3))),
            [0, 0, 0, 1, 2, 3, 4, 7, 7, 7, 8, 9]
        );
        assert_eq!(starts(None), [0, 0, 0, 0, 0, 0, 0, 7, 7, 7, 7, 7]);
    }
}
