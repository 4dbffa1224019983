//! What `#[context_parallel]` runs around a training step, for any model. On entering: the
//! batch is cut along the sequence for this rank of the cp group (ring attention, two
//! head-tail balanced chunks) or the sp group (Ulysses, one chunk), with the labels shifted
//! into next-token targets before the cut; and [`attention`] is routed to ring or Ulysses
//! attention until the step ends. On leaving: the loss's token count becomes the count of the
//! whole rows (summed over the group), so that `LossSum::mean` on every rank is its share of
//! the rows' mean and the summed gradients are the unsplit ones. With cp = sp = 1 nothing is
//! cut or routed.
//!
//! A model takes part by computing attention with [`attention`] and its loss against
//! `batch.targets()` (not shifting `labels` itself).
//!
//! The strategies themselves live here too: [`ring`] attention (cp), [`ulysses`] (sp),
//! [`linear`] (cp for linear attention: the state scanned over the ranks), and [`split`],
//! which picks one for a forward and cuts the batch for it.

pub mod linear;
pub mod ring;
pub mod split;
pub mod ulysses;

pub use split::{SeqAttention, SeqSplit};

use crate::comm::{Communicator, ReduceOp};
use crate::data::Batch;
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::nn::flash_attn::Attend;
use crate::nn::{AttentionImpl, LossSum};
use candle_core::{Tensor, TensorId};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

/// The split of the step running on this thread, and the attention built for its position
/// ids (the mask and its gathers are made once per step, not once per layer).
struct Active {
    split: SeqSplit,
    built: Option<(TensorId, Rc<SeqAttention>)>,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// A step in progress: this rank's part of the batch, and the routing (undone on drop).
pub struct StepScope {
    batch: Batch,
    group: Option<Arc<dyn Communicator>>,
    previous: Option<Active>,
}

impl StepScope {
    /// Cuts `batch` for this rank and routes attention for the rest of the step.
    pub fn enter(ctx: &DistContext, batch: &Batch) -> Result<Self> {
        let split = SeqSplit::from_context(ctx)?;
        let batch = batch.part(split.as_ref())?;
        let group = split.as_ref().map(|s| s.group.clone());
        let active = split.map(|split| Active { split, built: None });
        let previous = ACTIVE.with(|a| a.replace(active));
        Ok(StepScope {
            batch,
            group,
            previous,
        })
    }

    /// This rank's part of the batch (`targets()` are the shifted labels of its positions).
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// The step's result with the loss counting the target tokens of the whole rows.
    pub fn finish<T: StepOutput>(self, out: T) -> T {
        out.count_over(self.group.as_ref())
    }
}

impl Drop for StepScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        ACTIVE.with(|a| *a.borrow_mut() = previous);
    }
}

/// What a `#[context_parallel]` step returns: a loss (sum and token count).
#[diagnostic::on_unimplemented(
    message = "a #[context_parallel] step returns `Result<LossSum, E>`, not `{Self}`",
    note = "the loss's token count is made global over the sequence group: return the summed loss and its count (trl_runtime::nn::LossSum)"
)]
pub trait StepOutput {
    fn count_over(self, group: Option<&Arc<dyn Communicator>>) -> Self;
}

impl<E: From<Error>> StepOutput for std::result::Result<LossSum, E> {
    fn count_over(self, group: Option<&Arc<dyn Communicator>>) -> Self {
        let mut loss = self?;
        if let Some(g) = group {
            let count = Tensor::new(&[loss.count as f64], &candle_core::Device::Cpu)
                .map_err(Error::from)?;
            loss.count = g
                .all_reduce(&count, ReduceOp::Sum)?
                .to_vec1::<f64>()
                .map_err(Error::from)?[0] as usize;
        }
        Ok(loss)
    }
}

/// The split of the step running on this thread, if any. Our decoder follows it when it was
/// not split itself.
pub(crate) fn active_split() -> Option<SeqSplit> {
    ACTIVE.with(|a| a.borrow().as_ref().map(|a| a.split.clone()))
}

/// Causal, document-aware attention of `q` [b, heads, n, d] over `k`, `v` [b, kv_heads, n,
/// d] at `position_ids` [b, n] (this rank's positions inside a `#[context_parallel]` step):
/// ring attention under cp, Ulysses under sp, plain attention otherwise.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
    let how = AttentionImpl::Eager;
    let (dtype, device) = (q.dtype(), q.device());
    let built = ACTIVE.with(|a| -> Result<Option<Rc<SeqAttention>>> {
        let mut a = a.borrow_mut();
        let Some(active) = a.as_mut() else {
            return Ok(None);
        };
        match &active.built {
            Some((id, built)) if *id == position_ids.id() => Ok(Some(built.clone())),
            _ => {
                let built = Rc::new(SeqAttention::new(
                    Some(&active.split),
                    position_ids,
                    how,
                    None,
                    dtype,
                    device,
                )?);
                active.built = Some((position_ids.id(), built.clone()));
                Ok(Some(built))
            }
        }
    })?;
    Ok(match built {
        Some(attention) => attention.apply(q, k, v)?,
        None => SeqAttention::new(None, position_ids, how, None, dtype, device)?.apply(q, k, v)?,
    })
}
