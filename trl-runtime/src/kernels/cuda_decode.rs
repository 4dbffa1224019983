//! Decode attention on CUDA (`kernels/decode.cu`): new queries against the KV cache, the keys
//! of each query split over blocks as flash-decoding does, then combined. What
//! [`super::decode::attention`] is on the CPU, with the same arguments and results; the split
//! and combine are proven on the CPU (`decode::split_combine`). Compiled in CI, to be run on
//! the first GPU (scripts/gpu-run).

use super::cpu_flash::KeySpans;
use super::cuda_fused::{typed, view};
use super::op::fused_op;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CpuStorage, CudaStorage, DType, Layout, Result, Shape, Tensor};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
const MODULE: &str = "trl_decode";
const WARPS: u32 = 4;
/// Keys per split, at least: enough work per block to hide a block's start.
const KEYS_PER_SPLIT: usize = 256;

/// Whether the kernel takes these: q and the cache on a GPU in one of f32, bf16, f16, head dim
/// at most 256.
pub fn applies(q: &Tensor, cache: &Tensor) -> bool {
    q.device().is_cuda()
        && q.dtype() == cache.dtype()
        && matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && q.dims().last().is_some_and(|&d| d <= 256)
}

/// As [`super::decode::attention`]: the output [b, heads, sq, d] and log-sum-exp [b, heads,
/// sq], both f32.
pub fn attention(
    q: &Tensor,
    (k, v): (&Tensor, &Tensor),
    keys: usize,
    spans: &KeySpans,
) -> Result<(Tensor, Tensor)> {
    let (b, heads, sq, d) = q.dims4()?;
    super::decode::check_spans(spans, keys)?;
    let longest = spans
        .lo()
        .iter()
        .zip(spans.hi())
        .map(|(l, h)| h.saturating_sub(*l) as usize)
        .max()
        .unwrap_or(0);
    let splits = longest.div_ceil(KEYS_PER_SPLIT).clamp(1, 64);
    let rows = b * heads * sq;
    let packed = q.contiguous()?.apply_op3_no_bwd(
        &k.contiguous()?,
        &v.contiguous()?,
        &Decode { spans, splits },
    )?;
    let out = packed.narrow(0, 0, rows * d)?.reshape((b, heads, sq, d))?;
    let lse = packed.narrow(0, rows * d, rows)?.reshape((b, heads, sq))?;
    Ok((out, lse))
}

struct Decode<'a> {
    spans: &'a KeySpans,
    splits: usize,
}

fused_op!(Decode<'_>: CustomOp3 [this] {
    name: "cuda-decode-attention",
    cpu(_, _, _, _, _, _) {
        bail!("cuda decode attention runs on GPUs (the CPU has kernels::decode)")
    }
    cuda(qs, ql, ks, kl, vs, vl) {
        launch(this, (qs, ql), (ks, kl), (vs, vl))
    }
});

fn launch(
    this: &Decode,
    (qs, ql): (&CudaStorage, &Layout),
    (ks, kl): (&CudaStorage, &Layout),
    (vs, vl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = qs.device().clone();
    let dtype = qs.dtype();
    let (b, heads, sq, d) = ql.shape().dims4()?;
    let (_, kv_heads, cap, _) = kl.shape().dims4()?;
    let rows = b * heads * sq;
    let splits = this.splits;
    let sfx = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("cuda decode attention: {other:?} is not supported"),
    };
    let stream = dev.cuda_stream();
    let lo = stream.clone_htod(this.spans.lo()).w()?;
    let hi = stream.clone_htod(this.spans.hi()).w()?;
    // SAFETY: every element is written by the split kernel.
    let o_part = unsafe { dev.alloc::<f32>(rows * splits * d)? };
    let lse_part = unsafe { dev.alloc::<f32>(rows * splits)? };
    // The output, then the log-sum-exps, in one vector.
    let packed = dev.alloc_zeros::<f32>(rows * d + rows)?;
    let split_f = dev.get_or_load_custom_func(&format!("decode_split_{sfx}"), MODULE, PTX)?;
    let combine_f = dev.get_or_load_custom_func("decode_combine", MODULE, PTX)?;
    let scale = 1.0 / (d as f32).sqrt();
    let softcap = this.spans.softcap.unwrap_or(0.0);
    let ints = [heads, kv_heads, sq, cap, d, splits].map(|n| n as i32);
    typed!(dtype, |T| {
        let (q, k, v) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
        let mut lb = split_f.builder();
        lb.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&lo)
            .arg(&hi)
            .arg(&o_part)
            .arg(&lse_part);
        for n in &ints {
            lb.arg(n);
        }
        lb.arg(&scale).arg(&softcap);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, splits as u32, 1),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature.
        unsafe { lb.launch(cfg) }.w()?;
    });
    let (out, lse) = (packed.slice(..rows * d), packed.slice(rows * d..));
    let (rows_i, splits_i, d_i) = (rows as i32, splits as i32, d as i32);
    let mut lb = combine_f.builder();
    lb.arg(&o_part)
        .arg(&lse_part)
        .arg(&out)
        .arg(&lse)
        .arg(&rows_i)
        .arg(&splits_i)
        .arg(&d_i);
    let cfg = LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(WARPS), 1, 1),
        block_dim: (32 * WARPS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (a warp per row).
    unsafe { lb.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(packed, dev),
        Shape::from(rows * d + rows),
    ))
}
