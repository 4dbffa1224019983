//! Scaled dot-product attention with grouped-query heads and a causal mask that respects the
//! document boundaries of packed sequences (a token attends only to earlier tokens of its own
//! document). Every model calls [`attention`]; the context- and sequence-parallel issues route
//! it to ring or Ulysses attention.

use crate::kernels::precision;
use crate::kernels::softmax::causal_softmax;
use candle_core::{Device, Result, Tensor, D};

pub use super::mask::{document_ids, AttentionMask, WithScoreMods};

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
    // The kernels soft-cap the scores as the mask says.
    let spans = || mask.key_spans().clone().with_softcap(mask.mods.softcap);
    if mask.fused && square && crate::kernels::cpu_flash::applies(q, k) {
        return Some(crate::kernels::cpu_flash::flash_attention_cpu(
            (q, k, v),
            &spans(),
            mask.mods.sinks.as_ref(),
        ));
    }
    #[cfg(feature = "cuda")]
    if square && crate::kernels::cuda_flash::applies(q, k) {
        return Some(crate::kernels::cuda_flash::flash_attention_cuda(
            (q, k, v),
            &spans(),
            mask.mods.sinks.as_ref(),
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
    let scores = mask.cap(scores.to_dtype(precision::wide(dtype))?)?;
    let masked = |scores: Tensor| -> Result<Tensor> {
        match mask.block_bias((0, s), (0, k_len))? {
            Some(bias) => scores.broadcast_add(&bias.to_dtype(scores.dtype())?),
            None => Ok(scores),
        }
    };
    let probs = match (&mask.mods.sinks, mask.fused) {
        // transformers' way: the sink is one more column, dropped after the softmax.
        (Some(sinks), _) => {
            let scores = masked(scores)?;
            let column = sinks
                .to_dtype(scores.dtype())?
                .reshape((1, kv_heads, group, 1, 1))?
                .broadcast_as((b, kv_heads, group, s, 1))?;
            softmax(&Tensor::cat(&[scores, column], 4)?)?.narrow(4, 0, k_len)?
        }
        (None, true) => causal_softmax(&scores, &mask.ranges)?,
        (None, false) => softmax(&masked(scores)?)?,
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
    use crate::kernels::testing::max_abs_diff as max_diff;
    use crate::nn::Window;
    use candle_core::{DType, Var};

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
        let bias_mask = AttentionMask::build(&pos, None, DType::F32, &dev, false).unwrap();
        assert!(!bias_mask.fused);
        let q = Var::randn(0f32, 1.0, (2, 4, 7, 8), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (2, 2, 7, 8), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (2, 2, 7, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (2, 4, 7, 8), &dev).unwrap();
        let run = |m: &AttentionMask| {
            let out = attention(&q, &k, &v, m).unwrap();
            crate::kernels::testing::out_and_grads(out, &w, [&q, &k, &v])
        };
        let (a, ga) = run(&fused_mask);
        let (b, gb) = run(&bias_mask);
        assert!(max_diff(&a, &b) < 1e-5);
        for (x, y) in ga.iter().zip(&gb) {
            assert!(max_diff(x, y) < 1e-5);
        }
    }
    /// Attention sinks (gpt-oss) on every single-process path equal transformers' way (one
    /// more softmax column, dropped): the fused CPU kernel, the blockwise path, with a
    /// window and packed rows; values and the gradients of q, k, v and the sinks.
    #[test]
    fn sinks_agree_on_every_path() {
        let dev = Device::Cpu;
        let (b, heads, kv, s, d) = (2, 4, 2, 37, 8);
        let pos: Vec<i64> = (0..2)
            .flat_map(|r| (0..s as i64).map(move |i| if r == 0 && i >= 20 { i - 20 } else { i }))
            .collect();
        let pos = Tensor::from_vec(pos, (b, s), &dev).unwrap();
        let q = Var::randn(0f32, 1.0, (b, heads, s, d), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (b, kv, s, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (b, kv, s, d), &dev).unwrap();
        // Large sinks take most of some rows' weight.
        let sinks =
            Var::from_tensor(&Tensor::new(&[0.5f32, -1.0, 2.0, 4.0], &dev).unwrap()).unwrap();
        let w = Tensor::randn(0f32, 1.0, (b, heads, s, d), &dev).unwrap();
        let windows = [None, Some(Window::Sliding(6)), Some(Window::Chunked(5))];
        for window in windows {
            let mask = AttentionMask::windowed(&pos, window, DType::F32, &dev)
                .unwrap()
                .with_sinks(Some(sinks.as_tensor().clone()));
            let run = |path: usize| {
                let out = match path {
                    0 => whole_matrix_attention(&q, &k, &v, &mask).unwrap(),
                    1 => attention(&q, &k, &v, &mask).unwrap(),
                    _ => crate::nn::flash_attention(&q, &k, &v, &mask, 16).unwrap(),
                };
                let g = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let grads: Vec<Tensor> = [
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    sinks.as_tensor(),
                ]
                .iter()
                .map(|t| g.get(t).unwrap().clone())
                .collect();
                (out, grads)
            };
            let (want, want_g) = run(0);
            // The sinks matter: without them the output moves.
            let plain = attention(&q, &k, &v, &mask.clone().with_sinks(None)).unwrap();
            assert!(max_diff(&plain, &want) > 1e-2);
            for path in [1, 2] {
                let (got, got_g) = run(path);
                let diff = max_diff(&got, &want);
                assert!(diff < 1e-5, "path {path}, window {window:?}: output {diff}");
                for (name, (a, e)) in ["dq", "dk", "dv", "dsinks"]
                    .iter()
                    .zip(got_g.iter().zip(&want_g))
                {
                    let diff = max_diff(a, e);
                    assert!(diff < 1e-4, "path {path}, window {window:?}: {name} {diff}");
                }
            }
        }
    }
}
