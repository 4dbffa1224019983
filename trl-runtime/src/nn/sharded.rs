//! The layer side of ZeRO-3 / FSDP (and ZeRO-2): a weight held as a slot of a wrap unit, a
//! flat parameter vector sharded over the data-parallel group whose full value exists only
//! while the layers using it run (ZeRO-2's resident units keep it; see [`Holding`]). `crate::parallel::fsdp` cuts a model into units and steps their
//! optimizer; this module is what the layers call.
//!
//! The layers that use a unit's parameters (linear, norm scale, embedding lookup) run as custom
//! ops. Forward: the unit's flat parameters are all-gathered when the unit starts and freed when
//! it ends; each op computes from a detached input, so Candle's graph never holds a gathered
//! weight, only activations. Backward: the unit's first op gathers the parameters again, every
//! op accumulates its weight gradients in the unit (beside Candle's gradient store), and once
//! the unit's last op has run the gradients are reduce-scattered into this rank's slice and the
//! gathered parameters freed.

use super::chain::{adapter_product, Chain, Role};
use crate::comm::{CommQueue, Communicator, Pending, ReduceOp};
use crate::error::{Error, Result};
use crate::precomputed::{with_backward3, Backward3, Precomputed, Saved3};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, Var};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// How a unit holds its parameters and gradients between uses: the strategy's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Holding {
    /// The parameters stay gathered (ZeRO-2, FSDP's SHARD_GRAD_OP): only gradients and
    /// optimizer state are sharded, and the unit is gathered again once after each update.
    pub resident: bool,
    /// Reduce-scatters run while the backward goes on (DeepSpeed's overlap_comm; FSDP always);
    /// otherwise each is waited for when it starts, so one unit's gradients exist at a time.
    pub overlap: bool,
    /// The parameter slice lives in host memory and moves to the device for each gather
    /// (fsdp_offload_params, DeepSpeed's offload_param).
    pub host_params: bool,
    /// Reduced gradient slices move to host memory as they arrive, where the update runs
    /// (any offload of the optimizer).
    pub host_grads: bool,
}

impl Holding {
    /// ZeRO-3 / FSDP FULL_SHARD: gathered per use, reductions overlapped, nothing on the host.
    pub const SHARDED: Holding = Holding {
        resident: false,
        overlap: true,
        host_params: false,
        host_grads: false,
    };
}

/// Where each parameter lives in the flat vector.
#[derive(Debug, Clone)]
pub struct FlatLayout {
    entries: Vec<(String, Shape, usize)>,
    total: usize,
    padded: usize,
}

impl FlatLayout {
    /// Parameters in the given order, end to end, padded to a multiple of `world`.
    pub fn from_shapes(shapes: impl IntoIterator<Item = (String, Shape)>, world: usize) -> Self {
        let mut entries = Vec::new();
        let mut offset = 0;
        for (name, shape) in shapes {
            let n = shape.elem_count();
            entries.push((name, shape, offset));
            offset += n;
        }
        FlatLayout {
            entries,
            total: offset,
            padded: offset.div_ceil(world) * world,
        }
    }

    /// (name, shape, offset in the flat vector) of every parameter.
    pub fn entries(&self) -> &[(String, Shape, usize)] {
        &self.entries
    }

    /// Elements with the padding that makes the vector split evenly.
    pub fn padded(&self) -> usize {
        self.padded
    }

    pub fn shard(&self, rank: usize, world: usize) -> Range<usize> {
        let n = self.padded / world;
        rank * n..(rank + 1) * n
    }

    /// The tensors of `map` (by parameter name) end to end in f32, zero-padded.
    pub fn flatten(&self, map: &BTreeMap<String, Tensor>) -> Result<Tensor> {
        let ordered = self
            .entries
            .iter()
            .map(|(name, _, _)| {
                map.get(name).ok_or_else(|| {
                    Error::Candle(candle_core::Error::Msg(format!("no tensor for {name}")))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.flatten_ordered(&ordered)
    }

    /// One tensor per entry, in the layout's order, end to end in f32, zero-padded.
    pub fn flatten_ordered(&self, tensors: &[&Tensor]) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(self.entries.len() + 1);
        for ((name, shape, _), t) in self.entries.iter().zip(tensors) {
            if t.shape() != shape {
                return Err(Error::Candle(candle_core::Error::Msg(format!(
                    "{name}: shape {:?}, expected {shape:?}",
                    t.shape()
                ))));
            }
            parts.push(t.to_dtype(DType::F32)?.flatten_all()?);
        }
        let device = parts
            .first()
            .map(|t| t.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        if self.padded > self.total {
            parts.push(Tensor::zeros(
                self.padded - self.total,
                DType::F32,
                &device,
            )?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Elements `range` of the flat vector, reading each parameter's overlapping part
    /// through `read` (name, first element, count) and zeros for the padding, in f32.
    pub fn read_range(
        &self,
        range: Range<usize>,
        read: &dyn Fn(&str, usize, usize) -> Result<Tensor>,
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let mut parts = Vec::new();
        for (name, shape, offset) in &self.entries {
            let (start, end) = (*offset, offset + shape.elem_count());
            let (a, b) = (range.start.max(start), range.end.min(end));
            if a < b {
                parts.push(read(name, a - start, b - a)?.to_dtype(DType::F32)?);
            }
        }
        let tail = range.end.saturating_sub(range.start.max(self.total));
        if tail > 0 {
            parts.push(Tensor::zeros(tail, DType::F32, device)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The parameters back out of a flat (full, padded or not) vector.
    pub fn unflatten(&self, flat: &Tensor) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for (name, shape, offset) in &self.entries {
            out.insert(
                name.clone(),
                flat.narrow(0, *offset, shape.elem_count())?
                    .reshape(shape)?,
            );
        }
        Ok(out)
    }

    /// The parameters elements `range` of the flat vector cover: each one's part, relative to
    /// the range's start.
    pub fn ranges_in(&self, range: Range<usize>) -> EntryRanges {
        self.entries
            .iter()
            .filter_map(|(name, shape, offset)| {
                let (a, b) = (
                    range.start.max(*offset),
                    range.end.min(offset + shape.elem_count()),
                );
                (a < b).then(|| (name.clone(), a - range.start..b - range.start))
            })
            .collect()
    }

    /// `value(name)` at every element of that parameter (0 in the padding), over the padded
    /// vector.
    pub fn per_element<T: Copy + Default>(&self, value: impl Fn(&str) -> T) -> Vec<T> {
        let mut out = vec![T::default(); self.padded];
        for (name, shape, offset) in &self.entries {
            let v = value(name);
            out[*offset..*offset + shape.elem_count()]
                .iter_mut()
                .for_each(|x| *x = v);
        }
        out
    }
}

/// The parameters a stretch of a flat vector covers, each with its part of the stretch.
pub type EntryRanges = Vec<(String, Range<usize>)>;

pub(crate) struct UnitState {
    /// This rank's slice of the flat parameters, in the model dtype.
    pub(crate) shard: Tensor,
    /// The gathered flat parameters while the unit is in use.
    pub(crate) full: Option<Tensor>,
    /// An all-gather started ahead of use (prefetch).
    pub(crate) gathering: Option<Pending>,
    /// Ops applied in this forward whose backward has not run yet.
    pub(crate) pending: usize,
    /// Full gradients per entry, accumulated during this backward.
    pub(crate) grads: Vec<Option<Tensor>>,
    /// This rank's reduced gradient slice (f32), summed over micro-batches until the step.
    pub(crate) grad_shard: Option<Tensor>,
    /// A reduce-scatter still running; added to `grad_shard` when waited.
    pub(crate) reducing: Option<Pending>,
    /// Set by the unit's first op in backward.
    pub(crate) in_backward: bool,
    /// Per entry: whether a backward has deposited a gradient since the last check.
    pub(crate) got_grad: Vec<bool>,
    /// The parameters are constants (a LoRA base): backward computes no weight gradient and
    /// reduces nothing; the unit is only gathered and freed.
    pub(crate) frozen: bool,
    /// Kept gathered across forwards (a generation round that gathered the whole model once).
    pub(crate) held: bool,
}

/// One wrap unit: a flat parameter vector sharded over `comm`.
pub struct Unit {
    pub name: String,
    pub layout: FlatLayout,
    /// Runs the unit's collectives during forward and backward (shared by the model's units).
    pub(crate) queue: Arc<CommQueue>,
    /// The unit whose backward follows this one's: the previous layer unit, or for the root
    /// (whose LM head runs first in backward) the last layer unit.
    pub(crate) backward_next: OnceLock<Weak<Unit>>,
    /// Under expert parallelism, the same layers' experts: a unit of its own, sharded over
    /// the ranks holding the same experts (this one over all of dp_shard). It follows this
    /// unit, so that every rank runs its collectives in the same order whether or not any
    /// token was routed to its experts: it starts gathering when this unit does, is gathered
    /// when this unit is, freed when this unit is, and reduced when this unit is (its last op
    /// in backward, the layer's first in forward, comes after every expert's).
    pub(crate) experts: OnceLock<Arc<Unit>>,
    /// The root unit (and every resident one) is not freed after its forward.
    pub(crate) keep_gathered: bool,
    pub(crate) holding: Holding,
    /// Bytes moved between host and device memory (parameter slices to the device, gradient
    /// slices to the host) since the last [`Unit::take_moved`].
    pub(crate) moved: AtomicUsize,
    /// A one-element variable the embedding op hangs off, so that Candle's backward reaches
    /// the unit ops even though no parameter is a `Var`.
    pub(crate) anchor: Var,
    pub(crate) state: Mutex<UnitState>,
}

fn failed(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

impl Unit {
    pub(crate) fn lock(&self) -> MutexGuard<'_, UnitState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn start_gather(&self, st: &UnitState) -> Pending {
        if let Some(experts) = self.experts.get() {
            experts.prefetch();
        }
        let shard = st.shard.clone();
        // An offloaded slice goes to the device for the gather (a copy within memory when
        // the run computes on the CPU).
        let device = self.anchor.device().clone();
        if self.holding.host_params {
            self.count_moved(&shard);
        }
        self.queue
            .submit(move |c| c.all_gather(&shard.to_device(&device)?, 0))
    }

    fn count_moved(&self, t: &Tensor) {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        self.moved.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes moved between host and device since the last call.
    pub fn take_moved(&self) -> usize {
        self.moved.swap(0, Ordering::Relaxed)
    }

    /// Where the reduced gradient slice is kept: host memory under offload.
    pub(crate) fn grad_device(&self) -> Device {
        match self.holding.host_grads {
            true => Device::Cpu,
            false => self.anchor.device().clone(),
        }
    }

    /// Sets this rank's slice to `value` and returns the old one; gathered parameters are
    /// stale then (a resident unit gathers again at its next use).
    pub(crate) fn replace_shard(&self, value: Tensor) -> Result<Tensor> {
        self.reset()?;
        let mut st = self.lock();
        st.full = None;
        Ok(std::mem::replace(&mut st.shard, value))
    }

    /// The gathered flat parameters, waiting for a prefetch or gathering now (and its
    /// experts' unit's: gathered whenever this one is, on every rank alike).
    pub(crate) fn gathered(&self, st: &mut UnitState) -> Result<Tensor> {
        if let Some(experts) = self.experts.get() {
            experts.gathered(&mut experts.lock())?;
        }
        if let Some(full) = &st.full {
            return Ok(full.clone());
        }
        let pending = match st.gathering.take() {
            Some(p) => p,
            None => self.start_gather(st),
        };
        let full = pending.wait()?;
        self.hold_gathered(st, full.clone())?;
        Ok(full)
    }

    /// Waits for a gather in flight: a resident unit keeps what it gathered, another drops it.
    pub(crate) fn settle_gather(&self, st: &mut UnitState) -> Result<()> {
        if let Some(p) = st.gathering.take() {
            let full = p.wait()?;
            if self.holding.resident {
                self.hold_gathered(st, full)?;
            }
        }
        Ok(())
    }

    /// Keeps the gathered parameters `full`. A resident unit's slice (on the device) becomes
    /// a view of them, as DeepSpeed's 16-bit partition is of its flat buffer: one copy.
    fn hold_gathered(&self, st: &mut UnitState, full: Tensor) -> Result<()> {
        if self.holding.resident && !self.holding.host_params {
            let r = self.range();
            st.shard = full.narrow(0, r.start, r.len())?;
        }
        st.full = Some(full);
        Ok(())
    }

    /// Starts gathering this unit in the background unless it is gathered or on its way.
    pub(crate) fn prefetch(&self) {
        let mut st = self.lock();
        if st.full.is_none() && st.gathering.is_none() {
            st.gathering = Some(self.start_gather(&st));
        }
    }

    /// Called by each backward op once it has its parameters: the unit's first one starts
    /// gathering the unit whose backward runs next.
    pub(crate) fn backward_began(&self) {
        let first = !std::mem::replace(&mut self.lock().in_backward, true);
        if first {
            if let Some(next) = self.backward_next.get().and_then(Weak::upgrade) {
                next.prefetch();
            }
        }
    }

    /// The full value of entry `i` (gathering the unit if it is not).
    pub(crate) fn weight(&self, i: usize) -> Result<Tensor> {
        let mut st = self.lock();
        let full = self.gathered(&mut st)?;
        drop(st);
        let (_, shape, offset) = &self.layout.entries()[i];
        Ok(full
            .narrow(0, *offset, shape.elem_count())?
            .reshape(shape)?)
    }

    /// Starts this unit's forward: its parameters are gathered until `UnitScope` drops.
    pub fn enter(&self) -> Result<UnitScope<'_>> {
        let mut st = self.lock();
        self.gathered(&mut st)?;
        Ok(UnitScope(self))
    }

    /// Clears what a previous forward left (an evaluation forward has no backward); a
    /// resident unit keeps its gathered parameters.
    pub(crate) fn reset(&self) -> Result<()> {
        let mut st = self.lock();
        if !self.holding.resident && !st.held {
            st.full = None;
        }
        self.settle_gather(&mut st)?;
        st.pending = 0;
        st.in_backward = false;
        st.grads.iter_mut().for_each(|g| *g = None);
        Ok(())
    }

    /// Adds gradients of one op's entries; after the unit's last op, reduce-scatters.
    pub(crate) fn deposit(&self, grads: Vec<(usize, Tensor)>) -> Result<()> {
        let mut st = self.lock();
        for (i, g) in grads {
            // Detached: a weight gradient computed from the op's input carries that input's
            // graph (under checkpointing, the whole recomputed layer), which would live on in
            // the unit's gradients and its reduce-scatter, freed at a time that depends on the
            // communication.
            let g = g.detach();
            st.got_grad[i] = true;
            st.grads[i] = Some(match st.grads[i].take() {
                Some(prev) => (prev + g)?,
                None => g,
            });
        }
        st.pending = st.pending.saturating_sub(1);
        if st.pending == 0 {
            self.finish(&mut st)?;
        }
        Ok(())
    }

    /// Reduce-scatters the unit's full gradients into the slice this rank keeps (and its
    /// experts' unit's, which waits for it).
    pub(crate) fn finish(&self, st: &mut UnitState) -> Result<()> {
        if let Some(experts) = self.experts.get() {
            experts.deposit(Vec::new())?;
        }
        if !self.holding.resident {
            st.full = None;
        }
        if st.frozen {
            return Ok(());
        }
        let device = st.shard.device().clone();
        let grads = self
            .layout
            .entries()
            .iter()
            .zip(st.grads.iter_mut())
            .map(|((_, shape, _), g)| match g.take() {
                Some(g) => Ok(g),
                None => Tensor::zeros(shape, DType::F32, &device),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let flat = self
            .layout
            .flatten_ordered(&grads.iter().collect::<Vec<_>>())?;
        drop(grads);
        self.collect_reduced(st)?;
        st.reducing = Some(
            self.queue
                .submit(move |c| c.reduce_scatter(&flat, 0, ReduceOp::Sum)),
        );
        if !self.holding.overlap {
            self.collect_reduced(st)?;
        }
        Ok(())
    }

    /// Waits for a running reduce-scatter and adds its slice to the step's gradient (in host
    /// memory under offload: the slice is streamed out as it arrives).
    pub(crate) fn collect_reduced(&self, st: &mut UnitState) -> Result<()> {
        if let Some(p) = st.reducing.take() {
            let mut mine = p.wait()?;
            if self.holding.host_grads {
                self.count_moved(&mine);
                mine = mine.to_device(&Device::Cpu)?;
            }
            st.grad_shard = Some(match st.grad_shard.take() {
                Some(prev) => (prev + mine)?,
                None => mine,
            });
        }
        Ok(())
    }

    pub(crate) fn comm(&self) -> &Arc<dyn Communicator> {
        self.queue.comm()
    }

    /// The range of the flat vector this rank holds.
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
        self.layout.shard(self.comm().rank(), self.comm().size())
    }

    pub(crate) fn shard_elems(&self) -> usize {
        self.layout.padded() / self.comm().size()
    }

    /// The parameters this rank's slice covers: (name, element range within the slice).
    pub fn entry_ranges(&self) -> EntryRanges {
        self.layout.ranges_in(self.range())
    }

    /// The parameters of this unit that no backward reached since the last call (their
    /// gradient was taken as zero).
    pub fn take_without_grad(&self) -> Vec<String> {
        let mut st = self.lock();
        if st.frozen {
            return Vec::new();
        }
        let out = self
            .layout
            .entries()
            .iter()
            .zip(&st.got_grad)
            .filter(|(_, got)| !**got)
            .map(|((name, _, _), _)| name.clone())
            .collect();
        st.got_grad.iter_mut().for_each(|g| *g = false);
        out
    }
}

/// Frees the unit's gathered parameters when its forward ends (not for the root).
pub struct UnitScope<'a>(pub(crate) &'a Unit);

impl Drop for UnitScope<'_> {
    fn drop(&mut self) {
        for unit in std::iter::once(self.0).chain(self.0.experts.get().map(|e| &**e)) {
            let mut st = unit.lock();
            if !unit.keep_gathered && !st.held {
                st.full = None;
            }
        }
    }
}

/// A parameter's place in a unit.
#[derive(Clone)]
pub struct ShardedWeight {
    pub(crate) unit: Arc<Unit>,
    pub(crate) entry: usize,
}

impl ShardedWeight {
    pub fn dims(&self) -> &[usize] {
        self.unit.layout.entries()[self.entry].1.dims()
    }

    /// The compute dtype (the unit's).
    pub fn dtype(&self) -> DType {
        self.unit.lock().shard.dtype()
    }

    /// Where the unit computes (its slice may be on the host, offloaded).
    pub fn device(&self) -> Device {
        self.unit.anchor.device().clone()
    }
}

enum OpKind {
    /// With the ops around it (`nn::chain`; `Chain::default()`: none), but a residual add.
    Linear {
        weight: usize,
        bias: Option<usize>,
        chain: Chain,
    },
    Scale {
        weight: usize,
    },
    Bias {
        weight: usize,
    },
    Embedding {
        weight: usize,
        ids: Tensor,
    },
    /// The weight itself (a parameter used as a tensor, `nn::Param`).
    Whole {
        weight: usize,
    },
    /// A mixture of experts' grouped linear layer (`kernels::grouped`).
    Grouped {
        weight: usize,
        bias: Option<usize>,
        counts: Vec<usize>,
        layout: crate::kernels::grouped::ExpertLayout,
    },
}

/// A layer computation on a unit's parameters whose backward fetches them again.
struct UnitOp {
    unit: Arc<Unit>,
    kind: OpKind,
    /// The forward result, computed outside the op from detached inputs (taken by `cpu_fwd`).
    out: Precomputed,
}

impl CustomOp1 for UnitOp {
    fn name(&self) -> &'static str {
        "fsdp-unit-op"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.take("an fsdp unit op")
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.out.take_cuda("an fsdp unit op")
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let unit = &self.unit;
        let fetch = |i: usize| {
            let w = unit.weight(i).map_err(failed)?;
            unit.backward_began();
            Ok::<_, candle_core::Error>(w)
        };
        // A frozen unit (a LoRA base) passes the input gradient on and computes no weight
        // gradient.
        let train = !unit.lock().frozen;
        let mut grads = Vec::new();
        let dx = match &self.kind {
            OpKind::Linear {
                weight,
                bias,
                chain,
            } => {
                let w = fetch(*weight)?;
                let [dx] = chain_grads(
                    &w,
                    (*weight, *bias),
                    train,
                    chain,
                    [(Role::X, arg)],
                    grad,
                    &mut grads,
                )?;
                dx.expect("the input's gradient is asked for")
            }
            OpKind::Scale { weight } => {
                let w = fetch(*weight)?;
                if train {
                    let h = w.elem_count();
                    let dw = crate::kernels::fused::sum_rows(&(grad * arg)?.reshape(((), h))?)?;
                    grads.push((*weight, dw));
                }
                grad.broadcast_mul(&w)?
            }
            OpKind::Bias { weight } => {
                let b = fetch(*weight)?;
                if train {
                    let db = crate::kernels::fused::sum_rows(&grad.reshape(((), b.elem_count()))?)?;
                    grads.push((*weight, db));
                }
                grad.clone()
            }
            OpKind::Embedding { weight, ids } => {
                unit.backward_began();
                if train {
                    let shape = unit.layout.entries()[*weight].1.clone();
                    let g2 = grad.reshape(((), shape.dims()[1]))?;
                    let dw =
                        Tensor::zeros(&shape, g2.dtype(), g2.device())?.index_add(ids, &g2, 0)?;
                    grads.push((*weight, dw));
                }
                arg.zeros_like()?
            }
            OpKind::Grouped {
                weight,
                bias,
                counts,
                layout,
            } => {
                let w = fetch(*weight)?;
                let wanted = (train, train && bias.is_some());
                let (dx, dw, db) =
                    crate::kernels::grouped::backward(arg, (&w, *layout), grad, counts, wanted)?;
                grads.extend(dw.map(|dw| (*weight, dw)));
                grads.extend(bias.zip(db));
                dx
            }
            OpKind::Whole { weight } => {
                unit.backward_began();
                if train {
                    grads.push((*weight, grad.clone()));
                }
                arg.zeros_like()?
            }
        };
        unit.deposit(grads).map_err(failed)?;
        Ok(Some(dx))
    }
}

/// The backward of a LoRA layer on a unit's (frozen) weight, one op on `x`, the adapter's
/// rank-r hidden `h` and its B ([`Chain::linear_with_adapter`]'s way): the graph keeps `h`,
/// not the base's output or the adapter's [rows, out] product.
struct AdaptedUnitLinear {
    unit: Arc<Unit>,
    weight: usize,
    bias: Option<usize>,
    chain: Chain,
}

impl Backward3 for AdaptedUnitLinear {
    const NAME: &'static str = "fsdp-unit-adapted-linear";

    fn backward(&self, s: &Saved3) -> candle_core::Result<[Option<Tensor>; 3]> {
        let unit = &self.unit;
        let w = unit.weight(self.weight).map_err(failed)?;
        unit.backward_began();
        let train = !unit.lock().frozen;
        let [x, h, up] = &s.inputs;
        let inputs = [(Role::X, x), (Role::Hidden, h), (Role::Up, up)];
        let mut grads = Vec::new();
        let d = chain_grads(
            &w,
            (self.weight, self.bias),
            train,
            &self.chain,
            inputs,
            &s.dout,
            &mut grads,
        )?;
        unit.deposit(grads).map_err(failed)?;
        Ok(d)
    }
}

/// The backward of a linear chain on a unit's weight `w` (entry `weight`, and `bias`'s):
/// the gradients of `inputs` (each takes one), and with `train` the weight's and the
/// bias's pushed onto `weight_grads` for the unit.
fn chain_grads<const N: usize>(
    w: &Tensor,
    (weight, bias): (usize, Option<usize>),
    train: bool,
    chain: &Chain,
    inputs: [(Role, &Tensor); N],
    dout: &Tensor,
    weight_grads: &mut Vec<(usize, Tensor)>,
) -> candle_core::Result<[Option<Tensor>; N]> {
    let mut all: Vec<_> = inputs.iter().map(|&(role, t)| (role, t, true)).collect();
    all.push((Role::W, w, train));
    all.push((Role::Bias, w, train && bias.is_some()));
    let mut grads = chain.grads(w, &all, dout)?;
    let (db, dw) = (grads.pop().flatten(), grads.pop().flatten());
    weight_grads.extend(dw.map(|dw| (weight, dw)));
    weight_grads.extend(bias.zip(db));
    <[_; N]>::try_from(grads)
        .map_err(|_| candle_core::Error::Msg(format!("{N} input gradients expected")))
}

thread_local! {
    /// Set while activation checkpointing recomputes a layer in backward.
    static RECOMPUTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (a layer recomputed in backward by activation checkpointing): its unit ops were
/// counted when the layer first ran, and their backward passes are the ones that count down.
pub fn recomputing<T>(f: impl FnOnce() -> T) -> T {
    let before = RECOMPUTING.with(|r| r.replace(true));
    let out = f();
    RECOMPUTING.with(|r| r.set(before));
    out
}

/// Counts an op of `unit` whose backward is to come (not again for a recomputed layer's).
fn count_pending(unit: &Unit) {
    if !RECOMPUTING.with(|r| r.get()) {
        unit.lock().pending += 1;
    }
}

fn apply(arg: &Tensor, unit: &Arc<Unit>, kind: OpKind, y: Tensor) -> candle_core::Result<Tensor> {
    count_pending(unit);
    arg.apply_op1(UnitOp {
        unit: unit.clone(),
        kind,
        out: Precomputed::new(y),
    })
}

/// A layer's weight and bias from their unit (which must be the same), gathered.
fn weight_and_bias(
    w: &ShardedWeight,
    b: Option<&ShardedWeight>,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let weight = w.unit.weight(w.entry).map_err(failed)?;
    let Some(b) = b else {
        return Ok((weight, None));
    };
    if !Arc::ptr_eq(&w.unit, &b.unit) {
        candle_core::bail!("a layer's weight and bias must be in the same wrap unit");
    }
    Ok((weight, Some(b.unit.weight(b.entry).map_err(failed)?)))
}

/// The whole (gathered) value of a unit's weight, detached: for what reads a weight without
/// differentiating through it (DoRA's weight norm).
pub fn gathered(w: &ShardedWeight) -> candle_core::Result<Tensor> {
    Ok(w.unit.weight(w.entry).map_err(failed)?.detach())
}

/// `x W^T + b` on a unit's parameters.
pub fn linear(
    x: &Tensor,
    w: &ShardedWeight,
    b: Option<&ShardedWeight>,
) -> candle_core::Result<Tensor> {
    linear_chain(x, w, b, &Chain::default())
}

/// `x` through `chain` around `x W^T + b` on a unit's parameters, as one op ([`Chain`];
/// not its residual: the unit's op has one input).
pub fn linear_chain(
    x: &Tensor,
    w: &ShardedWeight,
    b: Option<&ShardedWeight>,
    chain: &Chain,
) -> candle_core::Result<Tensor> {
    if chain.residual.is_some() {
        candle_core::bail!("a unit's linear op adds no residual");
    }
    let (weight, bias) = weight_and_bias(w, b)?;
    let y = chain.compute(x, &weight, bias.as_ref(), None)?;
    let kind = OpKind::Linear {
        weight: w.entry,
        bias: b.map(|b| b.entry),
        chain: chain.clone(),
    };
    apply(x, &w.unit, kind, y)
}

/// A LoRA layer on a unit's parameters: `x` through `chain` around `x W^T + b + h B^T`
/// (`h` the adapter's scaled rank-r hidden, `up` its B), as one op on `x`, `h` and `up`
/// (not with a residual or merged heads: those take the unchained path).
pub fn linear_with_adapter(
    x: &Tensor,
    (w, b): (&ShardedWeight, Option<&ShardedWeight>),
    chain: &Chain,
    (h, up): (&Tensor, &Tensor),
) -> candle_core::Result<Tensor> {
    if chain.residual.is_some() || chain.merge_heads {
        candle_core::bail!("a unit's adapted linear op takes no residual and no merged heads");
    }
    let (weight, bias) = weight_and_bias(w, b)?;
    // The product is freed before the op copies `y`.
    let added = adapter_product(&h.detach(), &up.detach())?;
    let y = chain.compute(x, &weight, bias.as_ref(), Some(&added))?;
    drop(added);
    count_pending(&w.unit);
    let backward = AdaptedUnitLinear {
        unit: w.unit.clone(),
        weight: w.entry,
        bias: b.map(|b| b.entry),
        chain: chain.clone(),
    };
    with_backward3(x, h, up, y, backward)
}

/// `x * w` broadcast over the last dimension (a norm's weight).
pub fn scale(x: &Tensor, w: &ShardedWeight) -> candle_core::Result<Tensor> {
    let weight = w.unit.weight(w.entry).map_err(failed)?;
    let y = x.detach().broadcast_mul(&weight)?;
    apply(x, &w.unit, OpKind::Scale { weight: w.entry }, y)
}

/// `x + b` broadcast over the last dimension (a row-parallel layer's bias, added after the
/// tensor-parallel sum).
pub fn add_bias(x: &Tensor, b: &ShardedWeight) -> candle_core::Result<Tensor> {
    let bias = b.unit.weight(b.entry).map_err(failed)?;
    let y = crate::kernels::fused::add_bias(&x.detach(), &bias)?;
    apply(x, &b.unit, OpKind::Bias { weight: b.entry }, y)
}

/// Rows `ids` (u32, flat) of an embedding table: [n, hidden].
pub fn embedding(ids: &Tensor, w: &ShardedWeight) -> candle_core::Result<Tensor> {
    let table = w.unit.weight(w.entry).map_err(failed)?;
    let y = table.index_select(ids, 0)?;
    let kind = OpKind::Embedding {
        weight: w.entry,
        ids: ids.clone(),
    };
    apply(w.unit.anchor.as_tensor(), &w.unit, kind, y)
}

/// A unit's weight whole, as a tensor of the graph whose gradient goes to the unit (a
/// parameter used as a tensor: attention sinks).
pub fn whole(w: &ShardedWeight) -> candle_core::Result<Tensor> {
    // A view of the gathered vector: the op's output is its own copy already (`Precomputed`).
    let y = w.unit.weight(w.entry).map_err(failed)?;
    let kind = OpKind::Whole { weight: w.entry };
    apply(w.unit.anchor.as_tensor(), &w.unit, kind, y)
}

/// A mixture of experts' grouped linear layer on a unit's parameters (see
/// `nn::grouped::grouped_linear`).
pub fn grouped_linear(
    x: &Tensor,
    (w, layout): (&ShardedWeight, crate::kernels::grouped::ExpertLayout),
    b: Option<&ShardedWeight>,
    counts: &[usize],
) -> candle_core::Result<Tensor> {
    let (weight, bias) = weight_and_bias(w, b)?;
    let y =
        crate::kernels::grouped::forward(&x.detach(), (&weight, layout), bias.as_ref(), counts)?;
    let kind = OpKind::Grouped {
        weight: w.entry,
        bias: b.map(|b| b.entry),
        counts: counts.to_vec(),
        layout,
    };
    apply(x, &w.unit, kind, y)
}
