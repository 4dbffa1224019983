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
    spans.check_within(keys)?;
    let longest = spans
        .lo()
        .iter()
        .zip(spans.hi())
        .map(|(l, h)| h.saturating_sub(*l) as usize)
        .max()
        .unwrap_or(0);
    run(q, (k, v), Spans::Host(spans), splits(longest))
}

/// As [`attention`], the spans read on the device from `spans` (u32 [2 * b * sq]: every
/// query's first key, then every query's end), so that a captured CUDA graph reads each
/// step's spans, written before its launch. The keys are split for the whole capacity of the
/// cache, whatever the spans: a graph launches the same grid every step (stretches past a
/// query's keys are empty and cost a block's start).
pub fn attention_on_device(
    q: &Tensor,
    (k, v): (&Tensor, &Tensor),
    spans: &Tensor,
    softcap: Option<f32>,
) -> Result<(Tensor, Tensor)> {
    let (b, _, sq, _) = q.dims4()?;
    if spans.dtype() != DType::U32 || spans.elem_count() != 2 * b * sq {
        bail!(
            "cuda decode attention: spans {:?} {:?} for {b} x {sq} queries",
            spans.dims(),
            spans.dtype()
        );
    }
    let spans = spans.contiguous()?;
    run(q, (k, v), Spans::Device(&spans, softcap), splits(k.dim(2)?))
}

fn splits(keys: usize) -> usize {
    keys.div_ceil(KEYS_PER_SPLIT).clamp(1, 64)
}

fn run(
    q: &Tensor,
    (k, v): (&Tensor, &Tensor),
    spans: Spans,
    splits: usize,
) -> Result<(Tensor, Tensor)> {
    let (b, heads, sq, d) = q.dims4()?;
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

/// Where the kernel reads each query's visible keys.
enum Spans<'a> {
    /// Uploaded from the host at each call.
    Host(&'a KeySpans),
    /// Already on the device (lo then hi), with the soft-cap.
    Device(&'a Tensor, Option<f32>),
}

struct Decode<'a> {
    spans: Spans<'a>,
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
    let n = b * sq;
    let (uploaded, on_device, softcap) = match &this.spans {
        Spans::Host(s) => (Some(stream.clone_htod(&s.both()).w()?), None, s.softcap),
        Spans::Device(t, cap) => (None, Some(t.storage_and_layout()), *cap),
    };
    let both = match (&uploaded, &on_device) {
        (Some(u), _) => u.slice(..),
        (None, Some((storage, layout))) => match &**storage {
            candle_core::Storage::Cuda(c) => {
                c.as_cuda_slice::<u32>()?.slice(layout.start_offset()..)
            }
            _ => bail!("cuda decode attention: the spans must be on the GPU"),
        },
        (None, None) => unreachable!("spans come from the host or the device"),
    };
    let (lo, hi) = (both.slice(..n), both.slice(n..2 * n));
    // SAFETY: every element is written by the split kernel.
    let o_part = unsafe { dev.alloc::<f32>(rows * splits * d)? };
    let lse_part = unsafe { dev.alloc::<f32>(rows * splits)? };
    // The output, then the log-sum-exps, in one vector.
    let packed = dev.alloc_zeros::<f32>(rows * d + rows)?;
    let split_f = dev.get_or_load_custom_func(&format!("decode_split_{sfx}"), MODULE, PTX)?;
    let combine_f = dev.get_or_load_custom_func("decode_combine", MODULE, PTX)?;
    let scale = 1.0 / (d as f32).sqrt();
    let softcap = softcap.unwrap_or(0.0);
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

/// [`super::decode::append_at`] on the GPU: `fresh` [b, kv_heads, sq, d] into `cache` [b,
/// kv_heads, cap, d] after the length the u32 `held` holds, read by the kernel.
pub(super) fn append(
    (cs, cl): (&mut CudaStorage, &Layout),
    (fs, fl): (&CudaStorage, &Layout),
    (hs, hl): (&CudaStorage, &Layout),
) -> Result<()> {
    let dev = fs.device().clone();
    let dtype = fs.dtype();
    let (b, h, cap, d) = cl.shape().dims4()?;
    let sq = fl.shape().dims4()?.2;
    let sfx = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("KV cache append: {other:?} is not supported"),
    };
    if !cl.is_contiguous() {
        bail!("KV cache append: the cache buffer must be contiguous");
    }
    let f = dev.get_or_load_custom_func(&format!("kv_append_{sfx}"), MODULE, PTX)?;
    let held = view::<u32>(hs, hl)?;
    let n = b * h * sq * d;
    let ints = [b * h, sq, cap, d].map(|x| x as i32);
    typed!(dtype, |T| {
        let fresh = view::<T>(fs, fl)?;
        let cache = cs.as_cuda_slice_mut::<T>()?;
        let mut cache = cache.slice_mut(cl.start_offset()..);
        let mut lb = f.builder();
        lb.arg(&mut cache).arg(&fresh).arg(&held);
        for x in &ints {
            lb.arg(x);
        }
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256).clamp(1, 1024), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; it writes inside the cache.
        unsafe { lb.launch(cfg) }.w()?;
    });
    Ok(())
}
