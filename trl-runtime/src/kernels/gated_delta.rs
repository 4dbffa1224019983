//! The gated delta rule (Gated DeltaNet's linear attention) as one fused CPU op, forward and
//! backward. Per head a state S [dk, dv]; each token t
//!
//! ```text
//! S' = exp(g_t) S            (0 at a document start)
//! delta = beta_t (v_t - S'^T k_t)
//! S  = S' + k_t delta^T
//! o_t = S^T q_t
//! ```
//!
//! Each column of S evolves on its own (the sums run over dk), so the kernel walks the tokens
//! once per block of up to [`COLUMNS`] columns, that block of the state staying in L1 the
//! whole row long: two passes over it per token, vectorised across its columns, and no
//! intermediate tensor. This is the recurrence itself (transformers' recurrent reference,
//! `nn::gated_delta::recurrent`), not the chunked form, whose within-chunk solve is a chain of
//! small dependent products; on a CPU the state's block in L1 is what bounds either.
//!
//! The backward walks each block's row again to keep the state at every [`CHECKPOINT`]-th
//! token, then goes back chunk by chunk: it recomputes the chunk's decayed states S' from its
//! checkpoint and runs the chain rule token by token from the last:
//!
//! ```text
//! dS += q_t do_t^T;  dq_t = S do_t;  dd = dS^T k_t;  dk_t = dS delta
//! dv_t = beta dd;  dbeta_t = dd . (v_t - S'^T k_t);  dp = -beta dd
//! dS' = dS + k_t dp^T;  dk_t += S' dp;  dg_t = sum(dS' * S');  dS = exp(g_t) dS'
//! ```
//!
//! with dq, dk, dg and dbeta summed over the column blocks. Memory: one row's checkpoints
//! of one block per task, nothing kept between forward and backward but the inputs.
//!
//! Inputs travel packed, one row per token `[q (dk) | k (dk) | v (dv) | g | beta]`, beside the
//! initial state; the output holds the tokens' outputs then the final state's rows,
//! [b, h, s + dk, dv]. f32 and f64 on the CPU; on a GPU (feature `cuda`) the same op launches
//! `kernels/gated_delta.cu` (`cuda_gated_delta`: the same tiling, f32); elsewhere
//! `nn::gated_delta` runs the chunked form in Candle ops.

use super::fused::slice;
use super::op::fused_op;
use super::simd::simd_dispatch;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

/// Columns of the state per block: 32 f32 columns of a 128-feature key are 16 KiB.
const COLUMNS: usize = 32;

/// Tokens between the backward's checkpoints of the state.
const CHECKPOINT: usize = 16;

/// The sizes of one call, and which tokens open a document (`starts[row * seq + t]`).
#[derive(Clone)]
struct DeltaRule {
    heads: usize,
    seq: usize,
    dk: usize,
    dv: usize,
    starts: Vec<bool>,
}

/// Features of a packed token: q and k (dk each), v (dv), g and beta.
fn packed_width(dk: usize, dv: usize) -> usize {
    2 * dk + dv + 2
}

impl DeltaRule {
    fn width(&self) -> usize {
        packed_width(self.dk, self.dv)
    }

    #[cfg(feature = "cuda")]
    fn sizes(&self) -> super::cuda_gated_delta::Sizes<'_> {
        super::cuda_gated_delta::Sizes {
            heads: self.heads,
            seq: self.seq,
            dk: self.dk,
            dv: self.dv,
            starts: &self.starts,
        }
    }

    /// Each (row, head)'s initial state [dk, dv] in `s`, laid out by `l` (see
    /// [`state_starts`]).
    fn states<'a, T: WithDType>(&self, s: &'a CpuStorage, l: &Layout) -> Result<Vec<&'a [T]>> {
        let Some(starts) = state_starts(l) else {
            bail!("gated delta rule: the initial state's rows are not whole")
        };
        let all = s.as_slice::<T>()?;
        Ok(starts
            .iter()
            .map(|&a| &all[a..][..self.dk * self.dv])
            .collect())
    }

    /// Task `task`'s (row, head): its packed tokens, initial state and document starts.
    fn head<'a, T>(&'a self, x: &'a [T], s0: &[&'a [T]], task: usize) -> Head<'a, T> {
        let (s, dk, dv, w) = (self.seq, self.dk, self.dv, self.width());
        let row = task / self.heads;
        Head {
            x: &x[task * s * w..(task + 1) * s * w],
            s0: s0[task],
            starts: &self.starts[row * s..(row + 1) * s],
            dk,
            dv,
        }
    }
}

/// Whether the layers run [`delta_rule`] for these inputs (keys `k`, values `v`): on the CPU
/// in f32 or f64 (unless `TRL_DELTA_RULE=chunked`); built with `cuda`, on a GPU in f32 with
/// key dims up to 128 when asked, `TRL_DELTA_RULE=fused` (and the fused CUDA ops are on,
/// `TRL_FUSED_CUDA` not 0): the CUDA kernels have not run on a GPU yet (docs/gpu.md), so a
/// GPU keeps the chunk form in Candle ops by default until one has checked them.
pub fn fused_here(k: &Tensor, v: &Tensor) -> bool {
    // Read once: this runs in every Gated DeltaNet layer's forward.
    static ASKED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let asked = ASKED.get_or_init(|| std::env::var("TRL_DELTA_RULE").ok());
    match v.device() {
        d if d.is_cpu() => conv_here(v) && asked.as_deref() != Some("chunked"),
        d if d.is_cuda() => {
            asked.as_deref() == Some("fused")
                && v.dtype() == DType::F32
                && cuda_takes(k)
                && super::precision::cuda_fused_on()
        }
        _ => false,
    }
}

/// Whether the CUDA kernels take keys `k`: key dims up to theirs.
#[cfg(feature = "cuda")]
fn cuda_takes(k: &Tensor) -> bool {
    k.dims()
        .last()
        .is_some_and(|&d| d <= super::cuda_gated_delta::MAX_DK)
}

#[cfg(not(feature = "cuda"))]
fn cuda_takes(_: &Tensor) -> bool {
    false
}

/// The gated delta rule over `q`, `k` [b, h, s, dk], `v` [b, h, s, dv], log decays `g` and
/// strengths `beta` [b, h, s], from `initial` [b, h, dk, dv] (zeros when None), with
/// `starts[b][t]` whether token t of row b opens a document (its state starts at zero): the
/// outputs [b, h, s, dv] and the final state [b, h, dk, dv]. Differentiable in every input
/// and the initial state.
pub fn delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    starts: &[Vec<bool>],
    initial: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (b, h, s, dk) = k.dims4()?;
    let dv = v.dim(3)?;
    if starts.len() != b || starts.iter().any(|r| r.len() != s) {
        bail!("gated delta rule: document starts are not [{b}][{s}]");
    }
    let dtype = v.dtype();
    let packed = Tensor::cat(
        &[
            q.to_dtype(dtype)?,
            k.to_dtype(dtype)?,
            v.clone(),
            g.to_dtype(dtype)?.unsqueeze(3)?,
            beta.to_dtype(dtype)?.unsqueeze(3)?,
        ],
        3,
    )?;
    let initial = match initial {
        Some(s0) => s0.to_dtype(dtype)?,
        None => Tensor::zeros((b, h, dk, dv), dtype, v.device())?,
    };
    // The previous decode step's state is read where it lies (see below); any other layout
    // is copied first, and on a GPU always (the CUDA op reads it contiguous).
    let initial = match v.device().is_cpu() && state_starts(initial.layout()).is_some() {
        true => initial,
        false => initial.contiguous()?,
    };
    let op = DeltaRule {
        heads: h,
        seq: s,
        dk,
        dv,
        starts: starts.iter().flatten().copied().collect(),
    };
    let both = packed.contiguous()?.apply_op2(&initial, op)?;
    let state = both.narrow(2, s, dk)?;
    // A few tokens (a decode step): the state stays a view into the output, which it keeps
    // alive at little cost (s rows beside dk), and the next step reads it there. Copying it
    // out, then reading it back, was two more passes over it a step: the state is most of a
    // hybrid's decode traffic at batch 8 (a Qwen3.5-like 0.3B: 72 MB against 0.9 GB of
    // weights a step). Past that the view would keep the outputs alive with it.
    let state = match s * 8 <= dk {
        true => state,
        false => state.force_contiguous()?,
    };
    Ok((both.narrow(2, 0, s)?, state))
}

/// Where each (row, head)'s state starts in the storage of a state [b, h, dk, dv] laid out by
/// `l`, when each one's dk x dv rows lie whole (a contiguous state, or the view into a decode
/// step's output that the next step reads in place); None otherwise.
fn state_starts(l: &Layout) -> Option<Vec<usize>> {
    let (b, h, _, dv) = l.shape().dims4().ok()?;
    let st = l.stride();
    (st[3] == 1 && st[2] == dv).then(|| {
        (0..b)
            .flat_map(|r| (0..h).map(move |hd| l.start_offset() + r * st[0] + hd * st[1]))
            .collect()
    })
}

/// Runs `$body` with `$t` the element type of `$dtype` (f32 or f64), as CPU storage.
macro_rules! per_float {
    ($dtype:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                CpuStorage::F32($body)
            }
            DType::F64 => {
                type $t = f64;
                CpuStorage::F64($body)
            }
            d => bail!("gated delta rule: {d:?} is not supported (f32 or f64)"),
        }
    };
}

fused_op!(DeltaRule: CustomOp2 [this] {
    name: "gated-delta-rule",
    cpu(s1, l1, s2, l2) {
        let out = per_float!(s1.dtype(), |T| forward::<T>(this, slice(s1, l1)?, &this.states(s2, l2)?));
        let (b, h, s, _) = l1.shape().dims4()?;
        Ok((out, Shape::from((b, h, s + this.dk, this.dv))))
    }
    cuda(s1, l1, s2, l2) {
        let (b, h, s, _) = l1.shape().dims4()?;
        let out = super::cuda_gated_delta::forward(&this.sizes(), (s1, l1), (s2, l2))?;
        Ok((out, Shape::from((b, h, s + this.dk, this.dv))))
    }
    bwd(x, s0; _out, grad) {
        let op = DeltaRuleBwd(this.clone());
        let both = x.apply_op3_no_bwd(s0, &grad.contiguous()?, &op)?;
        let (b, h, s, w) = x.dims4()?;
        let dx = both.narrow(2, 0, s * w)?.reshape((b, h, s, w))?;
        let ds0 = both.narrow(2, s * w, this.dk * this.dv)?.reshape(s0.shape())?;
        Ok((Some(dx), Some(ds0)))
    }
});

struct DeltaRuleBwd(DeltaRule);

fused_op!(DeltaRuleBwd: CustomOp3 [this] {
    name: "gated-delta-rule-bwd",
    cpu(s1, l1, s2, l2, s3, l3) {
        let op = &this.0;
        let out = per_float!(s1.dtype(), |T| backward::<T>(
            op,
            slice(s1, l1)?,
            &op.states(s2, l2)?,
            slice(s3, l3)?,
        ));
        let (b, h, s, w) = l1.shape().dims4()?;
        Ok((out, Shape::from((b, h, s * w + op.dk * op.dv))))
    }
    cuda(s1, l1, s2, l2, s3, l3) {
        let op = &this.0;
        let (b, h, s, w) = l1.shape().dims4()?;
        let out = super::cuda_gated_delta::backward(&op.sizes(), (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, Shape::from((b, h, s * w + op.dk * op.dv))))
    }
});

/// One (row, head) per rayon task: its outputs then its final state.
fn forward<T: WithDType>(op: &DeltaRule, x: &[T], s0: &[&[T]]) -> Vec<T> {
    let (s, dk, dv, w) = (op.seq, op.dk, op.dv, op.width());
    let mut out = vec![T::from_f64(0.0); x.len() / w / s * (s + dk) * dv];
    out.par_chunks_mut((s + dk) * dv)
        .enumerate()
        .for_each(|(task, o)| forward_head(&op.head(x, s0, task), o));
    out
}

/// One (row, head)'s packed tokens, initial state and document starts.
struct Head<'a, T> {
    x: &'a [T],
    s0: &'a [T],
    starts: &'a [bool],
    dk: usize,
    dv: usize,
}

impl<T: WithDType> Head<'_, T> {
    fn width(&self) -> usize {
        packed_width(self.dk, self.dv)
    }

    /// Token t's query, key, its values of columns `cols`, decay factor and strength.
    #[inline(always)]
    fn token(&self, t: usize, cols: std::ops::Range<usize>) -> (&[T], &[T], &[T], T, T) {
        let (dk, dv) = (self.dk, self.dv);
        let xt = &self.x[t * self.width()..(t + 1) * self.width()];
        let decay = match self.starts[t] {
            true => T::from_f64(0.0),
            false => T::from_f64(xt[2 * dk + dv].to_f64().exp()),
        };
        (
            &xt[..dk],
            &xt[dk..2 * dk],
            &xt[2 * dk + cols.start..2 * dk + cols.end],
            decay,
            xt[2 * dk + dv + 1],
        )
    }

    /// The state's block of columns `cols` from the initial state, rows of `cols.len()`.
    fn initial_block(&self, cols: &std::ops::Range<usize>) -> Vec<T> {
        // Row by row (a copy each): an element-wise iterator here was 13% of a batch-8
        // decode step of the Qwen3.5-like bench.
        let mut block = Vec::with_capacity(self.dk * cols.len());
        for i in 0..self.dk {
            block.extend_from_slice(&self.s0[i * self.dv + cols.start..i * self.dv + cols.end]);
        }
        block
    }
}

simd_dispatch!(forward_head, forward_head_avx2, forward_head_body, <T: WithDType>, (head: &Head<T>, out: &mut [T]));

#[inline(always)]
fn forward_head_body<T: WithDType>(head: &Head<T>, out: &mut [T]) {
    let (dk, dv) = (head.dk, head.dv);
    let seq = head.starts.len();
    for c0 in (0..dv).step_by(COLUMNS) {
        let cols = c0..(c0 + COLUMNS).min(dv);
        let n = cols.len();
        let mut state = head.initial_block(&cols);
        let mut delta = vec![T::from_f64(0.0); n];
        for t in 0..seq {
            let (q, k, v, decay, beta) = head.token(t, cols.clone());
            predict(&mut state, k, decay, &mut delta);
            for (d, &vj) in delta.iter_mut().zip(v) {
                *d = beta * (vj - *d);
            }
            let o = &mut out[t * dv + cols.start..t * dv + cols.end];
            write_read(&mut state, k, q, &delta, o);
        }
        for i in 0..dk {
            out[(seq + i) * dv + cols.start..(seq + i) * dv + cols.end]
                .copy_from_slice(&state[i * n..(i + 1) * n]);
        }
    }
}

/// Decays the block by `decay` (S' = decay S) and sums its rows into `pred` = S'^T k.
#[inline(always)]
fn predict<T: WithDType>(state: &mut [T], k: &[T], decay: T, pred: &mut [T]) {
    let n = pred.len();
    pred.fill(T::from_f64(0.0));
    for (row, &ki) in state.chunks_exact_mut(n).zip(k) {
        for (s, p) in row.iter_mut().zip(pred.iter_mut()) {
            *s *= decay;
            *p += ki * *s;
        }
    }
}

/// Writes k delta^T into the block (S = S' + k delta^T) and reads it, o = S^T q.
#[inline(always)]
fn write_read<T: WithDType>(state: &mut [T], k: &[T], q: &[T], delta: &[T], o: &mut [T]) {
    let n = delta.len();
    o.fill(T::from_f64(0.0));
    for ((row, &ki), &qi) in state.chunks_exact_mut(n).zip(k).zip(q) {
        for ((s, &d), o) in row.iter_mut().zip(delta).zip(o.iter_mut()) {
            *s += ki * d;
            *o += qi * *s;
        }
    }
}

/// a . b in eight lanes (a sequential sum would not vectorise).
#[inline(always)]
fn dot<T: WithDType>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::from_f64(0.0); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .fold(T::from_f64(0.0), |s, (&x, &y)| s + x * y);
    for (xa, xb) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(xa).zip(xb) {
            *s += x * y;
        }
    }
    acc.iter().fold(tail, |s, &x| s + x)
}

/// One (row, head) per rayon task: its packed gradients, then the initial state's.
fn backward<T: WithDType>(op: &DeltaRule, x: &[T], s0: &[&[T]], grad: &[T]) -> Vec<T> {
    let (s, dk, dv, w) = (op.seq, op.dk, op.dv, op.width());
    let per_task = s * w + dk * dv;
    let mut out = vec![T::from_f64(0.0); x.len() / w / s * per_task];
    out.par_chunks_mut(per_task)
        .enumerate()
        .for_each(|(task, o)| {
            let g = &grad[task * (s + dk) * dv..(task + 1) * (s + dk) * dv];
            backward_head(&op.head(x, s0, task), g, o);
        });
    out
}

simd_dispatch!(backward_head, backward_head_avx2, backward_head_body, <T: WithDType>, (head: &Head<T>, grad: &[T], out: &mut [T]));

#[inline(always)]
fn backward_head_body<T: WithDType>(head: &Head<T>, grad: &[T], out: &mut [T]) {
    let (dk, dv, w) = (head.dk, head.dv, head.width());
    let seq = head.starts.len();
    let (dx, ds0) = out.split_at_mut(seq * w);
    let chunks = seq.div_ceil(CHECKPOINT);
    for c0 in (0..dv).step_by(COLUMNS) {
        let cols = c0..(c0 + COLUMNS).min(dv);
        let n = cols.len();
        let block = dk * n;
        // Forward again, keeping the state before every CHECKPOINT-th token.
        let mut checkpoints = vec![T::from_f64(0.0); chunks * block];
        let mut state = head.initial_block(&cols);
        let mut delta = vec![T::from_f64(0.0); n];
        for t in 0..seq {
            if t % CHECKPOINT == 0 {
                checkpoints[t / CHECKPOINT * block..][..block].copy_from_slice(&state);
            }
            let (_, k, v, decay, beta) = head.token(t, cols.clone());
            predict(&mut state, k, decay, &mut delta);
            for (d, &vj) in delta.iter_mut().zip(v) {
                *d = beta * (vj - *d);
            }
            write(&mut state, k, &delta);
        }
        // dS from the final state's gradient.
        let mut ds: Vec<T> = (0..dk)
            .flat_map(|i| grad[(seq + i) * dv + cols.start..(seq + i) * dv + cols.end].iter())
            .copied()
            .collect();
        // One chunk's decayed states S', residuals v - S'^T k and deltas.
        let mut decayed = vec![T::from_f64(0.0); CHECKPOINT * block];
        let mut residual = vec![T::from_f64(0.0); CHECKPOINT * n];
        let mut deltas = vec![T::from_f64(0.0); CHECKPOINT * n];
        let (mut dd, mut dp, mut scratch) = (
            vec![T::from_f64(0.0); n],
            vec![T::from_f64(0.0); n],
            vec![T::from_f64(0.0); n],
        );
        for c in (0..chunks).rev() {
            let first = c * CHECKPOINT;
            let last = (first + CHECKPOINT).min(seq);
            state.copy_from_slice(&checkpoints[c * block..(c + 1) * block]);
            for t in first..last {
                let j = t - first;
                let (_, k, v, decay, beta) = head.token(t, cols.clone());
                let res = &mut residual[j * n..(j + 1) * n];
                predict(&mut state, k, decay, res);
                decayed[j * block..(j + 1) * block].copy_from_slice(&state);
                let d = &mut deltas[j * n..(j + 1) * n];
                for ((r, d), &vj) in res.iter_mut().zip(d.iter_mut()).zip(v) {
                    *r = vj - *r;
                    *d = beta * *r;
                }
                write(&mut state, k, d);
            }
            for t in (first..last).rev() {
                let j = t - first;
                let (q, k, _, decay, beta) = head.token(t, cols.clone());
                let sp = &decayed[j * block..(j + 1) * block];
                let delta = &deltas[j * n..(j + 1) * n];
                let dout = &grad[t * dv + cols.start..t * dv + cols.end];
                let dxt = &mut dx[t * w..(t + 1) * w];
                // dS += q do^T; dq = S do with S = S' + k delta^T; dd = dS^T k; dk = dS delta.
                dd.fill(T::from_f64(0.0));
                for i in 0..dk {
                    let (row, ds_row) = (&sp[i * n..(i + 1) * n], &mut ds[i * n..(i + 1) * n]);
                    let (ki, qi) = (k[i], q[i]);
                    for ((s, &r), &d) in scratch.iter_mut().zip(row).zip(delta) {
                        *s = r + ki * d;
                    }
                    dxt[i] += dot(&scratch, dout);
                    for ((a, &o), e) in ds_row.iter_mut().zip(dout).zip(dd.iter_mut()) {
                        *a += qi * o;
                        *e += ki * *a;
                    }
                    dxt[dk + i] += dot(ds_row, delta);
                }
                let res = &residual[j * n..(j + 1) * n];
                let dv_t = &mut dxt[2 * dk + cols.start..2 * dk + cols.end];
                for ((o, p), &e) in dv_t.iter_mut().zip(dp.iter_mut()).zip(dd.iter()) {
                    *o = beta * e;
                    *p = T::from_f64(0.0) - beta * e;
                }
                dxt[2 * dk + dv + 1] += dot(&dd, res);
                // dS' = dS + k dp^T; dk += S' dp; dg = sum(dS' * S'); dS = decay dS'.
                let mut dg = T::from_f64(0.0);
                for i in 0..dk {
                    let (row, ds_row) = (&sp[i * n..(i + 1) * n], &mut ds[i * n..(i + 1) * n]);
                    let ki = k[i];
                    dxt[dk + i] += dot(row, &dp);
                    for (a, &p) in ds_row.iter_mut().zip(dp.iter()) {
                        *a += ki * p;
                    }
                    dg += dot(ds_row, row);
                    for a in ds_row.iter_mut() {
                        *a *= decay;
                    }
                }
                dxt[2 * dk + dv] += dg;
            }
        }
        for i in 0..dk {
            ds0[i * dv + cols.start..i * dv + cols.end].copy_from_slice(&ds[i * n..(i + 1) * n]);
        }
    }
}

/// Writes k delta^T into the block: S = S' + k delta^T.
#[inline(always)]
fn write<T: WithDType>(state: &mut [T], k: &[T], delta: &[T]) {
    let n = delta.len();
    for (row, &ki) in state.chunks_exact_mut(n).zip(k) {
        for (s, &d) in row.iter_mut().zip(delta) {
            *s += ki * d;
        }
    }
}

// ------------------------------------------------- the short causal convolution, with SiLU

/// f32 and f64, with the exponential each computes in.
trait Real: WithDType {
    fn exp(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn exp(self) -> Self {
        super::fused::exp_f32(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
}

/// SiLU's value and slope at `p`.
#[inline(always)]
fn silu_and_slope<T: Real>(p: T) -> (T, T) {
    let one = T::from_f64(1.0);
    let s = one / (one + (T::from_f64(0.0) - p).exp());
    (p * s, s * (one + p * (one - s)))
}

/// The causal depthwise convolution then SiLU: `x` [b, t, channels], taps `w` [kernel,
/// channels] (the last tap on the token itself; one tap's channels contiguous), and per token of each row how many tokens
/// back its document reaches (`reach[row * t + i]`): earlier documents are not seen.
#[derive(Clone)]
struct ConvSilu {
    kernel: usize,
    reach: Vec<usize>,
}

/// Whether [`conv_silu`] runs for `x`: on the CPU, f32 or f64 (the CPU kernels' types).
pub fn conv_here(x: &Tensor) -> bool {
    x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64)
}

/// SiLU of the causal depthwise convolution of `x` [b, t, channels] by `w` [channels, 1,
/// kernel], y_t = silu(sum_j w[., kernel - 1 - j] x_{t - j}), a token seeing `reach[row][t]`
/// tokens back at most (its document's start). One pass forward, two backward (the
/// gradient of the pre-activation, then dx gathered per token and dw summed per task).
pub fn conv_silu(x: &Tensor, w: &Tensor, reach: &[Vec<usize>]) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    let kernel = w.dim(2)?;
    if w.dims() != [c, 1, kernel] || reach.len() != b || reach.iter().any(|r| r.len() != t) {
        bail!(
            "causal convolution: taps {:?} or reach do not fit x {:?}",
            w.dims(),
            x.dims()
        );
    }
    let op = ConvSilu {
        kernel,
        reach: reach.iter().flatten().copied().collect(),
    };
    let taps = w.reshape((c, kernel))?.t()?.contiguous()?;
    x.contiguous()?.apply_op2(&taps, op)
}

/// Rows handed to one rayon task.
const CONV_ROWS: usize = 64;

fused_op!(ConvSilu: CustomOp2 [this] {
    name: "causal-conv-silu",
    cpu(s1, l1, s2, l2) {
        let c = l2.shape().dims()[1];
        let out = per_float!(s1.dtype(), |T| conv_fwd::<T>(this, slice(s1, l1)?, slice(s2, l2)?, c));
        Ok((out, l1.shape().clone()))
    }
    cuda(_s1, _l1, _s2, _l2) {
        bail!("the fused causal convolution runs on the CPU")
    }
    bwd(x, w; _y, dy) {
        let both = x.apply_op3_no_bwd(w, &dy.contiguous()?, &ConvSiluBwd(this.clone()))?;
        let n = x.elem_count();
        let dx = both.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = both.narrow(0, n, w.elem_count())?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
});

struct ConvSiluBwd(ConvSilu);

fused_op!(ConvSiluBwd: CustomOp3 [this] {
    name: "causal-conv-silu-bwd",
    cpu(s1, l1, s2, l2, s3, l3) {
        let c = l2.shape().dims()[1];
        let out = per_float!(s1.dtype(), |T| conv_bwd::<T>(
            &this.0,
            slice(s1, l1)?,
            slice(s2, l2)?,
            slice(s3, l3)?,
            c,
        ));
        Ok((out, Shape::from(l1.shape().elem_count() + l2.shape().elem_count())))
    }
    cuda(_s1, _l1, _s2, _l2, _s3, _l3) {
        bail!("the fused causal convolution runs on the CPU")
    }
});

/// One call's op, input `x` [tokens, c] and taps `w` [kernel, c].
struct Conv<'a, T> {
    op: &'a ConvSilu,
    x: &'a [T],
    w: &'a [T],
    c: usize,
}

/// The pre-activation of token `i` into `pre`.
#[inline(always)]
fn conv_pre<T: Real>(cv: &Conv<T>, i: usize, pre: &mut [T]) {
    let Conv { op, x, w, c } = *cv;
    let k = op.kernel;
    pre.fill(T::from_f64(0.0));
    for j in 0..k.min(op.reach[i] + 1) {
        let (xs, tap) = (
            &x[(i - j) * c..(i - j + 1) * c],
            &w[(k - 1 - j) * c..(k - j) * c],
        );
        for ((p, &xv), &wv) in pre.iter_mut().zip(xs).zip(tap) {
            *p += wv * xv;
        }
    }
}

fn conv_fwd<T: Real>(op: &ConvSilu, x: &[T], w: &[T], c: usize) -> Vec<T> {
    let cv = Conv { op, x, w, c };
    let mut y = vec![T::from_f64(0.0); x.len()];
    y.par_chunks_mut(c * CONV_ROWS)
        .enumerate()
        .for_each(|(task, ys)| conv_fwd_rows(&cv, task * CONV_ROWS, ys));
    y
}

simd_dispatch!(conv_fwd_rows, conv_fwd_rows_avx2, conv_fwd_rows_body, <T: Real>, (cv: &Conv<T>, first: usize, ys: &mut [T]));

#[inline(always)]
fn conv_fwd_rows_body<T: Real>(cv: &Conv<T>, first: usize, ys: &mut [T]) {
    for (r, yr) in ys.chunks_exact_mut(cv.c).enumerate() {
        conv_pre(cv, first + r, yr);
        for v in yr.iter_mut() {
            *v = silu_and_slope(*v).0;
        }
    }
}

/// dx (as x) then dw (as w [kernel, channels]).
fn conv_bwd<T: Real>(op: &ConvSilu, x: &[T], w: &[T], dy: &[T], c: usize) -> Vec<T> {
    let k = op.kernel;
    let cv = Conv { op, x, w, c };
    // The pre-activation's gradient, dy silu'(pre).
    let mut dp = vec![T::from_f64(0.0); x.len()];
    dp.par_chunks_mut(c * CONV_ROWS)
        .enumerate()
        .for_each(|(task, rows)| conv_slope_rows(&cv, dy, task * CONV_ROWS, rows));
    let mut out = vec![T::from_f64(0.0); x.len() + w.len()];
    let (dx, dw_out) = out.split_at_mut(x.len());
    let dw = dx
        .par_chunks_mut(c * CONV_ROWS)
        .enumerate()
        .map(|(task, rows)| {
            let mut dw = vec![T::from_f64(0.0); c * k];
            conv_grad_rows(&cv, &dp, task * CONV_ROWS, rows, &mut dw);
            dw
        })
        .reduce(
            || vec![T::from_f64(0.0); c * k],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                a
            },
        );
    dw_out.copy_from_slice(&dw);
    out
}

simd_dispatch!(conv_slope_rows, conv_slope_rows_avx2, conv_slope_rows_body, <T: Real>, (cv: &Conv<T>, dy: &[T], first: usize, rows: &mut [T]));

#[inline(always)]
fn conv_slope_rows_body<T: Real>(cv: &Conv<T>, dy: &[T], first: usize, rows: &mut [T]) {
    let c = cv.c;
    for (r, row) in rows.chunks_exact_mut(c).enumerate() {
        let i = first + r;
        conv_pre(cv, i, row);
        for (v, &d) in row.iter_mut().zip(&dy[i * c..(i + 1) * c]) {
            *v = d * silu_and_slope(*v).1;
        }
    }
}

simd_dispatch!(conv_grad_rows, conv_grad_rows_avx2, conv_grad_rows_body, <T: Real>, (cv: &Conv<T>, dp: &[T], first: usize, rows: &mut [T], dw: &mut [T]));

/// dx of tokens `first..` gathered from the tokens that see them (dx_i = sum_j w[k - 1 - j]
/// dp_{i + j} where token i + j reaches j back), and this task's part of dw (dw[k - 1 - j]
/// += x_{i - j} dp_i).
#[inline(always)]
fn conv_grad_rows_body<T: Real>(
    cv: &Conv<T>,
    dp: &[T],
    first: usize,
    rows: &mut [T],
    dw: &mut [T],
) {
    let Conv { op, x, w, c } = *cv;
    let k = op.kernel;
    let tokens = op.reach.len();
    for (r, row) in rows.chunks_exact_mut(c).enumerate() {
        let i = first + r;
        for j in 0..k {
            // Token i + j sees token i when it is in the same row and document.
            if i + j < tokens && op.reach[i + j] >= j {
                let (d, tap) = (
                    &dp[(i + j) * c..(i + j + 1) * c],
                    &w[(k - 1 - j) * c..(k - j) * c],
                );
                for ((o, &dv), &wv) in row.iter_mut().zip(d).zip(tap) {
                    *o += wv * dv;
                }
            }
            if op.reach[i] >= j {
                let (xs, d) = (&x[(i - j) * c..(i - j + 1) * c], &dp[i * c..(i + 1) * c]);
                let tap = &mut dw[(k - 1 - j) * c..(k - j) * c];
                for ((g, &xv), &dv) in tap.iter_mut().zip(xs).zip(d) {
                    *g += xv * dv;
                }
            }
        }
    }
}

/// `gated_delta.cu`'s kernels run on the CPU as the GPU runs them: one loop per block of 32
/// columns, the warp's lanes one after another within each phase that a `__syncwarp` closes,
/// its shared arrays ([dk][33] state and gradient blocks, the chunk's residuals and deltas,
/// the lanes' vectors) and global scratch (checkpoints, decayed states, each block's partial
/// gradients summed by `gdr_sum`) laid out as there. Against the CPU kernel (itself proven
/// against the recurrence), this proves the CUDA arrangement on the CPU: the lanes as rows
/// for dq, dk and dg, the padded layout, the per-block partials.
#[cfg(test)]
mod cuda_emulation {
    use super::*;

    const PAD: usize = 33;
    const CK: usize = 16;
    const LANES: usize = 32;

    /// gdr_fwd over every (task, block).
    fn gdr_fwd(op: &DeltaRule, x: &[f32], s0: &[f32]) -> Vec<f32> {
        let (heads, seq, dk, dv) = (op.heads, op.seq, op.dk, op.dv);
        let w = op.width();
        let tasks = x.len() / (seq * w);
        let mut out = vec![0f32; tasks * (seq + dk) * dv];
        for task in 0..tasks {
            for blk in 0..dv.div_ceil(LANES) {
                let row = task / heads;
                let mut st = vec![0f32; dk * PAD];
                let (mut sq, mut sk) = (vec![0f32; dk], vec![0f32; dk]);
                for lane in 0..LANES {
                    let col = blk * LANES + lane;
                    for i in 0..dk {
                        st[i * PAD + lane] = if col < dv {
                            s0[(task * dk + i) * dv + col]
                        } else {
                            0.0
                        };
                    }
                }
                for t in 0..seq {
                    let xt = &x[(task * seq + t) * w..(task * seq + t + 1) * w];
                    sq.copy_from_slice(&xt[..dk]);
                    sk.copy_from_slice(&xt[dk..2 * dk]);
                    let decay = if op.starts[row * seq + t] {
                        0.0
                    } else {
                        xt[2 * dk + dv].exp()
                    };
                    let beta = xt[2 * dk + dv + 1];
                    for lane in 0..LANES {
                        let col = blk * LANES + lane;
                        let v = if col < dv { xt[2 * dk + col] } else { 0.0 };
                        let mut pred = 0.0;
                        for i in 0..dk {
                            let s = st[i * PAD + lane] * decay;
                            st[i * PAD + lane] = s;
                            pred += sk[i] * s;
                        }
                        let delta = beta * (v - pred);
                        let mut acc = 0.0;
                        for i in 0..dk {
                            let s = st[i * PAD + lane] + sk[i] * delta;
                            st[i * PAD + lane] = s;
                            acc += sq[i] * s;
                        }
                        if col < dv {
                            out[(task * (seq + dk) + t) * dv + col] = acc;
                        }
                    }
                }
                for lane in 0..LANES {
                    let col = blk * LANES + lane;
                    for i in (0..dk).filter(|_| col < dv) {
                        out[(task * (seq + dk) + seq + i) * dv + col] = st[i * PAD + lane];
                    }
                }
            }
        }
        out
    }

    /// gdr_bwd over every (task, block), then gdr_sum.
    fn gdr_bwd(op: &DeltaRule, x: &[f32], s0: &[f32], grad: &[f32]) -> Vec<f32> {
        let (heads, seq, dk, dv) = (op.heads, op.seq, op.dk, op.dv);
        let w = op.width();
        let tasks = x.len() / (seq * w);
        let blocks = dv.div_ceil(LANES);
        let chunks = seq.div_ceil(CK);
        let block = dk * PAD;
        let mut out = vec![0f32; tasks * (seq * w + dk * dv)];
        let mut part = vec![0f32; tasks * blocks * seq * w];
        for task in 0..tasks {
            let row = task / heads;
            let gr = &grad[task * (seq + dk) * dv..(task + 1) * (seq + dk) * dv];
            let xs = &x[task * seq * w..(task + 1) * seq * w];
            for blk in 0..blocks {
                let bid = task * blocks + blk;
                let pt = &mut part[bid * seq * w..(bid + 1) * seq * w];
                let mut ck = vec![0f32; chunks * block];
                let mut sp = vec![0f32; CK * block];
                let (mut st, mut ds) = (vec![0f32; block], vec![0f32; block]);
                let (mut sq, mut sk) = (vec![0f32; dk], vec![0f32; dk]);
                let (mut res_s, mut del_s) = (vec![0f32; CK * LANES], vec![0f32; CK * LANES]);
                let (mut dvec, mut dpvec, mut dovec) =
                    ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
                let col = |lane: usize| blk * LANES + lane;
                // This lane's value at a token (0 past the last column).
                let value = |xt: &[f32], lane: usize| match col(lane) < dv {
                    true => xt[2 * dk + col(lane)],
                    false => 0.0,
                };
                let token = |t: usize| &xs[t * w..(t + 1) * w];
                let decay_of = |t: usize| {
                    if op.starts[row * seq + t] {
                        0.0
                    } else {
                        token(t)[2 * dk + dv].exp()
                    }
                };
                let predict = |st: &mut [f32], sk: &[f32], lane: usize, decay: f32| {
                    let mut pred = 0.0;
                    for i in 0..dk {
                        let s = st[i * PAD + lane] * decay;
                        st[i * PAD + lane] = s;
                        pred += sk[i] * s;
                    }
                    pred
                };
                for lane in 0..LANES {
                    for i in 0..dk {
                        st[i * PAD + lane] = if col(lane) < dv {
                            s0[(task * dk + i) * dv + col(lane)]
                        } else {
                            0.0
                        };
                    }
                }
                for t in 0..seq {
                    let xt = token(t);
                    if t % CK == 0 {
                        for lane in 0..LANES {
                            for i in 0..dk {
                                ck[(t / CK) * block + i * PAD + lane] = st[i * PAD + lane];
                            }
                        }
                    }
                    sq.copy_from_slice(&xt[..dk]);
                    sk.copy_from_slice(&xt[dk..2 * dk]);
                    let decay = decay_of(t);
                    for lane in 0..LANES {
                        let v = value(xt, lane);
                        let delta = xt[2 * dk + dv + 1] * (v - predict(&mut st, &sk, lane, decay));
                        for i in 0..dk {
                            st[i * PAD + lane] += sk[i] * delta;
                        }
                    }
                }
                for lane in 0..LANES {
                    for i in 0..dk {
                        ds[i * PAD + lane] = if col(lane) < dv {
                            gr[(seq + i) * dv + col(lane)]
                        } else {
                            0.0
                        };
                    }
                }
                for c in (0..chunks).rev() {
                    let (first, last) = (c * CK, (c * CK + CK).min(seq));
                    st.copy_from_slice(&ck[c * block..(c + 1) * block]);
                    for t in first..last {
                        let j = t - first;
                        let xt = token(t);
                        sq.copy_from_slice(&xt[..dk]);
                        sk.copy_from_slice(&xt[dk..2 * dk]);
                        let decay = decay_of(t);
                        for lane in 0..LANES {
                            let v = value(xt, lane);
                            let res = v - predict(&mut st, &sk, lane, decay);
                            for i in 0..dk {
                                sp[j * block + i * PAD + lane] = st[i * PAD + lane];
                            }
                            let delta = xt[2 * dk + dv + 1] * res;
                            res_s[j * LANES + lane] = res;
                            del_s[j * LANES + lane] = delta;
                            for i in 0..dk {
                                st[i * PAD + lane] += sk[i] * delta;
                            }
                        }
                    }
                    for t in (first..last).rev() {
                        let j = t - first;
                        let xt = token(t);
                        sq.copy_from_slice(&xt[..dk]);
                        sk.copy_from_slice(&xt[dk..2 * dk]);
                        st.copy_from_slice(&sp[j * block..(j + 1) * block]);
                        let (decay, beta) = (decay_of(t), xt[2 * dk + dv + 1]);
                        let pr = &mut pt[t * w..(t + 1) * w];
                        // Lanes as columns.
                        let mut dbeta = 0.0;
                        for lane in 0..LANES {
                            let dout = if col(lane) < dv {
                                gr[t * dv + col(lane)]
                            } else {
                                0.0
                            };
                            let mut dd = 0.0;
                            for i in 0..dk {
                                let d = ds[i * PAD + lane] + sq[i] * dout;
                                ds[i * PAD + lane] = d;
                                dd += d * sk[i];
                            }
                            if col(lane) < dv {
                                pr[2 * dk + col(lane)] = beta * dd;
                            }
                            dbeta += dd * res_s[j * LANES + lane];
                            dvec[lane] = del_s[j * LANES + lane];
                            dpvec[lane] = -beta * dd;
                            dovec[lane] = dout;
                        }
                        pr[2 * dk + dv + 1] = dbeta;
                        // Lanes as rows.
                        let mut dg = 0.0;
                        for lane in 0..LANES {
                            for i in (lane..dk).step_by(LANES) {
                                let ki = sk[i];
                                let (mut dq, mut dki) = (0.0, 0.0);
                                for c2 in 0..LANES {
                                    let (s, d) = (st[i * PAD + c2], ds[i * PAD + c2]);
                                    dq += (s + ki * dvec[c2]) * dovec[c2];
                                    dki += d * dvec[c2] + s * dpvec[c2];
                                    dg += (d + ki * dpvec[c2]) * s;
                                }
                                pr[i] = dq;
                                pr[dk + i] = dki;
                            }
                        }
                        pr[2 * dk + dv] = dg;
                        // Lanes as columns again.
                        for lane in 0..LANES {
                            for i in 0..dk {
                                ds[i * PAD + lane] =
                                    decay * (ds[i * PAD + lane] + sk[i] * dpvec[lane]);
                            }
                        }
                    }
                }
                for lane in (0..LANES).filter(|&l| col(l) < dv) {
                    for i in 0..dk {
                        out[task * (seq * w + dk * dv) + seq * w + i * dv + col(lane)] =
                            ds[i * PAD + lane];
                    }
                }
            }
        }
        // gdr_sum: the blocks' partials in order.
        for task in 0..tasks {
            for r in 0..seq * w {
                out[task * (seq * w + dk * dv) + r] = (0..blocks)
                    .map(|b| part[(task * blocks + b) * seq * w + r])
                    .sum();
            }
        }
        out
    }

    /// The emulated CUDA kernels equal the CPU kernel's forward and backward, f32, on packed
    /// rows, 128 key features (the kernels' most), 70 value columns (three blocks, the last
    /// partial), 37 tokens (three checkpoints), and a single decoded token.
    #[test]
    fn the_cuda_arrangement_equals_the_cpu_kernel() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for (seq, dk, dv) in [(37usize, 128usize, 70usize), (1, 64, 32)] {
            let (b, heads) = (2, 2);
            let w = packed_width(dk, dv);
            let scale = 1.0 / (dk as f32).sqrt();
            let mut x = vec![0f32; b * heads * seq * w];
            for token in x.chunks_mut(w) {
                for (f, v) in token.iter_mut().enumerate() {
                    *v = match f {
                        f if f < 2 * dk => rng.random_range(-1.0..1.0) * scale,
                        f if f < 2 * dk + dv => rng.random_range(-1.0..1.0),
                        f if f == 2 * dk + dv => -rng.random_range(0.0..0.5),
                        _ => rng.random_range(0.05..0.95),
                    };
                }
            }
            let s0: Vec<f32> = (0..b * heads * dk * dv)
                .map(|_| rng.random_range(-0.3..0.3))
                .collect();
            let grad: Vec<f32> = (0..b * heads * (seq + dk) * dv)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let mut starts = vec![false; b * seq];
            if seq > 20 {
                starts[0] = true;
                starts[16] = true;
                starts[seq + 23] = true;
            }
            let op = DeltaRule {
                heads,
                seq,
                dk,
                dv,
                starts,
            };
            let close = |what: &str, got: &[f32], want: &[f32]| {
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = got
                    .iter()
                    .zip(want)
                    .fold(0f32, |m, (a, e)| m.max((a - e).abs()));
                assert!(
                    d <= 1e-5 * scale.max(1.0),
                    "{what} seq {seq}: {d} (largest {scale})"
                );
            };
            let per_task: Vec<&[f32]> = s0.chunks(dk * dv).collect();
            close(
                "forward",
                &gdr_fwd(&op, &x, &s0),
                &forward::<f32>(&op, &x, &per_task),
            );
            close(
                "backward",
                &gdr_bwd(&op, &x, &s0, &grad),
                &backward::<f32>(&op, &x, &per_task, &grad),
            );
        }
    }
}
