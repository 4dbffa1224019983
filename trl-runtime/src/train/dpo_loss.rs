//! TRL 1.16's DPO losses over one micro-batch's sequence log-probabilities, and their
//! gradients with respect to the policy's: the trainer's backward then weighs each token's
//! log-probability by its sequence's gradient, so the loss never needs the tokens, and a
//! sequence split over ranks (sp / cp) needs only its sums exchanged. Written as Candle ops on
//! f64 tensors of [pairs] so that autograd gives the gradients of every loss type.

use crate::error::{Error, Result};
use candle_core::{Device, Tensor, Var};

crate::config::named::named! {
    /// The loss types TRL 1.16 documents (`loss_type`); [`LossType::Sft`] is RPO's NLL term.
    LossType {
        Sigmoid = "sigmoid",
        Hinge = "hinge",
        Ipo = "ipo",
        ExoPair = "exo_pair",
        NcaPair = "nca_pair",
        Robust = "robust",
        BcoPair = "bco_pair",
        SppoHard = "sppo_hard",
        Aot = "aot",
        AotUnpaired = "aot_unpaired",
        ApoZero = "apo_zero",
        ApoDown = "apo_down",
        Discopop = "discopop",
        Sft = "sft",
        SigmoidNorm = "sigmoid_norm",
    }
}

impl LossType {
    /// Built on the chosen-rejected score difference, so an f-divergence other than the
    /// reverse KL applies (TRL refuses it for the others).
    pub fn takes_f_divergence(self) -> bool {
        use LossType::*;
        matches!(
            self,
            Sigmoid | SigmoidNorm | Hinge | Ipo | ExoPair | Robust | Discopop | Sft
        )
    }
}

/// The f-divergence regularizer (f-DPO): how a log-ratio becomes a score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FDivergence {
    ReverseKl,
    ForwardKl,
    Js,
    Alpha(f64),
}

/// The DPO loss as `DPOConfig` sets it.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoLoss {
    pub beta: f64,
    /// (type, weight) pairs, summed.
    pub terms: Vec<(LossType, f64)>,
    pub label_smoothing: f64,
    pub f_divergence: FDivergence,
    pub discopop_tau: f64,
    /// WPO (TRL's use_weighting): each pair's loss weighed by [`PairLogps::weights`].
    pub weighting: bool,
}

/// One micro-batch's pairs: sequence log-probabilities (summed over completion tokens),
/// and completion sizes.
#[derive(Debug, Clone, Default)]
pub struct PairLogps {
    pub chosen: Vec<f64>,
    pub rejected: Vec<f64>,
    pub ref_chosen: Vec<f64>,
    pub ref_rejected: Vec<f64>,
    /// Completion tokens of each sequence (TRL's completion_mask sums: IPO, sigmoid_norm).
    pub chosen_len: Vec<f64>,
    pub rejected_len: Vec<f64>,
    /// Chosen completion tokens that are predicted (the shifted mask: the SFT term's mean).
    pub chosen_targets: f64,
    /// Per pair, a constant its loss is multiplied by (WPO's weights), if any.
    pub weights: Option<Vec<f64>>,
}

impl PairLogps {
    /// TRL's logged sums over these pairs, at `beta`: rewards chosen and rejected (beta x
    /// the log-ratio to the reference), accuracy (chosen above rejected), margin, and the
    /// policy's log-probabilities chosen and rejected, added into `sums`.
    pub fn add_reward_sums(&self, beta: f64, sums: &mut [f64; 6]) {
        for j in 0..self.chosen.len() {
            let (rc, rr) = (
                beta * (self.chosen[j] - self.ref_chosen[j]),
                beta * (self.rejected[j] - self.ref_rejected[j]),
            );
            sums[0] += rc;
            sums[1] += rr;
            sums[2] += (rc > rr) as u8 as f64;
            sums[3] += rc - rr;
            sums[4] += self.chosen[j];
            sums[5] += self.rejected[j];
        }
    }
}

/// The loss of a micro-batch and its gradients with respect to the policy's chosen and
/// rejected log-probabilities.
#[derive(Debug, Clone)]
pub struct LossAndGrads {
    pub loss: f64,
    pub d_chosen: Vec<f64>,
    pub d_rejected: Vec<f64>,
}

fn t(v: &[f64]) -> Result<Tensor> {
    Ok(Tensor::new(v, &Device::Cpu)?)
}

/// log(sigmoid(x)) = -log(1 + exp(-x)), smooth everywhere (a |x| form would have no
/// gradient at 0, where every pair starts); f64 keeps exp finite for |x| < 700.
fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok((x.clamp(-700.0, f64::MAX)?.neg()?.exp()? + 1.0)?
        .log()?
        .neg()?)
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(log_sigmoid(x)?.exp()?)
}

/// Values of `x` in ascending order, as a differentiable gather.
fn sorted(x: &Tensor) -> Result<Tensor> {
    let v: Vec<f64> = x.to_vec1()?;
    let mut order: Vec<u32> = (0..v.len() as u32).collect();
    order.sort_by(|&a, &b| v[a as usize].total_cmp(&v[b as usize]));
    Ok(x.index_select(&Tensor::new(order.as_slice(), &Device::Cpu)?, 0)?)
}

impl DpoLoss {
    /// The f-divergence's score of log-ratios.
    fn score(&self, logratios: &Tensor) -> Result<Tensor> {
        Ok(match self.f_divergence {
            FDivergence::ReverseKl => logratios.clone(),
            FDivergence::ForwardKl => (1.0 - logratios.neg()?.exp()?)?,
            FDivergence::Js => (log_sigmoid(logratios)? + std::f64::consts::LN_2)?,
            FDivergence::Alpha(a) if (a - 1.0).abs() < 1e-6 => logratios.clone(),
            FDivergence::Alpha(a) => {
                let scaled = (logratios * (a - 1.0))?.clamp(f64::MIN, 80.0)?;
                ((scaled.exp()? - 1.0)? * (1.0 / (a - 1.0)))?
            }
        })
    }

    /// The micro-batch's loss (each type's mean over pairs, weighted and summed, as TRL) and
    /// its gradients.
    pub fn compute(&self, p: &PairLogps) -> Result<LossAndGrads> {
        let n = p.chosen.len();
        if n == 0 {
            return Err(Error::Parallelism("a DPO micro-batch without pairs".into()));
        }
        let chosen = Var::new(p.chosen.as_slice(), &Device::Cpu)?;
        let rejected = Var::new(p.rejected.as_slice(), &Device::Cpu)?;
        let (ref_c, ref_r) = (t(&p.ref_chosen)?, t(&p.ref_rejected)?);
        let chosen_lr = (chosen.as_tensor() - &ref_c)?;
        let rejected_lr = (rejected.as_tensor() - &ref_r)?;
        let (chosen_s, rejected_s) = (self.score(&chosen_lr)?, self.score(&rejected_lr)?);
        let delta = (&chosen_s - &rejected_s)?;
        let beta = self.beta;
        let eps = self.label_smoothing;
        let lens = |l: &[f64]| t(&l.iter().map(|x| x.max(1.0)).collect::<Vec<_>>());
        let mut total = Tensor::zeros((), candle_core::DType::F64, &Device::Cpu)?;
        for &(kind, weight) in &self.terms {
            use LossType::*;
            let per_pair = match kind {
                Sigmoid => log_sigmoid(&(&delta * beta)?)?.neg()?,
                Hinge => (1.0 - (&delta * beta)?)?.relu()?,
                Ipo | SigmoidNorm => {
                    let avg = ((&chosen_s / lens(&p.chosen_len)?)?
                        - (&rejected_s / lens(&p.rejected_len)?)?)?;
                    if kind == Ipo {
                        (avg - 1.0 / (2.0 * beta))?.sqr()?
                    } else {
                        log_sigmoid(&(avg * beta)?)?.neg()?
                    }
                }
                ExoPair => {
                    let x = (&delta * beta)?;
                    let (log_qw, log_ql) = (log_sigmoid(&x)?, log_sigmoid(&x.neg()?)?);
                    let (qw, ql) = (log_qw.exp()?, log_ql.exp()?);
                    let (log_pw, log_pl) = ((-eps).ln_1p(), eps.ln());
                    ((qw * (log_qw - log_pw)?)? + (ql * (log_ql - log_pl)?)?)?
                }
                NcaPair => {
                    let (cr, rr) = ((&chosen_lr * beta)?, (&rejected_lr * beta)?);
                    ((log_sigmoid(&cr)?.neg()? - (log_sigmoid(&cr.neg()?)? * 0.5)?)?
                        - (log_sigmoid(&rr.neg()?)? * 0.5)?)?
                }
                Robust => {
                    let x = (&delta * beta)?;
                    let clean = (log_sigmoid(&x)? * -(1.0 - eps))?;
                    let flipped = (log_sigmoid(&x.neg()?)? * -eps)?;
                    ((clean - flipped)? / (1.0 - 2.0 * eps))?
                }
                BcoPair => {
                    let (cr, rr) = ((&chosen_lr * beta)?, (&rejected_lr * beta)?);
                    (log_sigmoid(&cr)?.neg()? - log_sigmoid(&rr.neg()?)?)?
                }
                SppoHard => {
                    let w = (&chosen_lr - 0.5 / beta)?.sqr()?;
                    let l = (&rejected_lr + 0.5 / beta)?.sqr()?;
                    (w + l)?
                }
                Aot | AotUnpaired => {
                    let d = if kind == Aot {
                        let lr = (chosen.as_tensor() - rejected.as_tensor())?;
                        let ref_lr = (&ref_c - &ref_r)?;
                        (sorted(&lr)? - sorted(&ref_lr)?)?
                    } else {
                        (sorted(&chosen_lr)? - sorted(&rejected_lr)?)?
                    };
                    let x = (d * beta)?;
                    ((log_sigmoid(&x)? * -(1.0 - eps))? - (log_sigmoid(&x.neg()?)? * eps)?)?
                }
                ApoZero => {
                    let c = (1.0 - sigmoid(&(&chosen_lr * beta)?)?)?;
                    (c + sigmoid(&(&rejected_lr * beta)?)?)?
                }
                ApoDown => {
                    let c = sigmoid(&(&chosen_lr * beta)?)?;
                    let margin = ((&chosen_lr - &rejected_lr)? * beta)?;
                    (c + (1.0 - sigmoid(&margin)?)?)?
                }
                Discopop => {
                    let x = (&delta * beta)?;
                    let m = sigmoid(&(&x / self.discopop_tau)?)?;
                    let logistic = log_sigmoid(&x)?.neg()?;
                    let exp = x.neg()?.exp()?;
                    ((logistic * (1.0 - &m)?)? + (exp * m)?)?
                }
                // The mean NLL over the micro-batch's chosen completion tokens.
                Sft => {
                    let nll = (chosen.as_tensor().sum_all()?.neg()? / p.chosen_targets.max(1.0))?;
                    nll.broadcast_as(n)?.contiguous()?
                }
            };
            let per_pair = match &p.weights {
                Some(w) => (per_pair * t(w)?)?,
                None => per_pair,
            };
            total = (total + (per_pair.mean_all()? * weight)?)?;
        }
        let grads = total.backward()?;
        let grad = |v: &Var| -> Result<Vec<f64>> {
            Ok(match grads.get(v.as_tensor()) {
                Some(g) => g.to_vec1()?,
                None => vec![0.0; n],
            })
        };
        Ok(LossAndGrads {
            loss: total.to_scalar()?,
            d_chosen: grad(&chosen)?,
            d_rejected: grad(&rejected)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::named::Named;

    fn pairs() -> PairLogps {
        PairLogps {
            chosen: vec![-10.0, -7.5, -12.0],
            rejected: vec![-11.0, -7.0, -15.0],
            ref_chosen: vec![-10.5, -7.0, -12.3],
            ref_rejected: vec![-10.0, -7.2, -14.1],
            chosen_len: vec![4.0, 3.0, 5.0],
            rejected_len: vec![5.0, 2.0, 6.0],
            chosen_targets: 12.0,
            weights: None,
        }
    }

    /// Every loss type's gradient matches central differences of its value.
    #[test]
    fn gradients_match_finite_differences() {
        for (&name, &kind) in LossType::NAMES.iter().zip(LossType::ALL) {
            for f in [
                FDivergence::ReverseKl,
                FDivergence::ForwardKl,
                FDivergence::Js,
                FDivergence::Alpha(0.5),
            ] {
                if f != FDivergence::ReverseKl && !kind.takes_f_divergence() {
                    continue;
                }
                let loss = DpoLoss {
                    beta: 0.3,
                    terms: vec![(kind, 0.7)],
                    label_smoothing: if kind == LossType::ExoPair { 1e-3 } else { 0.1 },
                    f_divergence: f,
                    discopop_tau: 0.05,
                    weighting: false,
                };
                let p = pairs();
                let got = loss.compute(&p).unwrap();
                let h = 1e-5;
                for i in 0..3 {
                    for side in 0..2 {
                        let at = |d: f64| {
                            let mut q = p.clone();
                            let v = if side == 0 {
                                &mut q.chosen
                            } else {
                                &mut q.rejected
                            };
                            v[i] += d;
                            loss.compute(&q).unwrap().loss
                        };
                        let fd = (at(h) - at(-h)) / (2.0 * h);
                        let g = if side == 0 {
                            got.d_chosen[i]
                        } else {
                            got.d_rejected[i]
                        };
                        assert!(
                            (fd - g).abs() <= 1e-6 * (1.0 + fd.abs()),
                            "{name} {f:?}: pair {i} side {side}: {g} vs {fd}"
                        );
                    }
                }
            }
        }
    }

    /// The sigmoid loss at policy = reference is log 2.
    #[test]
    fn sigmoid_starts_at_log_two() {
        let loss = DpoLoss {
            beta: 0.1,
            terms: vec![(LossType::Sigmoid, 1.0)],
            label_smoothing: 0.0,
            f_divergence: FDivergence::ReverseKl,
            discopop_tau: 0.05,
            weighting: false,
        };
        let mut p = pairs();
        p.ref_chosen = p.chosen.clone();
        p.ref_rejected = p.rejected.clone();
        let got = loss.compute(&p).unwrap();
        assert!((got.loss - std::f64::consts::LN_2).abs() < 1e-12);
        assert!((got.d_chosen[0] + 0.1 * 0.5 / 3.0).abs() < 1e-12);
    }
}
