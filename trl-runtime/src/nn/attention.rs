//! Scaled dot-product attention with grouped-query heads and a causal mask that respects the
//! document boundaries of packed sequences (a token attends only to earlier tokens of its own
//! document). Every model calls [`attention`]; the context- and sequence-parallel issues route
//! it to ring or Ulysses attention.

use super::cpu_flash::KeySpans;
use super::memo::Memo;
use super::precision;
use super::softmax::{causal_softmax, RowRanges};
use candle_core::{DType, Device, Result, Tensor, D};
use std::sync::Arc;

/// Which keys each query may see, derived from position ids: a position that does not follow
/// its predecessor (it restarts, typically at 0) opens a new document.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    /// First visible key of every (batch, row): the start of the row's document.
    ranges: RowRanges,
    /// Where and in which dtype the additive masks are built: the activations' device and
    /// their softmax dtype.
    device: Device,
    softmax: DType,
    /// Whether the whole-matrix path uses the fused CPU softmax (then it needs no additive mask).
    fused: bool,
    /// Additive masks (0 allowed, a large negative number elsewhere) by (first query, queries,
    /// first key, keys), built on first use and shared by every layer of one forward and its
    /// backward; None where every query sees every key. The whole matrix is one such pair.
    masks: Arc<Memo<BlockPair, Option<Tensor>>>,
    /// The same ranges as the fused kernels take them, built on first use and shared too.
    spans: Arc<std::sync::OnceLock<KeySpans>>,
}

/// (first query, queries, first key, keys).
type BlockPair = (usize, usize, usize, usize);

/// Added to masked scores: its exp() is 0, without the NaN that -inf - -inf would give.
pub(crate) const MASKED: f32 = -1e30;

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
        Self::build(position_ids, dtype, device, device.is_cpu())
    }

    fn build(position_ids: &Tensor, dtype: DType, device: &Device, fused: bool) -> Result<Self> {
        let rows: Vec<Vec<i64>> = position_ids.to_dtype(DType::I64)?.to_vec2()?;
        let (b, s) = (rows.len(), rows.first().map_or(0, Vec::len));
        let mut starts = Vec::with_capacity(b * s);
        for row in &rows {
            let docs = document_ids(row);
            let mut start = 0;
            for i in 0..s {
                if i > 0 && docs[i] != docs[i - 1] {
                    start = i;
                }
                starts.push(start as u32);
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
        })
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

/// How attention is computed: transformers' `attn_implementation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionImpl {
    /// The whole [seq x seq] score matrix per head, with a fused causal softmax on CPU
    /// (`eager`, and `sdpa` on CPU): fastest at short lengths, memory quadratic in the length.
    #[default]
    Eager,
    /// Blockwise attention ([`super::flash_attention`], `flash_attention_2`, and `sdpa` on a
    /// GPU): memory linear in the length.
    Flash,
}

impl AttentionImpl {
    pub const NAMES: &'static [&'static str] =
        &["eager", "sdpa", "flash_attention_2", "flash_attention_3"];

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "eager" | "sdpa" => Some(AttentionImpl::Eager),
            "flash_attention_2" | "flash_attention_3" => Some(AttentionImpl::Flash),
            _ => None,
        }
    }

    /// `name` as it runs on `device`. PyTorch's `sdpa` dispatches by device: on a GPU to a
    /// fused memory-efficient (blockwise) kernel, on a CPU to the whole matrix. Ours follows,
    /// so a GPU run of TRL's default keeps attention memory linear in the length as there.
    pub fn for_device(name: &str, device: &Device) -> Option<Self> {
        match Self::parse(name)? {
            AttentionImpl::Eager if name == "sdpa" && device.is_cuda() => {
                Some(AttentionImpl::Flash)
            }
            how => Some(how),
        }
    }

    /// Runs attention this way (see [`attention`] for the shapes).
    pub fn apply(self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask) -> Result<Tensor> {
        match self {
            AttentionImpl::Eager => attention(q, k, v, mask),
            // Where a fused kernel takes the inputs, both names run it.
            AttentionImpl::Flash => fused_kernel(q, k, v, mask).unwrap_or_else(|| {
                super::flash_attention(q, k, v, mask, super::flash::block_for(q.device()))
            }),
        }
    }
}

/// Attention of `q` [batch, heads, seq, head_dim] over `k`, `v` [batch, kv_heads, seq, head_dim].
/// Query head h reads key/value head h / (heads / kv_heads), without copying the kv heads.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask) -> Result<Tensor> {
    fused_kernel(q, k, v, mask).unwrap_or_else(|| whole_matrix_attention(q, k, v, mask))
}

/// The fused attention kernel for these inputs, when one takes them: `cpu_flash` for f32 on
/// the CPU, `cuda_flash` for bf16 / f16 (head dims 64, 128) on a GPU.
fn fused_kernel(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
) -> Option<Result<Tensor>> {
    let square = q.dim(2).ok() == k.dim(2).ok();
    if mask.fused && square && super::cpu_flash::applies(q, k) {
        return Some(super::cpu_flash::flash_attention_cpu(
            q,
            k,
            v,
            mask.key_spans(),
        ));
    }
    #[cfg(feature = "cuda")]
    if square && super::cuda_flash::applies(q, k) {
        return Some(super::cuda_flash::flash_attention_cuda(
            q,
            k,
            v,
            mask.key_spans(),
        ));
    }
    None
}

/// [`attention`] through the whole [seq x seq] score matrix (the reference the fused kernels
/// are tested against).
pub fn whole_matrix_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
) -> Result<Tensor> {
    let (b, heads, s, d) = q.dims4()?;
    let (_, kv_heads, k_len, _) = k.dims4()?;
    if heads % kv_heads != 0 {
        candle_core::bail!(
            "{heads} attention heads cannot share {kv_heads} key/value heads evenly"
        );
    }
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    // [b, kv, group*s, d]: the queries sharing one kv head become one longer matrix. Scaling
    // q (s x d) instead of the scores (s x s) saves a pass over the largest tensor.
    let q = (q * scale)?.reshape((b, kv_heads, group * s, d))?;
    let scores = q.matmul(&k.t()?)?.reshape((b, kv_heads, group, s, k_len))?;
    let dtype = scores.dtype();
    let scores = scores.to_dtype(precision::wide(dtype))?;
    let probs = match mask.fused {
        true => causal_softmax(&scores, &mask.ranges)?,
        false => match mask.block_bias((0, s), (0, k_len))? {
            Some(bias) => softmax(&scores.broadcast_add(&bias.to_dtype(scores.dtype())?)?)?,
            None => softmax(&scores)?,
        },
    }
    .to_dtype(dtype)?
    .reshape((b, kv_heads, group * s, k_len))?;
    probs.matmul(v)?.reshape((b, heads, s, d))
}

/// Softmax over the last dim with the max taken off the graph (it cancels in the gradient).
fn softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::testing::max_abs_diff as max_diff;
    use candle_core::Var;

    /// transformers' names: sdpa is the whole matrix on a CPU (a GPU runs it blockwise; the GPU
    /// tests check that), eager always, flash_attention_2/3 blockwise; others are refused.
    #[test]
    fn attention_names_resolve_per_device() {
        let cpu = Device::Cpu;
        let on_cpu = |name| AttentionImpl::for_device(name, &cpu);
        assert_eq!(on_cpu("sdpa"), Some(AttentionImpl::Eager));
        assert_eq!(on_cpu("eager"), Some(AttentionImpl::Eager));
        assert_eq!(on_cpu("flash_attention_2"), Some(AttentionImpl::Flash));
        assert_eq!(on_cpu("flash_attention_3"), Some(AttentionImpl::Flash));
        assert_eq!(on_cpu("flex_attention"), None);
    }

    /// The fused CPU softmax and the additive-mask path (used on other devices) agree, values
    /// and gradients, on packed rows with grouped heads.
    #[test]
    fn fused_and_additive_paths_agree() {
        let dev = Device::Cpu;
        let pos = Tensor::new(&[[0i64, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]], &dev).unwrap();
        let fused_mask = AttentionMask::causal(&pos, DType::F32, &dev).unwrap();
        assert!(fused_mask.fused);
        // Same ranges, with the additive mask as on a GPU.
        let bias_mask = AttentionMask::build(&pos, DType::F32, &dev, false).unwrap();
        assert!(!bias_mask.fused);
        let q = Var::randn(0f32, 1.0, (2, 4, 7, 8), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (2, 2, 7, 8), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (2, 2, 7, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (2, 4, 7, 8), &dev).unwrap();
        let run = |m: &AttentionMask| {
            let out = attention(&q, &k, &v, m).unwrap();
            let grads = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let g: Vec<Tensor> = [&q, &k, &v]
                .iter()
                .map(|t| grads.get(t).unwrap().clone())
                .collect();
            (out, g)
        };
        let (a, ga) = run(&fused_mask);
        let (b, gb) = run(&bias_mask);
        assert!(max_diff(&a, &b) < 1e-5);
        for (x, y) in ga.iter().zip(&gb) {
            assert!(max_diff(x, y) < 1e-5);
        }
    }
}
