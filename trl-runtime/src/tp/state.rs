//! Parameters and optimizer state across tensor-parallel layouts. Ranks hold slices; a
//! checkpoint holds whole tensors, so that it opens in transformers and loads under any tp
//! size: saving gathers the slices along their split dimension, loading cuts this rank's.
//! Gradients: partial parameters' gradients are summed over the group, and the gradient norm
//! for clipping is global: split parameters' slices add up over the group, while whole
//! parameters (the same on every rank once summed) count once.

use super::{PlanEntry, Split, TpStyle};
use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::optim::{sums_of_squares, AdamW, ParamState};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// A parameter's split by name, from a plan.
pub fn splits(plan: &[PlanEntry]) -> HashMap<String, Split> {
    plan.iter().map(|e| (e.name.clone(), e.split)).collect()
}

/// The tensors (flat gradients) cast to f32 and laid end to end, in order: one collective
/// for all of them.
fn concat_f32<'a>(tensors: impl Iterator<Item = &'a Tensor>) -> Result<Tensor> {
    let flat = tensors
        .map(|t| t.to_dtype(DType::F32))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&flat, 0)?)
}

/// Parameter `name`'s split (whole when the plan does not name it).
fn split_of(splits: &HashMap<String, Split>, name: &str) -> Split {
    splits.get(name).copied().unwrap_or(Split::REPLICATED)
}

/// Whole tensors from this rank's slices (collective over `tp`: every rank calls it with the
/// same names). Names not split in `plan` pass through.
pub fn gather_full(
    tensors: BTreeMap<String, Tensor>,
    plan: &[PlanEntry],
    tp: &dyn Communicator,
) -> Result<BTreeMap<String, Tensor>> {
    by_split(tensors, plan, |split, t| split.gather(&t, tp))
}

/// `f` of each value with its parameter's split (whole when the plan does not name it).
fn by_split<V, W>(
    values: BTreeMap<String, V>,
    plan: &[PlanEntry],
    f: impl Fn(Split, V) -> Result<W>,
) -> Result<BTreeMap<String, W>> {
    let splits = splits(plan);
    values
        .into_iter()
        .map(|(name, v)| Ok((name.clone(), f(split_of(&splits, &name), v)?)))
        .collect()
}

/// Rank `rank`'s slice of the whole tensor `t` of parameter `name` (a copy owning only its
/// elements).
pub fn slice_full(
    name: &str,
    t: &Tensor,
    split: Split,
    rank: usize,
    size: usize,
) -> Result<Tensor> {
    if split.dim.is_none() {
        return Ok(t.clone());
    }
    Ok(split
        .part(name, t, rank, size)?
        .force_contiguous()?
        .detach())
}

/// The whole per-parameter optimizer state from every rank's slices (collective over `tp`).
pub fn gather_state(state: AdamW, plan: &[PlanEntry], tp: &dyn Communicator) -> Result<AdamW> {
    Ok(AdamW {
        states: gather_param_states(state.states, plan, tp)?,
        ..state
    })
}

/// Whole per-parameter states from this rank's slices of them (collective over `tp`).
pub fn gather_param_states(
    states: BTreeMap<String, ParamState>,
    plan: &[PlanEntry],
    tp: &dyn Communicator,
) -> Result<BTreeMap<String, ParamState>> {
    by_split(states, plan, |split, s| {
        Ok(ParamState {
            master: split.gather(&s.master, tp)?,
            exp_avg: split.gather(&s.exp_avg, tp)?,
            exp_avg_sq: split.gather(&s.exp_avg_sq, tp)?,
            ..s
        })
    })
}

/// This rank's slices of a whole per-parameter optimizer state (from a checkpoint written
/// under any tp size).
pub fn slice_state(state: &AdamW, plan: &[PlanEntry], rank: usize, size: usize) -> Result<AdamW> {
    let splits = splits(plan);
    let mut states = BTreeMap::new();
    for (name, s) in &state.states {
        let split = split_of(&splits, name);
        let cut = |t: &Tensor| slice_full(name, t, split, rank, size);
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

/// The environment switch for [`TpGrads`]' agreement check.
pub const CHECK_VAR: &str = "TRL_CHECK_TP_GRADS";

/// Gradients across the tensor-parallel group. Each rank holds its slices of split
/// parameters and whole copies of the others. A replicated parameter's gradient is the same
/// on every rank; a partial one (whole, but applied to split features such as per-head q/k
/// norms) has part of its gradient on each rank, so [`Self::sync`] sums it over the group.
/// The global norm for clipping weighs split slices by 1 and whole parameters (the same on
/// every rank once synced) by 1/tp.
///
/// The first sync of a run (and every sync with `TRL_CHECK_TP_GRADS=1`) all-gathers the whole
/// parameters' gradients and compares the ranks': an `auto` parameter (unannotated, in a
/// struct with column and row layers) becomes partial where they differ and replicated where
/// they agree; a parameter annotated (or defaulting to) `replicate` whose gradients differ, or
/// annotated `partial` whose gradients agree, is an error naming it and the annotation it
/// needs. A wrong plan stops the first step instead of training wrongly.
#[derive(Clone)]
pub struct TpGrads {
    comm: Arc<dyn Communicator>,
    splits: HashMap<String, Split>,
    /// Check at every sync, not only the first (`TRL_CHECK_TP_GRADS`).
    check_every: bool,
    /// What the gradients showed of each `auto` parameter: partial (true) or replicated.
    found: Arc<Mutex<HashMap<String, bool>>>,
}

/// Relative difference under which two ranks' gradients count as the same: the ranks run the
/// same kernels on the same values, so replicated gradients agree to rounding (bf16 included),
/// while a partial one's shares differ at the first digit.
const SAME: f64 = 1e-3;

impl TpGrads {
    pub fn new(plan: &[PlanEntry], comm: Arc<dyn Communicator>) -> Self {
        let check_every =
            std::env::var(CHECK_VAR).is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false"));
        TpGrads {
            comm,
            splits: splits(plan),
            check_every,
            found: Arc::default(),
        }
    }

    fn style(&self, name: &str) -> TpStyle {
        self.splits
            .get(name)
            .map_or(TpStyle::Replicate, |s| s.style)
    }

    fn found(&self, name: &str) -> Option<bool> {
        let found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        found.get(name).copied()
    }

    /// Whether parameter `name`'s gradient is summed over the group (`auto` ones once the
    /// gradients have shown it).
    pub fn is_partial(&self, name: &str) -> bool {
        match self.style(name) {
            TpStyle::Partial => true,
            TpStyle::Auto => self.found(name) == Some(true),
            _ => false,
        }
    }

    /// Whether parameter `name` is held whole on every rank.
    fn is_whole(&self, name: &str) -> bool {
        self.splits.get(name).is_none_or(|s| s.dim.is_none())
    }

    /// An `auto` parameter whose gradients have not yet shown what it is.
    fn undecided(&self, name: &str) -> bool {
        self.style(name) == TpStyle::Auto && self.found(name).is_none()
    }

    /// What a sync reads of this name: partial and undecided ones always, every whole one
    /// when checking.
    fn takes(&self, name: &str, check: bool) -> bool {
        self.is_partial(name) || self.undecided(name) || (check && self.is_whole(name))
    }

    /// Sums the partial parameters' gradients over the group (collective over tp: every rank
    /// calls it with the same names). `first`: the run's first step, whose gradients are
    /// checked against the plan (every step's are with `TRL_CHECK_TP_GRADS=1`).
    pub fn sync(&self, grads: &mut BTreeMap<String, Tensor>, first: bool) -> Result<()> {
        let check = first || self.check_every;
        let names: Vec<String> = grads
            .keys()
            .filter(|n| self.takes(n, check))
            .cloned()
            .collect();
        let pieces = names
            .iter()
            .map(|n| Ok(grads[n].flatten_all()?))
            .collect::<Result<Vec<_>>>()?;
        let named: Vec<(&str, Tensor)> = names.iter().map(|n| n.as_str()).zip(pieces).collect();
        for (name, summed) in self.sync_pieces(named, check)? {
            let g = &grads[name];
            let summed = summed.reshape(g.shape())?.to_dtype(g.dtype())?;
            grads.insert(name.to_string(), summed);
        }
        Ok(())
    }

    /// [`Self::sync`] for a flat gradient slice: `entries` (name, element range within
    /// `flat`) are the parameters the slice covers. Tensor-parallel peers hold the same
    /// entries at the same places (their units have the same layout), so the sums line up.
    pub fn sync_flat(
        &self,
        flat: &Tensor,
        entries: &[(String, Range<usize>)],
        first: bool,
    ) -> Result<Tensor> {
        let check = first || self.check_every;
        let taken: Vec<&(String, Range<usize>)> = entries
            .iter()
            .filter(|(n, _)| self.takes(n, check))
            .collect();
        let named = taken
            .iter()
            .map(|(n, r)| Ok((n.as_str(), flat.narrow(0, r.start, r.len())?)))
            .collect::<Result<Vec<_>>>()?;
        let summed: HashMap<&str, Tensor> = self.sync_pieces(named, check)?.into_iter().collect();
        if summed.is_empty() {
            return Ok(flat.clone());
        }
        // The slice again, with the summed ranges in place of the local ones.
        let mut ordered: Vec<&(String, Range<usize>)> = taken
            .into_iter()
            .filter(|(n, _)| summed.contains_key(n.as_str()))
            .collect();
        ordered.sort_by_key(|(_, r)| r.start);
        let mut parts = Vec::new();
        let mut at = 0;
        for (name, r) in ordered {
            if r.start > at {
                parts.push(flat.narrow(0, at, r.start - at)?);
            }
            parts.push(summed[name.as_str()].to_dtype(flat.dtype())?);
            at = r.end;
        }
        let len = flat.dim(0)?;
        if at < len {
            parts.push(flat.narrow(0, at, len - at)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Compares the ranks' gradients (all of `pieces` when checking, else the undecided
    /// ones), then sums the partial pieces: those come back summed.
    fn sync_pieces<'n>(
        &self,
        pieces: Vec<(&'n str, Tensor)>,
        check: bool,
    ) -> Result<Vec<(&'n str, Tensor)>> {
        let compared: Vec<&(&str, Tensor)> = pieces
            .iter()
            .filter(|(n, _)| self.is_whole(n) && (check || self.undecided(n)))
            .collect();
        if !compared.is_empty() {
            self.compare(&compared)?;
        }
        let partial: Vec<(&str, Tensor)> = pieces
            .into_iter()
            .filter(|(n, _)| self.is_partial(n))
            .collect();
        if partial.is_empty() {
            return Ok(partial);
        }
        // One all-reduce for all of them, in f32.
        let flat = concat_f32(partial.iter().map(|(_, t)| t))?;
        let summed = self.comm.all_reduce(&flat, ReduceOp::Sum)?;
        let mut at = 0;
        partial
            .into_iter()
            .map(|(n, t)| {
                let len = t.elem_count();
                let s = summed.narrow(0, at, len)?;
                at += len;
                Ok((n, s))
            })
            .collect()
    }

    /// Gathers every rank's gradients of `pieces` and compares them: decides `auto`
    /// parameters, fails naming the first annotated one whose gradients contradict its
    /// annotation.
    fn compare(&self, pieces: &[&(&str, Tensor)]) -> Result<()> {
        let flat = concat_f32(pieces.iter().map(|(_, t)| t))?;
        // [tp, n]: every rank's gradients, the same on every rank.
        let all = self.comm.all_gather(&flat.unsqueeze(0)?, 0)?;
        let rank0 = all.narrow(0, 0, 1)?;
        let mut at = 0;
        let mut found_partial = Vec::new();
        for (name, t) in pieces {
            let len = t.elem_count();
            let ranks = all.narrow(1, at, len)?;
            let first = rank0.narrow(1, at, len)?;
            at += len;
            let scale = ranks.abs()?.max_all()?.to_scalar::<f32>()? as f64;
            let diff = ranks
                .broadcast_sub(&first)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()? as f64;
            // An all-zero gradient says nothing either way (no gradient reached it).
            if scale == 0.0 {
                continue;
            }
            let same = diff <= SAME * scale;
            let message = match (self.style(name), same) {
                (TpStyle::Auto, _) => {
                    let mut found = self.found.lock().unwrap_or_else(|e| e.into_inner());
                    if found.insert(name.to_string(), !same).is_none() && !same {
                        found_partial.push(name.to_string());
                    }
                    continue;
                }
                (TpStyle::Partial, true) => format!(
                    "it is marked #[parallel(tp = \"partial\")] but its gradient is the same on \
                     every tp rank ({scale:.3e} at most): it acts on whole features, and \
                     summing would count its gradient tp times. Mark its field \
                     #[parallel(tp = \"replicate\")] (or leave it unannotated)"
                ),
                (TpStyle::Partial, false) => continue,
                (_, false) => format!(
                    "its gradient differs across the tp ranks (by up to {diff:.3e}, against a \
                     largest value of {scale:.3e}): it is held whole on every rank, but each \
                     rank computes only part of its gradient, as for a norm applied to \
                     attention heads split over tp. Mark its field #[parallel(tp = \
                     \"partial\")] so that its gradient is summed over the group"
                ),
                (_, true) => continue,
            };
            return Err(Error::TensorParallel {
                name: name.to_string(),
                message: format!("the tensor-parallel plan does not fit this model: {message}"),
            });
        }
        if !found_partial.is_empty() && self.comm.rank() == 0 {
            tracing::info!(
                "tensor parallelism: {} parameter(s) act on features split over tp, so their \
                 gradients are summed over the group (their gradients differ across ranks): {}",
                found_partial.len(),
                found_partial.join(", ")
            );
        }
        Ok(())
    }

    /// The weight of parameter `name`'s squared gradient in this rank's share.
    pub fn weight(&self, name: &str) -> f64 {
        match split_of(&self.splits, name).dim {
            Some(_) => 1.0,
            None => 1.0 / self.comm.size() as f64,
        }
    }

    /// This rank's weighted sum of squares of a flat gradient slice `g` covering `entries`
    /// (each parameter's part of it), as [`Self::norm_sq`] weighs whole parameters: per
    /// parameter, so no per-element weight vector is kept, and in one pass over the parts
    /// ([`sums_of_squares`]: one launch on a GPU).
    pub fn weighted_sq(&self, g: &Tensor, entries: &[(String, Range<usize>)]) -> Result<f64> {
        let parts = entries
            .iter()
            .map(|(_, r)| g.narrow(0, r.start, r.len()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let sums = sums_of_squares(&parts)?;
        Ok(entries
            .iter()
            .zip(sums)
            .map(|((name, _), sq)| sq * self.weight(name))
            .sum())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::InProcessWorld;
    use crate::nn::module::Split;

    fn entry(name: &str, split: Split) -> PlanEntry {
        PlanEntry {
            name: name.into(),
            split,
            local_shape: vec![3],
            full_shape: vec![3],
        }
    }

    /// Runs `f` on every rank of a tp group of 2 with the gradients `grads(rank)`.
    fn on_two_ranks<T: Send>(
        plan: &[PlanEntry],
        grads: impl Fn(usize) -> BTreeMap<String, Tensor> + Sync,
        f: impl Fn(&TpGrads, BTreeMap<String, Tensor>) -> T + Sync,
    ) -> Vec<T> {
        let world = InProcessWorld::new(2);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (world, grads, f) = (&world, &grads, &f);
                    s.spawn(move || {
                        let tp = TpGrads::new(plan, world.world(rank).unwrap());
                        f(&tp, grads(rank))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn t(v: [f32; 3]) -> Tensor {
        Tensor::new(&v, &Device::Cpu).unwrap()
    }

    #[test]
    fn auto_parameters_are_decided_by_their_gradients_and_partial_ones_summed() {
        let plan = [
            entry("q_norm", Split::AUTO),
            entry("input_norm", Split::AUTO),
            entry("k_norm", Split::PARTIAL),
        ];
        let grads = |rank: usize| {
            let r = rank as f32;
            BTreeMap::from([
                ("q_norm".to_string(), t([1.0 + r, 2.0, 3.0 - r])),
                ("input_norm".to_string(), t([0.5, -1.0, 2.0])),
                ("k_norm".to_string(), t([r, 1.0, 0.0])),
            ])
        };
        let out = on_two_ranks(&plan, grads, |tp, mut g| {
            tp.sync(&mut g, true).unwrap();
            let flat = Tensor::cat(&[&g["input_norm"], &g["k_norm"], &g["q_norm"]], 0).unwrap();
            (flat.to_vec1::<f32>().unwrap(), tp.is_partial("q_norm"))
        });
        for (values, q_partial) in out {
            assert!(q_partial, "q_norm's gradients differ: partial");
            // input_norm kept, k_norm and q_norm summed over both ranks.
            assert_eq!(
                values,
                [0.5, -1.0, 2.0, 1.0, 2.0, 0.0, 3.0, 4.0, 5.0],
                "after sync"
            );
        }
    }

    #[test]
    fn annotations_that_the_gradients_contradict_are_errors() {
        // A replicated parameter whose gradients differ: it needs `partial`.
        let plan = [entry("q_norm", Split::REPLICATED)];
        let errors = on_two_ranks(
            &plan,
            |rank| BTreeMap::from([("q_norm".to_string(), t([rank as f32, 1.0, 2.0]))]),
            |tp, mut g| tp.sync(&mut g, true).unwrap_err().to_string(),
        );
        assert!(
            errors[0].contains("q_norm") && errors[0].contains("tp = \"partial\""),
            "{}",
            errors[0]
        );
        // A partial parameter whose gradients agree: it needs `replicate`.
        let plan = [entry("norm", Split::PARTIAL)];
        let errors = on_two_ranks(
            &plan,
            |_| BTreeMap::from([("norm".to_string(), t([1.0, 1.0, 2.0]))]),
            |tp, mut g| tp.sync(&mut g, true).unwrap_err().to_string(),
        );
        assert!(
            errors[0].contains("norm") && errors[0].contains("tp = \"replicate\""),
            "{}",
            errors[0]
        );
        // Not checked after the first step (without TRL_CHECK_TP_GRADS): summed as declared.
        let sums = on_two_ranks(
            &plan,
            |_| BTreeMap::from([("norm".to_string(), t([1.0, 1.0, 2.0]))]),
            |tp, mut g| {
                tp.sync(&mut g, false).unwrap();
                g["norm"].to_vec1::<f32>().unwrap()
            },
        );
        assert_eq!(sums[0], [2.0, 2.0, 4.0]);
    }

    #[test]
    fn flat_slices_sync_like_named_gradients() {
        let plan = [
            entry("a", Split::REPLICATED),
            entry("b", Split::AUTO),
            entry("c", Split::PARTIAL),
        ];
        let out = on_two_ranks(
            &plan,
            |rank| {
                let r = rank as f32;
                BTreeMap::from([("flat".to_string(), {
                    Tensor::new(&[1f32, 2., 3., 4. + r, 5., 6., r, 0., 1.], &Device::Cpu).unwrap()
                })])
            },
            |tp, g| {
                let entries = [
                    ("a".to_string(), 0..3),
                    ("b".to_string(), 3..6),
                    ("c".to_string(), 6..9),
                ];
                tp.sync_flat(&g["flat"], &entries, true)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            },
        );
        assert_eq!(out[0], [1., 2., 3., 9., 10., 12., 1., 0., 2.]);
        assert_eq!(out[0], out[1]);
    }
}
