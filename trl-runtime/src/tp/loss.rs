//! Cross-entropy over vocabulary-sharded logits (Megatron's vocab-parallel cross-entropy):
//! each rank holds the logits of its slice of the vocabulary; only per-row scalars (max, sum
//! of exponentials, the target's logit) cross the group, never the [tokens x vocab] logits.

use crate::comm::autograd::reduce_from_group;
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::nn::loss::{
    checked_targets, cross_entropy_tokens, cross_entropy_with_stats, token_stats_of, LossSum,
    IGNORE_INDEX,
};
use candle_core::{DType, Tensor, D};
use std::sync::Arc;

/// Summed cross-entropy of this rank's logits `[.., vocab / tp]` (rank r holds vocabulary ids
/// `r * vocab/tp ..`) against global `targets` `[..]` (i64, -100 ignored). Every rank of the
/// group gets the same loss; its backward reaches each rank's own logits only.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    comm: &Arc<dyn Communicator>,
) -> Result<LossSum> {
    let (nll, count, stats) = token_nll_with_stats(logits, targets, comm)?;
    Ok(LossSum::of_tokens((nll, count), &stats)?)
}

/// [`vocab_parallel_cross_entropy`] per position: [n], 0 where the target is ignored, and the
/// number of targets that count.
pub fn vocab_parallel_token_nll(
    logits: &Tensor,
    targets: &Tensor,
    comm: &Arc<dyn Communicator>,
) -> Result<(Tensor, usize)> {
    if comm.size() == 1 {
        return Ok(cross_entropy_tokens(logits, targets)?);
    }
    let rows = VocabRows::new(logits, targets, comm)?;
    Ok((rows.nll, rows.count))
}

/// [`vocab_parallel_token_nll`] and each position's TRL figures
/// ([`crate::nn::loss::token_stats_of`], [n, 2]) from the same exponentials: their
/// logit-weighted sum and the first argmax reduced over the group (two more collectives of
/// [n] values).
pub(crate) fn token_nll_with_stats(
    logits: &Tensor,
    targets: &Tensor,
    comm: &Arc<dyn Communicator>,
) -> Result<(Tensor, usize, Tensor)> {
    if comm.size() == 1 {
        return Ok(cross_entropy_with_stats(logits, targets)?);
    }
    let rows = VocabRows::new(logits, targets, comm)?;
    let stats = rows.stats(comm)?;
    Ok((rows.nll, rows.count, stats))
}

/// The vocab-parallel cross-entropy of this rank's part of the logits, with what the token
/// figures reuse.
struct VocabRows {
    /// Each row's loss, 0 where ignored (with the graph), and the targets that count.
    nll: Tensor,
    count: usize,
    /// This part's logits (detached), the first vocabulary id it holds, the checked targets.
    z: Tensor,
    start: usize,
    targets: Vec<i64>,
    /// The global row maxima, this part's exp(z - max) and the global sums of those.
    max: Tensor,
    e: Tensor,
    sum_exp: Tensor,
}

impl VocabRows {
    fn new(logits: &Tensor, targets: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Self> {
        let local_vocab = logits.dim(D::Minus1)?;
        let vocab = local_vocab * comm.size();
        let start = comm.rank() * local_vocab;
        let compute = if logits.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let logits = logits.reshape(((), local_vocab))?.to_dtype(compute)?;
        let (targets, count) = checked_targets(targets, vocab)?;
        let mine =
            |t: i64| t != IGNORE_INDEX && (start..start + local_vocab).contains(&(t as usize));
        let n = targets.len();
        let device = logits.device();
        let index: Vec<u32> = targets
            .iter()
            .map(|&t| {
                if mine(t) {
                    (t as usize - start) as u32
                } else {
                    0
                }
            })
            .collect();
        let here: Vec<f32> = targets.iter().map(|&t| mine(t) as u8 as f32).collect();
        let weight: Vec<f32> = targets
            .iter()
            .map(|&t| (t != IGNORE_INDEX) as u8 as f32)
            .collect();
        let index = Tensor::from_vec(index, (n, 1), device)?;
        let here = Tensor::from_vec(here, (n, 1), device)?.to_dtype(compute)?;
        let weight = Tensor::from_vec(weight, n, device)?.to_dtype(compute)?;
        // A shift by the global row maximum keeps exp() finite; it is a constant for the gradient.
        let local_max = logits.max_keepdim(1)?.detach();
        let max = comm.all_reduce(&local_max, ReduceOp::Max)?;
        let shifted = logits.broadcast_sub(&max)?;
        let e = shifted.exp()?;
        let sum_exp = reduce_from_group(&e.sum_keepdim(1)?, comm)?;
        // The target's logit lives on one rank; the others add zero.
        let picked = reduce_from_group(&(shifted.gather(&index, 1)? * here)?, comm)?;
        let nll = (sum_exp.log()? - picked)?.squeeze(1)?;
        Ok(VocabRows {
            nll: (nll * weight)?,
            count,
            z: logits.detach(),
            start,
            targets,
            max,
            e,
            sum_exp,
        })
    }

    /// Each row's token figures: the weighted sum reduced over the group, and the first
    /// argmax as the lowest id among the parts holding the row maximum (the maximum of minus
    /// the ids, the other parts offering minus infinity).
    fn stats(&self, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
        let f32 = |t: &Tensor| t.detach().to_dtype(DType::F32);
        let sum_ez = (self.e.detach() * &self.z)?.sum_keepdim(1)?;
        let sum_ez = comm.all_reduce(&sum_ez, ReduceOp::Sum)?;
        let sums = f32(&Tensor::cat(&[&self.sum_exp.detach(), &sum_ez], 1)?)?;
        let arg = self.z.argmax_keepdim(1)?;
        let id = (arg.to_dtype(DType::F32)? + self.start as f64)?;
        let holds = self.z.gather(&arg, 1)?.eq(&self.max)?;
        let lowest = Tensor::full(f32::NEG_INFINITY, id.shape(), id.device())?;
        let offer = holds.where_cond(&id.neg()?, &lowest)?;
        let first = comm.all_reduce(&offer, ReduceOp::Max)?.neg()?;
        Ok(token_stats_of(
            &f32(&self.max)?,
            &sums,
            &first,
            &self.targets,
        )?)
    }
}

/// [`crate::nn::loss::log_sum_sq_probs`] of vocabulary-sharded `logits` [n, vocab / tp]: the
/// row maximum and the two exponential sums are reduced over the group (detached).
pub fn vocab_parallel_log_sum_sq(logits: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    let over =
        |op: ReduceOp| move |t: Tensor| comm.all_reduce(&t, op).map_err(crate::Error::into_candle);
    Ok(crate::nn::loss::log_sum_sq_probs_over(
        logits,
        over(ReduceOp::Max),
        over(ReduceOp::Sum),
    )?)
}

/// [`crate::nn::divergence::divergence_rows`] of vocabulary-sharded student and teacher logits
/// `zs`, `zt` [n, vocab / tp] (already divided by the temperature): per row the divergence
/// (with `zs`'s graph) and the student's entropy, reduced over the group. The softmax's
/// normaliser feeds every part's own terms, so its gradient is summed over the parts; the
/// divergence is used alike by every rank, so each part keeps its own.
pub fn vocab_parallel_divergence(
    zs: &Tensor,
    zt: &Tensor,
    beta: f64,
    comm: &Arc<dyn Communicator>,
) -> Result<(Tensor, Tensor)> {
    use crate::comm::autograd::copy_to_group;
    use crate::nn::divergence::{divergence_rows, VocabParts};
    let candle = crate::Error::into_candle;
    let max = |t: Tensor| comm.all_reduce(&t, ReduceOp::Max).map_err(candle);
    let sum = |t: Tensor| reduce_from_group(&t, comm).map_err(candle);
    let shared = |t: Tensor| {
        copy_to_group(&t, comm)
            .and_then(|t| reduce_from_group(&t, comm))
            .map_err(candle)
    };
    let parts = VocabParts {
        max: &max,
        sum: &sum,
        shared: &shared,
    };
    Ok(divergence_rows(zs, zt, beta, &parts)?)
}
