//! The distillation divergence of rows of logits in one pass per row on the CPU (what
//! `nn::divergence` computes in Candle ops, and TRL's `_stats_kernel` / `_jsd_kernel` /
//! `_backward_kernel`): each row's statistics, its divergence and the student's entropy, and
//! the gradient of the weighted divergence written over the student's logits, the row in
//! cache throughout. Sums are kept in f64.

/// What the row pass computes: the divergence `beta` names (0 forward KL(t || s), 1 reverse
/// KL(s || t), between the generalised JSD), of logits soft-capped by their model's cap and
/// divided by `temperature`.
#[derive(Debug, Clone, Copy)]
pub struct RowDivergence {
    pub beta: f64,
    pub temperature: f64,
    pub student_cap: Option<f64>,
    pub teacher_cap: Option<f64>,
}

/// One row's divergence and the student's entropy.
#[derive(Debug, Clone, Copy, Default)]
pub struct RowFigures {
    pub divergence: f64,
    pub entropy: f64,
}

/// `x` as the loss sees it: capped, then divided by the temperature.
#[inline(always)]
fn scaled(x: f32, cap: Option<f32>, inv_t: f32) -> f32 {
    match cap {
        Some(c) => c * (x / c).tanh() * inv_t,
        None => x * inv_t,
    }
}

/// A row's scaled logits' exponentials shifted by their maximum (in `e`): its log sum exp and
/// one over the exponentials' sum (p = e / sum).
fn exps(z: &[f32], e: &mut [f32]) -> (f64, f64) {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for (e, &v) in e.iter_mut().zip(z) {
        *e = (v - max).exp();
        sum += *e as f64;
    }
    (max as f64 + sum.ln(), 1.0 / sum)
}

/// log((1 - beta) p_s + beta p_t) from the probabilities, or from the log-probabilities where
/// both underflowed.
#[inline(always)]
fn log_mixture(b: f64, (ps, pt): (f64, f64), (lps, lpt): (f64, f64)) -> f64 {
    let m = (1.0 - b) * ps + b * pt;
    if m > 0.0 {
        return m.ln();
    }
    let (x, y) = (lps + (1.0 - b).ln(), lpt + b.ln());
    let top = x.max(y);
    top + ((x - top).exp() + (y - top).exp()).ln()
}

impl RowDivergence {
    /// Rows of the student's logits `s` and the teacher's `t` ([rows, vocab] each, raw): each
    /// row's figures; with `weights` (one per row) `s` is overwritten with the gradient of
    /// sum_r weights[r] x divergence_r with respect to the raw logits.
    pub fn rows(
        &self,
        s: &mut [f32],
        t: &[f32],
        vocab: usize,
        weights: Option<&[f64]>,
    ) -> Vec<RowFigures> {
        let inv_t = (1.0 / self.temperature) as f32;
        let (cap_s, cap_t) = (
            self.student_cap.map(|c| c as f32),
            self.teacher_cap.map(|c| c as f32),
        );
        let b = self.beta;
        let (mut zs, mut zt) = (vec![0.0f32; vocab], vec![0.0f32; vocab]);
        let (mut es, mut et) = (vec![0.0f32; vocab], vec![0.0f32; vocab]);
        let mut out = Vec::with_capacity(s.len() / vocab.max(1));
        for (r, (srow, trow)) in s.chunks_mut(vocab).zip(t.chunks(vocab)).enumerate() {
            for v in 0..vocab {
                zs[v] = scaled(srow[v], cap_s, inv_t);
                zt[v] = scaled(trow[v], cap_t, inv_t);
            }
            let ((lse_s, ns), (lse_t, nt)) = (exps(&zs, &mut es), exps(&zt, &mut et));
            let at = |v: usize| {
                let (lps, lpt) = (zs[v] as f64 - lse_s, zt[v] as f64 - lse_t);
                ((es[v] as f64 * ns, et[v] as f64 * nt), (lps, lpt))
            };
            let (mut div, mut entropy, mut kl_s) = (0.0, 0.0, 0.0);
            for v in 0..vocab {
                let ((ps, pt), (lps, lpt)) = at(v);
                entropy -= ps * lps;
                if b == 0.0 {
                    div += pt * (lpt - lps);
                } else if b == 1.0 {
                    div += ps * (lps - lpt);
                } else {
                    let lm = log_mixture(b, (ps, pt), (lps, lpt));
                    let ks = ps * (lps - lm);
                    div += b * pt * (lpt - lm) + (1.0 - b) * ks;
                    kl_s += ks;
                }
            }
            out.push(RowFigures {
                divergence: div,
                entropy,
            });
            let Some(w) = weights.map(|w| w[r]) else {
                continue;
            };
            let scale = inv_t as f64 * w;
            for (v, x) in srow.iter_mut().enumerate() {
                let ((ps, pt), (lps, lpt)) = at(v);
                let dz = if b == 0.0 {
                    ps - pt
                } else if b == 1.0 {
                    ps * (lps - lpt - div)
                } else {
                    let lm = log_mixture(b, (ps, pt), (lps, lpt));
                    (1.0 - b) * ps * (lps - lm - kl_s)
                };
                let mut g = dz * scale;
                if let Some(cap) = cap_s {
                    let th = (*x / cap).tanh() as f64;
                    g *= 1.0 - th * th;
                }
                *x = g as f32;
            }
        }
        out
    }
}
