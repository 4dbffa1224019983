//! Launches the fused CUDA kernels of `kernels/fused.cu` (compiled to PTX by build.rs) for the
//! custom ops of [`super::fused`]: RMSNorm, SwiGLU and the rotary embedding, forward and
//! backward, on contiguous f32, bf16 and f16 tensors; the fused loss's per-row pass; and for
//! `optim` and the tiled ops the in-place AdamW, the gradient norm's sums of squares and the
//! in-place f32 accumulation (of a tensor, or of a product by cuBLAS). `TRL_FUSED_CUDA=0` turns
//! them off (the ops then run as Candle ops on the GPU, as before).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
const MODULE: &str = "trl_fused";
const THREADS: u32 = 256;

/// An on/off switch read once from `var` (on unless it is `0`).
pub(super) fn switch(cell: &'static std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// Whether the fused kernels run on GPUs (`TRL_FUSED_CUDA=0` turns them off).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch(&ON, "TRL_FUSED_CUDA")
}

fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => bail!("fused CUDA ops: {d:?} is not supported"),
    })
}

/// Blocks for a grid-stride loop over `n` items.
fn grid(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, 65_535) as u32
}

fn config(blocks: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// Runs `$body` with `$t` the Rust element type of `$dtype`.
macro_rules! typed {
    ($dtype:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            d => bail!("fused CUDA ops: {d:?} is not supported"),
        }
    };
}

pub(super) use typed;

fn check(l: &Layout, what: &str) -> Result<()> {
    if !l.is_contiguous() {
        bail!("fused CUDA {what}: inputs must be contiguous");
    }
    Ok(())
}

/// The elements of a contiguous input, as the kernels read them.
pub(super) fn view<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    check(l, "op")?;
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// RMSNorm forward of contiguous `x` (rows of `w`'s length) with weight `w`.
pub fn rms_norm_fwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.0.device().clone();
    let dtype = x.0.dtype();
    let h = w.1.shape().elem_count();
    let rows = x.1.shape().elem_count() / h;
    let f =
        dev.get_or_load_custom_func(&format!("rms_norm_fwd_{}", suffix(dtype)?), MODULE, PTX)?;
    let out = typed!(dtype, |T| {
        let (xs, ws) = (view::<T>(x.0, x.1)?, view::<T>(w.0, w.1)?);
        // SAFETY: every element is written by the kernel.
        let y = unsafe { dev.alloc::<T>(rows * h)? };
        let (rows_i, h_i) = (rows as i32, h as i32);
        let mut b = f.builder();
        b.arg(&xs).arg(&ws).arg(&y).arg(&rows_i).arg(&h_i).arg(&eps);
        // SAFETY: the arguments match the kernel's signature (a warp per row).
        unsafe { b.launch(config(grid(rows, THREADS as usize / 32), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(y, dev.clone())
    });
    Ok((out, x.1.shape().clone()))
}

/// RMSNorm backward: `[dx rows; dw]` as [(rows + 1), h], as the CPU kernel returns it.
pub fn rms_norm_bwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.0.device().clone();
    let dtype = x.0.dtype();
    let sfx = suffix(dtype)?;
    let h = w.1.shape().elem_count();
    let rows = x.1.shape().elem_count() / h;
    let bwd = dev.get_or_load_custom_func(&format!("rms_norm_bwd_{sfx}"), MODULE, PTX)?;
    let cast = dev.get_or_load_custom_func(&format!("cast_from_f32_{sfx}"), MODULE, PTX)?;
    let out = typed!(dtype, |T| {
        let (xs, ws, dys) = (
            view::<T>(x.0, x.1)?,
            view::<T>(w.0, w.1)?,
            view::<T>(dy.0, dy.1)?,
        );
        // SAFETY: every element is written (dx by the first kernel, dw's row by the cast).
        let both = unsafe { dev.alloc::<T>((rows + 1) * h)? };
        let dw = dev.alloc_zeros::<f32>(h)?;
        let (rows_i, h_i) = (rows as i32, h as i32);
        // A warp per row, each with its own row of dw partial sums in shared memory: up to 8
        // warps, as many as keep that within the default 48 KiB.
        let warps = (12 * 1024 / h).clamp(1, 8);
        let launch = LaunchConfig {
            grid_dim: (grid(rows, warps).min(1024), 1, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: (warps * h * 4) as u32,
        };
        {
            let dx = both.slice(..rows * h);
            let mut b = bwd.builder();
            b.arg(&xs)
                .arg(&ws)
                .arg(&dys)
                .arg(&dx)
                .arg(&dw)
                .arg(&rows_i)
                .arg(&h_i)
                .arg(&eps);
            // SAFETY: the arguments match the kernel's signature; shared memory holds a row of
            // h floats per warp.
            unsafe { b.launch(launch) }.w()?;
        }
        {
            let dw_row = both.slice(rows * h..);
            let mut b = cast.builder();
            b.arg(&dw).arg(&dw_row).arg(&h_i);
            // SAFETY: as above.
            unsafe { b.launch(config(grid(h, THREADS as usize), 0)) }.w()?;
        }
        CudaStorage::wrap_cuda_slice(both, dev.clone())
    });
    Ok((out, Shape::from((rows + 1, h))))
}

/// SwiGLU forward of contiguous `g` and `u` (same shapes).
pub fn swiglu_fwd(
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = g.0.device().clone();
    let dtype = g.0.dtype();
    let n = g.1.shape().elem_count();
    let f = dev.get_or_load_custom_func(&format!("swiglu_fwd_{}", suffix(dtype)?), MODULE, PTX)?;
    let out = typed!(dtype, |T| {
        let (gs, us) = (view::<T>(g.0, g.1)?, view::<T>(u.0, u.1)?);
        // SAFETY: every element is written by the kernel.
        let o = unsafe { dev.alloc::<T>(n)? };
        let n64 = n as u64;
        let mut b = f.builder();
        b.arg(&gs).arg(&us).arg(&o).arg(&n64);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(o, dev.clone())
    });
    Ok((out, g.1.shape().clone()))
}

/// SwiGLU backward: `[dg; du]` as [2, n], as the CPU kernel returns it.
pub fn swiglu_bwd(
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
    d: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = g.0.device().clone();
    let dtype = g.0.dtype();
    let n = g.1.shape().elem_count();
    let f = dev.get_or_load_custom_func(&format!("swiglu_bwd_{}", suffix(dtype)?), MODULE, PTX)?;
    let out = typed!(dtype, |T| {
        let (gs, us, ds) = (
            view::<T>(g.0, g.1)?,
            view::<T>(u.0, u.1)?,
            view::<T>(d.0, d.1)?,
        );
        // SAFETY: every element is written by the kernel.
        let o = unsafe { dev.alloc::<T>(2 * n)? };
        let n64 = n as u64;
        let mut b = f.builder();
        b.arg(&gs).arg(&us).arg(&ds).arg(&o).arg(&n64);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(o, dev.clone())
    });
    Ok((out, Shape::from((2, n))))
}

/// SwiGLU of the halves of each row of `gu` [rows, 2 cols] (gate | up): [rows, cols].
pub fn swiglu_halves_fwd(gu: (&CudaStorage, &Layout)) -> Result<(CudaStorage, Shape)> {
    let dev = gu.0.device().clone();
    let dtype = gu.0.dtype();
    let (rows, both) = gu.1.shape().dims2()?;
    let cols = both / 2;
    let f = dev.get_or_load_custom_func(
        &format!("swiglu_halves_fwd_{}", suffix(dtype)?),
        MODULE,
        PTX,
    )?;
    let out = typed!(dtype, |T| {
        let gs = view::<T>(gu.0, gu.1)?;
        // SAFETY: every element is written by the kernel.
        let o = unsafe { dev.alloc::<T>(rows * cols)? };
        let (r64, c64) = (rows as u64, cols as u64);
        let mut b = f.builder();
        b.arg(&gs).arg(&o).arg(&r64).arg(&c64);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(rows * cols, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(o, dev.clone())
    });
    Ok((out, Shape::from((rows, cols))))
}

/// Its backward in place: each row of `gu` becomes (dgate | dup) for the output's gradient
/// `d` [rows, cols].
pub fn swiglu_halves_bwd(
    gu: (&mut CudaStorage, &Layout),
    d: (&CudaStorage, &Layout),
) -> Result<()> {
    check(gu.1, "swiglu_halves_bwd")?;
    let (rows, both) = gu.1.shape().dims2()?;
    let cols = both / 2;
    if d.1.shape().elem_count() != rows * cols || d.0.dtype() != gu.0.dtype() {
        bail!(
            "fused CUDA swiglu_halves_bwd: {:?} against {:?}",
            d.1.dims(),
            gu.1.dims()
        );
    }
    let dev = gu.0.device().clone();
    let dtype = gu.0.dtype();
    let f = dev.get_or_load_custom_func(
        &format!("swiglu_halves_bwd_{}", suffix(dtype)?),
        MODULE,
        PTX,
    )?;
    let start = gu.1.start_offset();
    typed!(dtype, |T| {
        let ds = view::<T>(d.0, d.1)?;
        let mut g = gu.0.as_cuda_slice_mut::<T>()?.slice_mut(start..);
        let (r64, c64) = (rows as u64, cols as u64);
        let mut b = f.builder();
        b.arg(&mut g).arg(&ds).arg(&r64).arg(&c64);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(rows * cols, THREADS as usize), 0)) }.w()?;
    });
    Ok(())
}

/// Rotary embedding (`sign` 1) or its backward (`sign` -1) of `x` [b, heads, seq, d] by `cos`,
/// `sin` [b, seq, d].
pub fn rotary(
    x: (&CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    sign: f32,
) -> Result<(CudaStorage, Shape)> {
    let dev: CudaDevice = x.0.device().clone();
    let dtype = x.0.dtype();
    let (_, heads, seq, d) = x.1.shape().dims4()?;
    let pairs = x.1.shape().elem_count() / 2;
    let f = dev.get_or_load_custom_func(&format!("rotary_{}", suffix(dtype)?), MODULE, PTX)?;
    let out = typed!(dtype, |T| {
        let (xs, cs, ss) = (
            view::<T>(x.0, x.1)?,
            view::<T>(cos.0, cos.1)?,
            view::<T>(sin.0, sin.1)?,
        );
        // SAFETY: every element is written by the kernel.
        let o = unsafe { dev.alloc::<T>(2 * pairs)? };
        let (h_i, s_i, d_i, p64) = (heads as i32, seq as i32, d as i32, pairs as u64);
        let mut b = f.builder();
        b.arg(&xs)
            .arg(&cs)
            .arg(&ss)
            .arg(&o)
            .arg(&h_i)
            .arg(&s_i)
            .arg(&d_i)
            .arg(&p64)
            .arg(&sign);
        // A thread per 16 bytes of pairs where half a row is whole 16-byte units.
        let per = match (d / 2 * dtype.size_in_bytes()) % 16 {
            0 => 16 / dtype.size_in_bytes(),
            _ => 1,
        };
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(pairs.div_ceil(per), THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(o, dev.clone())
    });
    Ok((out, x.1.shape().clone()))
}

/// The fused linear cross-entropy's per-row pass on a contiguous [rows, vocab] logits tile,
/// in place (see `kernels/fused.cu`): `targets`, `loss` and `stats` are the tile's rows of the
/// device-resident targets (i64), per-row losses (f32) and per-row entropy and top-1 flag
/// ([rows, 2] f32), the last two written here. Nothing is read back: the caller sums them on
/// the device once, so the tiles run without synchronizing.
pub fn cross_entropy_rows(
    logits: &mut CudaStorage,
    l: &Layout,
    targets: &CudaView<'_, i64>,
    loss: &CudaView<'_, f32>,
    stats: &CudaView<'_, f32>,
    grads: bool,
) -> Result<()> {
    check(l, "cross-entropy")?;
    let dev = logits.device().clone();
    let dtype = logits.dtype();
    let (rows, vocab) = l.shape().dims2()?;
    if targets.len() != rows || loss.len() != rows || stats.len() != 2 * rows {
        bail!(
            "cross-entropy rows: {rows} logits rows, {} targets",
            targets.len()
        );
    }
    let f = dev.get_or_load_custom_func(
        &format!("cross_entropy_rows_{}", suffix(dtype)?),
        MODULE,
        PTX,
    )?;
    typed!(dtype, |T| {
        let slice = logits.as_cuda_slice_mut::<T>()?;
        let mut view = slice.slice_mut(l.start_offset()..);
        let (r, v, g) = (rows as i32, vocab as i32, grads as i32);
        let mut b = f.builder();
        // The kernel writes `loss` and `stats` (views of buffers only this pass uses).
        b.arg(&mut view)
            .arg(targets)
            .arg(loss)
            .arg(stats)
            .arg(&r)
            .arg(&v)
            .arg(&g);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(rows, 1), 0)) }.w()?;
    });
    Ok(())
}

/// AdamW's constants for [`adamw`]: weight-decay shrink (lr x decay), beta1, beta2, lr / bc1,
/// 1 / sqrt(bc2), eps.
#[derive(Clone, Copy)]
pub struct AdamWConsts {
    /// Multiplies the gradient (the clipping coefficient, 1 without).
    pub grad_scale: f32,
    pub shrink: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub step: f32,
    pub inv_bc2: f32,
    pub eps: f32,
}

/// One AdamW step in place: the contiguous f32 master `w` (mutable here), moments `m` and `v`
/// (written through their views: the caller hands over tensors nothing else reads) from the
/// gradient `g` in f32, bf16 or f16 times `c.grad_scale` (read as it is: no cast or scaling
/// pass), with an optional decay `mask` (u8, 1 where decay applies); with `out` (the model's
/// weight, contiguous, f32, bf16 or f16) the new weight is written there in the same pass.
pub fn adamw_in_place(
    w: (&mut CudaStorage, &Layout),
    [m, v, g]: [(&CudaStorage, &Layout); 3],
    mask: Option<(&CudaStorage, &Layout)>,
    out: Option<(&CudaStorage, &Layout)>,
    c: AdamWConsts,
) -> Result<()> {
    check(w.1, "AdamW")?;
    let dev = w.0.device().clone();
    let n = w.1.shape().elem_count();
    let others = [(m, "exp_avg"), (v, "exp_avg_sq"), (g, "gradient")];
    for (t, what) in others.into_iter().chain(out.map(|o| (o, "weight"))) {
        if t.1.shape().elem_count() != n {
            bail!(
                "fused CUDA AdamW: the {what} has {} elements, the master {n}",
                t.1.shape().elem_count()
            );
        }
    }
    let (gtype, wtype) = (g.0.dtype(), out.map_or(DType::F32, |o| o.0.dtype()));
    let name = format!("adamw_{}_{}", suffix(gtype)?, suffix(wtype)?);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let (ms, vs) = (view::<f32>(m.0, m.1)?, view::<f32>(v.0, v.1)?);
    let mask = match mask {
        Some(k) => Some(view::<u8>(k.0, k.1)?),
        None => None,
    };
    let start = w.1.start_offset();
    let n64 = n as u64;
    let (has_mask, has_out) = (mask.is_some() as i32, out.is_some() as i32);
    typed!(gtype, |G| {
        let gs = view::<G>(g.0, g.1)?;
        typed!(wtype, |W| {
            // Without a weight to write the kernel never touches `out`; the first moment stands
            // in for the pointer (and for the mask's).
            let os = match out {
                Some(o) => Some(view::<W>(o.0, o.1)?),
                None => None,
            };
            let mut ws = w.0.as_cuda_slice_mut::<f32>()?.slice_mut(start..);
            let mut b = f.builder();
            b.arg(&mut ws).arg(&ms).arg(&vs).arg(&gs);
            match &mask {
                Some(k) => b.arg(k),
                None => b.arg(&ms),
            };
            b.arg(&has_mask);
            match &os {
                Some(o) => b.arg(o),
                None => b.arg(&ms),
            };
            b.arg(&has_out).arg(&n64).arg(&c.grad_scale);
            b.arg(&c.shrink).arg(&c.beta1).arg(&c.beta2);
            b.arg(&c.step).arg(&c.inv_bc2).arg(&c.eps);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        });
    });
    Ok(())
}

/// The sum of the squares of each tensor (f32 math), on the GPU, read back once: one launch per
/// dtype over all the tensors (the gradient norm of a model's ~300 gradients, most of them
/// small, took ~300 launches).
pub fn sums_of_squares(tensors: &[&candle_core::Tensor]) -> Result<Vec<f32>> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::Storage;
    // Elements per block: 256 threads x 16 units of 16 bytes (a multiple of any unit).
    const PER_BLOCK: usize = 256 * 16 * 8;
    let Some(first) = tensors.first() else {
        return Ok(Vec::new());
    };
    let candle_core::Device::Cuda(dev) = first.device() else {
        bail!("fused CUDA sums of squares: the tensors must be on a GPU")
    };
    let stream = dev.cuda_stream();
    let mut out = vec![0f32; tensors.len()];
    let contiguous: Vec<candle_core::Tensor> = tensors
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<_>>()?;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let group: Vec<usize> = (0..contiguous.len())
            .filter(|&i| contiguous[i].dtype() == dtype && contiguous[i].elem_count() > 0)
            .collect();
        if group.is_empty() {
            continue;
        }
        let f =
            dev.get_or_load_custom_func(&format!("sums_squares_{}", suffix(dtype)?), MODULE, PTX)?;
        typed!(dtype, |T| {
            let locked: Vec<_> = group
                .iter()
                .map(|&i| contiguous[i].storage_and_layout())
                .collect();
            let mut views = Vec::with_capacity(group.len());
            for (guard, layout) in &locked {
                let Storage::Cuda(st) = &**guard else {
                    bail!("fused CUDA sums of squares: the tensors must be on a GPU")
                };
                views.push(view::<T>(st, layout)?);
            }
            let (mut ptrs, mut syncs) = (Vec::new(), Vec::new());
            for v in &views {
                let (ptr, sync) = v.device_ptr(&stream);
                ptrs.push(ptr);
                syncs.push(sync);
            }
            // A view runs to its storage's end: the lengths are the tensors'.
            let lens: Vec<u64> = group
                .iter()
                .map(|&i| contiguous[i].elem_count() as u64)
                .collect();
            let mut firsts = Vec::with_capacity(group.len());
            let mut blocks = 0usize;
            for &n in &lens {
                firsts.push(blocks as u32);
                blocks += (n as usize).div_ceil(PER_BLOCK);
            }
            let sums = dev.alloc_zeros::<f32>(group.len())?;
            let (ptrs, lens, firsts) = (
                stream.clone_htod(&ptrs).w()?,
                stream.clone_htod(&lens).w()?,
                stream.clone_htod(&firsts).w()?,
            );
            let (count, per_block) = (group.len() as i32, PER_BLOCK as u64);
            let mut b = f.builder();
            b.arg(&ptrs)
                .arg(&lens)
                .arg(&firsts)
                .arg(&count)
                .arg(&per_block)
                .arg(&sums);
            // SAFETY: the arguments match the kernel's signature; every pointer is a live
            // buffer of its length (the views stay borrowed until the launch is queued).
            unsafe { b.launch(config(blocks as u32, 0)) }.w()?;
            drop(syncs);
            for (k, sum) in stream.clone_dtoh(&sums).w()?.into_iter().enumerate() {
                out[group[k]] = sum;
            }
        });
    }
    Ok(out)
}

/// The sum over the rows of contiguous `x` [rows, n], in f32, cast to `x`'s dtype: [n].
pub fn sum_rows(x: (&CudaStorage, &Layout)) -> Result<(CudaStorage, Shape)> {
    let dev = x.0.device().clone();
    let dtype = x.0.dtype();
    let sfx = suffix(dtype)?;
    let (rows, n) = x.1.shape().dims2()?;
    // Rows per block: enough for each thread to add a few dozen values, few enough for a wide
    // grid (a bias of 896 over 4,096 tokens: 4 x 128 blocks); more past 65,535 row blocks.
    let per_block = 32.max(rows.div_ceil(65_535));
    let f = dev.get_or_load_custom_func(&format!("sum_rows_{sfx}"), MODULE, PTX)?;
    let cast = dev.get_or_load_custom_func(&format!("cast_from_f32_{sfx}"), MODULE, PTX)?;
    let acc = dev.alloc_zeros::<f32>(n)?;
    let out = typed!(dtype, |T| {
        let xs = view::<T>(x.0, x.1)?;
        let (rows_i, n_i, per) = (rows as i32, n as i32, per_block as i32);
        let mut b = f.builder();
        b.arg(&xs).arg(&rows_i).arg(&n_i).arg(&per).arg(&acc);
        let launch = LaunchConfig {
            grid_dim: (
                n.div_ceil(THREADS as usize) as u32,
                rows.div_ceil(per_block) as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(launch) }.w()?;
        // SAFETY: every element is written by the cast.
        let o = unsafe { dev.alloc::<T>(n)? };
        let mut b = cast.builder();
        b.arg(&acc).arg(&o).arg(&n_i);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(o, dev.clone())
    });
    Ok((out, Shape::from(n)))
}

/// `acc += x` in place, `acc` a contiguous f32 running sum, `x` f32, bf16 or f16 of as many
/// elements.
pub fn add_into(acc: (&mut CudaStorage, &Layout), x: (&CudaStorage, &Layout)) -> Result<()> {
    check(acc.1, "add")?;
    let n = acc.1.shape().elem_count();
    if x.1.shape().elem_count() != n {
        bail!(
            "fused CUDA add: {} elements into {n}",
            x.1.shape().elem_count()
        );
    }
    let dev = acc.0.device().clone();
    let xtype = x.0.dtype();
    let f = dev.get_or_load_custom_func(&format!("add_into_{}", suffix(xtype)?), MODULE, PTX)?;
    let start = acc.1.start_offset();
    let n64 = n as u64;
    typed!(xtype, |T| {
        let xs = view::<T>(x.0, x.1)?;
        let mut a = acc.0.as_cuda_slice_mut::<f32>()?.slice_mut(start..);
        let mut b = f.builder();
        b.arg(&mut a).arg(&xs).arg(&n64);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
    });
    Ok(())
}

/// `acc` [m, n] (f32) += a^T b for `a` [k, m] and `b` [k, n] (contiguous, one dtype): one
/// cuBLAS GEMM accumulating in f32 with beta = 1, so no [m, n] product is allocated and no
/// pass adds it (the tiled loss's weight gradient: 272 MB per tile at Qwen2's vocabulary).
pub fn add_product_t(
    acc: (&mut CudaStorage, &Layout),
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::cublas::{result::gemm_ex, sys};
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    for l in [acc.1, a.1, b.1] {
        check(l, "add_product_t")?;
    }
    let (k, m) = a.1.shape().dims2()?;
    let (kb, n) = b.1.shape().dims2()?;
    if kb != k || acc.1.shape().elem_count() != m * n || a.0.dtype() != b.0.dtype() {
        bail!(
            "fused CUDA add_product_t: {:?} += {:?}^T x {:?}",
            acc.1.dims(),
            a.1.dims(),
            b.1.dims()
        );
    }
    let dtype = a.0.dtype();
    let data_type = match dtype {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        d => bail!("fused CUDA add_product_t: {d:?} is not supported"),
    };
    let dev = acc.0.device().clone();
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let start = acc.1.start_offset();
    let (alpha, beta) = (1f32, 1f32);
    typed!(dtype, |T| {
        let (av, bv) = (view::<T>(a.0, a.1)?, view::<T>(b.0, b.1)?);
        let mut cv = acc.0.as_cuda_slice_mut::<f32>()?.slice_mut(start..);
        let (ap, _a_read) = av.device_ptr(&stream);
        let (bp, _b_read) = bv.device_ptr(&stream);
        let (cp, _c_write) = cv.device_ptr_mut(&stream);
        // Column-major: acc^T [n, m] = b^T [n, k] (b as stored, ld n) x a [k, m] (a as
        // stored is a^T [m, k] with ld m, so transposed).
        // SAFETY: the three buffers hold k x m, k x n and m x n elements (checked above), on
        // the handle's stream; alpha and beta are host f32 as the compute type expects.
        unsafe {
            gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_T,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                bp as *const _,
                data_type,
                n as i32,
                ap as *const _,
                data_type,
                m as i32,
                &beta as *const f32 as *const _,
                cp as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
    });
    Ok(())
}

/// Embedding rows: `w` [vocab, hidden] (contiguous) at `ids` (u32, contiguous) -> [n, hidden].
pub fn embedding_fwd(
    w: (&CudaStorage, &Layout),
    ids: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = w.0.device().clone();
    let dtype = w.0.dtype();
    let (_, hidden) = w.1.shape().dims2()?;
    let n_ids = ids.1.shape().elem_count();
    let f =
        dev.get_or_load_custom_func(&format!("embedding_fwd_{}", suffix(dtype)?), MODULE, PTX)?;
    let n = n_ids * hidden;
    let out = typed!(dtype, |T| {
        let (ws, is) = (view::<T>(w.0, w.1)?, view::<u32>(ids.0, ids.1)?);
        // SAFETY: every element is written by the kernel.
        let out = unsafe { dev.alloc::<T>(n)? };
        let (n64, h) = (n as u64, hidden as i32);
        let mut b = f.builder();
        b.arg(&ws).arg(&is).arg(&out).arg(&n64).arg(&h);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, Shape::from((n_ids, hidden))))
}

/// `acc[ids[t], :] += dy[t, :]` in place, `acc` [vocab, hidden] of `dy`'s dtype (the
/// embedding's gradient, begun by a tied LM head's loss or zeros): the rows are scatter-added
/// with f32 atomics into a column slab (a [vocab, 128] f32 buffer instead of the whole table),
/// which is then added into its columns, slab after slab.
pub fn embedding_add_rows(
    acc: (&mut CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    ids: (&CudaStorage, &Layout),
) -> Result<()> {
    const SLAB: usize = 128;
    check(acc.1, "embedding gradient")?;
    let (n_ids, hidden) = dy.1.shape().dims2()?;
    let (vocab, acc_hidden) = acc.1.shape().dims2()?;
    if acc.0.dtype() != dy.0.dtype() || acc_hidden != hidden || ids.1.shape().elem_count() != n_ids
    {
        bail!(
            "fused CUDA embedding gradient: {n_ids} ids, rows {:?} {:?}, table {:?} {:?}",
            dy.0.dtype(),
            dy.1.dims(),
            acc.0.dtype(),
            acc.1.dims()
        );
    }
    let dev = dy.0.device().clone();
    let dtype = dy.0.dtype();
    let sfx = suffix(dtype)?;
    let bwd = dev.get_or_load_custom_func(&format!("embedding_bwd_{sfx}"), MODULE, PTX)?;
    let add = dev.get_or_load_custom_func(&format!("embedding_slab_add_{sfx}"), MODULE, PTX)?;
    let stream = dev.cuda_stream();
    let slab = SLAB.min(hidden);
    let mut dw = dev.alloc_zeros::<f32>(vocab * slab)?;
    let start = acc.1.start_offset();
    typed!(dtype, |T| {
        let (dys, is) = (view::<T>(dy.0, dy.1)?, view::<u32>(ids.0, ids.1)?);
        let mut out = acc.0.as_cuda_slice_mut::<T>()?.slice_mut(start..);
        let (n_ids64, vocab64, h) = (n_ids as u64, vocab as u64, hidden as i32);
        for c0 in (0..hidden).step_by(slab) {
            let ch = slab.min(hidden - c0);
            if c0 > 0 {
                stream.memset_zeros(&mut dw).w()?;
            }
            let (c0_i, ch_i) = (c0 as i32, ch as i32);
            let mut b = bwd.builder();
            b.arg(&dys).arg(&is).arg(&dw).arg(&n_ids64).arg(&h);
            b.arg(&c0_i).arg(&ch_i);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { b.launch(config(grid(n_ids * ch, THREADS as usize), 0)) }.w()?;
            let mut b = add.builder();
            b.arg(&dw)
                .arg(&mut out)
                .arg(&vocab64)
                .arg(&h)
                .arg(&c0_i)
                .arg(&ch_i);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { b.launch(config(grid(vocab * ch, THREADS as usize), 0)) }.w()?;
        }
    });
    Ok(())
}

/// `x *= s` in place (contiguous f32, bf16 or f16; f32 math).
pub fn scale_in_place(x: (&mut CudaStorage, &Layout), s: f32) -> Result<()> {
    check(x.1, "scale")?;
    let dev = x.0.device().clone();
    let dtype = x.0.dtype();
    let f = dev.get_or_load_custom_func(&format!("scale_{}", suffix(dtype)?), MODULE, PTX)?;
    let (n, start) = (x.1.shape().elem_count(), x.1.start_offset());
    let n64 = n as u64;
    typed!(dtype, |T| {
        let mut xs = x.0.as_cuda_slice_mut::<T>()?.slice_mut(start..);
        let mut b = f.builder();
        b.arg(&mut xs).arg(&n64).arg(&s);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
    });
    Ok(())
}

/// Inverted dropout of contiguous `x` by the counter-based mask of `fused::dropout`.
pub fn dropout(
    x: (&CudaStorage, &Layout),
    seed: u64,
    keep_below: u64,
    s: f32,
) -> Result<(CudaStorage, Shape)> {
    map_elements(x, "dropout", (seed, keep_below, s))
}

/// Contiguous `x` plus the counter-based uniform noise of `fused::add_uniform_noise`.
pub fn uniform_noise(
    x: (&CudaStorage, &Layout),
    seed: u64,
    mag: f64,
) -> Result<(CudaStorage, Shape)> {
    map_elements(x, "uniform_noise", (seed, mag))
}

/// The arguments an element-wise kernel takes after `(x, out, n)`.
trait TailArgs {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>);
}

impl<A: DeviceRepr, B: DeviceRepr> TailArgs for (A, B) {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.0).arg(&self.1);
    }
}

impl<A: DeviceRepr, B: DeviceRepr, C: DeviceRepr> TailArgs for (A, B, C) {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.0).arg(&self.1).arg(&self.2);
    }
}

/// `<name>_<dtype>(x, out, n, tail...)`, one thread per element, over contiguous `x` into a
/// new tensor of its shape and dtype.
fn map_elements(
    x: (&CudaStorage, &Layout),
    name: &str,
    tail: impl TailArgs,
) -> Result<(CudaStorage, Shape)> {
    check(x.1, name)?;
    let dev = x.0.device().clone();
    let dtype = x.0.dtype();
    let f = dev.get_or_load_custom_func(&format!("{name}_{}", suffix(dtype)?), MODULE, PTX)?;
    let n = x.1.shape().elem_count();
    let out = typed!(dtype, |T| {
        let xs = view::<T>(x.0, x.1)?;
        // SAFETY: every element is written by the kernel.
        let out = unsafe { dev.alloc::<T>(n)? };
        let n64 = n as u64;
        let mut b = f.builder();
        b.arg(&xs).arg(&out).arg(&n64);
        tail.push(&mut b);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, x.1.shape().clone()))
}

/// `x` [a, b, c, d] (contiguous) -> [a, c, b, d]: dims 1 and 2 swapped, moving whole rows of
/// `d` (16 bytes a thread when a row is a multiple of 16 bytes).
pub fn swap12(x: (&CudaStorage, &Layout)) -> Result<(CudaStorage, Shape)> {
    check(x.1, "swap")?;
    let dev = x.0.device().clone();
    let dtype = x.0.dtype();
    let (a, b, c, d) = x.1.shape().dims4()?;
    let bytes = d * dtype.size_in_bytes();
    let (kernel, unit) = match (bytes % 16, dtype.size_in_bytes()) {
        (0, _) => ("swap12_u128", 16),
        (_, 2) => ("swap12_u16", 2),
        (_, 4) => ("swap12_u32", 4),
        (_, size) => bail!("fused CUDA swap: {size}-byte elements are not supported"),
    };
    let f = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
    let row = bytes / unit;
    let n = a * b * c * row;
    let (a64, b64, c64, r64) = (a as u64, b as u64, c as u64, row as u64);
    let out = typed!(dtype, |T| {
        let xs = view::<T>(x.0, x.1)?;
        // SAFETY: every element is written by the kernel.
        let out = unsafe { dev.alloc::<T>(a * b * c * d)? };
        let mut builder = f.builder();
        // The kernel reads and writes the same bytes as units of `unit` bytes.
        builder
            .arg(&xs)
            .arg(&out)
            .arg(&a64)
            .arg(&b64)
            .arg(&c64)
            .arg(&r64);
        // SAFETY: the arguments match the kernel's signature; the buffers hold n units.
        unsafe { builder.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, Shape::from((a, c, b, d))))
}

/// `x` [rows, cols] + `bias` [cols] (contiguous, one dtype).
pub fn bias_add(
    x: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    check(x.1, "bias")?;
    let dev = x.0.device().clone();
    let dtype = x.0.dtype();
    let n = x.1.shape().elem_count();
    let cols = bias.1.shape().elem_count();
    if cols == 0 || !n.is_multiple_of(cols) || x.1.dims().last() != Some(&cols) {
        bail!("fused CUDA bias: {:?} + [{cols}]", x.1.dims());
    }
    let f = dev.get_or_load_custom_func(&format!("bias_add_{}", suffix(dtype)?), MODULE, PTX)?;
    let out = typed!(dtype, |T| {
        let (xs, bs) = (view::<T>(x.0, x.1)?, view::<T>(bias.0, bias.1)?);
        // SAFETY: every element is written by the kernel.
        let out = unsafe { dev.alloc::<T>(n)? };
        let (n64, c) = (n as u64, cols as i32);
        let mut b = f.builder();
        b.arg(&xs).arg(&bs).arg(&out).arg(&n64).arg(&c);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(config(grid(n, THREADS as usize), 0)) }.w()?;
        CudaStorage::wrap_cuda_slice(out, dev.clone())
    });
    Ok((out, x.1.shape().clone()))
}
