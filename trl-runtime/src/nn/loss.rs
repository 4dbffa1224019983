//! Cross-entropy for causal language models, returned as (sum, count) so that the trainer
//! can divide by the target tokens of the whole optimizer step across micro-batches and ranks.

use candle_core::{DType, Result, Tensor, D};

/// Labels with this value are not predicted (prompt tokens, padding), as in PyTorch/HF.
pub const IGNORE_INDEX: i64 = -100;

/// Sum of token losses and the number of target tokens it covers.
#[derive(Debug, Clone)]
pub struct LossSum {
    pub sum: Tensor,
    pub count: usize,
}

impl LossSum {
    /// The sum of per-token losses (`nll`, 0 where ignored) over `count` targets.
    pub fn of_tokens((nll, count): (Tensor, usize)) -> Result<Self> {
        Ok(LossSum {
            sum: nll.sum_all()?,
            count,
        })
    }

    /// The mean over this batch's own tokens (what HF reports for one batch).
    pub fn mean(&self) -> Result<Tensor> {
        self.sum.affine(1.0 / self.count.max(1) as f64, 0.0)
    }
}

/// log sum_v p_v^2 of each row of `logits` [n, vocab] (p = softmax over the vocabulary):
/// log sum exp(2 z) - 2 log sum exp(z), both shifted by the row's maximum. Detached (WPO's
/// per-token term, a constant for the gradient).
pub fn log_sum_sq_probs(logits: &Tensor) -> Result<Tensor> {
    log_sum_sq_probs_over(logits, Ok, Ok)
}

/// [`log_sum_sq_probs`] of a row's part of the vocabulary: `max` and `sum` reduce the row
/// maximum and the two exponential sums over the parts (the identity for a whole row).
pub fn log_sum_sq_probs_over(
    logits: &Tensor,
    max: impl Fn(Tensor) -> Result<Tensor>,
    sum: impl Fn(Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let logits = logits.detach();
    let shifted = logits.broadcast_sub(&max(logits.max_keepdim(D::Minus1)?)?)?;
    let s1 = sum(shifted.exp()?.sum_keepdim(D::Minus1)?)?;
    let s2 = sum((&shifted * 2.0)?.exp()?.sum_keepdim(D::Minus1)?)?;
    (s2.log()? - (s1.log()? * 2.0)?)?.squeeze(1)
}

/// The targets as a list, checked against the vocabulary, and how many are not ignored.
pub(crate) fn checked_targets(targets: &Tensor, vocab: usize) -> Result<(Vec<i64>, usize)> {
    let targets: Vec<i64> = targets.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    if let Some(bad) = targets
        .iter()
        .find(|&&t| t != IGNORE_INDEX && (t < 0 || t as usize >= vocab))
    {
        candle_core::bail!("label {bad} is outside the vocabulary of {vocab} tokens (use -100 to ignore a position)");
    }
    let count = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    Ok((targets, count))
}

/// Per target: the column to gather, [n, 1] (0 where ignored), and whether it counts, [n]
/// (1 or 0, in `dtype`).
pub(crate) fn target_index_and_weight(
    targets: &[i64],
    dtype: DType,
    device: &candle_core::Device,
) -> Result<(Tensor, Tensor)> {
    let index: Vec<u32> = targets
        .iter()
        .map(|&t| if t == IGNORE_INDEX { 0 } else { t as u32 })
        .collect();
    let weight: Vec<f32> = targets
        .iter()
        .map(|&t| if t == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    let n = index.len();
    Ok((
        Tensor::from_vec(index, (n, 1), device)?,
        Tensor::from_vec(weight, n, device)?.to_dtype(dtype)?,
    ))
}

/// Summed cross-entropy of `logits` [.., vocab] against aligned `targets` [..] (i64, -100
/// ignored), computed in f32 (f64 inputs stay f64).
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor) -> Result<LossSum> {
    LossSum::of_tokens(cross_entropy_tokens(logits, targets)?)
}

/// Each position's cross-entropy (minus its target's log-probability), [n] in f32 (f64 for
/// f64 inputs), 0 where the target is ignored; and how many targets count.
pub fn cross_entropy_tokens(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, usize)> {
    let vocab = logits.dim(D::Minus1)?;
    let compute = crate::kernels::precision::wide(logits.dtype());
    let logits = logits.reshape(((), vocab))?.to_dtype(compute)?;
    let (targets, count) = checked_targets(targets, vocab)?;
    let (index, weight) = target_index_and_weight(&targets, compute, logits.device())?;
    let max = logits.max_keepdim(1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let log_z = shifted.exp()?.sum_keepdim(1)?.log()?;
    let picked = shifted.gather(&index, 1)?;
    let nll = (log_z - picked)?.squeeze(1)?;
    Ok(((nll * weight)?, count))
}

/// Next-token targets of `labels` [batch, seq] (i64): position t's target is label t+1, and
/// the last position predicts nothing (-100). Shifting before a sequence is split across ranks
/// keeps the target of a chunk's last token, which lives in the next chunk.
pub fn shift_labels(labels: &Tensor) -> Result<Tensor> {
    let (b, s) = labels.dims2()?;
    let ignore = Tensor::full(IGNORE_INDEX, (b, 1), labels.device())?;
    if s < 2 {
        return ignore.narrow(1, 0, s);
    }
    Tensor::cat(
        &[&labels.to_dtype(DType::I64)?.narrow(1, 1, s - 1)?, &ignore],
        1,
    )
}

/// Next-token loss: position t predicts label t+1 (labels not yet shifted, as HF models take them).
pub fn causal_lm_loss(logits: &Tensor, labels: &Tensor) -> Result<LossSum> {
    let s = logits.dim(1)?;
    if s < 2 {
        return Ok(LossSum {
            sum: Tensor::zeros((), DType::F32, logits.device())?,
            count: 0,
        });
    }
    let logits = logits.narrow(1, 0, s - 1)?;
    let targets = labels.narrow(1, 1, s - 1)?;
    cross_entropy_sum(&logits, &targets)
}
