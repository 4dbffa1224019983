//! `x W^T` for a few rows of `x` (a decode step: one token per sequence) on the CPU, f32:
//! each weight row read once from memory and dotted with every row of `x` (which stays in
//! cache), the weight's rows split over the threads. A general GEMM packs the weight into
//! its own layout first, a second pass over the bytes that bound a decode step.
//!
//! It computes no gradient: it runs inside [`no_grad`], which generation's forwards enter.

use super::simd::simd_dispatch;
use candle_core::{CpuStorage, DType, Result, Storage, Tensor};
use rayon::prelude::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The most rows of `x` this kernel takes (a decode step's rows, and short prefills); more rows
/// reuse each weight row enough for a packed GEMM to win. Against Candle's matmul on weights
/// streamed from memory (2 threads of the Intel VM, 2026-12-05): 1.3-3.5x faster at 16 to 32
/// rows, 1.05-2.1x at 48, even to 1.7x at 64, 0.6-1.1x at 128. At 16 a 32-token prompt's
/// prefill ran at 0.56x transformers', at 32 at 1.04x.
pub const MAX_ROWS: usize = 48;

thread_local! {
    static NO_GRAD: Cell<bool> = const { Cell::new(false) };
}

/// While the guard lives, this thread's forwards need no gradient (generation), so
/// [`applies`] takes inputs that track one.
pub fn no_grad() -> NoGrad {
    NoGrad(NO_GRAD.with(|g| g.replace(true)))
}

/// Runs `f`, one forward of generation, under [`no_grad`]; on the CPU on a thread of the pool,
/// so that each op's parallel loop starts there instead of this thread waking the pool and
/// sleeping on a latch once per op (a futex round trip, which weighs at decode sizes: 8-row
/// decode 1.3x faster, measured). While it is the process's only forward, the pool's other
/// threads spin for work ([`spin_for_work`]): a decode step is ~450 short ops, and a thread
/// that sleeps between them is woken late for the next (SmolLM2-135M-like batch 8 decode
/// 1.1-1.15x faster on 2 threads, measured).
pub fn generation_forward<R: Send>(
    device: &candle_core::Device,
    f: impl FnOnce() -> R + Send,
) -> R {
    let run = || {
        let _no_grad = no_grad();
        f()
    };
    if !device.is_cpu() {
        return run();
    }
    let _active = Active::enter();
    let done = &AtomicBool::new(false);
    rayon::scope(|s| {
        let home = rayon::current_thread_index();
        if ACTIVE.load(Ordering::Acquire) == 1 {
            for _ in 1..rayon::current_num_threads() {
                s.spawn(move |_| spin_for_work(home, done));
            }
        }
        let out = run();
        done.store(true, Ordering::Release);
        out
    })
}

/// Generation forwards running in this process (ranks in threads of one process share the
/// pool).
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// One forward counted in [`ACTIVE`] while it lives.
struct Active;

impl Active {
    fn enter() -> Self {
        ACTIVE.fetch_add(1, Ordering::AcqRel);
        Active
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the pool's work as it comes, without sleeping between jobs, until `done`. It leaves at
/// once on the forward's own thread (which pops it while waiting on a join: spinning there
/// would never end), and as soon as another forward starts in this process: a thread held
/// here would be lost to that forward, which may be a rank this one waits for in a
/// collective. (A spinner that another spinner runs nested spins in its place, and both
/// leave together.)
fn spin_for_work(home: Option<usize>, done: &AtomicBool) {
    if rayon::current_thread_index() == home {
        return;
    }
    while !done.load(Ordering::Acquire) && ACTIVE.load(Ordering::Acquire) == 1 {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::hint::spin_loop();
        }
    }
}

/// Restores the previous state when dropped.
pub struct NoGrad(bool);

impl Drop for NoGrad {
    fn drop(&mut self) {
        NO_GRAD.with(|g| g.set(self.0));
    }
}

/// Whether [`matmul_t`] takes `x` [rows, k] and `w` [n, k]: f32 on the CPU, at most
/// [`MAX_ROWS`] rows, in generation ([`no_grad`]) only. A training forward keeps Candle's
/// GEMM even where nothing tracks a gradient (a reference model's, a LoRA layer's frozen
/// base): its figures (DPO's rewards, GRPO's KL) compare with the policy's, which the GEMM
/// computes, and the two kernels sum in different orders (step 1's rewards came out at 5e-8
/// instead of TRL's exact 0 when a tiny batch's reference forward took this kernel).
pub fn applies(x: &Tensor, w: &Tensor) -> bool {
    let rows = x.dims().first().copied().unwrap_or(0);
    NO_GRAD.with(Cell::get)
        && x.device().is_cpu()
        && x.rank() == 2
        && w.rank() == 2
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && (1..=MAX_ROWS).contains(&rows)
}

fn f32s<'a>(s: &'a Storage, l: &candle_core::Layout) -> Option<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Some(&v[a..b]),
        _ => None,
    }
}

/// `x W^T` [rows, n] for `x` [rows, k] and `w` [n, k] (see [`applies`]).
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, wk) = w.dims2()?;
    if wk != k {
        candle_core::bail!("skinny matmul: x {:?} and w {:?}", x.dims(), w.dims());
    }
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (Some(xv), Some(wv)) = (f32s(&xs, xl), f32s(&ws, wl)) else {
        candle_core::bail!("skinny matmul: contiguous f32 CPU tensors expected");
    };
    // Transposed while computed ([n, m]: each task writes its rows), then turned.
    let mut yt = vec![0f32; n * m];
    // One contiguous run of weight rows per thread. Tasks of 64 rows, stolen as threads came
    // free, decoded 1.35-1.4x slower (SmolLM2-135M-like, batch 1 and 8, 2 threads of the
    // Intel VM, 2026-12-05): each task restarts the weight's stream, and a layer's small
    // projections (k, v: 3 tasks) split unevenly.
    let chunk = n
        .div_ceil(rayon::current_num_threads())
        .next_multiple_of(4)
        .max(4);
    yt.par_chunks_mut(chunk * m)
        .enumerate()
        .for_each(|(c, out)| rows_task(xv, &wv[c * chunk * k..], (m, k), out));
    drop((xs, ws));
    let mut y = vec![0f32; m * n];
    for (j, col) in yt.chunks_exact(m).enumerate() {
        for (i, v) in col.iter().enumerate() {
            y[i * n + j] = *v;
        }
    }
    Tensor::from_vec(y, (m, n), x.device())
}

/// Dots of one weight row with four rows of x (each `row.len()` long): each 16-lane block
/// of the weight loaded once for the four.
#[inline(always)]
fn dots4(row: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    let [x0, x1, x2, x3] = x;
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
    let blocks = row
        .chunks_exact(16)
        .zip(x0.chunks_exact(16))
        .zip(x1.chunks_exact(16))
        .zip(x2.chunks_exact(16))
        .zip(x3.chunks_exact(16));
    for ((((w, p0), p1), p2), p3) in blocks {
        for l in 0..16 {
            a0[l] += w[l] * p0[l];
            a1[l] += w[l] * p1[l];
            a2[l] += w[l] * p2[l];
            a3[l] += w[l] * p3[l];
        }
    }
    let full = row.len() / 16 * 16;
    let tail = |p: &[f32]| -> f32 { (full..row.len()).map(|c| row[c] * p[c]).sum() };
    [
        a0.iter().sum::<f32>() + tail(x0),
        a1.iter().sum::<f32>() + tail(x1),
        a2.iter().sum::<f32>() + tail(x2),
        a3.iter().sum::<f32>() + tail(x3),
    ]
}

/// The dot of one weight row with one row of x.
#[inline(always)]
fn dot1(row: &[f32], x: &[f32]) -> f32 {
    let mut a = [0f32; 16];
    for (w, p) in row.chunks_exact(16).zip(x.chunks_exact(16)) {
        for l in 0..16 {
            a[l] += w[l] * p[l];
        }
    }
    let full = row.len() / 16 * 16;
    a.iter().sum::<f32>() + (full..row.len()).map(|c| row[c] * x[c]).sum::<f32>()
}

/// Dots of two weight rows with four rows of x: each 16-lane block of the six rows loaded
/// once for eight products (two loads fewer per product than [`dots4`]).
#[inline(always)]
fn dots2x4(w: [&[f32]; 2], x: [&[f32]; 4]) -> [[f32; 4]; 2] {
    let [w0, w1] = w;
    let [x0, x1, x2, x3] = x;
    let z = [0f32; 16];
    let (mut a00, mut a01, mut a02, mut a03) = (z, z, z, z);
    let (mut a10, mut a11, mut a12, mut a13) = (z, z, z, z);
    let blocks = w0
        .chunks_exact(16)
        .zip(w1.chunks_exact(16))
        .zip(x0.chunks_exact(16))
        .zip(x1.chunks_exact(16))
        .zip(x2.chunks_exact(16))
        .zip(x3.chunks_exact(16));
    for (((((u, v), p0), p1), p2), p3) in blocks {
        for l in 0..16 {
            a00[l] += u[l] * p0[l];
            a01[l] += u[l] * p1[l];
            a02[l] += u[l] * p2[l];
            a03[l] += u[l] * p3[l];
            a10[l] += v[l] * p0[l];
            a11[l] += v[l] * p1[l];
            a12[l] += v[l] * p2[l];
            a13[l] += v[l] * p3[l];
        }
    }
    let full = w0.len() / 16 * 16;
    let dot = |a: &[f32; 16], w: &[f32], p: &[f32]| -> f32 {
        a.iter().sum::<f32>() + (full..w.len()).map(|c| w[c] * p[c]).sum::<f32>()
    };
    [
        [
            dot(&a00, w0, x0),
            dot(&a01, w0, x1),
            dot(&a02, w0, x2),
            dot(&a03, w0, x3),
        ],
        [
            dot(&a10, w1, x0),
            dot(&a11, w1, x1),
            dot(&a12, w1, x2),
            dot(&a13, w1, x3),
        ],
    ]
}

/// For each weight row in `w` (as many as `out` has room for), its dot with each of the `m`
/// rows of `x`: two weight rows by four rows of x at a time where they are there. (Four by
/// four did not vectorize: with the accumulators in arrays 10x slower, named and behind a
/// generic driver 3x slower, measured.)
#[inline(always)]
fn rows_task_body(x: &[f32], w: &[f32], (m, k): (usize, usize), out: &mut [f32]) {
    let xr = |i: usize| &x[i * k..(i + 1) * k];
    let wr = |j: usize| &w[j * k..(j + 1) * k];
    let rows = out.len() / m;
    let mut j = 0;
    while m >= 4 && j + 2 <= rows {
        let mut i = 0;
        while i + 4 <= m {
            let d = dots2x4([wr(j), wr(j + 1)], [xr(i), xr(i + 1), xr(i + 2), xr(i + 3)]);
            out[j * m + i..j * m + i + 4].copy_from_slice(&d[0]);
            out[(j + 1) * m + i..(j + 1) * m + i + 4].copy_from_slice(&d[1]);
            i += 4;
        }
        for r in i..m {
            out[j * m + r] = dot1(wr(j), xr(r));
            out[(j + 1) * m + r] = dot1(wr(j + 1), xr(r));
        }
        j += 2;
    }
    for jj in j..rows {
        let (row, o) = (wr(jj), &mut out[jj * m..(jj + 1) * m]);
        let mut i = 0;
        while i + 4 <= m {
            let d = dots4(row, [xr(i), xr(i + 1), xr(i + 2), xr(i + 3)]);
            o[i..i + 4].copy_from_slice(&d);
            i += 4;
        }
        for (r, oi) in o.iter_mut().enumerate().skip(i) {
            *oi = dot1(row, xr(r));
        }
    }
}

simd_dispatch!(rows_task_portable, rows_task_avx2, rows_task_body, (x: &[f32], w: &[f32], mk: (usize, usize), out: &mut [f32]));

/// [`rows_task_body`]'s blocks with explicit fused multiply-adds where the CPU has them
/// (x86-64 with AVX2 and FMA): LLVM neither fuses `a += w * x` (no fast-math) nor keeps
/// [`dots2x4`]'s 16-lane accumulators in AVX2's 16 registers, so this is ~1.8x faster on
/// weights in cache (measured: 8 rows x 256 x 4096, 21 -> 39 GFLOP/s on one core).
fn rows_task(x: &[f32], w: &[f32], mk: (usize, usize), out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { fma512::rows_task(x, w, mk, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { fma::rows_task(x, w, mk, out) };
    }
    rows_task_portable(x, w, mk, out)
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    /// The horizontal sum of `a` plus the products past the last full 8-lane block.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish(a: __m256, w: &[f32], x: &[f32]) -> f32 {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), a);
        let full = w.len() / 8 * 8;
        lanes.iter().sum::<f32>() + (full..w.len()).map(|c| w[c] * x[c]).sum::<f32>()
    }

    /// Dots of `R` weight rows with `M` rows of x (R x M <= 8 accumulators, leaving AVX2's
    /// other registers for the weight rows; the multiply-adds read the rows of x from
    /// memory).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<const R: usize, const M: usize>(
        w: [&[f32]; R],
        x: [&[f32]; M],
    ) -> [[f32; M]; R] {
        let k = w[0].len();
        let mut a = [[_mm256_setzero_ps(); M]; R];
        let mut c = 0;
        while c + 8 <= k {
            let mut ws = [_mm256_setzero_ps(); R];
            for r in 0..R {
                ws[r] = _mm256_loadu_ps(w[r].as_ptr().add(c));
                // The next block's rows (R rows on), once per 64-byte line: the weight
                // streams from memory, and this doubled the 8-row decode step (measured).
                if c % 16 == 0 {
                    let ahead = w[r].as_ptr().wrapping_add(c + R * w[r].len());
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                }
            }
            for i in 0..M {
                let p = _mm256_loadu_ps(x[i].as_ptr().add(c));
                for r in 0..R {
                    a[r][i] = _mm256_fmadd_ps(ws[r], p, a[r][i]);
                }
            }
            c += 8;
        }
        let mut out = [[0f32; M]; R];
        for r in 0..R {
            for i in 0..M {
                out[r][i] = finish(a[r][i], w[r], x[i]);
            }
        }
        out
    }

    /// Dots of each weight row in turn with one row of x, four accumulators along the row:
    /// one stream through the weight, which the hardware's prefetcher follows alone. Against
    /// 4 x 1 blocks (four streams, each prefetched a block ahead): 1.04-1.06x on SmolLM2-135M's
    /// layers and head streamed from memory (AVX2 VM, 2026-12-05); a software prefetch 128
    /// to 512 bytes ahead made it no faster.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_one_by_one(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
        for (j, o) in out.iter_mut().enumerate() {
            let row = &w[j * k..(j + 1) * k];
            let (p, q) = (row.as_ptr(), x.as_ptr());
            let mut a = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c + 32 <= k {
                for (u, a) in a.iter_mut().enumerate() {
                    let at = c + 8 * u;
                    *a =
                        _mm256_fmadd_ps(_mm256_loadu_ps(p.add(at)), _mm256_loadu_ps(q.add(at)), *a);
                }
                c += 32;
            }
            while c + 8 <= k {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(c)), _mm256_loadu_ps(q.add(c)), a[0]);
                c += 8;
            }
            let a = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            *o = finish(a, row, x);
        }
    }

    /// [`super::rows_task_body`] in blocks of 2 weight rows x 4 rows of x, then 4 x 1 for
    /// the rows of x left, then 1 x 1 for the weight rows left; for one row of x, the weight
    /// rows one by one; for eight short rows of x, blocks of 1 x 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_task(x: &[f32], w: &[f32], (m, k): (usize, usize), out: &mut [f32]) {
        let xr = |i: usize| &x[i * k..(i + 1) * k];
        let wr = |j: usize| &w[j * k..(j + 1) * k];
        if m == 1 {
            return rows_one_by_one(x, w, k, out);
        }
        // Eight rows of x that stay in L1 beside the weight's: each weight row against all
        // eight in one pass (8 accumulators), so the weight streams once instead of twice
        // through 2 x 4 blocks. Measured on the AVX2 VM (2026-12-05, 8 rows, weights
        // streamed): 1.08-1.15x at k 576 and 896, none at k 1536 and 4864 (x past L1). The
        // prefetch stays: without it 0.83x; 2 to 16 rows ahead, into L1 or L2, all within 1%.
        if m == 8 && 8 * k * 4 <= 32 << 10 {
            let x8 = [xr(0), xr(1), xr(2), xr(3), xr(4), xr(5), xr(6), xr(7)];
            for (j, o) in out.chunks_exact_mut(8).enumerate() {
                o.copy_from_slice(&block([wr(j)], x8)[0]);
            }
            return;
        }
        let rows = out.len() / m;
        let mut j = 0;
        while j + 4 <= rows {
            let mut i = 0;
            while i + 4 <= m {
                for jj in [j, j + 2] {
                    let d = block(
                        [wr(jj), wr(jj + 1)],
                        [xr(i), xr(i + 1), xr(i + 2), xr(i + 3)],
                    );
                    out[jj * m + i..jj * m + i + 4].copy_from_slice(&d[0]);
                    out[(jj + 1) * m + i..(jj + 1) * m + i + 4].copy_from_slice(&d[1]);
                }
                i += 4;
            }
            for r in i..m {
                let d = block([wr(j), wr(j + 1), wr(j + 2), wr(j + 3)], [xr(r)]);
                for (jj, v) in d.iter().enumerate() {
                    out[(j + jj) * m + r] = v[0];
                }
            }
            j += 4;
        }
        for jj in j..rows {
            for r in 0..m {
                out[jj * m + r] = block([wr(jj)], [xr(r)])[0][0];
            }
        }
    }
}

/// [`fma::rows_task`] with AVX-512's 16 lanes and 32 registers: blocks of 4 weight rows x 4
/// rows of x (16 accumulators, 8 loads per 16 multiply-adds where AVX2's 2 x 4 blocks need 6
/// per 8), the last partial lanes of a row through masked loads.
#[cfg(target_arch = "x86_64")]
mod fma512 {
    use std::arch::x86_64::*;

    /// One 16-lane step of [`block`] at column `c`, the lanes in `mask` only.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn step<const R: usize, const M: usize>(
        a: &mut [[__m512; M]; R],
        (w, x): ([&[f32]; R], [&[f32]; M]),
        (c, ld): (usize, usize),
        mask: __mmask16,
    ) {
        let mut ws = [_mm512_setzero_ps(); R];
        for r in 0..R {
            ws[r] = _mm512_maskz_loadu_ps(mask, w[r].as_ptr().add(c));
            // The rows four blocks on (4 R rows on in the weight), into L2 while these
            // compute: the hardware's prefetcher alone left the 8-row step at half the speed;
            // four blocks into L2 streamed 1.05-1.15x faster than the next block into L1
            // (8 rows of x, one core of the Intel VM, 2026-12-05).
            let ahead = w[r].as_ptr().wrapping_add(c + 4 * R * ld);
            _mm_prefetch::<_MM_HINT_T1>(ahead.cast());
        }
        for i in 0..M {
            let p = _mm512_maskz_loadu_ps(mask, x[i].as_ptr().add(c));
            for r in 0..R {
                a[r][i] = _mm512_fmadd_ps(ws[r], p, a[r][i]);
            }
        }
    }

    /// Dots of `R` weight rows with `M` rows of x (pieces of rows `ld` floats apart in the
    /// weight).
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize, const M: usize>(
        w: [&[f32]; R],
        x: [&[f32]; M],
        ld: usize,
    ) -> [[f32; M]; R] {
        let k = w[0].len();
        let mut a = [[_mm512_setzero_ps(); M]; R];
        let mut c = 0;
        while c + 16 <= k {
            step(&mut a, (w, x), (c, ld), 0xffff);
            c += 16;
        }
        if c < k {
            step(&mut a, (w, x), (c, ld), (1u16 << (k - c)) - 1);
        }
        let mut out = [[0f32; M]; R];
        if R * M == 16 {
            // Sixteen sums in one transposing tree (45 shuffles and adds, not 16 x 8).
            // SAFETY: `a` is R x M = 16 vectors in a row, `out` 16 floats in a row.
            let v = &*a.as_ptr().cast::<[__m512; 16]>();
            _mm512_storeu_ps(
                out.as_mut_ptr().cast(),
                super::super::simd::x86::reduce16(v),
            );
            return out;
        }
        for r in 0..R {
            for i in 0..M {
                out[r][i] = _mm512_reduce_add_ps(a[r][i]);
            }
        }
        out
    }

    /// Writes `d`, weight rows `j..j + R` against rows of x `i..i + M`, into `out` ([rows, m]).
    fn put<const R: usize, const M: usize>(
        d: [[f32; M]; R],
        out: &mut [f32],
        (j, i, m): (usize, usize, usize),
    ) {
        for (r, v) in d.iter().enumerate() {
            out[(j + r) * m + i..][..M].copy_from_slice(v);
        }
    }

    /// Adds `d`, weight rows `j..j + R` against rows of x `i..i + M`, into `out`.
    fn add<const R: usize, const M: usize>(
        d: [[f32; M]; R],
        out: &mut [f32],
        (j, i, m): (usize, usize, usize),
    ) {
        for (r, v) in d.iter().enumerate() {
            for (o, v) in out[(j + r) * m + i..][..M].iter_mut().zip(v) {
                *o += v;
            }
        }
    }

    /// [`super::rows_task_body`] in blocks of 4 weight rows x 4 rows of x (the last rows of x
    /// in one block of 1 to 3), or of 2 x 8 for eight short rows of x, then 1 x 1 for the
    /// weight rows left.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows_task(x: &[f32], w: &[f32], (m, k): (usize, usize), out: &mut [f32]) {
        let xr = |i: usize| &x[i * k..(i + 1) * k];
        let wr = |j: usize| &w[j * k..(j + 1) * k];
        let rows = out.len() / m;
        let mut j = 0;
        // Eight rows of x that stay in L1 beside the weight's: two weight rows against all
        // eight in one pass (16 accumulators), so the weight streams without a second pass
        // over each block. Measured on AVX-512 (2026-12-05): 8 x 896 x 4864 17 -> 24-39 GB/s
        // of weights. Longer rows in pieces of columns whose eight rows of x fit, a piece of
        // every weight row in turn, its dots added: k 1536 19.5 -> 25 GB/s against 4 x 4
        // blocks, which pass twice over each weight block with x out of L1 (2026-12-06).
        if m == 8 {
            let pieces = (8 * k * 4).div_ceil(32 << 10);
            let kc = k.div_ceil(pieces).next_multiple_of(16);
            for c0 in (0..k).step_by(kc) {
                let c1 = k.min(c0 + kc);
                let xp = |i: usize| &xr(i)[c0..c1];
                let x8 = [xp(0), xp(1), xp(2), xp(3), xp(4), xp(5), xp(6), xp(7)];
                for jj in (0..rows / 2 * 2).step_by(2) {
                    let d = block([&wr(jj)[c0..c1], &wr(jj + 1)[c0..c1]], x8, k);
                    match c0 {
                        0 => put(d, out, (jj, 0, m)),
                        _ => add(d, out, (jj, 0, m)),
                    }
                }
            }
            j = rows / 2 * 2;
        }
        while j + 4 <= rows {
            let ws = [wr(j), wr(j + 1), wr(j + 2), wr(j + 3)];
            let mut i = 0;
            while i < m {
                let at = (j, i, m);
                match m - i {
                    1 => put(block(ws, [xr(i)], k), out, at),
                    2 => put(block(ws, [xr(i), xr(i + 1)], k), out, at),
                    3 => put(block(ws, [xr(i), xr(i + 1), xr(i + 2)], k), out, at),
                    _ => put(
                        block(ws, [xr(i), xr(i + 1), xr(i + 2), xr(i + 3)], k),
                        out,
                        at,
                    ),
                }
                i += 4;
            }
            j += 4;
        }
        for jj in j..rows {
            for r in 0..m {
                out[jj * m + r] = block([wr(jj)], [xr(r)], k)[0][0];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::max_abs_diff;
    use candle_core::Device;

    /// Against Candle's matmul on fresh random inputs: 1 to 16 rows, widths that leave
    /// partial lanes and chunks.
    #[test]
    fn equals_candle_matmul() {
        for (m, k, n) in [
            (1, 64, 200),
            (3, 37, 129),
            (8, 896, 300),
            // Eight rows too long for L1: in pieces of columns, an odd weight row left.
            (8, 1100, 37),
            (16, 100, 64),
            (5, 16, 1),
            (47, 200, 130),
        ] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            // Generation's forwards alone, though nothing tracks a gradient here.
            assert!(!applies(&x, &w));
            let _generating = no_grad();
            assert!(applies(&x, &w));
            let got = matmul_t(&x, &w).unwrap();
            let want = x.matmul(&w.t().unwrap()).unwrap();
            // Sums of k products of unit normals: f32 rounding grows with k.
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 2e-6 * k as f32, "{m}x{k}x{n}: {diff}");
        }
    }

    /// A spinner leaves once a second forward runs in the process, though its own forward
    /// has not finished: it would otherwise hold a pool thread that the other forward (a rank
    /// this one may wait for) needs. Without the guard this never returns.
    #[test]
    fn a_spinner_leaves_when_another_forward_starts() {
        let (_one, _two) = (Active::enter(), Active::enter());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            pool.install(|| spin_for_work(None, &AtomicBool::new(false)));
            tx.send(()).unwrap();
        });
        let left = rx.recv_timeout(std::time::Duration::from_secs(20));
        assert!(left.is_ok(), "the spinner kept its thread");
    }

    /// Forwards of ranks in threads of one process, and one forward alone whose joins pop
    /// its own spinners: each finishes with its own sums.
    #[test]
    fn forwards_with_spinners_finish() {
        let sums = |t: u64| {
            for round in 0..100u64 {
                let got = generation_forward(&Device::Cpu, || {
                    (0..4096u64)
                        .into_par_iter()
                        .map(|i| i + t + round)
                        .sum::<u64>()
                });
                assert_eq!(got, 4095 * 4096 / 2 + 4096 * (t + round));
            }
        };
        sums(7);
        std::thread::scope(|s| {
            for t in 0..2u64 {
                s.spawn(move || sums(t));
            }
        });
    }

    /// Each build of the row loop this CPU can run (the portable one, AVX2 + FMA, AVX-512)
    /// against the plain sum, on rows that leave partial blocks of x, of weight rows and of
    /// lanes.
    #[test]
    fn every_build_equals_the_plain_sum() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (m, k, n) in [
            (1, 40, 9),
            // One row of x: four-block steps, an 8-lane step and a tail.
            (1, 77, 6),
            (3, 37, 7),
            (6, 96, 13),
            (8, 129, 64),
            // Eight rows of x in 2 x 8 blocks, a weight row left over.
            (8, 37, 5),
            (16, 16, 5),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut want = vec![0f32; n * m];
            for j in 0..n {
                for i in 0..m {
                    want[j * m + i] = (0..k).map(|c| w[j * k + c] * x[i * k + c]).sum();
                }
            }
            type Build = fn(&[f32], &[f32], (usize, usize), &mut [f32]);
            let mut builds: Vec<(&str, Build)> = vec![("portable", rows_task_portable)];
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    builds.push(("avx2", |x, w, mk, o| unsafe { fma::rows_task(x, w, mk, o) }));
                }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports AVX-512F (checked just above).
                    builds.push(("avx512", |x, w, mk, o| unsafe {
                        fma512::rows_task(x, w, mk, o)
                    }));
                }
            }
            for (name, f) in builds {
                let mut got = vec![0f32; n * m];
                f(&x, &w, (m, k), &mut got);
                for (g, e) in got.iter().zip(&want) {
                    assert!(
                        (g - e).abs() < 1e-5 * k as f32,
                        "{name} {m}x{k}x{n}: {g} vs {e}"
                    );
                }
            }
        }
    }
}
