//! Expert parallelism: each mixture's experts split over groups of data-parallel ranks (the
//! ep group, taken out of dp_replicate x dp_shard as torchtitan takes it). A rank keeps
//! `experts / ep` of every layer's experts (its own `experts.{e}` modules, or its rows of a
//! fused stack) beside everything else whole; the layers send each routed token to the rank
//! holding its expert and its output back (`models::arch::moe`'s dispatch, two uneven
//! all-to-alls). So:
//! - an expert's gradient already sums every ep rank's tokens (the exchange's backward); it
//!   is summed further over the experts' replicas (the data-parallel ranks holding the same
//!   share), dense gradients over every data-parallel rank as before;
//! - the gradient norm counts each expert once: the experts' squares are summed over the ep
//!   group, the rest's are the same on every rank;
//! - a checkpoint holds every expert under transformers' names whatever the ep size: saving
//!   gathers them over the ep group, loading (a resume on any ep size) keeps this rank's.
//!
//! docs/expert-parallel.md says what moves where and what it composes with.

use super::{ParallelOptions, Strategy};
use crate::comm::{Communicator, ReduceOp};
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::models::Params;
use crate::nn::module::ExpertHold;
use crate::nn::sharded::EntryRanges;
use crate::optim::{sums_of_squares, AdamW, ParamState};
use crate::tp::TpGrads;
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Which parameters expert parallelism holds per rank, and how, by HF name.
#[derive(Debug, Clone, Default)]
pub struct ExpertPlan {
    pub holds: BTreeMap<String, ExpertHold>,
    /// The ep group's size.
    pub ranks: usize,
}

impl ExpertPlan {
    /// Whether parameter `name` is one of this rank's experts' (held per rank).
    pub fn holds(&self, name: &str) -> bool {
        self.holds.contains_key(name)
    }

    /// Whole tensors of every expert from each rank's share (collective over `ep`: every
    /// rank calls it with the same set of names, in the same order): a stack gathered along
    /// its rows, a listed expert's parameter under each rank's expert names. Per-parameter
    /// optimizer states are gathered the same way.
    pub fn gather<V: Tensors>(
        &self,
        values: BTreeMap<String, V>,
        ep: &dyn Communicator,
    ) -> Result<BTreeMap<String, V>> {
        let mut out = BTreeMap::new();
        for (name, v) in values {
            match self.holds.get(&name) {
                None => {
                    out.insert(name, v);
                }
                Some(ExpertHold::Stack { .. }) => {
                    let parts = v
                        .parts()
                        .iter()
                        .map(|t| ep.all_gather(&t.contiguous()?, 0))
                        .collect::<Result<Vec<_>>>()?;
                    out.insert(name, v.rebuild(parts));
                }
                Some(ExpertHold::Listed {
                    list,
                    index,
                    per_rank,
                }) => {
                    let all = v
                        .parts()
                        .iter()
                        .map(|t| ep.all_gather(&t.contiguous()?.unsqueeze(0)?, 0))
                        .collect::<Result<Vec<_>>>()?;
                    for q in 0..ep.size() {
                        let parts = all
                            .iter()
                            .map(|a| a.get(q))
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        let named = listed_on(&name, (list, *index, *per_rank), q);
                        out.insert(named, v.rebuild(parts));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The names parameter `name` stands for once gathered: every rank's expert in its slot
    /// for a listed expert's parameter, itself otherwise.
    pub fn names_of(&self, name: &str) -> Vec<String> {
        match self.holds.get(name) {
            Some(ExpertHold::Listed {
                list,
                index,
                per_rank,
            }) => (0..self.ranks.max(1))
                .map(|q| listed_on(name, (list, *index, *per_rank), q))
                .collect(),
            _ => vec![name.to_string()],
        }
    }

    /// This rank's share of a whole per-parameter optimizer state (a checkpoint written under
    /// any ep size): the states of the parameters `kept` holds (the model's once its experts
    /// are kept per rank), a stack's cut to this rank's rows.
    pub fn slice_state(&self, state: AdamW, rank: usize, kept: &Params) -> Result<AdamW> {
        let mut states = BTreeMap::new();
        for (name, s) in state.states {
            if kept.get(&name).is_none() {
                continue;
            }
            let s = match self.holds.get(&name) {
                Some(ExpertHold::Stack { per_rank }) => {
                    let cut = |t: &Tensor| -> candle_core::Result<Tensor> {
                        Ok(t.narrow(0, rank * per_rank, *per_rank)?
                            .force_contiguous()?
                            .detach())
                    };
                    let parts = s
                        .parts()
                        .iter()
                        .map(cut)
                        .collect::<candle_core::Result<_>>()?;
                    s.rebuild(parts)
                }
                _ => s,
            };
            states.insert(name, s);
        }
        Ok(AdamW { states, ..state })
    }
}

/// Listed expert parameter `name` (`{list}.{index}.…`, `per_rank` experts of the list on each
/// rank) as rank `q` names the one it holds in the same slot.
fn listed_on(name: &str, (list, index, per_rank): (&str, usize, usize), q: usize) -> String {
    let rest = &name[list.len() + 1 + index.to_string().len()..];
    format!("{list}.{}{rest}", q * per_rank + index % per_rank)
}

/// A value made of tensors that gather alike (a parameter, its optimizer state).
pub trait Tensors: Sized {
    fn parts(&self) -> Vec<Tensor>;
    /// The same value over `parts` (in [`Self::parts`]' order).
    fn rebuild(&self, parts: Vec<Tensor>) -> Self;
}

impl Tensors for Tensor {
    fn parts(&self) -> Vec<Tensor> {
        vec![self.clone()]
    }
    fn rebuild(&self, mut parts: Vec<Tensor>) -> Self {
        parts.remove(0)
    }
}

impl Tensors for ParamState {
    fn parts(&self) -> Vec<Tensor> {
        vec![
            self.master.clone(),
            self.exp_avg.clone(),
            self.exp_avg_sq.clone(),
        ]
    }
    fn rebuild(&self, parts: Vec<Tensor>) -> Self {
        let [master, exp_avg, exp_avg_sq]: [Tensor; 3] =
            parts.try_into().expect("three parts, as listed");
        ParamState {
            master,
            exp_avg,
            exp_avg_sq,
            decay: self.decay,
            decay_mask: self.decay_mask.clone(),
        }
    }
}

/// A flat gradient slice's parameters (name, range in the slice): the dense ones, and this
/// rank's experts'.
pub type DenseAndExperts = (EntryRanges, EntryRanges);

impl ExpertPlan {
    /// `entries` split into the dense parameters' and this rank's experts'.
    pub fn dense_and_experts(&self, entries: EntryRanges) -> DenseAndExperts {
        let (experts, dense) = entries.into_iter().partition(|(n, _)| self.holds(n));
        (dense, experts)
    }
}

/// A ZeRO / FSDP gradient slice `g` with its dense parameters' parts (`dense`) summed over
/// `ep`, whose ranks hold the same dense slices (and different experts).
pub fn sum_dense_over(
    ep: &Arc<dyn Communicator>,
    g: Tensor,
    (dense, experts): &DenseAndExperts,
) -> Result<Tensor> {
    if dense.is_empty() {
        return Ok(g);
    }
    if experts.is_empty() {
        return ep.all_reduce(&g, ReduceOp::Sum);
    }
    // The dense parts laid end to end, summed, put back in place.
    let mut ranges: Vec<&std::ops::Range<usize>> = dense.iter().map(|(_, r)| r).collect();
    ranges.sort_by_key(|r| r.start);
    let parts = ranges
        .iter()
        .map(|r| g.narrow(0, r.start, r.len()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let summed = ep.all_reduce(&Tensor::cat(&parts, 0)?, ReduceOp::Sum)?;
    let (mut pieces, mut at, mut taken) = (Vec::new(), 0, 0);
    for r in ranges {
        if r.start > at {
            pieces.push(g.narrow(0, at, r.start - at)?);
        }
        pieces.push(summed.narrow(0, taken, r.len())?);
        taken += r.len();
        at = r.end;
    }
    if at < g.dim(0)? {
        pieces.push(g.narrow(0, at, g.dim(0)? - at)?);
    }
    Ok(Tensor::cat(&pieces, 0)?)
}

/// The sum of squares of `g`'s parts `entries`, each weighed as tensor parallelism says
/// (1 without tp).
pub fn entries_sq(g: &Tensor, entries: &EntryRanges, tp: Option<&TpGrads>) -> Result<f64> {
    if entries.is_empty() {
        return Ok(0.0);
    }
    if let Some(tp) = tp {
        return tp.weighted_sq(g, entries);
    }
    let parts = entries
        .iter()
        .map(|(_, r)| g.narrow(0, r.start, r.len()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(sums_of_squares(&parts)?.iter().sum())
}

/// The squared global gradient norm of a ZeRO / FSDP slice's parts under expert parallelism:
/// `dense_sq` and `expert_sq` this rank's (tp-weighted) squares, summed over the shard group
/// `shard` (and tp), the experts' then over `ep` (each share of the experts once).
pub fn sharded_norm_sq(
    (dense_sq, expert_sq): (f64, f64),
    shard: &dyn Communicator,
    tp: Option<&TpGrads>,
    ep: Option<&Arc<dyn Communicator>>,
) -> Result<f64> {
    let sq = Tensor::new(&[dense_sq, expert_sq], &Device::Cpu)?;
    let sq = shard.all_reduce(&sq, ReduceOp::Sum)?.to_vec1::<f64>()?;
    let (mut dense, mut experts) = (sq[0], sq[1]);
    if let Some(tp) = tp {
        dense = tp.sum(dense)?;
        experts = tp.sum(experts)?;
    }
    Ok(match ep {
        Some(ep) => dense + sum_over(ep, experts)?,
        None => dense + experts,
    })
}

/// The sum over `ep` of a local f64 (the experts' squared norms).
pub fn sum_over(ep: &Arc<dyn Communicator>, local: f64) -> Result<f64> {
    let t = Tensor::new(&[local], &Device::Cpu)?;
    Ok(ep.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?[0])
}

/// Refuses what expert parallelism does not compose with: ZeRO / FSDP with an ep group that
/// is not inside dp_shard (their state is sharded over the dp_shard ranks holding the same
/// experts, the ep group's ranks holding the same dense slices).
pub fn check_strategy(opts: &ParallelOptions, ctx: &DistContext, ep: usize) -> Result<()> {
    let shard = ctx.mesh.dims().dp_shard;
    match opts.strategy {
        Strategy::Ddp => Ok(()),
        Strategy::Zero(_) | Strategy::Fsdp(..) if !shard.is_multiple_of(ep) => Err(refuse(
            &format!("ZeRO / FSDP over dp_shard = {shard} ranks"),
            &format!(
                "ZeRO / FSDP take the ep group out of dp_shard: choose an ep that divides {shard}"
            ),
        )),
        Strategy::Zero(_) | Strategy::Fsdp(..) => Ok(()),
    }
}

/// The error for a strategy expert parallelism does not compose with yet.
pub fn refuse(what: &str, how: &str) -> Error {
    Error::Config {
        file: "the launch's parallelism config".into(),
        key: "parallelism_config_ep_size".into(),
        message: format!(
            "expert parallelism does not run with {what} yet: {how}, or set \
             parallelism_config_ep_size to 1"
        ),
    }
}
