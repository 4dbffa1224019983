//! RLOO's advantages and loss as TRL 1.16's `RLOOTrainer` computes them, on the host in f64:
//! the KL to the reference taken out of each completion's reward (summed over its tokens), the
//! leave-one-out baseline (each completion against the mean of its group's others), and one
//! clipped importance ratio per completion from its summed log-probabilities, the loss the
//! mean over the micro-batch's completions. The loss returns, beside its value, its
//! derivative with respect to each token's log-probability, as GRPO's does.

use super::grpo_loss::{nanmean, nanstd, Completion, LossOut};

/// RLOOConfig's keys that change the advantages and the loss.
#[derive(Debug, Clone, PartialEq)]
pub struct Rloo {
    pub epsilon_low: f64,
    pub epsilon_high: f64,
    /// The KL's weight in the reward (0: no reference).
    pub beta: f64,
    /// Advantages over the generation batch to mean 0, std 1.
    pub normalize_advantages: bool,
    /// Rewards clipped to (min, max) before the KL and the baseline.
    pub reward_clip_range: Option<(f64, f64)>,
}

impl Rloo {
    /// The advantages of a round's `rewards` (the weighted sums, NaN where no function
    /// scored, in groups of `g`) given each completion's KL summed over its tokens, and each
    /// row's group std of the penalised rewards (for `frac_reward_zero_std`).
    pub fn advantages(
        &self,
        g: usize,
        rewards: &[f64],
        kl: Option<&[f64]>,
    ) -> (Vec<f64>, Vec<f64>) {
        let n = rewards.len();
        let penalised: Vec<f64> = (0..n)
            .map(|i| {
                let r = match self.reward_clip_range {
                    Some((lo, hi)) => rewards[i].max(lo).min(hi),
                    None => rewards[i],
                };
                match kl {
                    Some(kl) if self.beta != 0.0 => r - self.beta * kl[i],
                    _ => r,
                }
            })
            .collect();
        let mut advantages = vec![0.0; n];
        let mut std = vec![0.0; n];
        for group in (0..n / g).map(|k| k * g..(k + 1) * g) {
            let r = &penalised[group.clone()];
            let scorable = r.iter().filter(|x| !x.is_nan()).count() as f64;
            let sum: f64 = r.iter().filter(|x| !x.is_nan()).sum();
            let sd = if g > 1 { nanstd(r) } else { 0.0 };
            for (i, x) in group.zip(r) {
                std[i] = sd;
                // 0/0 for a lone scorable completion: NaN, zeroed below as TRL does.
                advantages[i] = match g > 1 {
                    true => x - (sum - x) / (scorable - 1.0),
                    false => 0.0,
                };
            }
        }
        if self.normalize_advantages {
            let (m, sd) = (nanmean(&advantages), nanstd(&advantages));
            for a in &mut advantages {
                *a = (*a - m) / (sd + 1e-4);
            }
        }
        for a in &mut advantages {
            if a.is_nan() {
                *a = 0.0;
            }
        }
        (advantages, std)
    }

    /// The loss of `batch` (this rank's micro-batch, `accumulation` micro-batches a step)
    /// and its gradient. `old` is the policy at generation (None: the current one, ratio 1).
    pub fn loss(&self, batch: &[Completion], accumulation: usize) -> LossOut {
        let w = 1.0 / (batch.len().max(1) * accumulation.max(1)) as f64;
        let (lo, hi) = (1.0 - self.epsilon_low, 1.0 + self.epsilon_high);
        let mut out = LossOut {
            grads: Vec::with_capacity(batch.len()),
            ..Default::default()
        };
        for c in batch {
            let old = |t: usize| c.old.as_ref().map_or(c.logps[t], |o| o[t]);
            let log_ratio: f64 = (0..c.logps.len())
                .map(|t| c.mask[t] * (c.logps[t] - old(t)))
                .sum();
            let a = c.advantage;
            let c1 = log_ratio.exp();
            let (min, dmin) = super::grpo_loss::clipped_objective(c1, a, (lo, hi), None);
            out.loss -= w * min;
            out.grads
                .push(c.mask.iter().map(|m| -w * dmin * m).collect());
            out.tokens += c.mask.iter().sum::<f64>();
            let low = f64::from(u8::from(c1 < lo && a < 0.0));
            let high = f64::from(u8::from(c1 > hi && a > 0.0));
            out.clipped[0] += low;
            out.clipped[1] += high;
            out.clipped[2] += low.max(high);
            out.count += 1.0;
            out.seq_clipped.push([low, high]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rloo(beta: f64, normalize: bool, clip: Option<(f64, f64)>) -> Rloo {
        Rloo {
            epsilon_low: 0.2,
            epsilon_high: 0.28,
            beta,
            normalize_advantages: normalize,
            reward_clip_range: clip,
        }
    }

    /// Each completion's advantage is its reward minus the mean of its group's others; an
    /// unscored completion is left out of its siblings' baselines and gets 0, as does a lone
    /// scorable one.
    #[test]
    fn the_baseline_leaves_one_out() {
        let nan = f64::NAN;
        let rewards = [1.0, 2.0, 6.0, nan, 3.0, nan];
        let (a, std) = rloo(0.0, false, None).advantages(3, &rewards, None);
        assert_eq!(&a[..3], &[1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5]);
        assert_eq!(&a[3..], &[0.0, 0.0, 0.0]);
        assert!((std[0] - nanstd(&rewards[..3])).abs() < 1e-12);
        // The KL comes out of the reward before the baseline; clipping before the KL.
        let kl = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let (a, _) = rloo(0.5, false, Some((0.0, 5.0))).advantages(3, &rewards, Some(&kl));
        assert_eq!(a[0], 0.5 - (2.0 + 5.0) / 2.0);
        assert_eq!(a[2], 5.0 - (0.5 + 2.0) / 2.0);
        let (a, _) = rloo(0.0, true, None).advantages(3, &rewards, None);
        assert!(nanmean(&a[..3]).abs() < 1e-12);
    }

    /// The returned gradient is the loss's derivative (central differences), clipped or not.
    #[test]
    fn gradients_match_finite_differences() {
        let c = |logps: Vec<f64>, old: Vec<f64>, mask: Vec<f64>, advantage: f64| Completion {
            logps,
            old: Some(old),
            mask,
            advantage,
            ..Default::default()
        };
        let batch = vec![
            c(
                vec![-1.0, -0.5, -2.0],
                vec![-1.05, -0.45, -1.7],
                vec![1.0, 1.0, 0.0],
                0.8,
            ),
            c(
                vec![-0.2, -3.0, -0.9],
                vec![-0.1, -2.5, -1.0],
                vec![1.0, 1.0, 1.0],
                -1.1,
            ),
            c(vec![-0.4, -1.0], vec![-0.6, -1.2], vec![1.0, 1.0], 0.6),
        ];
        let loss = rloo(0.0, false, None);
        let out = loss.loss(&batch, 2);
        assert_eq!(out.count, 3.0);
        assert_eq!(out.clipped, [1.0, 1.0, 2.0]);
        for i in 0..batch.len() {
            for t in 0..batch[i].logps.len() {
                let at = |h: f64| {
                    let mut b = batch.clone();
                    b[i].logps[t] += h;
                    loss.loss(&b, 2).loss
                };
                let fd = (at(1e-6) - at(-1e-6)) / 2e-6;
                let g = out.grads[i][t];
                assert!(
                    (fd - g).abs() <= 1e-6 * (1.0 + fd.abs()),
                    "{i},{t}: {fd} vs {g}"
                );
            }
        }
    }
}
