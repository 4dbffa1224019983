//! Cross-entropy over vocabulary-sharded logits (Megatron's vocab-parallel cross-entropy):
//! each rank holds the logits of its slice of the vocabulary; only per-row scalars (max, sum
//! of exponentials, the target's logit) cross the group, never the [tokens x vocab] logits.

use crate::comm::autograd::reduce_from_group;
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::nn::loss::{checked_targets, cross_entropy_tokens, LossSum, IGNORE_INDEX};
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
    Ok(LossSum::of_tokens(vocab_parallel_token_nll(
        logits, targets, comm,
    )?)?)
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
    let mine = |t: i64| t != IGNORE_INDEX && (start..start + local_vocab).contains(&(t as usize));
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
    let sum_exp = reduce_from_group(&shifted.exp()?.sum_keepdim(1)?, comm)?;
    // The target's logit lives on one rank; the others add zero.
    let picked = reduce_from_group(&(shifted.gather(&index, 1)? * here)?, comm)?;
    let nll = (sum_exp.log()? - picked)?.squeeze(1)?;
    Ok(((nll * weight)?, count))
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
