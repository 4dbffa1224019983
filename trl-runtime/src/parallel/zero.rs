//! ZeRO stages 1 and 2 (DeepSpeed's names; FSDP's SHARD_GRAD_OP is stage 2): the fp32 master
//! weights and Adam moments are split over the data-parallel group, each rank updating only
//! its slice of the flattened parameters, then the updated parameters are all-gathered.
//! The gradients a trainer accumulated whole are reduce-scattered at the step, a bucket at a
//! time. This optimizer serves ZeRO-1, and ZeRO-2 over LoRA adapters (whole beside a frozen
//! base); ZeRO-2 of a whole model reduces during backward in resident units (`super::fsdp`).
//!
//! The flat layout is every parameter, sorted by name, end to end, padded to a multiple of the
//! group size. Checkpoints gather the state back per parameter (the same file as plain DDP),
//! so a run can resume on any number of ranks and with any strategy.

use super::expert::{entries_sq, sharded_norm_sq, sum_dense_over, DenseAndExperts, ExpertPlan};
use super::sharded_optimizer::ShardedOptimizer;
use super::sharded_state::{self, Piece, ShardedReader};
use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::models::Params;
use crate::nn::sharded::EntryRanges;
pub use crate::nn::sharded::FlatLayout;
use crate::optim::{clip_coef, decays, sums_of_squares, AdamW, AdamWConfig, ParamState};
use crate::tp::TpGrads;
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    One,
    Two,
}

impl ZeroStage {
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
        }
    }
}

const SHARD: &str = "zero_shard";

// The flat layout itself is the layer side's (`nn::sharded`); what the optimizer keeps per
// slice of it is here.
impl FlatLayout {
    pub fn new(params: &Params, world: usize) -> Self {
        Self::from_shapes(
            params.iter().map(|(n, v)| (n.clone(), v.shape().clone())),
            world,
        )
    }

    /// 1 where weight decay applies (HF's rule per parameter), 0 elsewhere and in the padding:
    /// a byte per element.
    fn decay_mask(&self) -> Vec<u8> {
        self.per_element(|name| decays(name) as u8)
    }

    /// Fresh AdamW state for the slice `range` whose master weights are `master` (f32).
    pub(crate) fn shard_state(&self, master: Tensor, range: Range<usize>) -> Result<ParamState> {
        let mask = self.decay_mask()[range.clone()].to_vec();
        let device = master.device().clone();
        Ok(ParamState {
            exp_avg: master.zeros_like()?,
            exp_avg_sq: master.zeros_like()?,
            master,
            decay: true,
            decay_mask: Some(Tensor::from_vec(mask, range.len(), &device)?),
        })
    }

    /// The per-parameter states of the whole vector from every rank's slice `s` (collective).
    pub(crate) fn gather_states(
        &self,
        comm: &dyn Communicator,
        s: &ParamState,
    ) -> Result<BTreeMap<String, ParamState>> {
        let gather = |t: &Tensor| -> Result<BTreeMap<String, Tensor>> {
            self.unflatten(&comm.all_gather(t, 0)?)
        };
        let (master, m, v) = (
            gather(&s.master)?,
            gather(&s.exp_avg)?,
            gather(&s.exp_avg_sq)?,
        );
        Ok(master
            .into_iter()
            .map(|(name, master)| {
                let st = ParamState {
                    exp_avg: m[&name].clone(),
                    exp_avg_sq: v[&name].clone(),
                    decay: decays(&name),
                    decay_mask: None,
                    master,
                };
                (name, st)
            })
            .collect())
    }

    /// This rank's slice `range` as per-parameter pieces (SHARDED_STATE_DICT).
    pub(crate) fn pieces(&self, range: Range<usize>, state: &ParamState) -> Result<Vec<Piece>> {
        sharded_state::flat_pieces(self.entries(), range, state)
    }

    /// Replaces `into`'s master and moments with the slice `range` read from a sharded
    /// checkpoint written by any world size and strategy.
    pub(crate) fn read_slice(
        &self,
        reader: &ShardedReader,
        range: Range<usize>,
        into: &mut ParamState,
    ) -> Result<()> {
        let read =
            |kind| sharded_state::read_flat_slice(reader, self.entries(), range.clone(), kind);
        into.master = read(0)?.to_device(into.master.device())?;
        into.exp_avg = read(1)?.to_device(into.master.device())?;
        into.exp_avg_sq = read(2)?.to_device(into.master.device())?;
        Ok(())
    }

    /// Replaces `into`'s master and moments with the slice `range` of a full per-parameter
    /// state (saved by any world size and strategy).
    pub(crate) fn take_slice(
        &self,
        full: &AdamW,
        range: Range<usize>,
        into: &mut ParamState,
    ) -> Result<()> {
        let pick = |f: &dyn Fn(&ParamState) -> Tensor| -> Result<Tensor> {
            let mut map = BTreeMap::new();
            for (name, _, _) in self.entries() {
                let s = full.states.get(name).ok_or_else(|| Error::Config {
                    file: "optimizer state".into(),
                    key: name.clone(),
                    message: "missing: the checkpoint does not match this model".into(),
                })?;
                map.insert(name.clone(), f(s));
            }
            Ok(self
                .flatten(&map)?
                .narrow(0, range.start, range.len())?
                .force_contiguous()?
                .detach())
        };
        into.master = pick(&|s| s.master.clone())?;
        into.exp_avg = pick(&|s| s.exp_avg.clone())?;
        into.exp_avg_sq = pick(&|s| s.exp_avg_sq.clone())?;
        Ok(())
    }
}

/// AdamW over this rank's slice of the flattened parameters.
pub struct ZeroOptimizer {
    pub stage: ZeroStage,
    layout: FlatLayout,
    comm: Arc<dyn Communicator>,
    /// HSDP: the replicas holding the same slices, across which reduced slices are summed.
    replicate: Option<Arc<dyn Communicator>>,
    range: Range<usize>,
    /// Elements reduced per collective (DeepSpeed's reduce_bucket_size).
    bucket: usize,
    inner: AdamW,
    /// Under tensor parallelism: how the slice's squared gradients count in the global norm
    /// (per element of this rank's range).
    tp_grads: Option<(TpGrads, EntryRanges)>,
    /// Under expert parallelism (the state sharded over the ranks holding the same experts):
    /// the ep group, over which the dense parameters' slice is summed and the experts'
    /// squares add up, and the slice's parameters split into (dense, experts).
    experts: Option<(Arc<dyn Communicator>, DenseAndExperts)>,
}

impl ZeroOptimizer {
    /// `comm` is the group the state is sharded over (dp_shard); `replicate` the dp_replicate
    /// group when there is more than one replica (HSDP), else `None`.
    pub fn new(
        params: &Params,
        config: AdamWConfig,
        stage: ZeroStage,
        comm: Arc<dyn Communicator>,
        replicate: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        let layout = FlatLayout::new(params, comm.size());
        let range = layout.shard(comm.rank(), comm.size());
        let values: BTreeMap<String, Tensor> = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let master = layout
            .flatten(&values)?
            .narrow(0, range.start, range.len())?
            // A copy of the slice alone: `copy()` would keep the whole flat vector alive.
            .force_contiguous()?
            .detach();
        let state = layout.shard_state(master, range.clone())?;
        let inner = AdamW {
            config,
            step: 0,
            states: [(SHARD.to_string(), state)].into(),
        };
        Ok(ZeroOptimizer {
            stage,
            layout,
            comm,
            replicate: replicate.filter(|c| c.size() > 1),
            range,
            bucket: super::DEEPSPEED_REDUCE_BUCKET,
            inner,
            tp_grads: None,
            experts: None,
        })
    }

    /// The same optimizer over parameters holding this rank's share of the experts (expert
    /// parallelism, `comm` the ranks holding the same share): the dense parameters' slice is
    /// summed over `ep` too, and the experts' squares over it for the norm.
    pub fn with_experts(mut self, plan: &ExpertPlan, ep: Arc<dyn Communicator>) -> Self {
        let entries = plan.dense_and_experts(self.layout.ranges_in(self.range.clone()));
        self.experts = Some((ep, entries));
        self
    }

    /// Reduces at most `elements` gradient elements per collective.
    pub fn with_bucket(mut self, elements: usize) -> Self {
        self.bucket = elements.max(1);
        self
    }

    /// This rank's slice of the reduced gradients, a bucket at a time: bucket k holds the k-th
    /// stretch of every rank's slice, flattened from `grads` as it is sent, so no flat copy of
    /// every gradient exists (DeepSpeed's reduce_bucket_size). Both stages reduce-scatter
    /// (DeepSpeed's `reduce_scatter: true`): a rank updates only its slice; stage 1 differs in
    /// holding whole gradients over the step's micro-batches.
    fn reduce_in_buckets(&self, grads: &BTreeMap<String, Tensor>) -> Result<Tensor> {
        let world = self.comm.size();
        let per_rank = self.range.len();
        let stretch = (self.bucket / world).max(1);
        let device = grads
            .values()
            .next()
            .map_or(candle_core::Device::Cpu, |t| t.device().clone());
        let read = |name: &str, start: usize, len: usize| -> Result<Tensor> {
            match grads.get(name) {
                Some(g) => Ok(g.flatten_all()?.narrow(0, start, len)?),
                None => Ok(Tensor::zeros(len, candle_core::DType::F32, &device)?),
            }
        };
        let mut mine = Vec::new();
        let mut at = 0;
        while at < per_rank {
            let len = stretch.min(per_rank - at);
            let parts = (0..world)
                .map(|r| {
                    let start = r * per_rank + at;
                    self.layout.read_range(start..start + len, &read, &device)
                })
                .collect::<Result<Vec<_>>>()?;
            let flat = Tensor::cat(&parts, 0)?;
            drop(parts);
            mine.push(self.comm.reduce_scatter(&flat, 0, ReduceOp::Sum)?);
            at += len;
        }
        Ok(match mine.len() {
            1 => mine.pop().expect("one bucket"),
            _ => Tensor::cat(&mine, 0)?,
        })
    }

    /// Ranks the state is split over.
    pub fn shard_size(&self) -> usize {
        self.comm.size()
    }

    /// One update from this rank's local gradients (summed over its micro-batches, not yet
    /// reduced): reduce, clip by the global norm, update the slice, all-gather the parameters.
    /// Returns the gradient norm before clipping.
    pub fn step(
        &mut self,
        params: &Params,
        grads: &BTreeMap<String, Tensor>,
        max_grad_norm: f64,
        lr: f64,
    ) -> Result<f64> {
        let shard = self.reduce_in_buckets(grads)?;
        let shard_device = &shard.device().clone();
        let mut shard = match &self.replicate {
            Some(r) => r.all_reduce(&shard, ReduceOp::Sum)?,
            None => shard,
        };
        let tp = self.tp_grads.as_ref().map(|(tp, _)| tp);
        let norm_sq = match &self.experts {
            Some((ep, parts)) => {
                // The dense parameters' parts summed over ep: its ranks hold the same ones.
                shard = sum_dense_over(ep, shard, parts)?;
                let local = (
                    entries_sq(&shard, &parts.0, tp)?,
                    entries_sq(&shard, &parts.1, tp)?,
                );
                sharded_norm_sq(local, self.comm.as_ref(), tp, Some(ep))?
            }
            None => {
                let local_sq = match &self.tp_grads {
                    Some((tp, entries)) => tp.weighted_sq(&shard, entries)?,
                    None => sums_of_squares([&shard])?[0],
                };
                let local_sq = Tensor::new(&[local_sq], shard.device())?;
                let norm_sq = self
                    .comm
                    .all_reduce(&local_sq, ReduceOp::Sum)?
                    .to_vec1::<f64>()?[0];
                match tp {
                    Some(tp) => tp.sum(norm_sq)?,
                    None => norm_sq,
                }
            }
        };
        let norm = norm_sq.sqrt();
        // A non-finite gradient never reaches the weights.
        if !norm.is_finite() {
            return Ok(norm);
        }
        // The clipping factor rides in the update's pass (no scaled copy of the slice).
        self.inner.update_scaled(
            &[(SHARD.to_string(), shard)].into(),
            lr,
            clip_coef(norm, max_grad_norm),
        )?;
        // Gathered on the compute device (the state may live in host memory).
        let master = self.inner.states[SHARD].master.to_device(shard_device)?;
        let full = self.comm.all_gather(&master, 0)?;
        for (name, t) in self.layout.unflatten(&full)? {
            if let Some(var) = params.get(&name) {
                var.set(&t.to_dtype(var.dtype())?)?;
            }
        }
        Ok(norm)
    }
}

impl ShardedOptimizer for ZeroOptimizer {
    /// Clips by the norm over the tensor-parallel group too (the parameters are tp slices).
    fn set_tp_grads(&mut self, norm: TpGrads) -> Result<()> {
        let entries = self.layout.ranges_in(self.range.clone());
        self.tp_grads = Some((norm, entries));
        Ok(())
    }

    /// The AdamW state of this rank's slices.
    fn state(&self) -> &AdamW {
        &self.inner
    }

    fn state_mut(&mut self) -> &mut AdamW {
        &mut self.inner
    }

    /// The whole optimizer state per parameter (collective: every rank must call it), in the
    /// form plain DDP keeps it, for checkpoints.
    fn gather_full_state(&self) -> Result<AdamW> {
        Ok(AdamW {
            config: self.inner.config,
            step: self.inner.step,
            states: self
                .layout
                .gather_states(self.comm.as_ref(), &self.inner.states[SHARD])?,
        })
    }

    /// Takes this rank's slice of a full per-parameter state (from any world size).
    fn load_full_state(&mut self, full: &AdamW) -> Result<()> {
        let st = self.inner.states.get_mut(SHARD).expect("shard state");
        self.layout.take_slice(full, self.range.clone(), st)?;
        self.inner.step = full.step;
        Ok(())
    }

    /// This rank's slice of the parameters' state as pieces (SHARDED_STATE_DICT).
    fn pieces(&self) -> Result<Vec<Piece>> {
        self.layout
            .pieces(self.range.clone(), &self.inner.states[SHARD])
    }

    /// Takes this rank's slice from a sharded checkpoint and sets the parameters to it
    /// (collective: the slices are all-gathered).
    fn load_sharded(&mut self, reader: &ShardedReader, params: &Params) -> Result<()> {
        let st = self.inner.states.get_mut(SHARD).expect("shard state");
        self.layout.read_slice(reader, self.range.clone(), st)?;
        self.inner.step = reader.optimizer_step;
        let full = self.comm.all_gather(&st.master, 0)?;
        for (name, t) in self.layout.unflatten(&full)? {
            if let Some(var) = params.get(&name) {
                var.set(&t.to_dtype(var.dtype())?)?;
            }
        }
        Ok(())
    }
}
