//! Cross-entropy over vocabulary-sharded logits (Megatron's vocab-parallel cross-entropy):
//! each rank holds the logits of its slice of the vocabulary; only per-row scalars (max, sum
//! of exponentials, the target's logit) cross the group, never the [tokens x vocab] logits.

use crate::comm::autograd::reduce_from_group;
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::nn::loss::{
    checked_targets, cross_entropy_tokens, token_stats_of, LossSum, IGNORE_INDEX,
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
    let (nll, count, _) = token_nll(logits, targets, comm, false)?;
    Ok((nll, count))
}

/// [`vocab_parallel_token_nll`] and each position's TRL figures, [n, 2].
pub(crate) fn token_nll_with_stats(
    logits: &Tensor,
    targets: &Tensor,
    comm: &Arc<dyn Communicator>,
) -> Result<(Tensor, usize, Tensor)> {
    match token_nll(logits, targets, comm, true)? {
        (nll, count, Some(stats)) => Ok((nll, count, stats)),
        _ => Err(
            candle_core::Error::Msg("the vocab-parallel loss gave no token figures".into()).into(),
        ),
    }
}

/// [`vocab_parallel_token_nll`] and, with `stats`, each position's TRL figures
/// ([`crate::nn::loss::token_stats`]) from the same exponentials: their logit-weighted sum and
/// the first argmax reduced over the group (two more collectives of [n] values).
fn token_nll(
    logits: &Tensor,
    targets: &Tensor,
    comm: &Arc<dyn Communicator>,
    stats: bool,
) -> Result<(Tensor, usize, Option<Tensor>)> {
    if comm.size() == 1 {
        let (nll, count) = cross_entropy_tokens(logits, targets)?;
        let stats = match stats {
            true => Some(crate::nn::loss::token_stats(
                &logits.reshape(((), logits.dim(D::Minus1)?))?,
                &checked_targets(targets, logits.dim(D::Minus1)?)?.0,
            )?),
            false => None,
        };
        return Ok((nll, count, stats));
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
    let e = shifted.exp()?;
    let sum_exp = reduce_from_group(&e.sum_keepdim(1)?, comm)?;
    // The target's logit lives on one rank; the others add zero.
    let picked = reduce_from_group(&(shifted.gather(&index, 1)? * here)?, comm)?;
    let nll = (sum_exp.log()? - picked)?.squeeze(1)?;
    let stats = match stats {
        false => None,
        true => {
            let f32 = |t: &Tensor| t.detach().to_dtype(DType::F32);
            let z = logits.detach();
            let sum_ez = comm.all_reduce(&(e.detach() * &z)?.sum_keepdim(1)?, ReduceOp::Sum)?;
            let sums = f32(&Tensor::cat(&[sum_exp.detach(), sum_ez], 1)?)?;
            // The first argmax: the lowest id among the parts holding the row maximum (as
            // the maximum of minus the ids, the others offering minus infinity).
            let arg = z.argmax_keepdim(1)?;
            let id = (arg.to_dtype(DType::F32)? + start as f64)?;
            let holds = z.gather(&arg, 1)?.eq(&max)?;
            let lowest = Tensor::full(f32::NEG_INFINITY, (n, 1), device)?;
            let offer = holds.where_cond(&id.neg()?, &lowest)?;
            let first = comm.all_reduce(&offer, ReduceOp::Max)?.neg()?;
            Some(token_stats_of(&f32(&max)?, &sums, &first, &targets)?)
        }
    };
    Ok(((nll * weight)?, count, stats))
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
