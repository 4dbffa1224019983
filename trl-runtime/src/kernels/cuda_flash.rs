//! Fused attention on CUDA, forward and backward, for bf16 and f16 with head dims 64 and 128:
//! what `sdpa` / `flash_attention_2` / `eager` run on a GPU for those inputs (others keep the
//! blockwise Candle-op path), and what ring attention runs per (query chunk, key chunk) pair.
//! Key spans, packed rows and grouped-query heads as on CPU (`cpu_flash`, the same tiling,
//! tested against the whole score matrix and the blockwise ring). `TRL_FLASH_CUDA=0` turns it
//! off.
//!
//! The kernels (`kernels/flash.cu`) are FlashAttention-2 with the operands in registers,
//! `mma.sync` and `ldmatrix`; docs/gpu.md has their measurements. On Hopper both have `wgmma`
//! versions (`kernels/flash_sm90.cu`, `TRL_FLASH_WGMMA=1`, not yet run on a GPU). (A first
//! version through WMMA, with the scores in shared memory, ran 7-8x slower on an H100 and is
//! gone.)
//!
//! The kernels write f32 (outputs, dQ, dK, dV; rows padded to the 64-row blocks). [`forward`]
//! returns the output in f32 with each row's log-sum-exp (ring attention merges them);
//! [`backward`] takes the whole attention's output and log-sum-exp and casts the gradients
//! to the inputs' dtype by one more kernel.

use super::cpu_flash::{KeySpans, Three};
use super::cuda_fused::{switch, typed, view};
use super::op::fused_op;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor,
};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
const MODULE: &str = "trl_flash";
/// The Hopper kernels (kernels/flash_sm90.cu, wgmma), PTX for sm_90a: loaded only on GPUs of
/// compute capability 9.0.
const PTX_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_sm90.ptx"));
const MODULE_SM90: &str = "trl_flash_sm90";
/// Query rows per forward block and keys per backward block (the padding of outputs).
const BLOCK: usize = 64;
const THREADS: u32 = 128;

/// Whether the fused kernels run on GPUs (`TRL_FLASH_CUDA=0` turns them off).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch(&ON, "TRL_FLASH_CUDA")
}

/// Whether the fused kernels take these inputs: on a GPU, bf16 or f16, head dim 64 or 128.
pub fn applies(q: &Tensor, k: &Tensor) -> bool {
    let Ok((_, heads, _, d)) = q.dims4() else {
        return false;
    };
    let Ok((_, kv_heads, _, _)) = k.dims4() else {
        return false;
    };
    enabled()
        && q.device().is_cuda()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && k.dtype() == q.dtype()
        && matches!(d, 64 | 128)
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
    kernel_in(dev, (MODULE, PTX), name, shared)
}

/// [`kernel`] from the module `(name, PTX)`.
fn kernel_in(
    dev: &CudaDevice,
    (module, ptx): (&'static str, &'static str),
    name: &str,
    shared: usize,
) -> Result<CudaFunction> {
    let f = dev
        .get_or_load_custom_func(name, module, ptx)?
        .into_cuda_function();
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        shared as i32,
    )
    .w()?;
    Ok(f)
}

fn config(grid: (u32, u32), shared: usize) -> LaunchConfig {
    config_threads(grid, THREADS, shared)
}

fn config_threads(grid: (u32, u32), threads: u32, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// Keys per backward block: 128 (8 warps; half the dQ atomic adds of 64), or 64 (4 warps)
/// with `TRL_FLASH_BWD_KEYS=64`.
fn bwd_keys() -> usize {
    static KEYS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KEYS.get_or_init(|| env_choice("TRL_FLASH_BWD_KEYS", &[("128", 128), ("64", 64)]))
}

/// The setting `var` names among `choices` (a value and what it selects), the first when
/// unset; another value is warned about and the first used.
fn env_choice<T: Copy>(var: &str, choices: &[(&str, T)]) -> T {
    let (default, chosen) = choices[0];
    let Ok(value) = std::env::var(var) else {
        return chosen;
    };
    match choices.iter().find(|(name, _)| *name == value) {
        Some(&(_, c)) => c,
        None => {
            let names: Vec<&str> = choices.iter().map(|c| c.0).collect();
            tracing::warn!(
                "{var}={value}: expected {}; using {default}",
                names.join(" or ")
            );
            chosen
        }
    }
}

/// Shared memory of the forward for head dim `d` (2-byte elements): Q, K and V tiles of 64
/// rows, padded by 8 elements.
fn fwd_shared(d: usize) -> usize {
    3 * 64 * (d + 8) * 2
}

/// Whether attention runs the Hopper kernels (kernels/flash_sm90.cu: wgmma): with
/// `TRL_FLASH_WGMMA=1` on a GPU of compute capability 9.0. Off by default until a GPU run has
/// checked them against the CPU and timed them (`scripts/gpu-run tests` and `attention` run
/// both).
/// Decided once per process (a process computes on one GPU), not per launch.
fn wgmma(dev: &CudaDevice) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        env_choice("TRL_FLASH_WGMMA", &[("0", false), ("1", true)])
            && dev
                .cuda_stream()
                .context()
                .compute_capability()
                .is_ok_and(|cc| cc == (9, 0))
    })
}

/// The kernels attention runs at head dim `d` on `dev` under the current switches
/// (`TRL_FLASH_*`): `wgmma` (the Hopper ones), else `mma[-async]-bwd<keys>[r32]`. The attention
/// bench labels its lines with it.
pub fn kernels_in_use(dev: &CudaDevice, d: usize) -> String {
    if wgmma(dev) {
        return "wgmma".into();
    }
    let rows = if bwd_two_blocks(d) { "r32" } else { "" };
    let copies = if pipelined() { "-async" } else { "" };
    format!("mma{copies}-bwd{}{rows}", bwd_keys())
}

/// One of flash_sm90.cu's probes of the two wgmma operand forms alone (the GPU test
/// `wgmma_operands_follow_the_cpu` compares them with the CPU, so that a first run tells an
/// operand-layout error from one in a kernel's logic). On a GPU of compute capability 9.0,
/// contiguous inputs: bf16 `a` [64, d] and `b` [n, d] (n 32 or 64, d 64 or 128) give `a b^T`
/// [64, n]; f32 `a` [64, 64] (rounded to bf16 on the way in) and bf16 `b` [64, d] give `a b`
/// [64, d]. In f32.
#[doc(hidden)]
pub fn wgmma_probe(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &WgProbe)
}

struct WgProbe;

fused_op!(WgProbe: CustomOp2 [this] {
    name: "wgmma-probe",
    cpu(_, _, _, _) {
        bail!("the wgmma probes run on GPUs of compute capability 9.0")
    }
    cuda(a, al, b, bl) {
        let dev = a.device().clone();
        let (n, d) = bl.shape().dims2()?;
        let products = a.dtype() == DType::F32;
        let (name, cols, shared) = if products {
            (format!("wg_probe_rs_d{d}"), d, 64 * d * 2)
        } else {
            (format!("wg_probe_ss_n{n}_d{d}"), n, (64 + n) * d * 2)
        };
        let f = kernel_in(&dev, (MODULE_SM90, PTX_SM90), &name, shared)?;
        let out = dev.alloc_zeros::<f32>(64 * cols)?;
        let bv = view::<half::bf16>(b, bl)?;
        let (av32, av16);
        let stream = dev.cuda_stream();
        let mut lb = stream.launch_builder(&f);
        if products {
            av32 = view::<f32>(a, al)?;
            lb.arg(&av32);
        } else {
            av16 = view::<half::bf16>(a, al)?;
            lb.arg(&av16);
        }
        lb.arg(&bv).arg(&out);
        // SAFETY: the arguments match the kernel's signature; shared memory as computed.
        unsafe { lb.launch(config_threads((1, 1), 128, shared)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((64, cols))))
    }
});

/// Shared memory of the Hopper forward: Q, K and V^T tiles of 64 x `d`, unpadded (its
/// operands are core-matrix tiles, free of bank conflicts).
fn wg_shared(d: usize) -> usize {
    3 * 64 * d * 2
}

/// Shared memory of the Hopper backward: K, V and K^T of 128 keys, Q, dO, Q^T and dO^T of a
/// query tile (64 rows at head dim 64, 32 at 128), and dS (tile x 128).
fn wg_bwd_shared(d: usize) -> usize {
    let rows = if d == 64 { 64 } else { 32 };
    (3 * 128 * d + 4 * rows * d + rows * 128) * 2
}

/// Whether the 128-key backward at head dim 64 runs on query tiles of 32 rows, two blocks per
/// multiprocessor (the `flash_bwd128r32_` kernels), instead of 64 rows and one block
/// (`TRL_FLASH_BWD_ROWS=64`). On by default: on an H200 (2026-12-04) attention fwd+bwd took
/// 0.94 / 4.38 / 50.5 ms at 2 x 2048 / 1 x 8192 / 1 x 32768 against 0.98 / 4.72 / 61.2 ms on
/// 64-row tiles (docs/gpu.md).
fn bwd_two_blocks(d: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| env_choice("TRL_FLASH_BWD_ROWS", &[("32", true), ("64", false)]));
    on && d == 64 && bwd_keys() == 128
}

/// Query rows per backward tile (flash.cu's FLASH_DTYPE and FLASH_BWD_R32).
fn bwd_rows(d: usize) -> usize {
    if d == 64 && !bwd_two_blocks(d) {
        64
    } else {
        32
    }
}

/// Shared memory of the backward: K and V tiles of `bwd_keys` rows, Q and dO of `bwd_rows`
/// (twice with [`pipelined`]), padded by 8 elements; dS (rows x keys + 8).
fn bwd_shared(d: usize) -> usize {
    let (keys, br) = (bwd_keys(), bwd_rows(d));
    let tiles = if pipelined() { 4 } else { 2 };
    (2 * keys + tiles * br) * (d + 8) * 2 + br * (keys + 8) * 2
}

/// Whether the kernels load their tiles by `cp.async`, overlapping loads with the math: K/V
/// in the forward, the next query tile in the backward. On by default: on an H200 it ran
/// attention fwd+bwd 14-19% faster than the synchronous kernels and the batch-8 step 7.9%
/// faster (docs/gpu.md). `TRL_FLASH_ASYNC=0` selects the synchronous ones (`scripts/gpu-run
/// tests` and `attention` run both).
fn pipelined() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_choice("TRL_FLASH_ASYNC", &[("1", true), ("0", false)]))
}

/// `flash_fwd_` / `flash_bwd128_` with `async_` when [`pipelined`], and `cap_` for the
/// kernels that soft-cap the scores (compiled apart, so the others stay as measured).
fn variant(stem: &str, spans: &KeySpans) -> String {
    match pipelined() {
        true => capped(&format!("{stem}async_"), spans),
        false => capped(stem, spans),
    }
}

/// `stem` with `cap_` for the kernels that soft-cap the scores.
fn capped(stem: &str, spans: &KeySpans) -> String {
    match spans.softcap {
        Some(_) => format!("{stem}cap_"),
        None => stem.to_string(),
    }
}

/// The geometry of one call, q [b, hq, nq, d] and k, v [b, hk, nk, d]: [b, hq, hk, nq, nk, d].
type Dims = [usize; 6];

fn dims(q: &Layout, k: &Layout, spans: &KeySpans) -> Result<Dims> {
    let (b, hq, nq, d) = q.shape().dims4()?;
    let (_, hk, nk, _) = k.shape().dims4()?;
    if spans.len() != b * nq {
        bail!(
            "cuda flash attention: {} key spans for {b} x {nq} queries",
            spans.len()
        );
    }
    Ok([b, hq, hk, nq, nk, d])
}

/// The spans on the GPU: (lo, hi) per (batch row, query).
fn upload(dev: &CudaDevice, spans: &KeySpans) -> Result<(CudaSlice<u32>, CudaSlice<u32>)> {
    let stream = dev.cuda_stream();
    Ok((
        stream.clone_htod(spans.lo()).w()?,
        stream.clone_htod(spans.hi()).w()?,
    ))
}

/// Casts `src` (f32, `groups` x `sum` blocks of `rows_pad` rows of `d`) into `dst` (T,
/// `groups` blocks of `rows` rows), adding each group's `sum` blocks (query heads sharing a
/// key/value head).
#[allow(clippy::too_many_arguments)]
fn unpad_sum_cast<T: DeviceRepr>(
    dev: &CudaDevice,
    dtype: DType,
    src: &CudaSlice<f32>,
    dst: &mut candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, T>,
    groups: usize,
    sum: usize,
    rows: usize,
    rows_pad: usize,
    d: usize,
) -> Result<()> {
    let f = kernel(dev, &format!("unpad_sum_cast_{}", suffix(dtype)?), 0)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let (g64, s, r, rp, di) = (
        groups as u64,
        sum as i32,
        rows as i32,
        rows_pad as i32,
        d as i32,
    );
    b.arg(src)
        .arg(dst)
        .arg(&g64)
        .arg(&s)
        .arg(&r)
        .arg(&rp)
        .arg(&di);
    let n = groups * rows * d;
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    // SAFETY: the arguments match the kernel's signature.
    unsafe { b.launch(config((blocks, 1), 0)) }.w()?;
    Ok(())
}

/// The arguments both kernels end with: head counts, lengths and the padded length as i32,
/// then the score scale and the soft-cap (0: none).
fn tail_args(sizes: [usize; 5], d: usize, spans: &KeySpans) -> ([i32; 5], [f32; 2]) {
    let scale = 1.0 / (d as f32).sqrt();
    (
        sizes.map(|n| n as i32),
        [scale, spans.softcap.unwrap_or(0.0)],
    )
}

/// The kernels as one op over (q, k, v), forward or backward.
struct Flash<'a> {
    spans: &'a KeySpans,
    pass: Pass,
}

enum Pass {
    /// The f32 outputs [b x hq, nq_pad, d] and then the log-sum-exps [b x hq, nq_pad], in
    /// one vector.
    Forward,
    /// dq, dk and dv packed in one vector, from the whole attention's output and its gradient
    /// (the inputs' dtype) and log-sum-exp (f32), all contiguous.
    Backward {
        out: Tensor,
        dout: Tensor,
        lse: Tensor,
    },
}

/// A CUDA input of the op: its storage and layout.
type Input<'a> = (&'a CudaStorage, &'a Layout);

fused_op!(Flash<'_>: CustomOp3 [this] {
    name: "cuda-flash-attention",
    cpu(_, _, _, _, _, _) {
        bail!("cuda flash attention runs on GPUs (the CPU has kernels::cpu_flash)")
    }
    cuda(qs, ql, ks, kl, vs, vl) {
        let dims = dims(ql, kl, this.spans)?;
        let qkv = [(qs, ql), (ks, kl), (vs, vl)];
        match &this.pass {
            Pass::Forward => launch_forward(this.spans, dims, qkv),
            Pass::Backward { out, dout, lse } => {
                launch_backward(this.spans, dims, qkv, (out, dout, lse))
            }
        }
    }
});

fn launch_forward(
    spans: &KeySpans,
    [b, hq, hk, nq, nk, d]: Dims,
    [(qs, ql), (ks, kl), (vs, vl)]: [Input; 3],
) -> Result<(CudaStorage, Shape)> {
    let dev = qs.device().clone();
    let dtype = qs.dtype();
    let nq_pad = nq.div_ceil(BLOCK) * BLOCK;
    let (lo, hi) = upload(&dev, spans)?;
    let n_out = b * hq * nq_pad * d;
    let packed = dev.alloc_zeros::<f32>(n_out + b * hq * nq_pad)?;
    let (shared, f) = if wgmma(&dev) {
        let name = format!("{}{}_d{d}", capped("flash_fwd_wg_", spans), suffix(dtype)?);
        let shared = wg_shared(d);
        (
            shared,
            kernel_in(&dev, (MODULE_SM90, PTX_SM90), &name, shared)?,
        )
    } else {
        let name = format!("{}{}_d{d}", variant("flash_fwd_", spans), suffix(dtype)?);
        let shared = fwd_shared(d);
        (shared, kernel(&dev, &name, shared)?)
    };
    let stream = dev.cuda_stream();
    typed!(dtype, |T| {
        let (q, k, v) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
        let (o, lse) = (packed.slice(..n_out), packed.slice(n_out..));
        let (ints, floats) = tail_args([hq, hk, nq, nk, nq_pad], d, spans);
        let mut lb = stream.launch_builder(&f);
        lb.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&lo)
            .arg(&hi)
            .arg(&o)
            .arg(&lse);
        for a in &ints {
            lb.arg(a);
        }
        for a in &floats {
            lb.arg(a);
        }
        let grid = ((nq_pad / BLOCK) as u32, (b * hq) as u32);
        // SAFETY: the arguments match the kernel's signature; shared memory as computed.
        unsafe { lb.launch(config(grid, shared)) }.w()?;
    });
    let n = packed.len();
    Ok((CudaStorage::wrap_cuda_slice(packed, dev), Shape::from(n)))
}

/// Attention of `q` [b, heads, nq, d] over `k`, `v` [b, kv_heads, nk, d] (bf16 / f16, on a
/// GPU) as `spans` say, without autograd: the output in f32 and each row's log-sum-exp
/// [b, heads, nq] (minus infinity where a row sees no key).
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, spans: &KeySpans) -> Result<(Tensor, Tensor)> {
    let (b, hq, nq, d) = q.dims4()?;
    let nq_pad = nq.div_ceil(BLOCK) * BLOCK;
    let packed = q.contiguous()?.apply_op3_no_bwd(
        &k.contiguous()?,
        &v.contiguous()?,
        &Flash {
            spans,
            pass: Pass::Forward,
        },
    )?;
    let n_out = b * hq * nq_pad * d;
    let out = packed
        .narrow(0, 0, n_out)?
        .reshape((b, hq, nq_pad, d))?
        .narrow(2, 0, nq)?;
    let lse = packed
        .narrow(0, n_out, b * hq * nq_pad)?
        .reshape((b, hq, nq_pad))?
        .narrow(2, 0, nq)?
        .contiguous()?;
    Ok((out, lse))
}

fn launch_backward(
    spans: &KeySpans,
    [b, hq, hk, nq, nk, d]: Dims,
    [(qs, ql), (ks, kl), (vs, vl)]: [Input; 3],
    (out, dout, lse): Three,
) -> Result<(CudaStorage, Shape)> {
    let dev = qs.device().clone();
    let dtype = qs.dtype();
    let sfx = suffix(dtype)?;
    // The Hopper backward has blocks of 128 keys, as the default one.
    let hopper = wgmma(&dev);
    let keys = if hopper { 128 } else { bwd_keys() };
    let nk_pad = nk.div_ceil(keys) * keys;
    let stream = dev.cuda_stream();
    let (lo, hi) = upload(&dev, spans)?;
    let (out_guard, out_layout) = out.storage_and_layout();
    let (grad_guard, grad_layout) = dout.storage_and_layout();
    let (lse_guard, lse_layout) = lse.storage_and_layout();
    let (Storage::Cuda(os), Storage::Cuda(gs), Storage::Cuda(ls)) =
        (&*out_guard, &*grad_guard, &*lse_guard)
    else {
        bail!(
            "cuda flash attention: the output, its gradient and the log-sum-exp must be on the GPU"
        )
    };
    let lse = view::<f32>(ls, lse_layout)?;
    let rows = b * hq * nq;
    // A block per query head, writing dK and dV per query head (summed over each group
    // by the cast): the grid stays batch x query heads wide.
    let kv_blocks = b * hq;
    let delta = dev.alloc_zeros::<f32>(rows)?;
    let dq = dev.alloc_zeros::<f32>(b * hq * nq * d)?;
    // Fully written by the kernel (padding rows included).
    // SAFETY: every element is written before it is read.
    let dk = unsafe { dev.alloc::<f32>(kv_blocks * nk_pad * d)? };
    let dv = unsafe { dev.alloc::<f32>(kv_blocks * nk_pad * d)? };
    let (n_q, n_k) = (b * hq * nq * d, b * hk * nk * d);
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

        let (shared, f) = if hopper {
            let name = format!("{}{sfx}_d{d}", capped("flash_bwd_wg_", spans));
            let shared = wg_bwd_shared(d);
            (
                shared,
                kernel_in(&dev, (MODULE_SM90, PTX_SM90), &name, shared)?,
            )
        } else {
            let shared = bwd_shared(d);
            let rows = if bwd_two_blocks(d) { "r32" } else { "" };
            let stem = variant(&format!("flash_bwd{keys}{rows}_"), spans);
            let name = format!("{stem}{sfx}_d{d}");
            (shared, kernel(&dev, &name, shared)?)
        };
        let (ints, floats) = tail_args([hq, hk, nq, nk, nk_pad], d, spans);
        let mut lb = stream.launch_builder(&f);
        lb.arg(&q).arg(&k).arg(&v).arg(&g).arg(&lse).arg(&delta);
        lb.arg(&lo).arg(&hi).arg(&dq).arg(&dk).arg(&dv);
        for a in &ints {
            lb.arg(a);
        }
        for a in &floats {
            lb.arg(a);
        }
        let grid = ((nk_pad / keys) as u32, kv_blocks as u32);
        // 16 keys per warp.
        let threads = (keys / 16 * 32) as u32;
        // SAFETY: the arguments match the kernel's signature; shared memory as computed.
        unsafe { lb.launch(config_threads(grid, threads, shared)) }.w()?;

        let group = kv_blocks / (b * hk);
        // SAFETY: every element is written by the three casts.
        let mut packed = unsafe { dev.alloc::<T>(n_q + 2 * n_k)? };
        let mut cast =
            |src: &CudaSlice<f32>, at: std::ops::Range<usize>, groups, sum, rows, pad| {
                unpad_sum_cast(
                    &dev,
                    dtype,
                    src,
                    &mut packed.slice_mut(at),
                    groups,
                    sum,
                    rows,
                    pad,
                    d,
                )
            };
        cast(&dq, 0..n_q, b * hq, 1, nq, nq)?;
        cast(&dk, n_q..n_q + n_k, b * hk, group, nk, nk_pad)?;
        cast(&dv, n_q + n_k..n_q + 2 * n_k, b * hk, group, nk, nk_pad)?;
        CudaStorage::wrap_cuda_slice(packed, dev.clone())
    });
    Ok((packed, Shape::from(n_q + 2 * n_k)))
}

/// The gradients of `q`, `k`, `v` for output gradient `dout`, given the output `out` (any
/// float dtype) and log-sum-exp `lse` [b, heads, nq] of the whole attention these keys are
/// part of (see [`forward`]); in the inputs' dtype.
pub fn backward(
    (q, k, v): Three,
    (out, lse, dout): Three,
    spans: &KeySpans,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = q.dtype();
    let op = Flash {
        spans,
        pass: Pass::Backward {
            out: out.to_dtype(dtype)?.contiguous()?,
            dout: dout.to_dtype(dtype)?.contiguous()?,
            lse: lse.to_dtype(DType::F32)?.contiguous()?,
        },
    };
    let packed = q
        .contiguous()?
        .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)?;
    let (nq, nk) = (q.elem_count(), k.elem_count());
    Ok((
        packed.narrow(0, 0, nq)?.reshape(q.shape())?,
        packed.narrow(0, nq, nk)?.reshape(k.shape())?,
        packed.narrow(0, nq + nk, nk)?.reshape(v.shape())?,
    ))
}

/// Attention of `q` [b, heads, sq, d] over `k`, `v` [b, kv_heads, sk, d] as `spans` say (the
/// decoder's: [`crate::nn::AttentionMask::key_spans`]), with autograd, by the fused kernels
/// (see the module docs); with `sinks` [heads] as [`super::sinks`] says.
pub fn flash_attention_cuda(
    (q, k, v): Three,
    spans: &KeySpans,
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    let (out, lse) = forward(&q.detach(), &k.detach(), &v.detach(), spans)?;
    let out = (out.to_dtype(q.dtype())?, lse);
    super::cpu_flash::with_kernel_backward((q, k, v), out, spans, sinks, backward)
}
