//! DDP: every data-parallel rank holds the whole model (its tensor-parallel slices under tp);
//! training starts from rank 0's weights and gradients are summed across the ranks that see
//! different tokens, in buckets of about 25 MiB (PyTorch DDP's default), last parameters first
//! (the order backward produces them).

use crate::comm::{CommQueue, Communicator, ReduceOp};
use crate::error::Result;
use crate::models::Params;
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Gradients are all-reduced in buckets of about this size.
pub(crate) const BUCKET_BYTES: usize = 25 << 20;

pub struct Ddp {
    /// Background collectives on the group (gradient buckets).
    queue: CommQueue,
}

impl Ddp {
    /// DDP over `group`: the data-parallel ranks and, when sequences are split, the ranks
    /// holding the other chunks of the same rows.
    pub fn new(group: Arc<dyn Communicator>) -> Result<Self> {
        Ok(Ddp {
            queue: CommQueue::new(group)?,
        })
    }

    /// How many replicas the gradients are summed over (1: nothing to reduce).
    pub fn replicas(&self) -> usize {
        self.queue.comm().size()
    }

    /// Sums gradients across the group in buckets. The queue's thread runs the collectives in
    /// order while this thread flattens the next bucket. Candle's backward returns all
    /// gradients at once, so the overlap is with bucket packing, not with the backward pass.
    pub fn reduce(&self, grads: &mut BTreeMap<String, Tensor>) -> Result<()> {
        if self.queue.comm().size() == 1 {
            return Ok(());
        }
        let names: Vec<String> = grads.keys().rev().cloned().collect();
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
            pending.push(
                self.queue
                    .submit(move |c| c.all_reduce(&flat, ReduceOp::Sum)),
            );
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
