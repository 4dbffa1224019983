//! Fused causal attention on CUDA (`kernels/flash.cu`: FlashAttention-2's tiling on tensor
//! cores through WMMA), forward and backward, for bf16 and f16 with head dims 64 and 128:
//! what `sdpa` / `flash_attention_2` / `eager` run on a GPU for those inputs (others keep the
//! blockwise Candle-op path). Packed rows and grouped-query heads as on CPU
//! (`cpu_flash`, the same tiling, tested against the whole score matrix). `TRL_FLASH_CUDA=0`
//! turns it off.
//!
//! The kernels write f32 (outputs, dQ, dK, dV; rows padded to the 64-row blocks), cast to the
//! inputs' dtype by one more kernel; the log-sum-exp of every row is kept for backward.

use super::cuda_fused::{switch, typed, view};
use super::softmax::RowRanges;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Storage,
    Tensor,
};
use std::sync::Mutex;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
const MODULE: &str = "trl_flash";
/// Query rows per forward block and keys per backward block (the padding of outputs).
const BLOCK: usize = 64;
const THREADS: u32 = 128;

/// Whether the fused kernels run on GPUs (`TRL_FLASH_CUDA=0` turns them off).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch(&ON, "TRL_FLASH_CUDA")
}

/// Whether [`flash_attention_cuda`] takes these inputs: on a GPU, bf16 or f16, head dim 64
/// or 128, keys as long as queries.
pub fn applies(q: &Tensor, k: &Tensor) -> bool {
    let Ok((_, heads, s, d)) = q.dims4() else {
        return false;
    };
    let Ok((_, kv_heads, k_len, _)) = k.dims4() else {
        return false;
    };
    enabled()
        && q.device().is_cuda()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && k.dtype() == q.dtype()
        && matches!(d, 64 | 128)
        && k_len == s
        && kv_heads > 0
        && heads % kv_heads == 0
}

fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => bail!("cuda flash attention: {d:?} is not supported (bf16, f16)"),
    })
}

/// A kernel allowed `shared` bytes of dynamic shared memory.
fn kernel(dev: &CudaDevice, name: &str, shared: usize) -> Result<CudaFunction> {
    let f = dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function();
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        shared as i32,
    )
    .w()?;
    Ok(f)
}

fn config(grid: (u32, u32), shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// Shared memory of the forward and backward kernels for head dim `d` (2-byte elements).
fn fwd_shared(d: usize) -> usize {
    let (br, bc) = (64, 32);
    br * d * 2 + 2 * bc * d * 2 + 4 * 16 * bc * 4 + 4 * 16 * bc * 2
}

fn bwd_shared(d: usize) -> usize {
    let (bc, br) = (64, 32);
    2 * bc * d * 2
        + 2 * br * d * 2
        + 2 * (4 * 16 * br * 4)
        + 4 * 16 * br * 2
        + bc * br * 2
        + 4 * br * (d / 4) * 4
}

/// (batch, query heads, kv heads, length, head dim) of q and k.
fn dims(q: &Layout, k: &Layout) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, hq, s, d) = q.shape().dims4()?;
    let (_, hk, _, _) = k.shape().dims4()?;
    Ok((b, hq, hk, s, d))
}

/// Casts `src` (f32, `groups` blocks of `rows_pad` rows of `d`) into `dst` (T, `rows` rows).
#[allow(clippy::too_many_arguments)]
fn unpad_cast<T: DeviceRepr>(
    dev: &CudaDevice,
    dtype: DType,
    src: &CudaSlice<f32>,
    dst: &mut candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, T>,
    groups: usize,
    rows: usize,
    rows_pad: usize,
    d: usize,
) -> Result<()> {
    let f = kernel(dev, &format!("unpad_cast_{}", suffix(dtype)?), 0)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let (g64, r, rp, di) = (groups as u64, rows as i32, rows_pad as i32, d as i32);
    b.arg(src).arg(dst).arg(&g64).arg(&r).arg(&rp).arg(&di);
    let n = groups * rows * d;
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    // SAFETY: the arguments match the kernel's signature.
    unsafe { b.launch(config((blocks, 1), 0)) }.w()?;
    Ok(())
}

struct FlashCuda {
    ranges: RowRanges,
    /// From forward to backward: every row's log-sum-exp ([batch x heads, padded rows]) and
    /// the document starts as uploaded.
    saved: Mutex<Option<(CudaSlice<f32>, CudaSlice<u32>)>>,
}

impl CustomOp3 for FlashCuda {
    fn name(&self) -> &'static str {
        "cuda-flash-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("cuda flash attention runs on GPUs (the CPU has nn::cpu_flash)")
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
        vs: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = qs.device().clone();
        let dtype = qs.dtype();
        let (b, hq, hk, s, d) = dims(ql, kl)?;
        let s_pad = s.div_ceil(BLOCK) * BLOCK;
        let stream = dev.cuda_stream();
        let starts = stream.clone_htod(self.ranges.starts.as_slice()).w()?;
        let o32 = dev.alloc_zeros::<f32>(b * hq * s_pad * d)?;
        let lse = dev.alloc_zeros::<f32>(b * hq * s_pad)?;
        let shared = fwd_shared(d);
        let f = kernel(&dev, &format!("flash_fwd_{}_d{d}", suffix(dtype)?), shared)?;
        let out = typed!(dtype, |T| {
            let (q, k, v) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
            let scale = 1.0 / (d as f32).sqrt();
            let (hq_i, hk_i, s_i, sp_i) = (hq as i32, hk as i32, s as i32, s_pad as i32);
            let mut lb = stream.launch_builder(&f);
            lb.arg(&q).arg(&k).arg(&v).arg(&starts).arg(&o32).arg(&lse);
            lb.arg(&hq_i).arg(&hk_i).arg(&s_i).arg(&sp_i).arg(&scale);
            let grid = ((s_pad / BLOCK) as u32, (b * hq) as u32);
            // SAFETY: the arguments match the kernel's signature; shared memory as computed.
            unsafe { lb.launch(config(grid, shared)) }.w()?;
            // SAFETY: every element is written by the cast.
            let mut out = unsafe { dev.alloc::<T>(b * hq * s * d)? };
            unpad_cast(
                &dev,
                dtype,
                &o32,
                &mut out.slice_mut(..),
                b * hq,
                s,
                s_pad,
                d,
            )?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        });
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some((lse, starts));
        Ok((out, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some((lse, starts)) = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take()
        else {
            bail!("cuda flash attention: backward ran twice")
        };
        let op = FlashCudaBwd {
            starts,
            lse,
            out: out.contiguous()?,
            grad: grad.contiguous()?,
        };
        let packed = q.apply_op3_no_bwd(k, v, &op)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        Ok((
            Some(packed.narrow(0, 0, nq)?.reshape(q.shape())?),
            Some(packed.narrow(0, nq, nk)?.reshape(k.shape())?),
            Some(packed.narrow(0, nq + nk, nk)?.reshape(v.shape())?),
        ))
    }
}

/// The backward, as an op over (q, k, v) returning dq, dk and dv packed in one vector.
struct FlashCudaBwd {
    starts: CudaSlice<u32>,
    lse: CudaSlice<f32>,
    out: Tensor,
    grad: Tensor,
}

impl CustomOp3 for FlashCudaBwd {
    fn name(&self) -> &'static str {
        "cuda-flash-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("cuda flash attention runs on GPUs")
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
        vs: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = qs.device().clone();
        let dtype = qs.dtype();
        let sfx = suffix(dtype)?;
        let (b, hq, hk, s, d) = dims(ql, kl)?;
        let s_pad = s.div_ceil(BLOCK) * BLOCK;
        let stream = dev.cuda_stream();
        let starts = &self.starts;
        let (out_guard, out_layout) = self.out.storage_and_layout();
        let (grad_guard, grad_layout) = self.grad.storage_and_layout();
        let (Storage::Cuda(os), Storage::Cuda(gs)) = (&*out_guard, &*grad_guard) else {
            bail!("cuda flash attention: the output and its gradient must be on the GPU")
        };
        let rows = b * hq * s;
        let delta = dev.alloc_zeros::<f32>(rows)?;
        let dq = dev.alloc_zeros::<f32>(b * hq * s * d)?;
        let dk = dev.alloc_zeros::<f32>(b * hk * s_pad * d)?;
        let dv = dev.alloc_zeros::<f32>(b * hk * s_pad * d)?;
        let (nq, nk) = (b * hq * s * d, b * hk * s * d);
        let packed = typed!(dtype, |T| {
            let (q, k, v) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
            let (o, g) = (view::<T>(os, out_layout)?, view::<T>(gs, grad_layout)?);
            let f = kernel(&dev, &format!("flash_delta_{sfx}"), 0)?;
            let (rows_i, d_i) = (rows as i32, d as i32);
            let mut lb = stream.launch_builder(&f);
            lb.arg(&o).arg(&g).arg(&delta).arg(&rows_i).arg(&d_i);
            let warps = (THREADS / 32) as usize;
            // SAFETY: the arguments match the kernel's signature.
            unsafe { lb.launch(config((rows.div_ceil(warps) as u32, 1), 0)) }.w()?;

            let shared = bwd_shared(d);
            let f = kernel(&dev, &format!("flash_bwd_{sfx}_d{d}"), shared)?;
            let scale = 1.0 / (d as f32).sqrt();
            let (hq_i, hk_i, s_i, sp_i) = (hq as i32, hk as i32, s as i32, s_pad as i32);
            let mut lb = stream.launch_builder(&f);
            lb.arg(&q)
                .arg(&k)
                .arg(&v)
                .arg(&g)
                .arg(&self.lse)
                .arg(&delta)
                .arg(starts);
            lb.arg(&dq).arg(&dk).arg(&dv);
            lb.arg(&hq_i).arg(&hk_i).arg(&s_i).arg(&sp_i).arg(&scale);
            let grid = ((s_pad / BLOCK) as u32, (b * hk) as u32);
            // SAFETY: the arguments match the kernel's signature; shared memory as computed.
            unsafe { lb.launch(config(grid, shared)) }.w()?;

            // SAFETY: every element is written by the three casts.
            let mut packed = unsafe { dev.alloc::<T>(nq + 2 * nk)? };
            unpad_cast(
                &dev,
                dtype,
                &dq,
                &mut packed.slice_mut(..nq),
                b * hq,
                s,
                s,
                d,
            )?;
            let at = nq + nk;
            unpad_cast(
                &dev,
                dtype,
                &dk,
                &mut packed.slice_mut(nq..at),
                b * hk,
                s,
                s_pad,
                d,
            )?;
            unpad_cast(
                &dev,
                dtype,
                &dv,
                &mut packed.slice_mut(at..),
                b * hk,
                s,
                s_pad,
                d,
            )?;
            CudaStorage::wrap_cuda_slice(packed, dev.clone())
        });
        Ok((packed, Shape::from(nq + 2 * nk)))
    }
}

/// Causal attention of `q` [b, heads, s, d] over `k`, `v` [b, kv_heads, s, d] with the
/// document ranges of `ranges`, by the fused kernels (see the module docs).
pub fn flash_attention_cuda(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ranges: &RowRanges,
) -> Result<Tensor> {
    let op = FlashCuda {
        ranges: ranges.clone(),
        saved: Mutex::new(None),
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}
