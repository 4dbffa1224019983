//! Fused training ops: each one pass over its rows, forward and backward, instead of a chain of
//! Candle ops that each write a full tensor (RMSNorm alone is seven forward).
//!
//! - [`rms_norm`]: `x / sqrt(mean(x^2) + eps) * w`, statistics in f32, the normalized value cast
//!   to the input dtype before the weight as transformers does. Backward gives dx and dw in one
//!   pass over the rows (dw summed per thread, then across threads).
//! - [`swiglu`]: `silu(gate) * up`; backward gives both gradients in one pass.
//! - [`swiglu_halves`]: the same on rows holding (gate | up), and its gradient written over
//!   its input ([`swiglu_halves_grad`]), for the gated MLP's ops (`nn::gated`).
//! - [`rotary`]: `x * cos + rotate_half(x) * sin` over [batch, heads, seq, head_dim] with the
//!   angles of each (batch, position) shared by all heads; backward is the inverse rotation.
//! - [`dropout`]: inverted dropout by a counter-based mask (LoRA's adapters), drawn again for
//!   the gradient instead of stored.
//!
//! On CPU they run as Candle custom ops (rayon across rows, f32 math for f32/bf16/f16 inputs, no
//! temporary tensors); on a GPU (feature `cuda`) the same ops launch the kernels of
//! `kernels/fused.cu` (see `cuda_fused`). For f64 they fall back to the same math in Candle ops.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType, D};
use half::{bf16, f16};
use rayon::prelude::*;

use super::op::{fused_op, inplace_op};

/// Rows handed to one rayon task (amortizes scheduling over small hidden sizes).
const ROWS_PER_TASK: usize = 16;

use super::simd::simd_dispatch;

/// e^x in f32 without branches (so it vectorizes): 2^n * p(r) with n = round(x / ln 2) and a
/// degree-7 polynomial on |r| <= ln(2)/2 (relative error below 1e-7); x is clamped to the
/// range where 2^n is a normal f32.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.3);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n built from the float: n + 127 (an integer in 1..=254) lands in the low mantissa bits
    // of itself + 2^23, and the shift moves it to the exponent field. `n as i32` would be a
    // saturating cast, which LLVM leaves scalar, one lane at a time (half of a softmax's time).
    let biased = (n + 127.0 + 8_388_608.0).to_bits();
    p * f32::from_bits(biased << 23)
}

#[inline(always)]
fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-v))
}

/// Sum of squares in eight lanes (a sequential f32 sum would not vectorize).
#[inline(always)]
fn sum_sq<T: F32Math>(x: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v.f() * v.f();
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|v| v.f() * v.f()).sum();
    acc.iter().sum::<f32>() + tail
}

/// Element types computed in f32.
trait F32Math: WithDType + Send + Sync {
    fn f(self) -> f32;
    fn of(v: f32) -> Self;
}

impl F32Math for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        v
    }
}

impl F32Math for bf16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl F32Math for f16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// The result of `$body`, computed with `$t` the element type of `$dtype` (f32, bf16 or f16),
/// as CPU storage.
macro_rules! per_dtype {
    ($dtype:expr, $what:literal, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                CpuStorage::F32($body)
            }
            DType::BF16 => {
                type $t = bf16;
                CpuStorage::BF16($body)
            }
            DType::F16 => {
                type $t = f16;
                CpuStorage::F16($body)
            }
            d => bail!("{}: {d:?} is not supported", $what),
        }
    };
}

/// The contiguous elements of one input.
pub(crate) fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("fused op: input is not contiguous")
    };
    Ok(&s.as_slice::<T>()?[start..end])
}

/// Two rayon tasks' partial column sums, added.
fn add_partial(mut a: Vec<f32>, b: Vec<f32>) -> Vec<f32> {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
    a
}

/// Whether the fused kernels take these tensors: f32, bf16 or f16, all alike, on the CPU or
/// (built with `cuda`) on a GPU.
fn fused_here(ts: &[&Tensor]) -> bool {
    let dtype = ts[0].dtype();
    let device = ts[0].device();
    let here = device.is_cpu() || (device.is_cuda() && super::precision::cuda_fused_on());
    here && ts
        .iter()
        .all(|t| t.device().same_device(device) && t.dtype() == dtype)
        && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

// ---------------------------------------------------------------- RMSNorm

struct RmsNormFwd {
    eps: f32,
}

fn rms_norm_fwd<T: F32Math>(x: &[T], w: &[T], eps: f32) -> Vec<T> {
    let h = w.len();
    let mut y = vec![T::of(0.0); x.len()];
    y.par_chunks_mut(h * ROWS_PER_TASK)
        .zip(x.par_chunks(h * ROWS_PER_TASK))
        .for_each(|(ys, xs)| rms_norm_fwd_rows(ys, xs, w, eps));
    y
}

simd_dispatch!(rms_norm_fwd_rows, rms_norm_fwd_rows_avx2, rms_norm_fwd_body, <T: F32Math>, (ys: &mut [T], xs: &[T], w: &[T], eps: f32));

#[inline(always)]
fn rms_norm_fwd_body<T: F32Math>(ys: &mut [T], xs: &[T], w: &[T], eps: f32) {
    let h = w.len();
    for (yr, xr) in ys.chunks_mut(h).zip(xs.chunks(h)) {
        let rstd = 1.0 / (sum_sq(xr) / h as f32 + eps).sqrt();
        for ((o, &xi), &wi) in yr.iter_mut().zip(xr).zip(w) {
            // Rounded to the input dtype before the weight, as transformers does.
            *o = T::of(T::of(xi.f() * rstd).f() * wi.f());
        }
    }
}

fused_op!(RmsNormFwd: CustomOp2 [this] {
    name: "fused-rms-norm",
    cpu(s1, l1, s2, l2) {
        let out = per_dtype!(s1.dtype(), "fused rms_norm", |T| rms_norm_fwd(
            slice::<T>(s1, l1)?,
            slice(s2, l2)?,
            this.eps,
        ));
        Ok((out, l1.shape().clone()))
    }
    cuda(s1, l1, s2, l2) {
        super::cuda_fused::rms_norm_fwd((s1, l1), (s2, l2), this.eps)
    }
    bwd(x, w; _y, dy) {
        let h = w.dim(0)?;
        let rows = x.elem_count() / h;
        let both = x.apply_op3_no_bwd(w, &dy.contiguous()?, &RmsNormBwd { eps: this.eps })?;
        let dx = both.narrow(0, 0, rows)?.reshape(x.shape())?;
        // Copied out: a view would keep the whole [rows + 1, h] buffer alive for as long as
        // the weight's gradient lives (until the optimizer step), one per norm.
        let dw = both.narrow(0, rows, 1)?.reshape(h)?.force_contiguous()?;
        Ok((Some(dx), Some(dw)))
    }
});

struct RmsNormBwd {
    eps: f32,
}

/// dx (rows x h) followed by dw (one row): for each row, with x^ = x * rstd and g = dy * w,
/// dx = rstd * (g - x^ * mean(g * x^)), dw += dy * round(x^).
fn rms_norm_bwd<T: F32Math>(x: &[T], w: &[T], dy: &[T], eps: f32) -> Vec<T> {
    let h = w.len();
    let rows = x.len() / h;
    let mut out = vec![T::of(0.0); (rows + 1) * h];
    let (dx, _) = out.split_at_mut(rows * h);
    let dw = dx
        .par_chunks_mut(h * ROWS_PER_TASK)
        .zip(x.par_chunks(h * ROWS_PER_TASK))
        .zip(dy.par_chunks(h * ROWS_PER_TASK))
        .map(|((dxs, xs), dys)| {
            let mut dw = vec![0f32; h];
            rms_norm_bwd_rows(dxs, &mut dw, xs, dys, w, eps);
            dw
        })
        .reduce(|| vec![0f32; h], add_partial);
    for (o, v) in out[rows * h..].iter_mut().zip(dw) {
        *o = T::of(v);
    }
    out
}

simd_dispatch!(rms_norm_bwd_rows, rms_norm_bwd_rows_avx2, rms_norm_bwd_body, <T: F32Math>, (dxs: &mut [T], dw: &mut [f32], xs: &[T], dys: &[T], w: &[T], eps: f32));

#[inline(always)]
fn rms_norm_bwd_body<T: F32Math>(
    dxs: &mut [T],
    dw: &mut [f32],
    xs: &[T],
    dys: &[T],
    w: &[T],
    eps: f32,
) {
    let h = w.len();
    for ((dxr, xr), dyr) in dxs.chunks_mut(h).zip(xs.chunks(h)).zip(dys.chunks(h)) {
        let rstd = 1.0 / (sum_sq(xr) / h as f32 + eps).sqrt();
        // mean(g * x^) in eight lanes, with g = dy * w.
        let mut acc = [0f32; 8];
        for (i, ((&xi, &dyi), &wi)) in xr.iter().zip(dyr).zip(w).enumerate() {
            acc[i % 8] += dyi.f() * wi.f() * xi.f();
        }
        let mean = acc.iter().sum::<f32>() * rstd / h as f32;
        for ((((dx, dwi), &xi), &dyi), &wi) in
            dxr.iter_mut().zip(dw.iter_mut()).zip(xr).zip(dyr).zip(w)
        {
            let xh = xi.f() * rstd;
            *dwi += dyi.f() * T::of(xh).f();
            *dx = T::of(rstd * (dyi.f() * wi.f() - xh * mean));
        }
    }
}

fused_op!(RmsNormBwd: CustomOp3 [this] {
    name: "fused-rms-norm-bwd",
    cpu(s1, l1, s2, l2, s3, l3) {
        let h = l2.shape().elem_count();
        let rows = l1.shape().elem_count() / h;
        let out = per_dtype!(s1.dtype(), "fused rms_norm backward", |T| rms_norm_bwd(
            slice::<T>(s1, l1)?,
            slice(s2, l2)?,
            slice(s3, l3)?,
            this.eps,
        ));
        Ok((out, Shape::from((rows + 1, h))))
    }
    cuda(s1, l1, s2, l2, s3, l3) {
        super::cuda_fused::rms_norm_bwd((s1, l1), (s2, l2), (s3, l3), this.eps)
    }
});

/// RMSNorm over the last dimension of `x` with weight `w` (one value per feature).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    // The kernel reads `w` as one value per feature of `x`'s rows.
    let one_per_feature = w.rank() == 1 && x.rank() > 0 && w.dim(0)? == x.dim(D::Minus1)?;
    if !fused_here(&[x, w]) || !one_per_feature {
        return rms_norm_reference(x, w, eps);
    }
    x.contiguous()?
        .apply_op2(&w.contiguous()?, RmsNormFwd { eps: eps as f32 })
}

/// The same math in Candle ops (statistics in f32 or f64).
pub fn rms_norm_reference(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    rms_normalize(x, eps)?.broadcast_mul(w)
}

/// `x / sqrt(mean(x^2) + eps)` in Candle ops, cast back to `x`'s dtype before any weight (as
/// transformers does); for weights this rank does not hold whole (`nn::RmsNorm`).
pub fn rms_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(super::precision::wide(dtype))?;
    let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
    x32.broadcast_div(&(variance + eps)?.sqrt()?)?
        .to_dtype(dtype)
}

// ---------------------------------------------------------------- SwiGLU

struct SwigluFwd;

const ELEMS_PER_TASK: usize = 4096;

fn swiglu_fwd<T: F32Math>(g: &[T], u: &[T]) -> Vec<T> {
    let mut out = vec![T::of(0.0); g.len()];
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(
            g.par_chunks(ELEMS_PER_TASK)
                .zip(u.par_chunks(ELEMS_PER_TASK)),
        )
        .for_each(|(o, (g, u))| swiglu_fwd_chunk(o, g, u));
    out
}

simd_dispatch!(swiglu_fwd_chunk, swiglu_fwd_chunk_avx2, swiglu_fwd_body, <T: F32Math>, (o: &mut [T], g: &[T], u: &[T]));

#[inline(always)]
fn swiglu_fwd_body<T: F32Math>(o: &mut [T], g: &[T], u: &[T]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        let g = g.f();
        *o = T::of(g * sigmoid(g) * u.f());
    }
}

fused_op!(SwigluFwd: CustomOp2 [this] {
    name: "fused-swiglu",
    cpu(s1, l1, s2, l2) {
        let out = per_dtype!(s1.dtype(), "fused swiglu", |T| swiglu_fwd::<T>(
            slice(s1, l1)?,
            slice(s2, l2)?
        ));
        Ok((out, l1.shape().clone()))
    }
    cuda(s1, l1, s2, l2) {
        super::cuda_fused::swiglu_fwd((s1, l1), (s2, l2))
    }
    bwd(g, u; _out, dout) {
        let both = g.apply_op3_no_bwd(u, &dout.contiguous()?, &SwigluBwd)?;
        let dg = both.narrow(0, 0, 1)?.reshape(g.shape())?;
        let du = both.narrow(0, 1, 1)?.reshape(u.shape())?;
        Ok((Some(dg), Some(du)))
    }
});

struct SwigluBwd;

/// dg then du: with s = sigmoid(g), dg = dout * u * s * (1 + g * (1 - s)), du = dout * g * s.
fn swiglu_bwd<T: F32Math>(g: &[T], u: &[T], d: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = vec![T::of(0.0); 2 * n];
    let (dg, du) = out.split_at_mut(n);
    dg.par_chunks_mut(ELEMS_PER_TASK)
        .zip(du.par_chunks_mut(ELEMS_PER_TASK))
        .zip(g.par_chunks(ELEMS_PER_TASK))
        .zip(
            u.par_chunks(ELEMS_PER_TASK)
                .zip(d.par_chunks(ELEMS_PER_TASK)),
        )
        .for_each(|(((dg, du), g), (u, d))| swiglu_bwd_chunk(dg, du, g, u, d));
    out
}

simd_dispatch!(swiglu_bwd_chunk, swiglu_bwd_chunk_avx2, swiglu_bwd_body, <T: F32Math>, (dg: &mut [T], du: &mut [T], g: &[T], u: &[T], d: &[T]));

/// SwiGLU's input gradients (dg, du) for gate `g`, up `u` and the output's gradient `d`.
#[inline(always)]
fn swiglu_grads(g: f32, u: f32, d: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (d * u * s * (1.0 + g * (1.0 - s)), d * g * s)
}

#[inline(always)]
fn swiglu_bwd_body<T: F32Math>(dg: &mut [T], du: &mut [T], g: &[T], u: &[T], d: &[T]) {
    for ((((dg, du), &g), &u), &d) in dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u).zip(d) {
        let (a, b) = swiglu_grads(g.f(), u.f(), d.f());
        (*dg, *du) = (T::of(a), T::of(b));
    }
}

fused_op!(SwigluBwd: CustomOp3 [this] {
    name: "fused-swiglu-bwd",
    cpu(s1, l1, s2, l2, s3, l3) {
        let n = l1.shape().elem_count();
        let out = per_dtype!(s1.dtype(), "fused swiglu backward", |T| swiglu_bwd::<T>(
            slice(s1, l1)?,
            slice(s2, l2)?,
            slice(s3, l3)?,
        ));
        Ok((out, Shape::from((2, n))))
    }
    cuda(s1, l1, s2, l2, s3, l3) {
        super::cuda_fused::swiglu_bwd((s1, l1), (s2, l2), (s3, l3))
    }
});

/// `silu(gate) * up`, elementwise (same shapes).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if !fused_here(&[gate, up]) || gate.shape() != up.shape() {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwigluFwd)
}

// ---------------------------------------------------------------- SwiGLU on a row's halves

/// SwiGLU of rows holding (gate | up), as one GEMM against the concatenated gate and up
/// weights writes them.
struct SwigluHalves;

fn swiglu_halves_fwd<T: F32Math>(gu: &[T], cols: usize) -> Vec<T> {
    let mut out = vec![T::of(0.0); gu.len() / 2];
    let rows = (ELEMS_PER_TASK / cols).max(1);
    out.par_chunks_mut(rows * cols)
        .zip(gu.par_chunks(rows * 2 * cols))
        .for_each(|(o, gu)| {
            for (o, row) in o.chunks_exact_mut(cols).zip(gu.chunks_exact(2 * cols)) {
                let (g, u) = row.split_at(cols);
                swiglu_fwd_chunk(o, g, u);
            }
        });
    out
}

fused_op!(SwigluHalves: CustomOp1 [this] {
    name: "fused-swiglu-halves",
    cpu(s1, l1) {
        let (rows, both) = l1.shape().dims2()?;
        let out = per_dtype!(s1.dtype(), "fused swiglu", |T| swiglu_halves_fwd::<T>(
            slice(s1, l1)?,
            both / 2
        ));
        Ok((out, Shape::from((rows, both / 2))))
    }
    cuda(s1, l1) {
        super::cuda_fused::swiglu_halves_fwd((s1, l1))
    }
});

/// Its backward, in place: (gate | up) becomes (dgate | dup).
struct SwigluHalvesBwd;

fn swiglu_halves_bwd<T: F32Math>(gu: &mut [T], d: &[T], cols: usize) {
    let rows = (ELEMS_PER_TASK / cols).max(1);
    gu.par_chunks_mut(rows * 2 * cols)
        .zip(d.par_chunks(rows * cols))
        .for_each(|(gu, d)| {
            for (row, d) in gu.chunks_exact_mut(2 * cols).zip(d.chunks_exact(cols)) {
                let (g, u) = row.split_at_mut(cols);
                swiglu_bwd_in_place_chunk(g, u, d);
            }
        });
}

simd_dispatch!(swiglu_bwd_in_place_chunk, swiglu_bwd_in_place_chunk_avx2, swiglu_bwd_in_place_body, <T: F32Math>, (g: &mut [T], u: &mut [T], d: &[T]));

#[inline(always)]
fn swiglu_bwd_in_place_body<T: F32Math>(g: &mut [T], u: &mut [T], d: &[T]) {
    for ((g, u), &d) in g.iter_mut().zip(u.iter_mut()).zip(d) {
        let (a, b) = swiglu_grads(g.f(), u.f(), d.f());
        (*g, *u) = (T::of(a), T::of(b));
    }
}

inplace_op!(SwigluHalvesBwd: InplaceOp2 [this] {
    name: "fused-swiglu-halves-bwd",
    cpu(gu, gl, d, dl) {
        let (Some((g0, g1)), (_, cols)) = (gl.contiguous_offsets(), dl.shape().dims2()?) else {
            bail!("fused swiglu backward: a contiguous input expected")
        };
        match (gu, d) {
            (CpuStorage::F32(g), d) => swiglu_halves_bwd(&mut g[g0..g1], slice(d, dl)?, cols),
            (CpuStorage::BF16(g), d) => swiglu_halves_bwd(&mut g[g0..g1], slice(d, dl)?, cols),
            (CpuStorage::F16(g), d) => swiglu_halves_bwd(&mut g[g0..g1], slice(d, dl)?, cols),
            (g, _) => bail!("fused swiglu backward: {:?} is not supported", g.dtype()),
        }
        Ok(())
    }
    cuda(gu, gl, d, dl) {
        super::cuda_fused::swiglu_halves_bwd((gu, gl), (d, dl))
    }
});

/// `silu(gate) * up` for each row of `gu` [rows, 2 cols] holding (gate | up): [rows, cols].
/// Not recorded in the graph (the gated MLP's op computes it inside, and again in backward).
pub fn swiglu_halves(gu: &Tensor) -> Result<Tensor> {
    let (_, both) = gu.dims2()?;
    let cols = both / 2;
    if !fused_here(&[gu]) {
        let gu = gu.detach();
        return gu.narrow(1, 0, cols)?.silu()? * gu.narrow(1, cols, cols)?;
    }
    gu.contiguous()?.apply_op1_no_bwd(&SwigluHalves)
}

/// The gradient of [`swiglu_halves`] for its output's gradient `d` [rows, cols], as (dgate |
/// dup). Where the fused kernels run it is written over `gu` itself and returned (no second
/// [rows, 2 cols] buffer): the caller must be the last reader of `gu`. Elsewhere a new tensor.
pub fn swiglu_halves_grad(gu: &Tensor, d: &Tensor) -> Result<Tensor> {
    let cols = d.dim(1)?;
    if fused_here(&[gu, d]) && gu.is_contiguous() {
        gu.inplace_op2(&d.contiguous()?, &SwigluHalvesBwd)?;
        return Ok(gu.clone());
    }
    let (g, u) = (gu.narrow(1, 0, cols)?, gu.narrow(1, cols, cols)?);
    let s = candle_nn::ops::sigmoid(&g)?;
    // dg = d u s (1 + g (1 - s)), du = d g s.
    let du = ((d * &g)? * &s)?;
    let dg = ((d * &u)? * &s)?.mul(&((&g * (1.0 - &s)?)? + 1.0)?)?;
    Tensor::cat(&[dg, du], 1)
}

// ---------------------------------------------------------------- gpt-oss's clamped SwiGLU

/// gpt-oss's activation on interleaved gate/up pairs: the gate clamped above at `limit`, the
/// up projection on both sides, then `(up + 1) * gate * sigmoid(alpha * gate)`.
#[derive(Clone, Copy)]
struct ClampedSwiglu {
    alpha: f32,
    limit: f32,
}

impl ClampedSwiglu {
    /// The output of one pair, and its gradients with respect to gate and up (for `dout` 1).
    #[inline(always)]
    fn pair(self, g: f32, u: f32) -> (f32, f32, f32) {
        let (gc, uc) = (g.min(self.limit), u.clamp(-self.limit, self.limit));
        let s = sigmoid(self.alpha * gc);
        let glu = gc * s;
        // Gradients pass where the clamps do not bite (bounds included, as torch's clamp).
        // Selects, not branches: the loops vectorize.
        let dg = (uc + 1.0) * (s + self.alpha * gc * s * (1.0 - s));
        let dg = if g <= self.limit { dg } else { 0.0 };
        let du = if u.abs() <= self.limit { glu } else { 0.0 };
        ((uc + 1.0) * glu, dg, du)
    }
}

simd_dispatch!(clamped_swiglu_fwd_chunk, clamped_swiglu_fwd_chunk_avx2, clamped_swiglu_fwd_body, <T: F32Math>, (o: &mut [T], gu: &[T], op: ClampedSwiglu));

#[inline(always)]
fn clamped_swiglu_fwd_body<T: F32Math>(o: &mut [T], gu: &[T], op: ClampedSwiglu) {
    for (o, p) in o.iter_mut().zip(gu.chunks_exact(2)) {
        *o = T::of(op.pair(p[0].f(), p[1].f()).0);
    }
}

simd_dispatch!(clamped_swiglu_bwd_chunk, clamped_swiglu_bwd_chunk_avx2, clamped_swiglu_bwd_body, <T: F32Math>, (o: &mut [T], gu: &[T], d: &[T], op: ClampedSwiglu));

/// d gate and d up, interleaved as the input.
#[inline(always)]
fn clamped_swiglu_bwd_body<T: F32Math>(o: &mut [T], gu: &[T], d: &[T], op: ClampedSwiglu) {
    for ((o, p), d) in o.chunks_exact_mut(2).zip(gu.chunks_exact(2)).zip(d) {
        let (_, dg, du) = op.pair(p[0].f(), p[1].f());
        o[0] = T::of(d.f() * dg);
        o[1] = T::of(d.f() * du);
    }
}

fused_op!(ClampedSwiglu: CustomOp1 [this] {
    name: "fused-clamped-swiglu",
    cpu(s1, l1) {
        let out = per_dtype!(s1.dtype(), "fused clamped swiglu", |T| {
            let gu: &[T] = slice(s1, l1)?;
            let mut out = vec![T::of(0.0); gu.len() / 2];
            out.par_chunks_mut(ELEMS_PER_TASK)
                .zip(gu.par_chunks(2 * ELEMS_PER_TASK))
                .for_each(|(o, gu)| clamped_swiglu_fwd_chunk(o, gu, *this));
            out
        });
        let mut dims = l1.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last /= 2;
        }
        Ok((out, Shape::from(dims)))
    }
    cuda(_s1, _l1) {
        candle_core::bail!("the fused clamped swiglu runs on the CPU (other devices use Candle's ops)")
    }
    bwd(gu; _out, dout) {
        Ok(Some(gu.apply_op2_no_bwd(&dout.contiguous()?, &ClampedSwigluBwd(*this))?))
    }
});

struct ClampedSwigluBwd(ClampedSwiglu);

fused_op!(ClampedSwigluBwd: CustomOp2 [this] {
    name: "fused-clamped-swiglu-bwd",
    cpu(s1, l1, s2, l2) {
        let op = this.0;
        let out = per_dtype!(s1.dtype(), "fused clamped swiglu backward", |T| {
            let (gu, d): (&[T], &[T]) = (slice(s1, l1)?, slice(s2, l2)?);
            let mut out = vec![T::of(0.0); gu.len()];
            out.par_chunks_mut(2 * ELEMS_PER_TASK)
                .zip(gu.par_chunks(2 * ELEMS_PER_TASK).zip(d.par_chunks(ELEMS_PER_TASK)))
                .for_each(|(o, (gu, d))| clamped_swiglu_bwd_chunk(o, gu, d, op));
            out
        });
        Ok((out, l1.shape().clone()))
    }
    cuda(_s1, _l1, _s2, _l2) {
        candle_core::bail!("the fused clamped swiglu runs on the CPU")
    }
});

/// gpt-oss's clamped SwiGLU of `gate_up` [..., 2 x inter] (gate and up interleaved:
/// `gate_up[..., ::2]`, `gate_up[..., 1::2]`): [..., inter]. One fused pass each way on the
/// CPU; Candle's ops elsewhere ([`clamped_swiglu_reference`]).
pub fn clamped_swiglu(gate_up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    if !gate_up.device().is_cpu() || !fused_here(&[gate_up]) {
        return clamped_swiglu_reference(gate_up, alpha, limit);
    }
    let op = ClampedSwiglu {
        alpha: alpha as f32,
        limit: limit as f32,
    };
    gate_up.contiguous()?.apply_op1(op)
}

/// [`clamped_swiglu`] in Candle's ops, as transformers writes it.
pub fn clamped_swiglu_reference(gate_up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    let mut dims = gate_up.dims().to_vec();
    let width = dims.pop().unwrap_or(0);
    dims.extend([width / 2, 2]);
    let pairs = gate_up.reshape(dims)?;
    let last = pairs.rank() - 1;
    let gate = pairs.narrow(last, 0, 1)?.squeeze(last)?.minimum(limit)?;
    let up = pairs
        .narrow(last, 1, 1)?
        .squeeze(last)?
        .clamp(-limit, limit)?;
    let sigmoid = (gate.affine(-alpha, 0.0)?.exp()? + 1.0)?.recip()?;
    (up + 1.0)? * (gate * sigmoid)?
}

// ---------------------------------------------------------------- Rotary embedding

/// Forward (`sign` 1) or its transpose, the backward (`sign` -1), for one (batch, position)
/// row of every head: out_j = v_j cos_j - v_{j+h} sin_j (j < h) and v_j cos_j + v_{j-h} sin_j
/// (j >= h) forward; the transpose swaps which sin each term takes.
#[inline(always)]
fn rotary_body<T: F32Math>(out: &mut [T], v: &[T], cos: &[T], sin: &[T], sign: f32) {
    let half = cos.len() / 2;
    let (o1, o2) = out.split_at_mut(half);
    let (v1, v2) = v.split_at(half);
    let (c1, c2) = cos.split_at(half);
    let (s1, s2) = sin.split_at(half);
    for j in 0..half {
        let (a, b) = (v1[j].f(), v2[j].f());
        if sign > 0.0 {
            o1[j] = T::of(a * c1[j].f() - b * s1[j].f());
            o2[j] = T::of(b * c2[j].f() + a * s2[j].f());
        } else {
            o1[j] = T::of(a * c1[j].f() + b * s2[j].f());
            o2[j] = T::of(b * c2[j].f() - a * s1[j].f());
        }
    }
}

#[inline(always)]
fn rotary_rows_body<T: F32Math>(
    out: &mut [T],
    v: &[T],
    cos: &[T],
    sin: &[T],
    first_row: usize,
    dims: (usize, usize, usize),
    sign: f32,
) {
    let (heads, seq, d) = dims;
    for (i, (o, x)) in out.chunks_mut(d).zip(v.chunks(d)).enumerate() {
        let row = first_row + i;
        let (batch, pos) = (row / (heads * seq), row % seq);
        let at = (batch * seq + pos) * d;
        rotary_body(o, x, &cos[at..at + d], &sin[at..at + d], sign);
    }
}

simd_dispatch!(rotary_rows, rotary_rows_avx2, rotary_rows_body, <T: F32Math>, (out: &mut [T], v: &[T], cos: &[T], sin: &[T], first_row: usize, dims: (usize, usize, usize), sign: f32));

fn rotary_cpu<T: F32Math>(
    v: &[T],
    cos: &[T],
    sin: &[T],
    dims: (usize, usize, usize),
    sign: f32,
) -> Vec<T> {
    let d = dims.2;
    let mut out = vec![T::of(0.0); v.len()];
    out.par_chunks_mut(d * ROWS_PER_TASK)
        .zip(v.par_chunks(d * ROWS_PER_TASK))
        .enumerate()
        .for_each(|(t, (o, x))| rotary_rows(o, x, cos, sin, t * ROWS_PER_TASK, dims, sign));
    out
}

struct Rotary {
    /// 1 forward, -1 the backward (the transposed rotation).
    sign: f32,
}

fused_op!(Rotary: CustomOp3 [this] {
    name: if this.sign > 0.0 {
        "fused-rotary"
    } else {
        "fused-rotary-bwd"
    },
    cpu(s1, l1, s2, l2, s3, l3) {
        let (_, heads, seq, d) = l1.shape().dims4()?;
        let dims = (heads, seq, d);
        let sign = this.sign;
        let out = per_dtype!(s1.dtype(), "fused rotary", |T| rotary_cpu::<T>(
            slice(s1, l1)?,
            slice(s2, l2)?,
            slice(s3, l3)?,
            dims,
            sign,
        ));
        Ok((out, l1.shape().clone()))
    }
    cuda(s1, l1, s2, l2, s3, l3) {
        super::cuda_fused::rotary((s1, l1), (s2, l2), (s3, l3), this.sign)
    }
    bwd(_x, cos, sin; _y, dy) {
        // The angles come from position ids: no gradient for them.
        let dx = dy
            .contiguous()?
            .apply_op3_no_bwd(cos, sin, &Rotary { sign: -this.sign })?;
        Ok((Some(dx), None, None))
    }
});

/// Rotates `x` [batch, heads, seq, head_dim] by the angles in `cos`/`sin` [batch, seq, head_dim],
/// in Candle ops (where the fused kernel does not apply).
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// Rotates `x` [batch, heads, seq, head_dim] by `cos`/`sin` [batch, seq, head_dim] (as
/// `nn::rope::apply_rotary`).
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !rotary_fused_fits(x, cos, sin)? {
        return apply_rotary(x, cos, sin);
    }
    x.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rotary { sign: 1.0 })
}

/// Whether the fused rotary kernel takes `x` [b, heads, s, d] and `cos`/`sin` [b, s, d].
fn rotary_fused_fits(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<bool> {
    let shapes_fit = x.rank() == 4 && cos.rank() == 3 && {
        let (b, _, s, d) = x.dims4()?;
        cos.dims() == [b, s, d] && sin.dims() == [b, s, d] && d % 2 == 0
    };
    Ok(shapes_fit && fused_here(&[x, cos, sin]))
}

/// The transposed rotation of [`rotary`] (by the negated angles): its backward, for a chain
/// of ops that computes its own (`nn::chain`). Not differentiable.
pub fn rotary_transposed(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !rotary_fused_fits(g, cos, sin)? {
        return apply_rotary(&g.detach(), cos, &sin.neg()?);
    }
    g.contiguous()?.apply_op3_no_bwd(
        &cos.contiguous()?,
        &sin.contiguous()?,
        &Rotary { sign: -1.0 },
    )
}

/// The plain computation (also what the sharded op runs once its weights are gathered).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims();
    let inner = dims[dims.len() - 1];
    let rows = x.elem_count() / inner;
    let x2 = x.reshape((rows, inner))?;
    // A decode step's few rows: each weight row read once (no gradient wanted there).
    let y = match super::skinny::applies(&x2, weight) {
        true => super::skinny::matmul_t(&x2, weight)?,
        false => x2.matmul(&weight.t()?)?,
    };
    let y = match bias {
        Some(b) => add_bias(&y, b)?,
        None => y,
    };
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().unwrap() = weight.dim(0)?;
    y.reshape(out_dims)
}

/// `x W^T + b` with `W` and `b` held constant (a LoRA layer's frozen base): the backward
/// gives `x` its gradient `g W` and computes no weight gradient, which Candle's matmul
/// backward would (a third of the layer's work, thrown away).
pub fn linear_frozen(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = linear(&x.detach(), weight, bias)?;
    if !x.track_op() {
        return Ok(y);
    }
    x.apply_op1(FrozenLinear {
        weight: weight.clone(),
        out: crate::precomputed::Precomputed::new(y),
    })
}

struct FrozenLinear {
    weight: Tensor,
    out: crate::precomputed::Precomputed,
}

impl candle_core::CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        self.out.take("a frozen linear layer")
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.take_cuda("a frozen linear layer")
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (out, inner) = self.weight.dims2()?;
        let rows = arg.elem_count() / inner;
        let g = grad.reshape((rows, out))?.to_dtype(self.weight.dtype())?;
        Ok(Some(g.matmul(&self.weight)?.reshape(arg.shape())?))
    }
}

#[cfg(test)]
mod tests;

// ---------------------------------------------------------------- cross-entropy rows

/// Max of a row in eight lanes.
#[inline(always)]
fn row_max<T: F32Math>(x: &[T]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = a.max(v.f());
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, v| m.max(v.f()));
    acc.iter().fold(tail, |m, v| m.max(*v))
}

/// What the cross-entropy pass gives for one row: its loss, its entropy (TRL's `entropy`:
/// log-sum-exp minus the probabilities' mean logit) and whether the target is the argmax
/// (TRL's `mean_token_accuracy`: the first maximum, as torch's argmax picks it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct RowStats {
    pub loss: f64,
    pub entropy: f64,
    pub top1: bool,
}

/// One logits row: its [`RowStats`] and, with `grads`, the row turned in place into the
/// loss's gradient: softmax minus the one-hot target.
#[inline(always)]
fn cross_entropy_row_body<T: F32Math>(
    row: &mut [T],
    target: usize,
    grads: bool,
    out: &mut RowStats,
) {
    // The maximum in two parts: the part before the target decides a tie (the first wins).
    let before = row_max(&row[..target]);
    let max = before.max(row_max(&row[target..]));
    let picked = row[target].f();
    let (mut acc, mut acc_d) = ([0f32; 8], [0f32; 8]);
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        for ((a, ad), v) in acc.iter_mut().zip(acc_d.iter_mut()).zip(c.iter_mut()) {
            let d = v.f() - max;
            let e = exp_f32(d);
            *v = T::of(e);
            *a += e;
            *ad += e * d;
        }
    }
    let (mut tail, mut tail_d) = (0f32, 0f32);
    for v in chunks.into_remainder() {
        let d = v.f() - max;
        let e = exp_f32(d);
        *v = T::of(e);
        tail += e;
        tail_d += e * d;
    }
    let sum = acc.iter().sum::<f32>() + tail;
    let sum_d = acc_d.iter().sum::<f32>() + tail_d;
    if grads {
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v = T::of(v.f() * inv);
        }
        row[target] = T::of(row[target].f() - 1.0);
    }
    let ln_sum = (sum as f64).ln();
    *out = RowStats {
        loss: (max as f64 + ln_sum) - picked as f64,
        // log Z - E_p[z], with z shifted by the maximum: ln(sum) - sum(e d) / sum.
        entropy: ln_sum - sum_d as f64 / sum as f64,
        top1: picked >= max && picked > before,
    };
}

/// Max of an f32 row.
pub(crate) fn row_max_f32(x: &[f32]) -> f32 {
    row_max(x)
}

simd_dispatch!(cross_entropy_row, cross_entropy_row_avx2, cross_entropy_row_body, <T: F32Math>, (row: &mut [T], target: usize, grads: bool, out: &mut RowStats));

/// Cross-entropy of every row of `logits` (rows of `vocab`) against `targets` (-100:
/// ignored), in place and in parallel: writes each row's [`RowStats`] to `stats` (zero where
/// ignored), returns the losses' sum in f64 and, with `grads`, leaves in `logits` the
/// gradient of that sum (softmax minus one-hot; zero rows for ignored targets). Targets are
/// checked by the caller.
pub(crate) fn cross_entropy_rows(
    logits: &mut [f32],
    vocab: usize,
    targets: &[i64],
    grads: bool,
    stats: &mut [RowStats],
) -> f64 {
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .zip(stats.par_iter_mut())
        .map(|((row, &t), out)| {
            *out = RowStats::default();
            if t < 0 {
                if grads {
                    row.fill(0.0);
                }
            } else {
                cross_entropy_row::<f32>(row, t as usize, grads, out);
            }
            out.loss
        })
        .sum()
}

// ---------------------------------------------------------------- dropout

/// splitmix64's increment: element `i` of a mask draws from `seed + (i + 1) * GOLDEN`.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output for the state `z` (already advanced).
#[inline(always)]
pub fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 53 random bits element `i` draws from `seed`: splitmix64's output for the state
/// `seed + (i + 1) * GOLDEN`, its top 53 bits (dropout's mask, NEFTune's noise; fused.cu's
/// `counter_hash` draws the same).
#[inline(always)]
fn draw53(seed: u64, i: usize) -> u64 {
    splitmix(seed.wrapping_add((i as u64 + 1).wrapping_mul(GOLDEN))) >> 11
}

/// Inverted dropout with probability `p`: element `i` of `x` is kept, times `1 / (1 - p)`
/// (rounded to `x`'s dtype), when `(splitmix(seed + (i + 1) * GOLDEN) >> 11) / 2^53 < 1 - p`,
/// else zeroed. The mask is a function of the seed and the element alone, so it is drawn in
/// parallel (rayon, or one GPU thread per element) and never stored: the backward draws it
/// again for the gradient. LoRA's adapters drop their inputs with it.
pub fn dropout(x: &Tensor, seed: u64, p: f64) -> Result<Tensor> {
    let keep = 1.0 - p;
    let op = Dropout {
        seed,
        // u < keep for u = m / 2^53 (m an integer) is m < keep * 2^53, rounded up.
        keep_below: (keep * (1u64 << 53) as f64).ceil() as u64,
        // The factor as x's dtype holds it (a mask of that dtype times x, as before).
        scale: match x.dtype() {
            DType::BF16 => bf16::from_f32((1.0 / keep) as f32).to_f32(),
            DType::F16 => f16::from_f32((1.0 / keep) as f32).to_f32(),
            _ => (1.0 / keep) as f32,
        },
    };
    if fused_here(&[x]) {
        return x.contiguous()?.apply_op1(op);
    }
    // Other dtypes, or CUDA with the fused kernels off: the same mask built on the host.
    let mask = Tensor::from_vec(op.mask(x.elem_count()), x.shape(), x.device())?;
    x * mask.to_dtype(x.dtype())?
}

#[derive(Clone, Copy)]
struct Dropout {
    seed: u64,
    keep_below: u64,
    scale: f32,
}

impl Dropout {
    #[inline(always)]
    fn factor(&self, i: usize) -> f32 {
        if draw53(self.seed, i) < self.keep_below {
            self.scale
        } else {
            0.0
        }
    }

    fn mask(&self, n: usize) -> Vec<f32> {
        (0..n).into_par_iter().map(|i| self.factor(i)).collect()
    }

    fn apply<T: F32Math>(&self, x: &[T]) -> Vec<T> {
        const CHUNK: usize = 1 << 14;
        // Written once (no zero-filling pass first), as `bias_add_rows` writes.
        let mut out: Vec<T> = Vec::with_capacity(x.len());
        out.spare_capacity_mut()[..x.len()]
            .par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(c, (os, xs))| dropout_chunk(os, xs, *self, c * CHUNK));
        // SAFETY: every element below x.len() was written just above.
        unsafe { out.set_len(x.len()) };
        out
    }
}

// The 64-bit multiplies of the mask's hash vectorize with AVX-512DQ (8 lanes): the baseline
// build hashed one element at a time, 20% of a LoRA step at dropout 0.05 here.
simd_dispatch!(dropout_chunk, dropout_chunk_avx2, dropout_chunk_body, <T: F32Math>, (os: &mut [std::mem::MaybeUninit<T>], xs: &[T], op: Dropout, first: usize));

#[inline(always)]
fn dropout_chunk_body<T: F32Math>(
    os: &mut [std::mem::MaybeUninit<T>],
    xs: &[T],
    op: Dropout,
    first: usize,
) {
    for (j, (o, v)) in os.iter_mut().zip(xs).enumerate() {
        o.write(T::of(v.f() * op.factor(first + j)));
    }
}

fused_op!(Dropout: CustomOp1 [this] {
    name: "dropout",
    cpu(s, l) {
        let out = per_dtype!(s.dtype(), "dropout", |T| this.apply::<T>(slice(s, l)?));
        Ok((out, l.shape().clone()))
    }
    cuda(s, l) {
        super::cuda_fused::dropout((s, l), this.seed, this.keep_below, this.scale)
    }
    bwd(_; _, grad) {
        // Linear in x: the gradient through the same mask.
        Ok(Some(grad.contiguous()?.apply_op1(*this)?))
    }
});

/// `x` plus noise drawn uniformly from [-mag, mag) (NEFTune): element `i` gets
/// `(2u - 1) mag` for `u = (splitmix(seed + (i + 1) * GOLDEN) >> 11) / 2^53`, computed in f64
/// and rounded to f32 before the add, on every device alike. Its gradient is the identity.
pub fn add_uniform_noise(x: &Tensor, seed: u64, mag: f64) -> Result<Tensor> {
    let op = UniformNoise { seed, mag };
    if fused_here(&[x]) {
        return x.contiguous()?.apply_op1(op);
    }
    let noise: Vec<f32> = (0..x.elem_count())
        .into_par_iter()
        .map(|i| op.noise(i))
        .collect();
    let noise = Tensor::from_vec(noise, x.shape(), x.device())?;
    (x.to_dtype(DType::F32)? + noise)?.to_dtype(x.dtype())
}

#[derive(Clone, Copy)]
struct UniformNoise {
    seed: u64,
    mag: f64,
}

impl UniformNoise {
    #[inline(always)]
    fn noise(&self, i: usize) -> f32 {
        let u = draw53(self.seed, i) as f64 / (1u64 << 53) as f64;
        ((2.0 * u - 1.0) * self.mag) as f32
    }

    fn apply<T: F32Math>(&self, x: &[T]) -> Vec<T> {
        x.par_iter()
            .enumerate()
            .map(|(i, v)| T::of(v.f() + self.noise(i)))
            .collect()
    }
}

fused_op!(UniformNoise: CustomOp1 [this] {
    name: "uniform-noise",
    cpu(s, l) {
        let out = per_dtype!(s.dtype(), "uniform noise", |T| this.apply::<T>(slice(s, l)?));
        Ok((out, l.shape().clone()))
    }
    cuda(s, l) {
        super::cuda_fused::uniform_noise((s, l), this.seed, this.mag)
    }
    bwd(_; _, grad) {
        Ok(Some(grad.clone()))
    }
});

// ---------------------------------------------------------------- layout and bias (GPU)

/// `x` [a, b, c, d] -> [a, c, b, d], contiguous: attention's `transpose(1, 2).contiguous()`.
/// On a GPU one kernel that moves whole rows (Candle's strided copy moves 2 bytes a thread and
/// took ~11% of a Qwen2-0.5B step); elsewhere the transpose and copy.
pub fn swap_heads(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cuda() && super::precision::cuda_fused_on() && x.rank() == 4 {
        return x.contiguous()?.apply_op1(SwapHeads);
    }
    x.transpose(1, 2)?.contiguous()
}

/// Swapping dims 1 and 2 again is the backward.
struct SwapHeads;

fused_op!(SwapHeads: CustomOp1 [this] {
    name: "swap-heads",
    cpu(_, _) {
        candle_core::bail!("swap-heads runs on GPUs (the CPU transposes)")
    }
    cuda(s, l) {
        super::cuda_fused::swap12((s, l))
    }
    bwd(_; _, grad) {
        Ok(Some(grad.contiguous()?.apply_op1(SwapHeads)?))
    }
});

/// `y` [.., n] + `bias` [n]: a linear layer's bias, in one pass over contiguous `y` (Candle's
/// broadcast add ran at ~0.1 TB/s on a GPU). The bias gradient is the output gradient summed
/// over the rows ([`sum_rows`]).
pub fn add_bias(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let fits = bias.rank() == 1
        && bias.elem_count() > 0
        && y.dims().last() == Some(&bias.dim(0)?)
        && fused_here(&[y, bias]);
    if fits {
        return y.contiguous()?.apply_op2(&bias.contiguous()?, BiasAdd);
    }
    y.broadcast_add(bias)
}

struct BiasAdd;

fn bias_add_rows<T: F32Math>(y: &[T], b: &[T]) -> Vec<T> {
    let n = b.len();
    // Written once, straight from `y` (a copy then an add would be two passes).
    let mut out: Vec<T> = Vec::with_capacity(y.len());
    out.spare_capacity_mut()[..y.len()]
        .par_chunks_mut(n * ROWS_PER_TASK)
        .zip(y.par_chunks(n * ROWS_PER_TASK))
        .for_each(|(os, ys)| {
            for (orow, yrow) in os.chunks_mut(n).zip(ys.chunks(n)) {
                for ((o, &v), &bi) in orow.iter_mut().zip(yrow).zip(b) {
                    o.write(T::of(v.f() + bi.f()));
                }
            }
        });
    // SAFETY: every element below y.len() was written just above.
    unsafe { out.set_len(y.len()) };
    out
}

fused_op!(BiasAdd: CustomOp2 [this] {
    name: "bias-add",
    cpu(s1, l1, s2, l2) {
        let out = per_dtype!(s1.dtype(), "bias add", |T| bias_add_rows::<T>(
            slice(s1, l1)?,
            slice(s2, l2)?
        ));
        Ok((out, l1.shape().clone()))
    }
    cuda(s1, l1, s2, l2) {
        super::cuda_fused::bias_add((s1, l1), (s2, l2))
    }
    bwd(_, bias; _, grad) {
        let db = sum_rows(&grad.reshape(((), bias.elem_count()))?)?;
        Ok((Some(grad.clone()), Some(db)))
    }
});

/// The sum over the rows of `x` [rows, n]: a bias's or a norm weight's gradient, for backward
/// passes (it records no gradient of its own). One pass adding whole rows in f32: on the CPU
/// (Candle's `sum(0)` walks the columns with a stride: ~3% of a training step) and on GPUs
/// (Candle's took 17 us per bias of a Qwen2-0.5B step); `sum(0)` elsewhere.
pub fn sum_rows(x: &Tensor) -> Result<Tensor> {
    if x.rank() == 2 && x.elem_count() > 0 && fused_here(&[x]) {
        return x.contiguous()?.apply_op1_no_bwd(&SumRows);
    }
    x.sum(0)
}

struct SumRows;

fn sum_rows_f32<T: F32Math>(x: &[T], n: usize) -> Vec<T> {
    let sums = x
        .par_chunks(n * ROWS_PER_TASK * 8)
        .map(|rows| {
            let mut acc = vec![0f32; n];
            sum_rows_into(&mut acc, rows);
            acc
        })
        .reduce(|| vec![0f32; n], add_partial);
    sums.into_iter().map(T::of).collect()
}

simd_dispatch!(sum_rows_into, sum_rows_into_avx2, sum_rows_body, <T: F32Math>, (acc: &mut [f32], rows: &[T]));

#[inline(always)]
fn sum_rows_body<T: F32Math>(acc: &mut [f32], rows: &[T]) {
    for row in rows.chunks(acc.len()) {
        for (a, v) in acc.iter_mut().zip(row) {
            *a += v.f();
        }
    }
}

fused_op!(SumRows: CustomOp1 [this] {
    name: "sum-rows",
    cpu(s, l) {
        let n = l.dims()[1];
        let out = per_dtype!(s.dtype(), "sum over rows", |T| sum_rows_f32::<T>(
            slice(s, l)?,
            n
        ));
        Ok((out, Shape::from(n)))
    }
    cuda(s, l) {
        super::cuda_fused::sum_rows((s, l))
    }
});
