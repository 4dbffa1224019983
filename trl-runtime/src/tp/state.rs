//! Parameters and optimizer state across tensor-parallel layouts. Ranks hold slices; a
//! checkpoint holds whole tensors, so that it opens in transformers and loads under any tp
//! size: saving gathers the slices along their split dimension, loading cuts this rank's.
//! The gradient norm for clipping is global too: split parameters' slices add up over the
//! group, while replicated parameters (the same on every rank) count once.

use super::{PlanEntry, Split};
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::optim::{sums_of_squares, AdamW, ParamState};
use candle_core::{Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A parameter's split by name, from a plan.
pub fn splits(plan: &[PlanEntry]) -> HashMap<String, Split> {
    plan.iter().map(|e| (e.name.clone(), e.split)).collect()
}

fn split_dim(splits: &HashMap<String, Split>, name: &str) -> Option<usize> {
    splits.get(name).and_then(|s| s.dim)
}

/// Whole tensors from this rank's slices (collective over `tp`: every rank calls it with the
/// same names). Names not split in `plan` pass through.
pub fn gather_full(
    tensors: BTreeMap<String, Tensor>,
    plan: &[PlanEntry],
    tp: &dyn Communicator,
) -> Result<BTreeMap<String, Tensor>> {
    let splits = splits(plan);
    tensors
        .into_iter()
        .map(|(name, t)| {
            let t = match split_dim(&splits, &name) {
                Some(d) => tp.all_gather(&t, d)?,
                None => t,
            };
            Ok((name, t))
        })
        .collect()
}

/// Rank `rank`'s slice of the whole tensor `t` of parameter `name` (a copy owning only its
/// elements).
pub fn slice_full(
    name: &str,
    t: &Tensor,
    split: Option<usize>,
    rank: usize,
    size: usize,
) -> Result<Tensor> {
    let Some(d) = split else {
        return Ok(t.clone());
    };
    let (start, len) = super::slice_range(name, t.dims(), d, rank, size)?;
    Ok(t.narrow(d, start, len)?.force_contiguous()?.detach())
}

/// The whole per-parameter optimizer state from every rank's slices (collective over `tp`).
pub fn gather_state(state: AdamW, plan: &[PlanEntry], tp: &dyn Communicator) -> Result<AdamW> {
    let splits = splits(plan);
    let mut states = BTreeMap::new();
    for (name, s) in state.states {
        let s = match split_dim(&splits, &name) {
            Some(d) => ParamState {
                master: tp.all_gather(&s.master, d)?,
                exp_avg: tp.all_gather(&s.exp_avg, d)?,
                exp_avg_sq: tp.all_gather(&s.exp_avg_sq, d)?,
                ..s
            },
            None => s,
        };
        states.insert(name, s);
    }
    Ok(AdamW { states, ..state })
}

/// This rank's slices of a whole per-parameter optimizer state (from a checkpoint written
/// under any tp size).
pub fn slice_state(state: &AdamW, plan: &[PlanEntry], rank: usize, size: usize) -> Result<AdamW> {
    let splits = splits(plan);
    let mut states = BTreeMap::new();
    for (name, s) in &state.states {
        let d = split_dim(&splits, name);
        let cut = |t: &Tensor| slice_full(name, t, d, rank, size);
        states.insert(
            name.clone(),
            ParamState {
                master: cut(&s.master)?,
                exp_avg: cut(&s.exp_avg)?,
                exp_avg_sq: cut(&s.exp_avg_sq)?,
                decay: s.decay,
                decay_mask: s.decay_mask.clone(),
            },
        );
    }
    Ok(AdamW {
        config: state.config,
        step: state.step,
        states,
    })
}

/// How squared gradient norms add up over the tensor-parallel group: each rank weighs its
/// split slices by 1 and replicated parameters by 1/tp, and the group sums the weighted
/// squares. (Replicated parameters' gradients are the same on every rank, so they count once.)
#[derive(Clone)]
pub struct TpNorm {
    comm: Arc<dyn Communicator>,
    splits: HashMap<String, Split>,
}

impl TpNorm {
    pub fn new(plan: &[PlanEntry], comm: Arc<dyn Communicator>) -> Self {
        TpNorm {
            comm,
            splits: splits(plan),
        }
    }

    /// The weight of parameter `name`'s squared gradient in this rank's share.
    pub fn weight(&self, name: &str) -> f64 {
        match split_dim(&self.splits, name) {
            Some(_) => 1.0,
            None => 1.0 / self.comm.size() as f64,
        }
    }

    /// The group's sum of each rank's weighted squares (collective over tp).
    pub fn sum(&self, local: f64) -> Result<f64> {
        let t = Tensor::new(&[local], &Device::Cpu)?;
        Ok(self.comm.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?[0])
    }

    /// The squared global norm of per-parameter gradients `grads` (this rank's slices).
    pub fn norm_sq(&self, grads: &BTreeMap<String, Tensor>) -> Result<f64> {
        let sums = sums_of_squares(grads.values())?;
        let local = grads
            .keys()
            .zip(sums)
            .map(|(name, sq)| sq * self.weight(name));
        self.sum(local.sum())
    }
}
