//! Fused attention on CPU, forward and backward: FlashAttention-2's algorithm over blocks of
//! 64 queries x 64 keys, each (batch, key/value head) one rayon task.
//!
//! Forward, per query block: the visible key blocks (causal, and from the start of the row's
//! document) are visited with the online softmax: scores by one small GEMM, then per row the
//! running maximum and sum updated and the probabilities written in place, then the output
//! rescaled and accumulated by a second GEMM. The score matrix never exists beyond one block;
//! key blocks after the query block, or before every query's document, are skipped. What is
//! kept for backward is the output and each row's log-sum-exp.
//!
//! Backward, per key block: for every query block that sees it, the probabilities are
//! recomputed from the scores and the log-sum-exp, and dV, dP = dO V^T, dS = P (dP - D) with
//! D = rowsum(dO * O), dQ and dK follow by GEMMs; dK and dV accumulate in the key block, dQ in
//! the query rows. Query heads sharing a key/value head (GQA) are handled by the same task, so
//! dK and dV need no synchronisation.
//!
//! This is the tiling the CUDA kernel uses (issue: flash attention on GPU); on CPU it replaces
//! the whole-matrix path for f32 inputs.

use super::cpu_gemm::{mm, Mat};
use super::fused::{exp_f32, row_max_f32};
use super::simd::simd_dispatch;
use super::softmax::RowRanges;
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::{CpuStorage, DType, Layout, Result, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

/// Queries and keys per block.
pub const BLOCK: usize = 64;

/// The geometry of one call: q [b, heads, sq, d], k and v [b, kv_heads, sk, d].
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    heads: usize,
    kv_heads: usize,
    sq: usize,
    sk: usize,
    d: usize,
}

impl Dims {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Which keys each query row sees: per (batch row, query) a span `lo..hi` of key indices
/// (empty when `lo >= hi`). The decoder's causal attention over packed rows is one case
/// ([`KeySpans::causal`]); one step of ring attention, queries and keys from two chunks of
/// the sequence, is another ([`KeySpans::shifted`]).
#[derive(Debug, Clone)]
pub struct KeySpans {
    queries: usize,
    // Shared: every layer of a forward (and its backward) uses the same spans.
    lo: Arc<[u32]>,
    hi: Arc<[u32]>,
    /// Scores soft-capped at this (Gemma 2's attn_logit_softcapping): `cap * tanh(s / cap)`
    /// before the softmax; the kernels (CPU and CUDA) apply it, and their backward the cap's
    /// slope `1 - tanh^2`.
    pub softcap: Option<f32>,
}

impl KeySpans {
    /// Causal within documents: query `r` sees keys `start..=r` (keys are the queries).
    pub fn causal(ranges: &RowRanges) -> Self {
        let rows = ranges.rows;
        KeySpans {
            queries: rows,
            lo: ranges.starts.as_slice().into(),
            hi: (0..ranges.batch * rows)
                .map(|i| (i % rows + 1) as u32)
                .collect::<Vec<_>>()
                .into(),
            softcap: None,
        }
    }

    /// The same spans with the scores soft-capped at `cap` (None: not capped).
    pub fn with_softcap(mut self, cap: Option<f64>) -> Self {
        self.softcap = cap.map(|c| c as f32);
        self
    }

    /// Queries at global indices `q0..q0 + nq` over keys at `k0..k0 + nk`, each query seeing
    /// the keys from its document's start (`starts`, global, per batch row and query) to
    /// itself. None when no query sees any key.
    pub fn shifted(
        starts: &[&[usize]],
        q0: usize,
        nq: usize,
        k0: usize,
        nk: usize,
    ) -> Option<Self> {
        let (mut lo, mut hi) = (Vec::new(), Vec::new());
        let mut any = false;
        for row in starts {
            for (r, &st) in row[..nq].iter().enumerate() {
                let a = st.max(k0).min(k0 + nk) - k0;
                let b = (q0 + r + 1).clamp(k0, k0 + nk) - k0;
                any |= a < b;
                lo.push(a as u32);
                hi.push(b.max(a) as u32);
            }
        }
        any.then(|| KeySpans {
            queries: nq,
            lo: lo.into(),
            hi: hi.into(),
            softcap: None,
        })
    }

    /// Spans given per (batch row, query): `lo[i]..hi[i]`, `queries` queries per row.
    pub fn new(queries: usize, lo: Vec<u32>, hi: Vec<u32>) -> Self {
        KeySpans {
            queries,
            lo: lo.into(),
            hi: hi.into(),
            softcap: None,
        }
    }

    /// Queries times batch rows.
    pub fn len(&self) -> usize {
        self.lo.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lo.is_empty()
    }

    /// The first visible key of every (batch row, query).
    pub fn lo(&self) -> &[u32] {
        &self.lo
    }

    /// One past the last visible key of every (batch row, query).
    pub fn hi(&self) -> &[u32] {
        &self.hi
    }

    /// Refuses spans that reach past the `keys` held (every decode kernel's precondition).
    pub fn check_within(&self, keys: usize) -> candle_core::Result<()> {
        if self.hi().iter().any(|&h| h as usize > keys) {
            candle_core::bail!("decode attention: a span reaches past the {keys} cached keys");
        }
        Ok(())
    }

    /// [`Self::lo`] then [`Self::hi`], as one vector (what the GPU decode kernel reads).
    pub fn both(&self) -> Vec<u32> {
        [self.lo(), self.hi()].concat()
    }

    /// The spans of rows `[r0, r0 + m)` of batch row `bi`.
    fn rows(&self, bi: usize, r0: usize, m: usize) -> (&[u32], &[u32]) {
        let span = bi * self.queries + r0..bi * self.queries + r0 + m;
        (&self.lo[span.clone()], &self.hi[span])
    }
}

/// The key blocks a block of rows may see: from the block holding the first visible key to
/// the last visible key (an empty range when none).
fn key_range(lo: &[u32], hi: &[u32]) -> std::ops::Range<usize> {
    let visible = lo.iter().zip(hi).filter(|(l, h)| l < h);
    let first = visible.clone().map(|(l, _)| *l).min();
    let end = visible.map(|(_, h)| *h).max();
    match (first, end) {
        (Some(f), Some(e)) => f as usize / BLOCK * BLOCK..e as usize,
        _ => 0..0,
    }
}

/// One block of rows against keys `[j0, j0 + n)`, with each row's visible key span.
#[derive(Clone, Copy)]
struct BlockRows<'a> {
    j0: usize,
    m: usize,
    n: usize,
    lo: &'a [u32],
    hi: &'a [u32],
}

impl BlockRows<'_> {
    /// Row `r`'s visible columns of the block (empty when none).
    fn cols(&self, r: usize) -> std::ops::Range<usize> {
        let a = (self.lo[r] as usize).max(self.j0);
        let b = (self.hi[r] as usize).min(self.j0 + self.n);
        if a >= b {
            0..0
        } else {
            a - self.j0..b - self.j0
        }
    }

    /// Whether any row sees a key of the block.
    fn any(&self) -> bool {
        (0..self.m).any(|r| !self.cols(r).is_empty())
    }
}

/// Sum of a row in eight lanes.
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// `row[cols] = exp(row[cols] - shift)`, zero elsewhere; returns the sum.
#[inline(always)]
pub(crate) fn exp_visible(row: &mut [f32], cols: std::ops::Range<usize>, shift: f32) -> f32 {
    let (head, rest) = row.split_at_mut(cols.start);
    head.fill(0.0);
    let (vis, tail) = rest.split_at_mut(cols.end - cols.start);
    tail.fill(0.0);
    for x in vis.iter_mut() {
        *x = exp_f32(*x - shift);
    }
    lane_sum(vis)
}

/// Forward: the scores of a block become probabilities under the running maximum; the
/// running maximum and sum of each row are updated and its output row rescaled.
#[inline(always)]
fn online_softmax_body(
    scores: &mut [f32],
    rows: BlockRows,
    m_run: &mut [f32],
    l_run: &mut [f32],
    o: &mut [f32],
    d: usize,
) {
    for r in 0..rows.m {
        let row = &mut scores[r * BLOCK..r * BLOCK + rows.n];
        let cols = rows.cols(r);
        if cols.is_empty() {
            row.fill(0.0);
            continue;
        }
        let m_new = m_run[r].max(row_max_f32(&row[cols.clone()]));
        let alpha = exp_f32(m_run[r] - m_new);
        let sum = exp_visible(row, cols, m_new);
        l_run[r] = alpha * l_run[r] + sum;
        m_run[r] = m_new;
        for x in o[r * d..(r + 1) * d].iter_mut() {
            *x *= alpha;
        }
    }
}

simd_dispatch!(online_softmax, online_softmax_avx2, online_softmax_body, (scores: &mut [f32], rows: BlockRows, m_run: &mut [f32], l_run: &mut [f32], o: &mut [f32], d: usize));

/// Backward: a block's scores become the probabilities `exp(score - lse)` (zero where masked).
#[inline(always)]
fn probabilities_body(p: &mut [f32], rows: BlockRows, lse: &[f32]) {
    for r in 0..rows.m {
        let cols = rows.cols(r);
        let row = &mut p[r * BLOCK..r * BLOCK + rows.n];
        if cols.is_empty() {
            row.fill(0.0);
        } else {
            exp_visible(row, cols, lse[r]);
        }
    }
}

simd_dispatch!(probabilities, probabilities_avx2, probabilities_body, (p: &mut [f32], rows: BlockRows, lse: &[f32]));

/// Backward: `dS = P (dP - D)` in place of dP.
#[inline(always)]
fn score_grads_body(dp: &mut [f32], p: &[f32], rows: BlockRows, delta: &[f32]) {
    for (r, dl) in delta.iter().enumerate().take(rows.m) {
        let span = r * BLOCK..r * BLOCK + rows.n;
        for (g, pv) in dp[span.clone()].iter_mut().zip(&p[span]) {
            *g = pv * (*g - dl);
        }
    }
}

simd_dispatch!(score_grads, score_grads_avx2, score_grads_body, (dp: &mut [f32], p: &[f32], rows: BlockRows, delta: &[f32]));

/// The scores of a block: the head dim and the soft-cap (if any) they are computed with.
#[derive(Clone, Copy)]
struct Scorer {
    d: usize,
    cap: Option<f32>,
}

impl Scorer {
    /// `s` = Q_i K_j^T / sqrt(d) for the block `rows` (rows BLOCK apart, `k` from key j0
    /// on), soft-capped where there is a cap (its slope into `slope` where asked).
    fn scores(self, s: &mut [f32], rows: BlockRows, qi: Mat, k: &[f32], slope: Option<&mut [f32]>) {
        let (m, n, d) = (rows.m, rows.n, self.d);
        let kt = Mat::transposed(k, d);
        mm((m, n, d), s, BLOCK, qi, kt, 1.0 / (d as f32).sqrt(), false);
        if let Some(cap) = self.cap {
            soft_cap(s, (m, n), cap, slope);
        }
    }
}

/// `cap * tanh(s / cap)` over the `m x n` scores of a block (rows BLOCK apart), and the slope
/// `1 - tanh^2` of each into `slope` when given.
fn soft_cap(scores: &mut [f32], (m, n): (usize, usize), cap: f32, mut slope: Option<&mut [f32]>) {
    for r in 0..m {
        for c in r * BLOCK..r * BLOCK + n {
            let t = (scores[c] / cap).tanh();
            scores[c] = cap * t;
            if let Some(s) = slope.as_deref_mut() {
                s[c] = 1.0 - t * t;
            }
        }
    }
}

/// Forward of one (batch, kv head): outputs and log-sum-exps of its `group` query heads. A
/// row that sees no key gets a zero output and a log-sum-exp of minus infinity (a ring step
/// then adds nothing to it).
fn forward_task(
    dims: Dims,
    bi: usize,
    (q, k, v): (&[f32], &[f32], &[f32]),
    spans: &KeySpans,
    (out, lse): (&mut [f32], &mut [f32]),
) {
    let Dims { sq, sk, d, .. } = dims;
    let scorer = Scorer {
        d,
        cap: spans.softcap,
    };
    let mut scores = vec![0f32; BLOCK * BLOCK];
    let (mut m_run, mut l_run) = (vec![0f32; BLOCK], vec![0f32; BLOCK]);
    for h in 0..dims.group() {
        let qh = &q[h * sq * d..(h + 1) * sq * d];
        let oh = &mut out[h * sq * d..(h + 1) * sq * d];
        let lh = &mut lse[h * sq..(h + 1) * sq];
        for i0 in (0..sq).step_by(BLOCK) {
            let m = BLOCK.min(sq - i0);
            let (lo, hi) = spans.rows(bi, i0, m);
            // Zero from its allocation: the first visible block adds into it.
            let o = &mut oh[i0 * d..(i0 + m) * d];
            m_run[..m].fill(f32::NEG_INFINITY);
            l_run[..m].fill(0.0);
            for j0 in key_range(lo, hi).step_by(BLOCK) {
                let n = BLOCK.min(sk - j0);
                let rows = BlockRows { j0, m, n, lo, hi };
                if !rows.any() {
                    continue;
                }
                let qi = Mat::rows(&qh[i0 * d..], d);
                scorer.scores(&mut scores, rows, qi, &k[j0 * d..], None);
                online_softmax(&mut scores, rows, &mut m_run, &mut l_run, o, d);
                let p = Mat::rows(&scores, BLOCK);
                let vj = Mat::rows(&v[j0 * d..], d);
                mm((m, d, n), o, d, p, vj, 1.0, true);
            }
            for r in 0..m {
                if l_run[r] == 0.0 {
                    lh[i0 + r] = f32::NEG_INFINITY;
                    continue;
                }
                let inv = 1.0 / l_run[r];
                o[r * d..(r + 1) * d].iter_mut().for_each(|x| *x *= inv);
                lh[i0 + r] = m_run[r] + l_run[r].ln();
            }
        }
    }
}

/// Backward of one (batch, kv head): dq of its query heads, dk and dv of the kv head. `out`
/// and `lse` are those of the whole attention the keys here are part of (a ring step's keys
/// are one part), so the gradients of this part come out exact.
#[allow(clippy::too_many_arguments)]
fn backward_task(
    dims: Dims,
    bi: usize,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (out, lse, dout): (&[f32], &[f32], &[f32]),
    spans: &KeySpans,
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let Dims { sq, sk, d, .. } = dims;
    let scorer = Scorer {
        d,
        cap: spans.softcap,
    };
    let scale = 1.0 / (d as f32).sqrt();
    let mut p = vec![0f32; BLOCK * BLOCK];
    let mut dp = vec![0f32; BLOCK * BLOCK];
    // The cap's slope per score, when capped.
    let mut slope = vec![
        0f32;
        if spans.softcap.is_some() {
            BLOCK * BLOCK
        } else {
            0
        }
    ];
    let mut delta = vec![0f32; sq];
    // The key blocks each query block may see.
    let reach: Vec<_> = (0..sq)
        .step_by(BLOCK)
        .map(|i0| {
            let (lo, hi) = spans.rows(bi, i0, BLOCK.min(sq - i0));
            key_range(lo, hi)
        })
        .collect();
    // dq, dk and dv are zero from their allocation: blocks add into them.
    for h in 0..dims.group() {
        let span = h * sq * d..(h + 1) * sq * d;
        let (qh, oh, doh) = (&q[span.clone()], &out[span.clone()], &dout[span.clone()]);
        let dqh = &mut dq[span];
        let lh = &lse[h * sq..(h + 1) * sq];
        for (r, dl) in delta.iter_mut().enumerate() {
            let row = r * d..(r + 1) * d;
            *dl = doh[row.clone()]
                .iter()
                .zip(&oh[row])
                .map(|(a, b)| a * b)
                .sum();
        }
        for j0 in (0..sk).step_by(BLOCK) {
            let n = BLOCK.min(sk - j0);
            for (bi0, keys) in reach.iter().enumerate() {
                if !keys.contains(&j0) {
                    continue;
                }
                let i0 = bi0 * BLOCK;
                let m = BLOCK.min(sq - i0);
                let (lo, hi) = spans.rows(bi, i0, m);
                let rows = BlockRows { j0, m, n, lo, hi };
                if !rows.any() {
                    continue;
                }
                let qi = Mat::rows(&qh[i0 * d..], d);
                scorer.scores(&mut p, rows, qi, &k[j0 * d..], Some(&mut slope));
                probabilities(&mut p, rows, &lh[i0..i0 + m]);
                // dV_j += P^T dO_i
                let pt = Mat::transposed(&p, BLOCK);
                let doi = Mat::rows(&doh[i0 * d..], d);
                mm((n, d, m), &mut dv[j0 * d..], d, pt, doi, 1.0, true);
                // dP = dO_i V_j^T, then dS = P (dP - D) in place of dP.
                let vt = Mat::transposed(&v[j0 * d..], d);
                mm((m, n, d), &mut dp, BLOCK, doi, vt, 1.0, false);
                score_grads(&mut dp, &p, rows, &delta[i0..i0 + m]);
                if spans.softcap.is_some() {
                    // Through the cap: the capped scores' gradient times the slope.
                    for r in 0..m {
                        let span = r * BLOCK..r * BLOCK + n;
                        for (g, s) in dp[span.clone()].iter_mut().zip(&slope[span]) {
                            *g *= s;
                        }
                    }
                }
                // dQ_i += scale dS K_j; dK_j += scale dS^T Q_i
                let ds = Mat::rows(&dp, BLOCK);
                let kj = Mat::rows(&k[j0 * d..], d);
                mm((m, d, n), &mut dqh[i0 * d..], d, ds, kj, scale, true);
                let dst = Mat::transposed(&dp, BLOCK);
                mm((n, d, m), &mut dk[j0 * d..], d, dst, qi, scale, true);
            }
        }
    }
}

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("cpu flash attention: contiguous f32 inputs expected"),
    }
}

fn dims_of(q: &Layout, k: &Layout, spans: &KeySpans) -> Result<Dims> {
    let (b, heads, sq, d) = q.shape().dims4()?;
    let (kb, kv_heads, sk, kd) = k.shape().dims4()?;
    if kb != b || kd != d || heads % kv_heads != 0 || spans.lo.len() != b * sq {
        candle_core::bail!(
            "cpu flash attention: q {:?}, k {:?} and {} key spans do not match",
            q.dims(),
            k.dims(),
            spans.lo.len()
        );
    }
    Ok(Dims {
        b,
        heads,
        kv_heads,
        sq,
        sk,
        d,
    })
}

/// Outputs [b, heads, sq, d] and log-sum-exps [b, heads, sq] of contiguous f32 inputs.
fn run_forward(
    dims: Dims,
    (q, k, v): (&[f32], &[f32], &[f32]),
    spans: &KeySpans,
) -> (Vec<f32>, Vec<f32>) {
    let Dims { sq, sk, d, .. } = dims;
    let g = dims.group();
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![0f32; dims.b * dims.heads * sq];
    out.par_chunks_mut(g * sq * d)
        .zip(lse.par_chunks_mut(g * sq))
        .enumerate()
        .for_each(|(t, (o, l))| {
            let bi = t / dims.kv_heads;
            let qs = &q[t * g * sq * d..(t + 1) * g * sq * d];
            let kv_span = t * sk * d..(t + 1) * sk * d;
            forward_task(
                dims,
                bi,
                (qs, &k[kv_span.clone()], &v[kv_span]),
                spans,
                (o, l),
            );
        });
    (out, lse)
}

/// dq, dk, dv of contiguous f32 inputs (see [`backward_task`]).
fn run_backward(
    dims: Dims,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (out, lse, dout): (&[f32], &[f32], &[f32]),
    spans: &KeySpans,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims { sq, sk, d, .. } = dims;
    let g = dims.group();
    let mut dq = vec![0f32; q.len()];
    let mut dk = vec![0f32; k.len()];
    let mut dv = vec![0f32; v.len()];
    dq.par_chunks_mut(g * sq * d)
        .zip(dk.par_chunks_mut(sk * d).zip(dv.par_chunks_mut(sk * d)))
        .enumerate()
        .for_each(|(t, (dqt, (dkt, dvt)))| {
            let bi = t / dims.kv_heads;
            let qspan = t * g * sq * d..(t + 1) * g * sq * d;
            let kspan = t * sk * d..(t + 1) * sk * d;
            backward_task(
                dims,
                bi,
                (&q[qspan.clone()], &k[kspan.clone()], &v[kspan]),
                (
                    &out[qspan.clone()],
                    &lse[t * g * sq..(t + 1) * g * sq],
                    &dout[qspan],
                ),
                spans,
                (dqt, dkt, dvt),
            );
        });
    (dq, dk, dv)
}

/// Runs `f` over the contiguous f32 data of CPU tensors.
fn with_slices<T>(ts: &[&Tensor], f: impl FnOnce(&[&[f32]]) -> Result<T>) -> Result<T> {
    let ts: Vec<Tensor> = ts.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(ts.len());
    for (storage, layout) in &guards {
        match &**storage {
            candle_core::Storage::Cpu(c) => slices.push(contiguous(c, layout)?),
            _ => candle_core::bail!("cpu flash attention: CPU tensors expected"),
        }
    }
    f(&slices)
}

/// Attention of `q` [b, heads, sq, d] over `k`, `v` [b, kv_heads, sk, d] (f32, CPU) as
/// `spans` say, without autograd: the output and each row's log-sum-exp [b, heads, sq] (minus
/// infinity where a row sees no key). Ring attention merges its steps with them.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, spans: &KeySpans) -> Result<(Tensor, Tensor)> {
    let dims = dims_of(q.layout(), k.layout(), spans)?;
    let (out, lse) = with_slices(&[q, k, v], |s| {
        Ok(run_forward(dims, (s[0], s[1], s[2]), spans))
    })?;
    let dev = q.device();
    Ok((
        Tensor::from_vec(out, q.shape(), dev)?,
        Tensor::from_vec(lse, (dims.b, dims.heads, dims.sq), dev)?,
    ))
}

/// The gradients of `q`, `k`, `v` for output gradient `dout`, given the output `out` and
/// log-sum-exp `lse` of the whole attention these keys are part of (see [`forward`]).
pub fn backward(
    (q, k, v): Three,
    (out, lse, dout): Three,
    spans: &KeySpans,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = dims_of(q.layout(), k.layout(), spans)?;
    let (dq, dk, dv) = with_slices(&[q, k, v, out, lse, dout], |s| {
        Ok(run_backward(
            dims,
            (s[0], s[1], s[2]),
            (s[3], s[4], s[5]),
            spans,
        ))
    })?;
    let dev = q.device();
    Ok((
        Tensor::from_vec(dq, q.shape(), dev)?,
        Tensor::from_vec(dk, k.shape(), dev)?,
        Tensor::from_vec(dv, v.shape(), dev)?,
    ))
}

/// Three tensors a kernel reads together: (q, k, v), or (out, lse, dout) in a backward.
pub type Three<'a> = (&'a Tensor, &'a Tensor, &'a Tensor);

/// A fused kernel's backward (this file's, or the CUDA one's): the gradients of q, k, v from
/// (q, k, v), (the output, the log-sum-exp, the output's gradient) and the spans.
pub(crate) type KernelBackward = fn(Three, Three, &KeySpans) -> Result<(Tensor, Tensor, Tensor)>;

/// The decoder's attention: its spans and the forward's log-sum-exp, for a kernel's backward.
struct Flash {
    spans: KeySpans,
    lse: Tensor,
    run: KernelBackward,
}

impl Backward3 for Flash {
    const NAME: &'static str = "flash attention";

    fn backward(&self, saved: &Saved3) -> Result<[Option<Tensor>; 3]> {
        let ([q, k, v], out) = (&saved.inputs, &saved.out);
        let (dq, dk, dv) = (self.run)((q, k, v), (out, &self.lse, &saved.dout), &self.spans)?;
        Ok([Some(dq), Some(dk), Some(dv)])
    }
}

/// A fused kernel's forward `(out, lse)` of `q`, `k`, `v` with autograd by `run`, and the
/// `sinks` [heads] folded in when given (see [`super::sinks`]).
pub(crate) fn with_kernel_backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    forward: (Tensor, Tensor),
    spans: &KeySpans,
    sinks: Option<&Tensor>,
    run: KernelBackward,
) -> Result<Tensor> {
    let spans = spans.clone();
    super::sinks::attend_with(forward, sinks, |out, lse| {
        with_backward3(q, k, v, out, Flash { spans, lse, run })
    })
}

/// Whether the fused CPU kernels take these inputs: f32 on the CPU.
pub fn applies(q: &Tensor, k: &Tensor) -> bool {
    q.device().is_cpu()
        && q.dtype() == DType::F32
        && k.dtype() == DType::F32
        && q.rank() == 4
        && k.rank() == 4
}

/// Attention of `q` [b, heads, sq, d] over `k`, `v` [b, kv_heads, sk, d] as `spans` say (the
/// decoder's: [`crate::nn::AttentionMask::key_spans`]), with autograd, fused as described in
/// the module docs.
/// With `sinks` [heads], each head's sink logit joins every row's softmax (see
/// [`super::sinks`]).
pub fn flash_attention_cpu(
    (q, k, v): Three,
    spans: &KeySpans,
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    let detached = |t: &Tensor| t.detach().contiguous();
    let out = forward(&detached(q)?, &detached(k)?, &detached(v)?, spans)?;
    with_kernel_backward((q, k, v), out, spans, sinks, backward)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::max_abs_diff;
    use crate::nn::attention::{whole_matrix_attention, AttentionMask};
    use candle_core::{Device, Var};

    /// Against the whole-matrix attention (fused causal softmax), values and every gradient, on
    /// packed rows, grouped heads, lengths that leave partial blocks; and it is what the
    /// attention entry points run on CPU in f32.
    #[test]
    fn equals_whole_matrix_attention() {
        let dev = Device::Cpu;
        for (s, heads, kv_heads, d) in [(150, 4, 2, 32), (64, 2, 2, 16), (9, 3, 1, 8)] {
            let mut pos = Vec::new();
            for b in 0..2i64 {
                // Row 0 packs documents of 40 and the rest; row 1 is one document.
                pos.extend((0..s as i64).map(|i| if b == 0 && i >= 40 { i - 40 } else { i }));
            }
            let pos = Tensor::from_vec(pos, (2, s), &dev).unwrap();
            let mask = AttentionMask::causal(&pos, DType::F32, &dev).unwrap();
            let q = Var::randn(0f32, 1.0, (2, heads, s, d), &dev).unwrap();
            let k = Var::randn(0f32, 1.0, (2, kv_heads, s, d), &dev).unwrap();
            let v = Var::randn(0f32, 1.0, (2, kv_heads, s, d), &dev).unwrap();
            let w = Tensor::randn(0f32, 1.0, (2, heads, s, d), &dev).unwrap();
            let run = |fused: bool| {
                let out = match fused {
                    true => flash_attention_cpu((&q, &k, &v), mask.key_spans(), None).unwrap(),
                    false => whole_matrix_attention(&q, &k, &v, &mask).unwrap(),
                };
                crate::kernels::testing::out_and_grads(out, &w, [&q, &k, &v])
            };
            let (want, want_g) = run(false);
            let (got, got_g) = run(true);
            // What every f32 CPU attention runs (eager, sdpa and flash_attention_2 alike).
            for how in [
                crate::nn::AttentionImpl::Eager,
                crate::nn::AttentionImpl::Flash,
            ] {
                let routed = how.apply(&q, &k, &v, &mask).unwrap();
                assert_eq!(
                    max_abs_diff(&routed, &got),
                    0.0,
                    "{how:?} runs the fused kernel"
                );
            }
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-5, "s {s}: output differs by {diff}");
            for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(got_g.iter().zip(&want_g)) {
                let diff = max_abs_diff(a, b);
                assert!(diff < 1e-4, "s {s}: {name} differs by {diff}");
            }
        }
    }
}
