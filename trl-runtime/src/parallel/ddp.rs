//! DDP: every data-parallel rank holds the whole model (its tensor-parallel slices under tp);
//! training starts from rank 0's weights and gradients are summed across the ranks that see
//! different tokens, in buckets of about 25 MiB (PyTorch DDP's default), last parameters first
//! (the order backward produces them). Under expert parallelism the experts' gradients are
//! summed over the ranks holding the same experts instead (`super::expert`).

use super::expert::{sum_over, ExpertPlan};
use crate::comm::{CommQueue, Communicator, ReduceOp};
use crate::error::Result;
use crate::models::Params;
use crate::optim::sums_of_squares;
use crate::tp::TpGrads;
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Gradients are all-reduced in buckets of about this size.
pub(crate) const BUCKET_BYTES: usize = 25 << 20;

pub struct Ddp {
    /// Background collectives on the group (gradient buckets).
    queue: CommQueue,
    /// Under expert parallelism: which parameters are this rank's experts, the ep group and
    /// the experts' replicas (whose queue sums the experts' gradients).
    experts: Option<Experts>,
}

struct Experts {
    plan: Arc<ExpertPlan>,
    ep: Arc<dyn Communicator>,
    replicas: CommQueue,
}

impl Ddp {
    /// DDP over `group`: the data-parallel ranks and, when sequences are split, the ranks
    /// holding the other chunks of the same rows.
    pub fn new(group: Arc<dyn Communicator>) -> Result<Self> {
        Ok(Ddp {
            queue: CommQueue::new(group)?,
            experts: None,
        })
    }

    /// The same, with the experts of `plan` (held per rank of `ep`) reduced over `replicas`.
    pub fn with_experts(
        self,
        plan: Arc<ExpertPlan>,
        ep: Arc<dyn Communicator>,
        replicas: Arc<dyn Communicator>,
    ) -> Result<Self> {
        Ok(Ddp {
            experts: Some(Experts {
                plan,
                ep,
                replicas: CommQueue::new(replicas)?,
            }),
            ..self
        })
    }

    /// The squared global gradient norm of `grads` (reduced), when more than this rank's
    /// squares make it: tensor-parallel slices summed over tp, experts' over the ep group.
    /// None: the plain local norm is the global one.
    pub fn norm_sq(
        &self,
        grads: &BTreeMap<String, Tensor>,
        tp: Option<&TpGrads>,
    ) -> Result<Option<f64>> {
        let sq = |g: &BTreeMap<String, Tensor>| -> Result<f64> {
            match tp {
                Some(tp) => tp.norm_sq(g),
                None => Ok(sums_of_squares(g.values())?.iter().sum()),
            }
        };
        match &self.experts {
            None => tp.map(|tp| tp.norm_sq(grads)).transpose(),
            Some(e) => {
                let (experts, dense): (BTreeMap<_, _>, BTreeMap<_, _>) = grads
                    .iter()
                    .map(|(n, g)| (n.clone(), g.clone()))
                    .partition(|(n, _)| e.plan.holds(n));
                Ok(Some(sq(&dense)? + sum_over(&e.ep, sq(&experts)?)?))
            }
        }
    }

    /// How many replicas the gradients are summed over (1: nothing to reduce).
    pub fn replicas(&self) -> usize {
        self.queue.comm().size()
    }

    /// Sums gradients across the group in buckets. The queue's thread runs the collectives in
    /// order while this thread flattens the next bucket. Candle's backward returns all
    /// gradients at once, so the overlap is with bucket packing, not with the backward pass.
    pub fn reduce(&self, grads: &mut BTreeMap<String, Tensor>) -> Result<()> {
        let Some(e) = &self.experts else {
            let names: Vec<String> = grads.keys().rev().cloned().collect();
            return reduce_on(&self.queue, grads, names);
        };
        let (experts, dense): (Vec<String>, Vec<String>) =
            grads.keys().rev().cloned().partition(|n| e.plan.holds(n));
        reduce_on(&self.queue, grads, dense)?;
        reduce_on(&e.replicas, grads, experts)
    }
}

/// Sums gradients `names` of `grads` over `queue`'s group in buckets.
fn reduce_on(
    queue: &CommQueue,
    grads: &mut BTreeMap<String, Tensor>,
    names: Vec<String>,
) -> Result<()> {
    if queue.comm().size() == 1 || names.is_empty() {
        return Ok(());
    }
    let mut buckets: Vec<Vec<String>> = vec![Vec::new()];
    let mut size = 0;
    for n in names {
        let bytes = grads[&n].elem_count() * 4;
        if size > 0 && size + bytes > BUCKET_BYTES {
            buckets.push(Vec::new());
            size = 0;
        }
        size += bytes;
        buckets.last_mut().expect("one bucket at least").push(n);
    }
    let mut pending = Vec::with_capacity(buckets.len());
    for bucket in &buckets {
        let parts: Vec<Tensor> = bucket
            .iter()
            .map(|n| grads[n].flatten_all())
            .collect::<candle_core::Result<_>>()?;
        let flat = Tensor::cat(&parts, 0)?;
        pending.push(queue.submit(move |c| c.all_reduce(&flat, ReduceOp::Sum)));
    }
    for (bucket, reduced) in buckets.iter().zip(pending) {
        let flat = reduced.wait()?;
        let mut offset = 0;
        for n in bucket {
            let g = grads.get_mut(n).expect("bucketed from grads");
            let count = g.elem_count();
            *g = flat.narrow(0, offset, count)?.reshape(g.shape())?;
            offset += count;
        }
    }
    Ok(())
}

/// Rank 0's weights on every rank of `group` (DDP's start, FSDP's sync_module_states), one
/// broadcast per parameter, once.
pub fn sync_parameters(group: &Arc<dyn Communicator>, params: &Params) -> Result<()> {
    if group.size() == 1 {
        return Ok(());
    }
    for (_, var) in params.iter() {
        let t = group.broadcast(var.as_tensor(), 0)?;
        if group.rank() != 0 {
            var.set(&t)?;
        }
    }
    Ok(())
}
