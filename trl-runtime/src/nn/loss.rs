//! Cross-entropy for causal language models, returned as (sum, count) so that the trainer
//! can divide by the target tokens of the whole optimizer step across micro-batches and ranks.

use candle_core::{DType, Result, Tensor, D};

/// Labels with this value are not predicted (prompt tokens, padding), as in PyTorch/HF.
pub const IGNORE_INDEX: i64 = -100;

/// Sum of token losses and the number of target tokens it covers, with what TRL logs beside
/// the loss.
#[derive(Debug, Clone)]
pub struct LossSum {
    pub sum: Tensor,
    pub count: usize,
    /// [2] f32, detached: the targets' summed entropy and how many of them are the argmax
    /// (TRL's `entropy` and `mean_token_accuracy`, once divided by the targets).
    pub stats: Tensor,
}

impl LossSum {
    /// The sum of per-token losses (`nll`, 0 where ignored) over `count` targets, with each
    /// position's [`token_stats_of`] ([n, 2]).
    pub fn of_tokens((nll, count): (Tensor, usize), stats: &Tensor) -> Result<Self> {
        Ok(LossSum {
            sum: nll.sum_all()?,
            count,
            stats: stats.sum(0)?,
        })
    }

    /// The mean over this batch's own tokens (what HF reports for one batch).
    pub fn mean(&self) -> Result<Tensor> {
        self.sum.affine(1.0 / self.count.max(1) as f64, 0.0)
    }
}

/// TRL's token figures per row and its target (-100: ignored): the softmax's entropy and 1
/// when the target is the argmax (the first maximum, as torch's argmax picks it), both 0 for
/// ignored rows: [n, 2] f32, detached (TRL's `entropy` and `mean_token_accuracy`). Computed
/// from per-row figures over the whole vocabulary: the maximum `max` [n, 1], `sums` [n, 2] of
/// e = exp(z - max) and of e z, and the first argmax's id `first` [n, 1] (f32, exact below
/// 2^24), all f32 and detached; vocabulary-parallel losses reduce these over their parts.
pub fn token_stats_of(
    max: &Tensor,
    sums: &Tensor,
    first: &Tensor,
    targets: &[i64],
) -> Result<Tensor> {
    let (sum_e, sum_ez) = (sums.narrow(1, 0, 1)?, sums.narrow(1, 1, 1)?);
    // log Z - E_p[z] = ln(sum e) + max - sum(e z) / sum(e).
    let entropy = ((sum_e.log()? + max)? - (sum_ez / &sum_e)?)?;
    let n = targets.len();
    let dev = max.device();
    let target: Vec<f32> = targets.iter().map(|&t| t as f32).collect();
    let top1 = first
        .eq(&Tensor::from_vec(target, (n, 1), dev)?)?
        .to_dtype(DType::F32)?;
    let counts: Vec<f32> = targets
        .iter()
        .map(|&t| (t != IGNORE_INDEX) as u8 as f32)
        .collect();
    let counts = Tensor::from_vec(counts, (n, 1), dev)?;
    Tensor::cat(&[entropy, top1], 1)?.broadcast_mul(&counts)
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
    let (nll, count, stats) = cross_entropy_with_stats(logits, targets)?;
    LossSum::of_tokens((nll, count), &stats)
}

/// Each position's cross-entropy (minus its target's log-probability), [n] in f32 (f64 for
/// f64 inputs), 0 where the target is ignored; and how many targets count.
pub fn cross_entropy_tokens(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, usize)> {
    let (logits, targets, count) = rows_of(logits, targets)?;
    Ok((RowLosses::new(&logits, &targets)?.nll, count))
}

/// [`cross_entropy_tokens`] and each position's [`token_stats_of`] ([n, 2]) from the same
/// exponentials (three more passes over the logits: their weighted sum and the argmax).
pub(crate) fn cross_entropy_with_stats(
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, usize, Tensor)> {
    let (logits, targets, count) = rows_of(logits, targets)?;
    let rows = RowLosses::new(&logits, &targets)?;
    let stats = rows.stats(&targets)?;
    Ok((rows.nll, count, stats))
}

/// `logits` as [n, vocab] rows in the wide dtype, the targets checked, and how many count.
fn rows_of(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Vec<i64>, usize)> {
    let vocab = logits.dim(D::Minus1)?;
    let compute = crate::kernels::precision::wide(logits.dtype());
    let logits = logits.reshape(((), vocab))?.to_dtype(compute)?;
    let (targets, count) = checked_targets(targets, vocab)?;
    Ok((logits, targets, count))
}

/// The cross-entropy of whole rows of logits, with what the token figures reuse.
pub(crate) struct RowLosses {
    /// Each row's loss, 0 where ignored (with the graph of `logits`).
    pub nll: Tensor,
    /// The rows' logits, detached.
    z: Tensor,
    /// The row maxima, exp(z - max) and their row sums (with the graph).
    max: Tensor,
    e: Tensor,
    sum_e: Tensor,
}

impl RowLosses {
    /// `logits` [n, vocab] (in the dtype computed in) against checked `targets`.
    pub fn new(logits: &Tensor, targets: &[i64]) -> Result<Self> {
        let (index, weight) = target_index_and_weight(targets, logits.dtype(), logits.device())?;
        let max = logits.max_keepdim(1)?.detach();
        let shifted = logits.broadcast_sub(&max)?;
        let e = shifted.exp()?;
        let sum_e = e.sum_keepdim(1)?;
        let picked = shifted.gather(&index, 1)?;
        let nll = ((sum_e.log()? - picked)?.squeeze(1)? * weight)?;
        Ok(RowLosses {
            nll,
            z: logits.detach(),
            max,
            e,
            sum_e,
        })
    }

    /// Each row's [`token_stats_of`], [n, 2].
    pub fn stats(&self, targets: &[i64]) -> Result<Tensor> {
        let f32 = |t: &Tensor| t.detach().to_dtype(DType::F32);
        let sum_ez = (self.e.detach() * &self.z)?.sum_keepdim(1)?;
        let sums = f32(&Tensor::cat(&[&self.sum_e.detach(), &sum_ez], 1)?)?;
        let first = self.z.argmax_keepdim(1)?.to_dtype(DType::F32)?;
        token_stats_of(&f32(&self.max)?, &sums, &first, targets)
    }
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
            stats: Tensor::zeros(2, DType::F32, logits.device())?,
        });
    }
    let logits = logits.narrow(1, 0, s - 1)?;
    let targets = labels.narrow(1, 1, s - 1)?;
    cross_entropy_sum(&logits, &targets)
}
