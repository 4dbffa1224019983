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

use crate::comm::{Communicator, ReduceOp};
use crate::data::{Batch, SequenceChunk};
use crate::dist::mesh::Axis;
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::nn::ring::{ring_attention, RingMask};
use crate::nn::ulysses::ulysses_attention;
use crate::nn::{AttentionImpl, AttentionMask, LossSum};
use candle_core::{DType, Tensor};
use std::cell::RefCell;
use std::sync::Arc;

/// Where attention goes while a step runs on this thread.
#[derive(Clone)]
struct Route {
    group: Arc<dyn Communicator>,
    ring: bool,
}

thread_local! {
    static ROUTE: RefCell<Option<Route>> = const { RefCell::new(None) };
}

/// A step in progress: this rank's part of the batch, and the routing (undone on drop).
pub struct StepScope {
    batch: Batch,
    group: Option<Arc<dyn Communicator>>,
    previous: Option<Route>,
}

impl StepScope {
    /// Cuts `batch` for this rank and routes attention for the rest of the step.
    pub fn enter(ctx: &DistContext, batch: &Batch) -> Result<Self> {
        let (sp, cp) = (ctx.group(&[Axis::Sp]), ctx.group(&[Axis::Cp]));
        let (chunk, route) = match (sp.size(), cp.size()) {
            (1, 1) => (SequenceChunk::of(batch, 0, 1)?, None),
            (_, 1) => (
                SequenceChunk::of(batch, sp.rank(), sp.size())?,
                Some(Route {
                    group: sp,
                    ring: false,
                }),
            ),
            (1, _) => (
                SequenceChunk::balanced(batch, cp.rank(), cp.size())?,
                Some(Route {
                    group: cp,
                    ring: true,
                }),
            ),
            (s, c) => {
                return Err(Error::Parallelism(format!(
                    "#[context_parallel] splits a step over cp or sp, not both (cp = {c}, sp = {s})"
                )))
            }
        };
        let group = route.as_ref().map(|r| r.group.clone());
        let previous = ROUTE.with(|r| r.replace(route));
        Ok(StepScope {
            batch: Batch {
                input_ids: chunk.input_ids,
                labels: chunk.targets.clone(),
                position_ids: chunk.position_ids,
                num_target_tokens: chunk.num_target_tokens,
                shifted_targets: Some(chunk.targets),
            },
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
        ROUTE.with(|r| *r.borrow_mut() = previous);
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

/// The group attention is routed over in the step running on this thread, and whether it
/// is a ring (cp) rather than Ulysses (sp). Our decoder follows it when it was not split itself.
pub(crate) fn active_route() -> Option<(Arc<dyn Communicator>, bool)> {
    ROUTE.with(|r| r.borrow().as_ref().map(|r| (r.group.clone(), r.ring)))
}

/// Causal, document-aware attention of `q` [b, heads, n, d] over `k`, `v` [b, kv_heads, n,
/// d] at `position_ids` [b, n] (this rank's positions inside a `#[context_parallel]` step):
/// ring attention under cp, Ulysses under sp, plain attention otherwise.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
    let route = ROUTE.with(|r| r.borrow().clone());
    let (dtype, device) = (q.dtype(), q.device());
    Ok(match route {
        None => {
            let mask = AttentionMask::causal(position_ids, dtype, device)?;
            AttentionImpl::Eager.apply(q, k, v, &mask)?
        }
        Some(Route { group, ring: true }) => ring_attention(
            q,
            k,
            v,
            &RingMask::new(position_ids, group.as_ref())?,
            &group,
        )?,
        Some(Route { group, ring: false }) => {
            let everyone = group.all_gather(&position_ids.to_dtype(DType::I64)?, 1)?;
            let mask = AttentionMask::causal(&everyone, dtype, device)?;
            ulysses_attention(q, k, v, &mask, AttentionImpl::Eager, &group)?
        }
    })
}
