//! A mixture of experts' router load-balancing loss over a step's micro-batches, as TRL adds
//! it (`router_aux_loss_coef` times the mean over micro-batches and ranks).

use super::core::Core;
use crate::error::Result;
use crate::models::router_loss::RouterLoss;
use crate::models::CausalModel;
use std::sync::Arc;

/// The router load-balancing losses of a step's micro-batches, or of an evaluation's
/// batches (a mixture of experts whose weight is not 0). In training each adds its gradient
/// weighted by weight / (micro-batches x data-parallel ranks), the average TRL takes, and
/// [`Self::mean`] is what it logs as `aux_loss`; an evaluation reduces each batch's value
/// ([`Self::end`]) as TRL reduces `eval_aux_loss` ([`super::eval_rounds::EvalSlots`]).
pub struct RouterLosses {
    on: bool,
    /// The gradient's weight per micro-batch (0 in evaluation: no backward).
    weight: f64,
    /// Over the batches ended here: the losses and how many.
    sum: std::cell::Cell<f64>,
    batches: std::cell::Cell<usize>,
}

impl RouterLosses {
    /// For a training step of `micro_batches` micro-batches per rank.
    pub fn new<N: CausalModel>(core: &Core<'_, N>, micro_batches: usize) -> Self {
        let count = (micro_batches * core.dp.size()) as f64;
        RouterLosses {
            on: core.router_loss_weight != 0.0,
            weight: core.router_loss_weight / count,
            sum: std::cell::Cell::new(0.0),
            batches: std::cell::Cell::new(0),
        }
    }

    /// For an evaluation: the values only.
    pub fn for_evaluation<N: CausalModel>(core: &Core<'_, N>) -> Self {
        RouterLosses {
            weight: 0.0,
            ..Self::new(core, 1)
        }
    }

    /// None collected (a forward that adds no router loss: DPO's reference).
    pub fn off() -> Self {
        RouterLosses {
            on: false,
            weight: 0.0,
            sum: std::cell::Cell::new(0.0),
            batches: std::cell::Cell::new(0),
        }
    }

    /// The loss to collect over `batch`'s forward (its real tokens), if any.
    pub fn begin(&self, batch: &crate::data::Batch) -> Result<Option<Arc<RouterLoss>>> {
        if !self.on {
            return Ok(None);
        }
        Ok(Some(RouterLoss::new(batch.real_tokens()?, self.weight)))
    }

    /// Runs the forward `f` collecting `aux`.
    pub fn during<R>(&self, aux: &Option<Arc<RouterLoss>>, f: impl FnOnce() -> R) -> R {
        match aux {
            Some(aux) => crate::models::router_loss::with_router_loss(aux, f),
            None => f(),
        }
    }

    /// After a counted batch (in training, after its backward): its loss (None when off).
    pub fn end(&self, aux: Option<Arc<RouterLoss>>) -> Option<f64> {
        let v = aux.and_then(|a| a.value())?;
        self.sum.set(self.sum.get() + v);
        self.batches.set(self.batches.get() + 1);
        Some(v)
    }

    /// The mean loss over the batches every data-parallel rank ended (None when off).
    pub fn mean<N: CausalModel>(&self, core: &Core<'_, N>) -> Result<Option<f64>> {
        if !self.on {
            return Ok(None);
        }
        let g = core.global_sum(&[self.sum.get(), self.batches.get() as f64])?;
        Ok(Some(g[0] / g[1].max(1.0)))
    }
}
