//! GRPO's loss as TRL 1.16's `GRPOTrainer._compute_loss` computes it, on the per-token
//! log-probabilities of a micro-batch's completions: the clipped importance ratio (per token
//! or per sequence), the k3 KL estimate against the reference (optionally corrected by the
//! ratio), the top-entropy mask, and each loss type's per-token term and aggregation: the
//! clipped ratio (grpo, bnpo, dr_grpo, dapo, luspo), the clipped and detached ratio weighing
//! the log-probability (cispo), a sigmoid gate of the ratio (sapo), and a detached gamma
//! weight of the sequence's ratio (vespo). It runs on the host in f64 and returns, beside the
//! loss, its derivative with respect to each token's log-probability: the model's backward
//! then weighs each token by it, as DPO's does with each sequence's.

/// TRL's GRPO loss types built here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpoLossType {
    /// Each sequence's mean over its tokens, then the mean over sequences.
    Grpo,
    /// The mean over the micro-batch's tokens.
    Bnpo,
    /// The sum over tokens / (sequences x max_completion_length).
    DrGrpo,
    /// The sum over tokens / the generation batch's tokens (per rank and micro-batch).
    Dapo,
    /// The ratio capped at epsilon_high and detached, times the advantage and the
    /// log-probability; aggregated as dapo.
    Cispo,
    /// A sigmoid gate of the ratio (temperatures by the advantage's sign); aggregated as grpo.
    Sapo,
    /// The clipped ratio, each sequence's sum over its tokens, then the mean over sequences.
    Luspo,
    /// A detached gamma weight of the sequence's summed log-ratio times the advantage and the
    /// log-probability; aggregated as dapo.
    Vespo,
}

/// The figures a loss type logs beside the loss (TRL's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossFigures {
    /// `clip_ratio/{low,high,region}_mean`, `clip_ratio/low_min`, `clip_ratio/high_max`.
    Clip,
    /// `cispo_clip_ratio`.
    Cispo,
    /// `vespo/phi_seq_mean`.
    VespoPhi,
    None,
}

impl LossFigures {
    /// The one figure a type without clip figures logs: its name and its slot in
    /// [`LossOut::clipped`] (counted over [`LossOut::count`]).
    pub fn single(self) -> Option<(&'static str, usize)> {
        match self {
            LossFigures::Cispo => Some(("cispo_clip_ratio", 1)),
            LossFigures::VespoPhi => Some(("vespo/phi_seq_mean", 0)),
            LossFigures::Clip | LossFigures::None => None,
        }
    }
}

impl GrpoLossType {
    pub const NAMES: &'static [&'static str] = &[
        "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo",
    ];

    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "grpo" => GrpoLossType::Grpo,
            "bnpo" => GrpoLossType::Bnpo,
            "dr_grpo" => GrpoLossType::DrGrpo,
            "dapo" => GrpoLossType::Dapo,
            "cispo" => GrpoLossType::Cispo,
            "sapo" => GrpoLossType::Sapo,
            "luspo" => GrpoLossType::Luspo,
            "vespo" => GrpoLossType::Vespo,
            _ => return None,
        })
    }

    /// What [`LossOut::clipped`] holds for this type, and TRL logs.
    pub fn figures(self) -> LossFigures {
        match self {
            GrpoLossType::Cispo => LossFigures::Cispo,
            GrpoLossType::Vespo => LossFigures::VespoPhi,
            GrpoLossType::Sapo => LossFigures::None,
            _ => LossFigures::Clip,
        }
    }
}

/// The loss's settings (GRPOConfig's keys).
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoLoss {
    pub kind: GrpoLossType,
    pub epsilon_low: f64,
    pub epsilon_high: f64,
    /// Two-sided clipping: the unclipped ratio capped at delta.
    pub delta: Option<f64>,
    pub beta: f64,
    /// `use_bias_correction_kl`: the KL term times the importance ratio.
    pub bias_correction_kl: bool,
    /// `importance_sampling_level` sequence: one ratio per completion.
    pub sequence_level: bool,
    pub max_completion_length: usize,
    /// sapo's temperatures for positive and for other advantages.
    pub sapo_temperature: [f64; 2],
    /// vespo's (k, lambda) for advantages >= 0, then for negative ones.
    pub vespo: [f64; 4],
}

/// One completion of a micro-batch, per completion token.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    /// The policy's log-probabilities now.
    pub logps: Vec<f64>,
    /// At generation (the policy that sampled; None: the current ones, detached).
    pub old: Option<Vec<f64>>,
    /// The reference's (beta > 0).
    pub reference: Option<Vec<f64>>,
    /// 1 where the token counts (its completion mask), else 0.
    pub mask: Vec<f64>,
    /// `top_entropy_quantile` < 1: 1 where the token's entropy reaches the threshold.
    pub entropy_mask: Option<Vec<bool>>,
    pub advantage: f64,
}

/// How a micro-batch's sum is divided, beside what the loss type fixes.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Micro-batches per optimizer step (TRL's current_gradient_accumulation_steps).
    pub accumulation: usize,
    /// dapo: the generation batch's tokens over all ranks / ranks x accumulation /
    /// steps_per_generation (TRL's normalizer).
    pub dapo_normalizer: f64,
}

/// What the loss of a micro-batch gave.
#[derive(Debug, Clone, Default)]
pub struct LossOut {
    /// This rank's loss of the micro-batch, scaled as TRL scales it for accumulation.
    pub loss: f64,
    /// d loss / d log p per completion token.
    pub grads: Vec<Vec<f64>>,
    /// The KL summed over the masked tokens, and their count.
    pub kl: f64,
    pub tokens: f64,
    /// Low-, high- and region-clipped summed over the masked tokens (over the sequences at
    /// sequence level, one ratio each), and what they are counted over. cispo: its clipped
    /// tokens in the high slot; vespo: its weight summed over the sequences in the low slot,
    /// counted over the sequences.
    pub clipped: [f64; 3],
    pub count: f64,
    /// Per completion: its masked means of low- and high-clipped (NaN without tokens).
    pub seq_clipped: Vec<[f64; 2]>,
}

/// TRL's nanstd: the unbiased standard deviation of the values that are not NaN.
pub fn nanstd(v: &[f64]) -> f64 {
    let xs: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (var * n / (n - 1.0)).sqrt()
}

/// The mean of the values that are not NaN (NaN when there are none).
pub fn nanmean(v: &[f64]) -> f64 {
    let xs: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// PPO's clipped objective min(r a, clip(r, lo, hi) a) for ratio `r` and advantage `a`, the
/// unclipped ratio capped at `delta` when given (two-sided clipping), and its derivative with
/// respect to the log-ratio, as torch computes them: the clamp passes the gradient inside its
/// bounds (bounds included), and min splits the gradient of a tie.
pub(crate) fn clipped_objective(
    r: f64,
    a: f64,
    (lo, hi): (f64, f64),
    delta: Option<f64>,
) -> (f64, f64) {
    let (t1, t2) = (delta.map_or(r, |d| r.min(d)) * a, r.clamp(lo, hi) * a);
    let dt1 = match delta {
        Some(d) if r > d => 0.0,
        _ => a * r,
    };
    let dt2 = if (lo..=hi).contains(&r) { a * r } else { 0.0 };
    if t1 < t2 {
        (t1, dt1)
    } else if t2 < t1 {
        (t2, dt2)
    } else {
        (t1, 0.5 * (dt1 + dt2))
    }
}

impl GrpoLoss {
    /// Low- and high-clipped for ratio `c1` and advantage `a`, as TRL counts them for this
    /// loss type (cispo: its cap, in the high slot).
    fn clip_flags(&self, c1: f64, a: f64) -> (f64, f64) {
        let flag = |b: bool| b as u8 as f64;
        match self.kind.figures() {
            LossFigures::Clip => (
                flag(c1 < 1.0 - self.epsilon_low && a < 0.0),
                flag(c1 > 1.0 + self.epsilon_high && a > 0.0),
            ),
            LossFigures::Cispo => (0.0, flag(c1 > self.epsilon_high && a > 0.0)),
            LossFigures::VespoPhi | LossFigures::None => (0.0, 0.0),
        }
    }

    /// vespo's detached weight of a completion: its summed log-ratio `s`, the advantage `a`.
    fn vespo_phi(&self, s: f64, a: f64) -> f64 {
        let [kp, lp, kn, ln] = self.vespo;
        let (k, lambda) = if a >= 0.0 { (kp, lp) } else { (kn, ln) };
        let lambda = lambda.max(1e-4);
        let log_w = s.clamp(1e-8f64.ln(), 20.0);
        let phi = (lambda + k * log_w - lambda * log_w.exp()).exp();
        if phi.is_finite() {
            phi
        } else {
            0.0
        }
    }

    /// The policy term of one token (before the entropy mask and the KL), its derivative with
    /// respect to the log importance weight, and with respect to the log-probability itself.
    fn policy_term(&self, c1: f64, a: f64, logp: f64, phi: f64) -> (f64, f64, f64) {
        match self.kind {
            GrpoLossType::Cispo => {
                let r = c1.min(self.epsilon_high);
                (-r * a * logp, 0.0, -r * a)
            }
            GrpoLossType::Vespo => (-phi * a * logp, 0.0, -phi * a),
            GrpoLossType::Sapo => {
                let [pos, neg] = self.sapo_temperature;
                let tau = if a > 0.0 { pos } else { neg };
                let s = 1.0 / (1.0 + (-(tau * (c1 - 1.0))).exp());
                (-s * 4.0 / tau * a, -a * 4.0 * s * (1.0 - s) * c1, 0.0)
            }
            _ => {
                let bounds = (1.0 - self.epsilon_low, 1.0 + self.epsilon_high);
                let (min, dmin) = clipped_objective(c1, a, bounds, self.delta);
                (-min, -dmin, 0.0)
            }
        }
    }

    /// The loss of `batch` (this rank's micro-batch) and its gradient.
    pub fn compute(&self, batch: &[Completion], scale: Scale) -> LossOut {
        let b = batch.len().max(1) as f64;
        let ga = scale.accumulation as f64;
        let all_tokens: f64 = batch.iter().map(|c| c.mask.iter().sum::<f64>()).sum();
        let mut out = LossOut {
            grads: Vec::with_capacity(batch.len()),
            ..Default::default()
        };
        for c in batch {
            let n = c.logps.len();
            let m_sum: f64 = c.mask.iter().sum();
            // Each token's weight in the micro-batch's loss.
            let w = match self.kind {
                GrpoLossType::Grpo | GrpoLossType::Sapo => 1.0 / (b * m_sum.max(1.0) * ga),
                GrpoLossType::Bnpo => 1.0 / (all_tokens.max(1.0) * ga),
                GrpoLossType::DrGrpo => 1.0 / (b * self.max_completion_length as f64 * ga),
                GrpoLossType::Luspo => 1.0 / (b * ga),
                GrpoLossType::Dapo | GrpoLossType::Cispo | GrpoLossType::Vespo => {
                    1.0 / scale.dapo_normalizer.max(f64::MIN_POSITIVE)
                }
            };
            let old = |t: usize| c.old.as_ref().map_or(c.logps[t], |o| o[t]);
            let log_ratio: Vec<f64> = (0..n).map(|t| c.logps[t] - old(t)).collect();
            // The log importance weight per token, or one per sequence (a masked mean).
            let seq_liw = (0..n).map(|t| c.mask[t] * log_ratio[t]).sum::<f64>() / m_sum.max(1.0);
            let liw = |t: usize| match self.sequence_level {
                true => seq_liw,
                false => log_ratio[t],
            };
            let a = c.advantage;
            let phi = match self.kind {
                GrpoLossType::Vespo => {
                    let s = (0..n).map(|t| c.mask[t] * log_ratio[t].clamp(-20.0, 20.0));
                    self.vespo_phi(s.sum(), a)
                }
                _ => 0.0,
            };
            let mut grad = vec![0.0; n];
            // At sequence level: the sum over tokens of d(loss)/d(the shared weight).
            let mut shared = 0.0;
            let mut low_seq = 0.0;
            let mut high_seq = 0.0;
            for t in 0..n {
                let c1 = liw(t).exp();
                let (term, d_term_liw, d_term_direct) = self.policy_term(c1, a, c.logps[t], phi);
                let on = c.entropy_mask.as_ref().is_none_or(|e| e[t]) as u8 as f64;
                let mut loss = term * on;
                let mut d_liw = d_term_liw * on;
                let mut d_direct = d_term_direct * on;
                if self.beta != 0.0 {
                    let r = c.reference.as_ref().map_or(c.logps[t], |r| r[t]) - c.logps[t];
                    let k3 = r.exp() - r - 1.0;
                    let dk3 = 1.0 - r.exp();
                    let (kl, dkl_direct, dkl_liw) = match self.bias_correction_kl {
                        true => (k3 * c1, dk3 * c1, k3 * c1),
                        false => (k3, dk3, 0.0),
                    };
                    loss += self.beta * kl;
                    d_direct += self.beta * dkl_direct;
                    d_liw += self.beta * dkl_liw;
                    out.kl += c.mask[t] * kl;
                }
                let m = c.mask[t];
                out.tokens += m;
                out.loss += w * m * loss;
                grad[t] += w * m * d_direct;
                match self.sequence_level {
                    true => shared += w * m * d_liw,
                    false => grad[t] += w * m * d_liw,
                }
                // Clipping as TRL counts it (on the ratio before delta's cap).
                let (low, high) = self.clip_flags(c1, a);
                if !self.sequence_level && self.kind != GrpoLossType::Vespo {
                    out.clipped[0] += m * low;
                    out.clipped[1] += m * high;
                    out.clipped[2] += m * (low.max(high));
                    out.count += m;
                }
                low_seq += m * low;
                high_seq += m * high;
            }
            if self.sequence_level {
                // d(shared weight)/d(log p_t) = mask_t / tokens.
                for (g, m) in grad.iter_mut().zip(&c.mask) {
                    *g += shared * m / m_sum.max(1.0);
                }
            }
            if self.kind == GrpoLossType::Vespo {
                // One weight per sequence, averaged over the sequences.
                out.clipped[0] += phi;
                out.count += 1.0;
                out.seq_clipped.push([f64::NAN; 2]);
            } else if self.sequence_level {
                // One ratio per sequence: counted once per sequence.
                let (low, high) = self.clip_flags(seq_liw.exp(), a);
                out.clipped[0] += low;
                out.clipped[1] += high;
                out.clipped[2] += low.max(high);
                out.count += 1.0;
                out.seq_clipped.push([low, high]);
            } else {
                out.seq_clipped.push([low_seq / m_sum, high_seq / m_sum]);
            }
            out.grads.push(grad);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> Vec<Completion> {
        let c = |logps: Vec<f64>, old: Vec<f64>, reference: Vec<f64>, mask: Vec<f64>, a: f64| {
            Completion {
                logps,
                old: Some(old),
                reference: Some(reference),
                mask,
                entropy_mask: None,
                advantage: a,
            }
        };
        vec![
            c(
                vec![-1.0, -0.5, -2.0],
                vec![-1.3, -0.45, -1.7],
                vec![-1.1, -0.7, -2.2],
                vec![1.0, 1.0, 0.0],
                0.8,
            ),
            c(
                vec![-0.2, -3.0, -0.9],
                vec![-0.1, -2.5, -1.0],
                vec![-0.3, -2.8, -0.8],
                vec![1.0, 1.0, 1.0],
                -1.1,
            ),
        ]
    }

    /// Every loss type, token and sequence level, with and without the KL's correction and
    /// delta: the returned gradient is the loss's derivative (central differences).
    #[test]
    fn gradients_match_finite_differences() {
        let scale = Scale {
            accumulation: 2,
            dapo_normalizer: 3.5,
        };
        for name in GrpoLossType::NAMES {
            let kind = GrpoLossType::from_name(name).unwrap();
            for sequence_level in [false, true] {
                // cispo's and vespo's weights of the ratio are detached (TRL computes them
                // without a graph): their differences move the old log-probabilities along,
                // so that the ratio, and the weights, hold still; the KL's correction by the
                // ratio is then what they cannot see, so it is left out for them.
                let detached = matches!(kind, GrpoLossType::Cispo | GrpoLossType::Vespo);
                for (bias, delta) in [(false, None), (true, Some(1.1))] {
                    if detached && bias {
                        continue;
                    }
                    let loss = GrpoLoss {
                        kind,
                        epsilon_low: 0.2,
                        // Above the ratios for cispo, so that its cap is not what they see.
                        epsilon_high: if detached { 1.5 } else { 0.28 },
                        delta,
                        beta: 0.05,
                        bias_correction_kl: bias,
                        sequence_level,
                        max_completion_length: 4,
                        sapo_temperature: [1.0, 1.05],
                        vespo: [2.0, 3.0, 3.0, 2.0],
                    };
                    let b = batch();
                    let out = loss.compute(&b, scale);
                    for i in 0..b.len() {
                        for t in 0..b[i].logps.len() {
                            let at = |h: f64| {
                                let mut p = b.clone();
                                p[i].logps[t] += h;
                                if let (true, Some(old)) = (detached, p[i].old.as_mut()) {
                                    old[t] += h;
                                }
                                loss.compute(&p, scale).loss
                            };
                            let h = 1e-6;
                            let fd = (at(h) - at(-h)) / (2.0 * h);
                            let g = out.grads[i][t];
                            assert!(
                                (fd - g).abs() <= 1e-6 * (1.0 + fd.abs()),
                                "{kind:?} seq {sequence_level} bias {bias}: token {i},{t}: {fd} vs {g}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// On-policy (old = current), no KL: the ratio is 1, nothing clips, and the loss is minus
    /// the advantage-weighted token mean (for grpo, the mean over sequences of their mean).
    #[test]
    fn on_policy_loss_is_minus_the_mean_advantage() {
        let mut b = batch();
        for c in &mut b {
            c.old = None;
            c.reference = None;
        }
        let loss = GrpoLoss {
            kind: GrpoLossType::Grpo,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            beta: 0.0,
            bias_correction_kl: false,
            sequence_level: false,
            max_completion_length: 3,
            sapo_temperature: [1.0, 1.05],
            vespo: [2.0, 3.0, 3.0, 2.0],
        };
        let scale = Scale {
            accumulation: 1,
            dapo_normalizer: 1.0,
        };
        let out = loss.compute(&b, scale);
        assert!(
            (out.loss - (-(0.8 - 1.1) / 2.0)).abs() < 1e-12,
            "{}",
            out.loss
        );
        assert_eq!(out.clipped, [0.0; 3]);
        assert_eq!(out.count, 5.0);
    }
}
