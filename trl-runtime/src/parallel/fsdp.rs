//! ZeRO stage 3 / FSDP FULL_SHARD: parameters, gradients and optimizer state all split over
//! the data-parallel shard group.
//!
//! The model is cut into wrap units: by default one per decoder layer (FSDP's
//! TRANSFORMER_BASED_WRAP), plus the root unit holding the embedding, the final norm and the
//! LM head. A unit keeps its parameters as one flat vector (sorted by name, padded to the group
//! size) of which this rank holds a slice.
//!
//! How a layer computes with a unit's parameters (gathered for its forward, gathered again
//! in backward, gradients reduce-scattered after the unit's last op) is the layer side, in
//! [`crate::nn::sharded`]; here the model is cut into units and their optimizer runs. The
//! root unit stays gathered from forward to the end of backward (its parameters are needed
//! first and last), as FSDP2 does for the root.
//!
//! Communication overlaps compute: every unit collective runs on the model's [`CommQueue`]
//! (one thread, first in first out, so all ranks still issue them in one order). Entering a
//! unit in forward starts the next unit's all-gather; a unit's first op in backward starts the
//! previous unit's; reduce-scatters run while the backward goes on, and
//! [`ShardedModel::finish_backward`] waits for them. At most two units are gathered at once.
//!
//! Under expert parallelism a layer unit's routed experts (this rank's share of them) form a
//! unit of their own, sharded over the ranks holding the same experts, while the rest of the
//! layer stays sharded over all of dp_shard, as torchtitan wraps a MoE layer's experts apart
//! on the dp_shard / ep mesh. The experts' unit is gathered, freed and reduced with its
//! layer's unit (`Unit::experts`), on a queue of its own.

use super::sharded_optimizer::ShardedOptimizer;
use super::sharded_state::{Piece, ShardedReader};
use crate::alloc::StorageBytes;
use crate::comm::{CommQueue, Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::models::Params;
pub use crate::nn::sharded::Holding;
use crate::nn::sharded::{EntryRanges, FlatLayout, ShardedWeight, Unit, UnitScope, UnitState};
use crate::nn::Weight;
use crate::optim::{clip_coef, sums_of_squares, AdamW, AdamWConfig, ParamState};
use crate::tp::{named_tensors, Parallelize, TpGrads};
use candle_core::{DType, Shape, Tensor, TensorId, Var};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

/// How parameters are grouped into units (FSDP's auto-wrap policies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrapPolicy {
    /// One unit per decoder layer (TRANSFORMER_BASED_WRAP; DeepSpeed ZeRO-3 gathers per layer too).
    PerLayer,
    /// Consecutive layers grouped until a unit has at least this many parameters (SIZE_BASED_WRAP).
    MinParams(usize),
    /// The whole model in the root unit (NO_WRAP): gathered for the whole step.
    Whole,
    /// Consecutive layers grouped while a unit has at most this many parameters (at least
    /// one layer each): DeepSpeed ZeRO-2's reduce buckets (`reduce_bucket_size`).
    Buckets(usize),
}

/// Which all-gathers start one unit ahead of use (FSDP's forward_prefetch and
/// backward_prefetch; DeepSpeed ZeRO-3 prefetches both ways).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    pub forward: bool,
    pub backward: bool,
}

impl Prefetch {
    pub const BOTH: Prefetch = Prefetch {
        forward: true,
        backward: true,
    };
    pub const NONE: Prefetch = Prefetch {
        forward: false,
        backward: false,
    };
}

/// The wrap unit (index into `unit_names`) a parameter belongs to: the one whose name is a
/// prefix of it (`model.layers.3` holds `model.layers.3.mlp.up_proj.weight`).
pub(super) fn unit_of(name: &str, unit_names: &[String]) -> Option<usize> {
    unit_names.iter().position(|u| {
        name.strip_prefix(u.as_str())
            .is_some_and(|rest| rest.starts_with('.'))
    })
}

/// Which unit each layer joins under `policy` (unit 0 is the root), from the layers'
/// parameter counts: the one rule the sharding and the memory estimate both cut by.
pub(super) fn layer_units(layer_sizes: &[usize], policy: WrapPolicy) -> Vec<usize> {
    let mut layer_unit = vec![0usize; layer_sizes.len()];
    let mut next = 1;
    let mut size = 0usize;
    for (unit, layer_size) in layer_unit.iter_mut().zip(layer_sizes) {
        match policy {
            WrapPolicy::Whole => {}
            WrapPolicy::PerLayer => {
                *unit = next;
                next += 1;
            }
            WrapPolicy::MinParams(min) => {
                *unit = next;
                size += layer_size;
                if size >= min {
                    next += 1;
                    size = 0;
                }
            }
            WrapPolicy::Buckets(max) => {
                if size > 0 && size + layer_size > max {
                    next += 1;
                    size = 0;
                }
                *unit = next;
                size += layer_size;
            }
        }
    }
    layer_unit
}

/// Under expert parallelism: which parameters are this rank's experts (`ExpertPlan::holds`),
/// and the ranks holding the same ones, over which their units are sharded.
pub type ExpertUnits<'a> = (&'a (dyn Fn(&str) -> bool + Sync), Arc<dyn Communicator>);

/// Shards `model` over `comm` in place: its parameters (this rank's tensor-parallel slices if
/// it was split) go into wrap units, one per value marked `#[parallel(fsdp_unit)]` (grouped by
/// `policy`) plus the root holding the rest, and every layer's weight is swapped for its slot
/// in a unit. A weight shared by two layers (tied embeddings) stays one slot. The model's own
/// tensors are dropped: call it before anything else holds them. With `experts`, each layer
/// unit's experts go into a unit of their own over the ranks holding the same experts.
pub fn shard_model(
    model: &mut impl Parallelize,
    (policy, prefetch, holding): (WrapPolicy, Prefetch, Holding),
    comm: Arc<dyn Communicator>,
    experts: Option<ExpertUnits<'_>>,
) -> Result<Arc<ShardedModel>> {
    let (slots, frozen) = weight_slots(model)?;
    let mut params = named_tensors(model);
    // LoRA adapters are parameters but no slots, and the modules a LoRA run trains whole are
    // left out of the frozen units: both stay whole on every rank.
    params.retain(|name, _| slots.contains(name));
    let mut unit_names = Vec::new();
    model.visit_units("", &mut |n| unit_names.push(n.to_string()));
    let sharding = Arc::new(ShardedModel::new(
        &params,
        &unit_names,
        (policy, prefetch, holding),
        comm,
        experts,
    )?);
    drop(params);
    swap_weights(model, &sharding)?;
    sharding.set_frozen(frozen);
    Ok(sharding)
}

/// The names of `model`'s weight slots that go into units, and whether those are constants:
/// every slot when all are trainable (full fine-tuning), else the frozen ones alone (a LoRA
/// base, whose units then reduce nothing; modules trained whole beside it stay whole). A
/// skeleton's weights are views, not variables: with no variable anywhere (no adapters
/// either), every slot trains.
fn weight_slots(model: &mut impl Parallelize) -> Result<(HashSet<String>, bool)> {
    if !named_tensors(model).values().any(|t| t.is_variable()) {
        let mut all = HashSet::new();
        model.visit_weights_mut("", &mut |name, _| {
            all.insert(name.to_string());
            Ok(())
        })?;
        return Ok((all, false));
    }
    let (mut all, mut frozen) = (HashSet::new(), HashSet::new());
    model.visit_weights_mut("", &mut |name, w| {
        all.insert(name.to_string());
        if matches!(w, Weight::Local(t) if !t.is_variable()) {
            frozen.insert(name.to_string());
        }
        Ok(())
    })?;
    Ok(match frozen.is_empty() {
        true => (all, false),
        false => (frozen, true),
    })
}

/// Reads one parameter's elements `start..start + len` (row-major) from where the weights
/// live, in f32.
pub type ReadRange<'a> = dyn Fn(&str, usize, usize) -> Result<Tensor> + 'a;

/// As [`shard_model`] for a model whose weights are not loaded (a skeleton): each rank reads
/// only its slice of every unit through `read`, so no rank ever holds the whole model (FSDP's
/// cpu_ram_efficient_loading, DeepSpeed's zero3_init). `shapes` names every parameter once.
pub fn shard_model_reading(
    model: &mut impl Parallelize,
    shapes: Vec<(String, Shape)>,
    (dtype, device): (DType, &candle_core::Device),
    read: &ReadRange<'_>,
    units: (WrapPolicy, Prefetch, Holding),
    comm: Arc<dyn Communicator>,
) -> Result<Arc<ShardedModel>> {
    let (slots, frozen) = weight_slots(model)?;
    let mut unit_names = Vec::new();
    model.visit_units("", &mut |n| unit_names.push(n.to_string()));
    let mut sorted = shapes;
    sorted.retain(|(name, _)| slots.contains(name));
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let slice = |layout: &FlatLayout, range: std::ops::Range<usize>| -> Result<Tensor> {
        layout.read_range(range, read, device)
    };
    let sharding = Arc::new(ShardedModel::build(
        sorted,
        (dtype, device),
        &slice,
        &unit_names,
        units,
        (comm, None),
    )?);
    swap_weights(model, &sharding)?;
    sharding.set_frozen(frozen);
    Ok(sharding)
}

/// Swaps every weight of `model` for its slot in `sharding`, a tensor shared by two layers
/// (tied embeddings) going to the slot of the name it was first seen under.
fn swap_weights(model: &mut impl Parallelize, sharding: &ShardedModel) -> Result<()> {
    let mut canonical: HashMap<TensorId, String> = HashMap::new();
    model.visit_weights_mut("", &mut |name, w| {
        if let Weight::Local(t) = w {
            canonical.entry(t.id()).or_insert_with(|| name.to_string());
        }
        Ok(())
    })?;
    model.visit_weights_mut("", &mut |name, w| {
        let Weight::Local(t) = w else {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: "already sharded: a model is wrapped for FSDP once".into(),
            });
        };
        let key = canonical.get(&t.id()).map(String::as_str).unwrap_or(name);
        if t.is_variable() && sharding.weight(key).is_none() {
            // Trained whole beside a frozen base (a LoRA run's modules_to_save).
            return Ok(());
        }
        *w = sharding.weight(key).ok_or_else(|| {
            Error::Candle(candle_core::Error::Msg(format!(
                "{name} is not among the parameters the model lists"
            )))
        })?;
        Ok(())
    })
}

/// A model's parameters as sharded wrap units.
pub struct ShardedModel {
    /// The root unit first, then the layer units in forward order, then (under expert
    /// parallelism) the experts' units, each following its layer unit (`Unit::experts`).
    pub units: Vec<Arc<Unit>>,
    /// How many of `units` are the root and the layer units.
    dense: usize,
    weights: BTreeMap<String, ShardedWeight>,
    /// Per marked unit of the model (a decoder layer): the index of the wrap unit in `units`
    /// holding it and whether it is that unit's last (None: it is in the root).
    layers: Vec<Option<(usize, bool)>>,
    prefetch: Prefetch,
    /// Parameter count (without padding).
    num_elements: usize,
}

impl ShardedModel {
    /// Shards `params` (the same values on every rank of `comm`) over `comm`, in units made
    /// of the marked units `unit_names` (the model's `visit_units`, in forward order, grouped as
    /// `policy` says) and a root with every other parameter. This rank keeps its slice of every
    /// unit; the full tensors can be dropped afterwards. See [`shard_model`].
    pub fn new(
        params: &BTreeMap<String, Tensor>,
        unit_names: &[String],
        units: (WrapPolicy, Prefetch, Holding),
        comm: Arc<dyn Communicator>,
        experts: Option<ExpertUnits<'_>>,
    ) -> Result<Self> {
        let values = params;
        let Some(first) = values.values().next() else {
            return Err(Error::Candle(candle_core::Error::Msg(
                "a model without parameters cannot be sharded".into(),
            )));
        };
        let (dtype, device) = (first.dtype(), first.device().clone());
        let shapes = values
            .iter()
            .map(|(n, t)| (n.clone(), t.shape().clone()))
            .collect();
        let slice = |layout: &FlatLayout, range: std::ops::Range<usize>| -> Result<Tensor> {
            Ok(layout
                .flatten(values)?
                .narrow(0, range.start, range.len())?)
        };
        Self::build(
            shapes,
            (dtype, &device),
            &slice,
            unit_names,
            units,
            (comm, experts),
        )
    }

    /// Units over parameters `shapes` (sorted by name), this rank's slice of each cut by
    /// `slice` (f32, from the unit's layout and this rank's range), held as `holding` says
    /// (an offloaded slice in host memory).
    fn build(
        shapes: Vec<(String, Shape)>,
        (dtype, device): (DType, &candle_core::Device),
        slice: &dyn Fn(&FlatLayout, std::ops::Range<usize>) -> Result<Tensor>,
        unit_names: &[String],
        (policy, prefetch, holding): (WrapPolicy, Prefetch, Holding),
        (comm, experts): (Arc<dyn Communicator>, Option<ExpertUnits<'_>>),
    ) -> Result<Self> {
        let num_layers = unit_names.len();
        let layer_of = |name: &str| unit_of(name, unit_names);
        let mut layer_sizes = vec![0usize; num_layers];
        for (name, shape) in &shapes {
            if let Some(l) = layer_of(name) {
                layer_sizes[l] += shape.elem_count();
            }
        }
        let layer_unit = layer_units(&layer_sizes, policy);
        let count = layer_unit.iter().copied().max().unwrap_or(0) + 1;
        let num_elements = shapes.iter().map(|(_, s)| s.elem_count()).sum();
        let mut members: Vec<Vec<(String, Shape)>> = vec![Vec::new(); count];
        // Each layer unit's experts, apart (never the root's: experts sit in layers).
        let mut expert_members: Vec<Vec<(String, Shape)>> = vec![Vec::new(); count];
        for (name, shape) in shapes {
            let u = layer_of(&name).map(|l| layer_unit[l]).unwrap_or(0);
            match &experts {
                Some((holds, _)) if u > 0 && holds(&name) => expert_members[u].push((name, shape)),
                _ => members[u].push((name, shape)),
            }
        }
        let queue = Arc::new(CommQueue::new(comm.clone())?);
        let expert_queue = match &experts {
            Some((_, c)) => Some(Arc::new(CommQueue::new(c.clone())?)),
            None => None,
        };
        let mut units: Vec<Arc<Unit>> = Vec::with_capacity(count);
        let mut weights = BTreeMap::new();
        let parts = members
            .into_iter()
            .enumerate()
            .map(|(u, e)| (u, e, &queue, false))
            .chain(
                expert_members
                    .into_iter()
                    .enumerate()
                    .filter(|(_, e)| !e.is_empty())
                    .filter_map(|(u, e)| expert_queue.as_ref().map(|q| (u, e, q, true))),
            )
            .collect::<Vec<_>>();
        for (u, entries, queue, expert) in parts {
            // The root always holds the embedding; every other unit at least one layer.
            if entries.is_empty() {
                return Err(Error::Candle(candle_core::Error::Msg(
                    "a model without an embedding cannot be sharded".into(),
                )));
            }
            let (rank, world) = (queue.comm().rank(), queue.comm().size());
            let layout = FlatLayout::from_shapes(entries, world);
            let range = layout.shard(rank, world);
            let home = match holding.host_params {
                true => &candle_core::Device::Cpu,
                false => device,
            };
            let shard = slice(&layout, range)?
                .to_dtype(dtype)?
                .to_device(home)?
                // A copy of the slice alone: `copy()` would keep the whole flat unit alive.
                .force_contiguous()?
                .detach();
            let entries = layout.entries().len();
            let unit = Arc::new(Unit {
                name: match (u, expert) {
                    (0, _) => "root".into(),
                    (_, false) => format!("unit{u}"),
                    (_, true) => format!("unit{u}.experts"),
                },
                layout,
                queue: queue.clone(),
                backward_next: OnceLock::new(),
                experts: OnceLock::new(),
                keep_gathered: u == 0 || holding.resident,
                holding,
                moved: Default::default(),
                anchor: Var::zeros(1, dtype, device)?,
                state: Mutex::new(UnitState {
                    shard,
                    full: None,
                    gathering: None,
                    pending: 0,
                    grads: vec![None; entries],
                    grad_shard: None,
                    reducing: None,
                    in_backward: false,
                    got_grad: vec![false; entries],
                    frozen: false,
                    held: false,
                }),
            });
            for (i, (name, _, _)) in unit.layout.entries().iter().enumerate() {
                weights.insert(
                    name.clone(),
                    ShardedWeight {
                        unit: unit.clone(),
                        entry: i,
                    },
                );
            }
            if expert {
                // Its layer unit's experts.
                let _ = units[u].experts.set(unit.clone());
            }
            units.push(unit);
        }
        let dense = &units[..count];
        for (u, unit) in dense.iter().enumerate().filter(|_| prefetch.backward) {
            let next = if u == 0 {
                dense.last()
            } else {
                dense.get(u - 1)
            };
            if let Some(next) = next.filter(|n| !Arc::ptr_eq(n, unit)) {
                let _ = unit.backward_next.set(Arc::downgrade(next));
            }
        }
        let layers = (0..num_layers)
            .map(|l| {
                let u = layer_unit[l];
                let last = l + 1 == num_layers || layer_unit[l + 1] != u;
                (u != 0).then_some((u, last))
            })
            .collect();
        Ok(ShardedModel {
            units,
            dense: count,
            weights,
            layers,
            prefetch,
            num_elements,
        })
    }

    /// Makes every unit's parameters constants (a LoRA base) or trainable.
    fn set_frozen(&self, frozen: bool) {
        for unit in &self.units {
            unit.lock().frozen = frozen;
        }
    }

    /// Whether the units hold constants (a LoRA base).
    pub fn frozen(&self) -> bool {
        self.root().lock().frozen
    }

    /// The layer-facing handle of parameter `name`.
    pub fn weight(&self, name: &str) -> Option<Weight> {
        self.weights.get(name).cloned().map(Weight::Sharded)
    }

    pub fn root(&self) -> &Arc<Unit> {
        &self.units[0]
    }

    /// The root (0) or a layer unit (not an experts' unit).
    fn layer_unit(&self, u: usize) -> Option<&Arc<Unit>> {
        self.units[..self.dense].get(u)
    }

    /// The parameters no backward reached since the last call, in every unit.
    pub fn take_without_grad(&self) -> Vec<String> {
        self.units
            .iter()
            .flat_map(|u| u.take_without_grad())
            .collect()
    }

    pub fn num_elements(&self) -> usize {
        self.num_elements
    }

    /// Starts a forward pass: clears what an earlier forward left, gathers the root unit and
    /// starts gathering the first layer's.
    pub fn begin_forward(&self) -> Result<UnitScope<'_>> {
        for unit in &self.units {
            unit.reset()?;
        }
        // An experts' unit is reduced when its layer unit is: one more op to wait for.
        for unit in &self.units[..self.dense] {
            if let Some(experts) = unit.experts.get() {
                experts.lock().pending += 1;
            }
        }
        let scope = self.root().enter()?;
        // Units are in forward order: the first layer unit follows the root.
        if let Some(first) = self.layer_unit(1).filter(|_| self.prefetch.forward) {
            first.prefetch();
        }
        Ok(scope)
    }

    /// Gathers every unit, one after another (collective: every rank calls it), and keeps
    /// them gathered until the guard drops: a generation round then runs its forwards with
    /// no collective, at the cost of the whole model's weights on each rank.
    pub fn hold_gathered(&self) -> Result<HeldGathered<'_>> {
        let guard = HeldGathered(self);
        for unit in &self.units {
            let mut st = unit.lock();
            unit.settle_gather(&mut st)?;
            unit.gathered(&mut st)?;
            st.held = true;
        }
        Ok(guard)
    }

    /// Bytes of every unit gathered at once: what [`Self::hold_gathered`] adds per rank.
    pub fn gathered_bytes(&self) -> usize {
        self.units
            .iter()
            .map(|u| u.layout.padded() * u.lock().shard.dtype().size_in_bytes())
            .sum()
    }

    /// Enters layer `l`'s unit (and starts gathering the next unit); the returned scope frees
    /// it if `l` is the unit's last layer.
    pub fn enter_layer(&self, l: usize) -> Result<Option<UnitScope<'_>>> {
        let Some((u, last)) = self.layers.get(l).copied().flatten() else {
            return Ok(None);
        };
        let unit = &self.units[u];
        unit.gathered(&mut unit.lock())?;
        if let Some(next) = self.layer_unit(u + 1).filter(|_| self.prefetch.forward) {
            next.prefetch();
        }
        Ok(last.then(|| UnitScope(unit)))
    }

    /// After a backward: reduces any unit whose ops did not all receive a gradient (a
    /// parameter off the loss path), last unit first, so every rank issues the same collectives.
    /// Then waits for every reduce-scatter, so the communicator is idle when it returns.
    pub fn finish_backward(&self) -> Result<()> {
        // Not the experts' units: each is reduced with its layer unit.
        for unit in self.units[..self.dense].iter().rev() {
            let mut st = unit.lock();
            if st.pending > 0 {
                st.pending = 0;
                unit.finish(&mut st)?;
            }
        }
        for unit in self.units.iter().rev() {
            let mut st = unit.lock();
            unit.settle_gather(&mut st)?;
            unit.collect_reduced(&mut st)?;
        }
        Ok(())
    }

    /// How the units hold parameters and gradients.
    pub fn holding(&self) -> Holding {
        self.root().holding
    }

    /// Bytes moved between host and device memory (offload) since the last call.
    pub fn take_moved(&self) -> usize {
        self.units.iter().map(|u| u.take_moved()).sum()
    }

    /// Every parameter's full value (collective: every rank calls it; one unit at a time).
    pub fn gather_full(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for unit in &self.units {
            let shard = unit.lock().shard.clone();
            out.extend(unit.layout.unflatten(&unit.comm().all_gather(&shard, 0)?)?);
        }
        Ok(out)
    }

    /// This rank's slice of every unit, root first (shallow: they share storage).
    pub fn shards(&self) -> Vec<Tensor> {
        self.units.iter().map(|u| u.lock().shard.clone()).collect()
    }

    /// Swaps this rank's slice of every unit with `values` (one per unit, as [`Self::shards`]
    /// lists them), dropping whatever a forward left gathered from the old ones.
    pub fn swap_shards(&self, values: &mut [Tensor]) -> Result<()> {
        for (unit, v) in self.units.iter().zip(values) {
            let old = unit.replace_shard(v.clone())?;
            *v = old;
        }
        Ok(())
    }

    /// Adds the storage of the parameters this rank keeps to `device` (its slices, or a
    /// resident unit's whole parameters, of which its slice is a view: counted at their size
    /// whether or not an update has just made them stale) or to `host` (offloaded slices).
    pub fn add_storage(&self, device: &mut StorageBytes, host: &mut StorageBytes) {
        for u in &self.units {
            let st = u.lock();
            if u.holding.resident {
                device.total += u.layout.padded() * st.shard.dtype().size_in_bytes();
            }
            match (u.holding.host_params, u.holding.resident) {
                (true, _) => host.add(&st.shard),
                (false, false) => device.add(&st.shard),
                (false, true) => {}
            }
        }
    }
}

/// A unit's new parameter slice from its master weights: in the slice's dtype, where the
/// slice lives; a copy of its own where the master lives apart in host memory (optimizer
/// offload alone), as on a GPU, on a CPU run too.
fn slice_from_master(unit: &Unit, master: &Tensor) -> Result<Tensor> {
    let (dtype, home) = {
        let st = unit.lock();
        (st.shard.dtype(), st.shard.device().clone())
    };
    let slice = master.to_dtype(dtype)?.to_device(&home)?;
    let apart = unit.holding.host_grads && !unit.holding.host_params;
    Ok(match apart && home.is_cpu() {
        true => slice.copy()?,
        false => slice,
    })
}

/// AdamW over this rank's slices of every unit. With `replicate` (HSDP), gradient slices are
/// also summed across the replicas, which hold the same slices of the model.
pub struct FsdpOptimizer {
    model: Arc<ShardedModel>,
    replicate: Option<Arc<dyn Communicator>>,
    inner: AdamW,
    /// Under tensor parallelism: the parameters each unit's slice covers (by unit name), whose
    /// squared gradients count in the global norm by their split.
    tp_grads: Option<(TpGrads, BTreeMap<String, EntryRanges>)>,
}

impl FsdpOptimizer {
    /// Fills each unit's state with `fill` (its layout, this rank's range of it, the state)
    /// and sets the unit's shard to the new master weights.
    fn set_slices(
        &mut self,
        fill: impl Fn(&FlatLayout, std::ops::Range<usize>, &mut ParamState) -> Result<()>,
    ) -> Result<()> {
        for unit in &self.model.units {
            let st = self.inner.states.get_mut(&unit.name).expect("unit state");
            fill(&unit.layout, unit.range(), st)?;
            unit.replace_shard(slice_from_master(unit, &st.master)?)?;
        }
        Ok(())
    }

    pub fn new(
        model: Arc<ShardedModel>,
        config: AdamWConfig,
        replicate: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        let mut states = BTreeMap::new();
        for unit in &model.units {
            let range = unit.range();
            // fp32 parameters are their own master copy (the same storage), but for optimizer
            // offload without parameter offload, whose master weights live apart in host
            // memory (a copy there, on a CPU run too).
            let mut master = unit.lock().shard.to_dtype(DType::F32)?;
            if unit.holding.host_grads && !unit.holding.host_params {
                master = master.to_device(&candle_core::Device::Cpu)?.copy()?;
            }
            let state = unit.layout.shard_state(master, range)?;
            states.insert(unit.name.clone(), state);
        }
        Ok(FsdpOptimizer {
            model,
            replicate: replicate.filter(|c| c.size() > 1),
            inner: AdamW {
                config,
                step: 0,
                states,
            },
            tp_grads: None,
        })
    }

    /// The parameter names (with the dtype they are held in) in the order
    /// [`Self::for_each_full_unit`] hands them over: unit by unit, each unit's by name.
    /// `names_of` gives the names a unit's parameter stands for once gathered (under expert
    /// parallelism, every rank's expert in its slot).
    pub fn full_order(&self, names_of: impl Fn(&str) -> Vec<String>) -> Vec<(String, DType)> {
        self.model
            .units
            .iter()
            .flat_map(|u| {
                let dtype = u.lock().shard.dtype();
                let mut names: Vec<(String, DType)> = u
                    .layout
                    .entries()
                    .iter()
                    .flat_map(|(n, _, _)| names_of(n))
                    .map(|n| (n, dtype))
                    .collect();
                names.sort_by(|a, b| a.0.cmp(&b.0));
                names
            })
            .collect()
    }

    /// Each unit's whole parameters (in the compute dtype) and, `with_states`, optimizer state
    /// in turn (collective: every rank calls it), handed to `f` and dropped before the next unit is
    /// gathered: a full checkpoint is written with one unit whole at a time beside the slices,
    /// where gathering the whole model first would hold it all.
    pub fn for_each_full_unit(
        &self,
        with_states: bool,
        mut f: impl FnMut(BTreeMap<String, Tensor>, BTreeMap<String, ParamState>) -> Result<()>,
    ) -> Result<()> {
        for unit in &self.model.units {
            let shard = unit.lock().shard.clone();
            let params = unit.layout.unflatten(&unit.comm().all_gather(&shard, 0)?)?;
            let states = match with_states {
                true => unit
                    .layout
                    .gather_states(unit.comm().as_ref(), &self.inner.states[&unit.name])?,
                false => BTreeMap::new(),
            };
            f(params, states)?;
        }
        Ok(())
    }

    /// One update from the gradient slices the backward passes left in the units: (HSDP:
    /// sum across replicas), clip by the global norm, update, and write the new slices back.
    /// Returns the gradient norm before clipping. `first`: the run's first step, which checks
    /// the tensor-parallel plan against the gradients ([`TpGrads::sync_flat`]).
    pub fn step(&mut self, max_grad_norm: f64, lr: f64, first: bool) -> Result<f64> {
        let mut grads = BTreeMap::new();
        let mut local_sq = 0f64;
        for unit in &self.model.units {
            let g = match unit.lock().grad_shard.take() {
                Some(g) => g,
                None => Tensor::zeros(unit.shard_elems(), DType::F32, &unit.grad_device())?,
            };
            let g = match &self.replicate {
                Some(r) => r.all_reduce(&g, ReduceOp::Sum)?,
                None => g,
            };
            // Partial parameters' slices summed over tp.
            let g = match &self.tp_grads {
                Some((tp, units)) => {
                    let entries = &units[&unit.name];
                    let g = tp.sync_flat(&g, entries, first)?;
                    local_sq += tp.weighted_sq(&g, entries)?;
                    g
                }
                None => g,
            };
            grads.insert(unit.name.clone(), g);
        }
        if self.tp_grads.is_none() {
            // Every unit's slice in one pass (one read-back on a GPU).
            local_sq = sums_of_squares(grads.values())?.iter().sum();
        }
        // Every element sits in one slice of the shard group (under expert parallelism, each
        // expert in one slice of the ranks holding it, and those ranks with the ep group make
        // the shard group).
        let shard_comm = self.model.root().comm();
        let sq = Tensor::new(&[local_sq], &candle_core::Device::Cpu)?;
        let sq = shard_comm
            .all_reduce(&sq, ReduceOp::Sum)?
            .to_vec1::<f64>()?[0];
        let norm_sq = match &self.tp_grads {
            Some((tp, _)) => tp.sum(sq)?,
            None => sq,
        };
        let norm = norm_sq.sqrt();
        // A non-finite gradient never reaches the weights.
        if !norm.is_finite() {
            return Ok(norm);
        }
        // The clipping factor rides in the update's pass (no scaled copy of the slices).
        self.inner
            .update_scaled(&grads, lr, clip_coef(norm, max_grad_norm))?;
        // New slices; a resident unit (ZeRO-2) all-gathers its updated parameters at once,
        // as DeepSpeed's step ends (the old ones freed first).
        for unit in &self.model.units {
            let master = &self.inner.states[&unit.name].master;
            unit.replace_shard(slice_from_master(unit, master)?)?;
            if unit.holding.resident {
                unit.gathered(&mut unit.lock())?;
            }
        }
        Ok(norm)
    }

    /// Bytes of the gradient slices kept in host memory between backward and step.
    pub fn host_grad_bytes(&self) -> usize {
        self.model
            .units
            .iter()
            .filter(|u| u.holding.host_grads)
            .map(|u| 4 * u.shard_elems())
            .sum()
    }

    /// Bytes of the gradient slices kept on the device between backward and step (none
    /// when they stream to host memory).
    pub fn grad_bytes(&self) -> usize {
        self.model
            .units
            .iter()
            .filter(|u| !u.holding.host_grads)
            .map(|u| 4 * u.shard_elems())
            .sum()
    }
}

impl ShardedOptimizer for FsdpOptimizer {
    /// The AdamW state of this rank's slices.
    fn state(&self) -> &AdamW {
        &self.inner
    }

    fn state_mut(&mut self) -> &mut AdamW {
        &mut self.inner
    }

    /// Clips by the norm over the tensor-parallel group too (the units hold tp slices).
    fn set_tp_grads(&mut self, norm: TpGrads) -> Result<()> {
        let mut units = BTreeMap::new();
        for unit in &self.model.units {
            units.insert(unit.name.clone(), unit.entry_ranges());
        }
        self.tp_grads = Some((norm, units));
        Ok(())
    }

    /// The whole optimizer state per parameter (collective), as plain DDP keeps it.
    fn gather_full_state(&self) -> Result<AdamW> {
        let mut states = BTreeMap::new();
        for unit in &self.model.units {
            let s = &self.inner.states[&unit.name];
            states.extend(unit.layout.gather_states(unit.comm().as_ref(), s)?);
        }
        Ok(AdamW {
            config: self.inner.config,
            step: self.inner.step,
            states,
        })
    }

    /// Takes this rank's slices of a full per-parameter state (from any world size) and
    /// sets the parameters to its master weights.
    fn load_full_state(&mut self, full: &AdamW) -> Result<()> {
        self.set_slices(|layout, range, st| layout.take_slice(full, range, st))?;
        self.inner.step = full.step;
        Ok(())
    }

    /// This rank's slices of every unit as per-parameter pieces (SHARDED_STATE_DICT).
    fn pieces(&self) -> Result<Vec<Piece>> {
        let mut out = Vec::new();
        for unit in &self.model.units {
            let range = unit.range();
            out.extend(unit.layout.pieces(range, &self.inner.states[&unit.name])?);
        }
        Ok(out)
    }

    /// Reads this rank's slices from a sharded checkpoint (any world size, wrap policy or
    /// strategy wrote it): only the ranges this rank owns are read.
    fn load_sharded(&mut self, reader: &ShardedReader, _params: &Params) -> Result<()> {
        self.set_slices(|layout, range, st| layout.read_slice(reader, range, st))?;
        self.inner.step = reader.optimizer_step;
        Ok(())
    }
}

/// Every unit kept gathered, until dropped ([`ShardedModel::hold_gathered`]).
pub struct HeldGathered<'a>(&'a ShardedModel);

impl Drop for HeldGathered<'_> {
    fn drop(&mut self) {
        for unit in &self.0.units {
            let mut st = unit.lock();
            st.held = false;
            if !unit.keep_gathered {
                st.full = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::InProcessWorld;
    use crate::models::ModelConfig;
    use crate::nn::causal_lm_loss;
    use crate::parallel::CausalLm;
    use candle_core::Device;

    /// The bundled tiny Qwen2: 2 layers of 49,408 parameters each.
    fn tiny() -> (ModelConfig, Params) {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../assets/tiny/model/config.json"
        );
        let cfg = ModelConfig::from_file(dir).unwrap();
        let params = Params::init(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
        (cfg, params)
    }

    /// The tiny model wrapped by `policy` on one rank.
    fn sharded(policy: WrapPolicy) -> (CausalLm, Arc<ShardedModel>) {
        held(policy, Holding::SHARDED)
    }

    fn held(policy: WrapPolicy, holding: Holding) -> (CausalLm, Arc<ShardedModel>) {
        let (cfg, params) = tiny();
        let comm = InProcessWorld::new(1).world(0).unwrap();
        let mut model = CausalLm::new(cfg, params).unwrap();
        model
            .shard((policy, Prefetch::BOTH, holding), comm)
            .unwrap();
        let sharding = model.sharding.clone().unwrap();
        (model, sharding)
    }

    fn batch() -> (Tensor, Tensor, Tensor) {
        let ids = Tensor::new(&[[5u32, 9, 14, 3, 7, 21]], &Device::Cpu).unwrap();
        let pos = Tensor::arange(0i64, 6, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let labels = Tensor::new(&[[5i64, 9, 14, 3, 7, 21]], &Device::Cpu).unwrap();
        (ids, pos, labels)
    }

    #[test]
    fn reduce_buckets_group_layers_up_to_their_size() {
        // Layers of 49,408 parameters: a bucket of 100,000 takes both, one of 60,000 one,
        // and a bucket smaller than a layer still takes the layer whole.
        let units = |b| sharded(WrapPolicy::Buckets(b)).1.units.len();
        assert_eq!(units(100_000), 2, "root + both layers");
        assert_eq!(units(60_000), 3);
        assert_eq!(units(1_000), 3);
        assert_eq!(
            layer_units(&[5, 5, 5, 5], WrapPolicy::Buckets(10)),
            [1, 1, 2, 2]
        );
    }

    /// ZeRO-2 (resident units): parameters stay gathered through forward, backward and
    /// evaluation; each unit's gradients are reduced as backward finishes it, waited for at
    /// once without overlap_comm, so no unit's whole gradients outlive its backward; a new
    /// slice from the update makes the unit gather again, once.
    #[test]
    fn resident_units_stay_gathered_and_reduce_during_backward() {
        let holding = Holding {
            resident: true,
            overlap: false,
            ..Holding::SHARDED
        };
        let (model, sharding) = held(WrapPolicy::PerLayer, holding);
        let (ids, pos, labels) = batch();
        let logits = model.forward(&ids, &pos).unwrap();
        for unit in &sharding.units {
            assert!(unit.lock().full.is_some(), "{} freed", unit.name);
        }
        let loss = causal_lm_loss(&logits, &labels).unwrap().sum;
        loss.backward().unwrap();
        for unit in &sharding.units {
            let st = unit.lock();
            assert!(st.full.is_some(), "{} freed by backward", unit.name);
            assert!(st.reducing.is_none(), "{}: waited at once", unit.name);
            assert!(st.grads.iter().all(Option::is_none), "{}", unit.name);
            assert!(st.grad_shard.is_some(), "{} not reduced", unit.name);
        }
        sharding.finish_backward().unwrap();
        // An evaluation forward keeps them gathered.
        model.forward(&ids, &pos).unwrap();
        assert!(sharding.units.iter().all(|u| u.lock().full.is_some()));
        // An update's new slice: stale until the next use gathers it.
        let unit = &sharding.units[1];
        let slice = unit.lock().shard.clone();
        unit.replace_shard((&slice + 1.0).unwrap()).unwrap();
        assert!(unit.lock().full.is_none());
        model.forward(&ids, &pos).unwrap();
        let full = unit.lock().full.clone().expect("gathered again");
        let want = (slice + 1.0).unwrap();
        let got = full.narrow(0, 0, want.elem_count()).unwrap();
        assert_eq!(
            crate::kernels::testing::max_abs(&(got - want).unwrap()),
            0.0
        );
    }

    /// Offload: parameter slices in host memory, moved for each gather; reduced gradient
    /// slices streamed to host memory. On the CPU each move is a no-op copy, counted.
    #[test]
    fn offloaded_units_count_their_moves() {
        let holding = Holding {
            host_params: true,
            host_grads: true,
            ..Holding::SHARDED
        };
        let (model, sharding) = held(WrapPolicy::PerLayer, holding);
        let (ids, pos, labels) = batch();
        let logits = model.forward(&ids, &pos).unwrap();
        let loss = causal_lm_loss(&logits, &labels).unwrap().sum;
        loss.backward().unwrap();
        sharding.finish_backward().unwrap();
        let bytes: usize = sharding.units.iter().map(|u| 4 * u.shard_elems()).sum();
        let layers: usize = sharding.units[1..]
            .iter()
            .map(|u| 4 * u.shard_elems())
            .sum();
        // Every unit to the device for forward, the layers again for backward (the root
        // stays gathered), and every gradient slice back.
        assert_eq!(sharding.take_moved(), bytes + layers + bytes);
        assert_eq!(sharding.take_moved(), 0);
        for unit in &sharding.units {
            let st = unit.lock();
            assert!(
                st.shard.device().is_cpu() && st.grad_shard.as_ref().unwrap().device().is_cpu()
            );
        }
    }

    #[test]
    fn wrap_policies_group_layers_into_units() {
        let units = |policy| sharded(policy).1.units.len();
        assert_eq!(units(WrapPolicy::PerLayer), 3, "root + one per layer");
        assert_eq!(
            units(WrapPolicy::MinParams(40_000)),
            3,
            "each layer is enough"
        );
        assert_eq!(
            units(WrapPolicy::MinParams(50_000)),
            2,
            "both layers in one unit"
        );
        assert_eq!(units(WrapPolicy::Whole), 1, "everything in the root");
    }

    #[test]
    fn units_are_freed_after_forward_and_reduced_during_backward() {
        let (model, sharding) = sharded(WrapPolicy::PerLayer);
        let (ids, pos, labels) = batch();
        let logits = model.forward(&ids, &pos).unwrap();
        let gathered = |u: &Unit| u.lock().full.is_some();
        assert!(
            gathered(sharding.root()),
            "the root stays gathered for backward"
        );
        for unit in &sharding.units[1..] {
            assert!(
                !gathered(unit),
                "{} kept its parameters after forward",
                unit.name
            );
            assert!(unit.lock().pending > 0);
        }
        let loss = causal_lm_loss(&logits, &labels).unwrap().sum;
        loss.backward().unwrap();
        // Every unit started its reduce-scatter when its last op ran, before finish_backward.
        for unit in &sharding.units {
            let st = unit.lock();
            assert!(st.full.is_none(), "{} still gathered", unit.name);
            assert_eq!(st.pending, 0, "{}", unit.name);
            assert!(st.reducing.is_some(), "{} did not reduce", unit.name);
        }
        sharding.finish_backward().unwrap();
        for unit in &sharding.units {
            let st = unit.lock();
            assert!(st.reducing.is_none() && st.gathering.is_none());
            let g = st.grad_shard.as_ref().expect("reduced gradient slice");
            let largest = crate::kernels::testing::max_abs(g);
            assert!(largest > 0.0, "{} got a zero gradient", unit.name);
        }
    }

    /// Under expert parallelism a layer's experts are a unit of their own that follows its
    /// layer unit: a rank whose experts got no rows (no op on that unit) still gathers and
    /// reduces it with the ranks that ran it, in the same order, so nobody waits; the reduced
    /// gradient is what those ranks gave, the layer unit's every rank's.
    #[test]
    fn an_experts_unit_without_ops_on_a_rank_still_reduces_with_its_layer() {
        let (dense, experts) = (InProcessWorld::new(2), InProcessWorld::new(2));
        let w = |b: f64| {
            Tensor::arange(0f32, 16.0, &Device::Cpu)
                .and_then(|t| t.affine(0.1, b)?.reshape((4, 4)))
                .unwrap()
        };
        let params: BTreeMap<String, Tensor> = [
            ("embed.weight", w(0.0)),
            ("layers.0.attn.weight", w(1.0)),
            ("layers.0.experts.0.weight", w(2.0)),
        ]
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (dense, experts, params) = (dense.clone(), experts.clone(), params.clone());
                std::thread::spawn(move || {
                    let holds = |n: &str| n.contains(".experts.");
                    let sharding = ShardedModel::new(
                        &params,
                        &["layers.0".to_string()],
                        (WrapPolicy::PerLayer, Prefetch::BOTH, Holding::SHARDED),
                        dense.world(rank).unwrap(),
                        Some((&holds, experts.world(rank).unwrap())),
                    )
                    .unwrap();
                    assert_eq!(sharding.units.len(), 3, "root, layer, the layer's experts");
                    let slot = |n: &str| match sharding.weight(n) {
                        Some(Weight::Sharded(s)) => s,
                        _ => panic!("{n} is not in a unit"),
                    };
                    let x =
                        Var::new(&[[1f32, 2., 3., 4.], [0.5, -1., 2., 0.]], &Device::Cpu).unwrap();
                    let _root = sharding.begin_forward().unwrap();
                    let scope = sharding.enter_layer(0).unwrap();
                    let linear = |n: &str| {
                        crate::nn::sharded::linear(x.as_tensor(), &slot(n), None).unwrap()
                    };
                    let mut y = linear("layers.0.attn.weight");
                    // Only rank 0's experts got rows.
                    if rank == 0 {
                        y = (y + linear("layers.0.experts.0.weight")).unwrap();
                    }
                    drop(scope);
                    y.sum_all().unwrap().backward().unwrap();
                    sharding.finish_backward().unwrap();
                    sharding.units[1..]
                        .iter()
                        .map(|u| {
                            let st = u.lock();
                            assert!(st.full.is_none(), "{} still gathered", u.name);
                            let g = st.grad_shard.as_ref().expect("reduced");
                            g.to_vec1::<f32>().unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        // d(sum x W^T) / dW: every row the column sums of x, (1.5, 1, 5, 4); this rank's
        // slice two of the four rows.
        let rows = |times: f32| [1.5f32, 1.0, 5.0, 4.0, 1.5, 1.0, 5.0, 4.0].map(|v| v * times);
        for rank in ranks {
            let got = rank.join().expect("no rank failed or waited forever");
            assert_eq!(got[0], rows(2.0), "the layer: both ranks' gradients");
            assert_eq!(got[1], rows(1.0), "the experts: rank 0's alone");
        }
    }

    #[test]
    fn gathers_are_prefetched_one_unit_ahead() {
        let (_, sharding) = sharded(WrapPolicy::PerLayer);
        let in_flight = |u: usize| sharding.units[u].lock().gathering.is_some();
        let gathered = |u: usize| sharding.units[u].lock().full.is_some();
        let _root = sharding.begin_forward().unwrap();
        assert!(
            in_flight(1),
            "the first layer's gather starts with the forward"
        );
        let scope = sharding.enter_layer(0).unwrap();
        assert!(
            gathered(1) && in_flight(2),
            "entering a layer prefetches the next"
        );
        drop(scope);
        assert!(!gathered(1), "a layer unit is freed when its forward ends");
        let scope = sharding.enter_layer(1).unwrap();
        drop(scope);
        assert!(!gathered(2) && !in_flight(1) && !in_flight(2));
        // Backward starts at the root's LM head, whose first op fetches the last layer unit.
        sharding.root().backward_began();
        assert!(
            in_flight(2),
            "the root's backward prefetches the last layer"
        );
        sharding.finish_backward().unwrap();
        assert!(!in_flight(2), "finish_backward leaves nothing in flight");
    }
}
