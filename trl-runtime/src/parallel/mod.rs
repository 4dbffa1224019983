//! The parallel training strategies, one file each, and the one function that composes them.
//!
//! [`parallelize`] applies them in a fixed order, as torchtitan's `parallelize` does:
//! tensor parallelism (`crate::tp`, each rank keeps its slices) -> expert parallelism
//! ([`expert`], each rank keeps its share of the experts) -> sequence split (ring
//! attention over cp, Ulysses over sp) -> activation checkpointing ([`checkpointing`]) ->
//! data parallelism: [`ddp`] (replicated, bucketed all-reduce), [`zero`] (ZeRO-1/2: optimizer
//! state and gradients sharded) or [`fsdp`] (ZeRO-3 / FSDP: parameters too), with the
//! optimizer state in host memory when [`offload`] asks for it.

pub mod build;
pub mod checkpointing;
pub mod ddp;
pub mod estimate;
pub mod expert;
pub mod fsdp;
pub mod generate;
pub mod model;
pub mod offload;
pub mod sharded_optimizer;
pub mod sharded_state;
pub mod zero;

pub use build::{build, build_frozen, Built};
pub use checkpointing::Checkpointing;
pub use fsdp::{FsdpOptimizer, Holding, Prefetch, ShardedModel, WrapPolicy};
pub use generate::GatherMode;
pub use model::{CausalLm, Model, TokenLogps};
pub use sharded_optimizer::ShardedOptimizer;
pub use zero::{ZeroOptimizer, ZeroStage};

use crate::config::launch::{
    DistributedType, FsdpAutoWrapPolicy, FsdpBackwardPrefetch, FsdpShardingStrategy,
    FsdpStateDictType,
};
use crate::config::LaunchPlan;
use crate::context_parallel::SeqSplit;
use crate::dist::mesh::{Axis, DP, DP_CP, DP_SHARD_CP, DP_SHARD_SP, DP_SP};
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::models::CausalModel;
use crate::models::Params;
use crate::nn::lora::LoraConfig;
use crate::nn::AttentionImpl;
use crate::optim::{grad_clip_coef, AdamW, AdamWConfig};
use crate::tp::{state as tp_state, TpGrads};
use candle_core::{DType, Tensor};
use ddp::Ddp;
use sharded_state::ShardedReader;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// How data-parallel ranks hold the model state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Everything replicated; gradients all-reduced (DDP).
    Ddp,
    /// Optimizer state (and with stage 2 gradients) sharded over the data-parallel group.
    Zero(ZeroStage),
    /// ZeRO stage 3 / FSDP FULL_SHARD: parameters too, gathered per wrap unit when used, with
    /// the next unit's gather started ahead as `Prefetch` says.
    Fsdp(WrapPolicy, Prefetch),
}

/// FSDP's SIZE_BASED_WRAP default (Accelerate's fsdp_min_num_params default).
const DEFAULT_MIN_NUM_PARAMS: u64 = 100_000_000;

/// DeepSpeed's reduce_bucket_size default, in elements.
pub const DEEPSPEED_REDUCE_BUCKET: usize = 500_000_000;

/// The units FSDP's auto-wrap policy cuts.
fn fsdp_wrap(f: &crate::config::FsdpConfig) -> WrapPolicy {
    match f.auto_wrap_policy {
        FsdpAutoWrapPolicy::TransformerBasedWrap => WrapPolicy::PerLayer,
        FsdpAutoWrapPolicy::NoWrap => WrapPolicy::Whole,
        FsdpAutoWrapPolicy::SizeBasedWrap => {
            WrapPolicy::MinParams(f.min_num_params.unwrap_or(DEFAULT_MIN_NUM_PARAMS) as usize)
        }
    }
}

/// How ZeRO-2 (full fine-tuning) cuts the model into resident units, each of whose gradients
/// is reduce-scattered as soon as backward is done with it, and whether those reductions
/// overlap the backward: DeepSpeed's reduce buckets (`reduce_bucket_size` elements, "auto"
/// being transformers' hidden_size squared; `overlap_comm`, off unless set, as in DeepSpeed),
/// or FSDP SHARD_GRAD_OP's wrap units (always overlapped).
pub fn zero2_units(plan: &LaunchPlan, hidden_size: usize) -> (WrapPolicy, bool) {
    match (&plan.fsdp, &plan.deepspeed) {
        (Some(f), _) if plan.distributed_type == DistributedType::Fsdp => (fsdp_wrap(f), true),
        (_, Some(ds)) => {
            let bucket = ds
                .reduce_bucket_size
                .map_or(hidden_size * hidden_size, |b| b as usize);
            (
                WrapPolicy::Buckets(bucket),
                ds.overlap_comm.unwrap_or(false),
            )
        }
        _ => (WrapPolicy::Buckets(DEEPSPEED_REDUCE_BUCKET), false),
    }
}

impl Strategy {
    /// ZeRO-3 / FSDP with `wrap` units, prefetching in both directions.
    pub fn fsdp(wrap: WrapPolicy) -> Self {
        Strategy::Fsdp(wrap, Prefetch::BOTH)
    }

    /// What a launch plan asks for: DeepSpeed's ZeRO stage, FSDP's sharding strategy, wrap
    /// policy and prefetch settings; plain DDP otherwise.
    pub fn from_plan(plan: &LaunchPlan) -> Self {
        if let (DistributedType::DeepSpeed, Some(ds)) = (plan.distributed_type, &plan.deepspeed) {
            return match ds.zero_stage {
                0 => Strategy::Ddp,
                1 => Strategy::Zero(ZeroStage::One),
                2 => Strategy::Zero(ZeroStage::Two),
                // DeepSpeed gathers ZeRO-3 parameters module by module: one unit per layer.
                _ => Strategy::fsdp(WrapPolicy::PerLayer),
            };
        }
        let Some(f) = plan.fsdp.as_ref() else {
            return Strategy::Ddp;
        };
        match f.sharding_strategy {
            FsdpShardingStrategy::NoShard => Strategy::Ddp,
            FsdpShardingStrategy::ShardGradOp | FsdpShardingStrategy::HybridShardZero2 => {
                Strategy::Zero(ZeroStage::Two)
            }
            FsdpShardingStrategy::FullShard | FsdpShardingStrategy::HybridShard => {
                let wrap = fsdp_wrap(f);
                // BACKWARD_PRE and BACKWARD_POST both start the next unit's gather during
                // backward; FSDP2 always overlaps the next forward gather (its implicit
                // prefetch), so forward prefetch is on for version 2 whatever the flag says.
                Strategy::Fsdp(
                    wrap,
                    Prefetch {
                        forward: f.forward_prefetch || f.version == 2,
                        backward: f.backward_prefetch != FsdpBackwardPrefetch::NoPrefetch,
                    },
                )
            }
        }
    }

    /// A short name for reports: `ddp`, `zero1`, `zero2`, `zero3`.
    pub fn name(&self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::Zero(ZeroStage::One) => "zero1",
            Strategy::Zero(ZeroStage::Two) => "zero2",
            Strategy::Fsdp(..) => "zero3",
        }
    }
}

/// FSDP's state_dict_type: FULL_STATE_DICT gathers everything and rank 0 writes HF
/// safetensors; SHARDED_STATE_DICT has every rank write its own slices in parallel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointFormat {
    Full,
    Sharded,
}

impl CheckpointFormat {
    /// FSDP's SHARDED_STATE_DICT (LOCAL_STATE_DICT, each rank's own flat slices, is written
    /// the same way) and DeepSpeed ZeRO-3, which saves its partitions, are sharded.
    pub fn from_plan(plan: &LaunchPlan) -> Self {
        let fsdp_sharded = plan
            .fsdp
            .as_ref()
            .is_some_and(|f| f.state_dict_type != FsdpStateDictType::FullStateDict);
        let zero3 = plan.deepspeed.as_ref().is_some_and(|d| d.zero_stage == 3);
        if fsdp_sharded || zero3 {
            CheckpointFormat::Sharded
        } else {
            CheckpointFormat::Full
        }
    }
}

/// What ZeRO / FSDP shard over: dp_shard, and the ranks of the sequence chunks (which hold
/// different gradients) when sequences are split.
pub fn shard_axes(split: Option<&SeqSplit>) -> &'static [Axis] {
    match split {
        Some(s) if s.ring => DP_SHARD_CP,
        Some(_) => DP_SHARD_SP,
        None => &[Axis::DpShard],
    }
}

/// The ranks that see different tokens: data-parallel ranks, and those holding the other
/// chunks of the same rows.
pub fn batch_axes(split: Option<&SeqSplit>) -> &'static [Axis] {
    match split {
        Some(s) if s.ring => DP_CP,
        Some(_) => DP_SP,
        None => DP,
    }
}

/// What a trainer asks of [`build`] and [`parallelize`]: the model, how it computes, and where
/// a resumed run continues. The settings the launch fixes (its activation checkpointing and
/// optimizer offload, efficient loading, the checkpoint format) come from the context's plan.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    pub strategy: Strategy,
    /// The model directory (read, and named in errors about splitting it).
    pub model_dir: PathBuf,
    pub dtype: DType,
    pub attention: AttentionImpl,
    /// Fused, tiled LM head + loss (use_liger_kernel).
    pub tiled_loss: bool,
    pub tiled_mlp: bool,
    /// The training arguments' gradient_checkpointing (or-ed with the launch's
    /// fsdp_activation_checkpointing).
    pub gradient_checkpointing: bool,
    /// Keep checkpointed layer inputs in host memory (activation_offloading, GPU runs).
    pub offload_activations: bool,
    pub adam: AdamWConfig,
    /// A checkpoint directory to continue from, and the optimizer step its trainer state is
    /// at (for optimizer files that do not record it).
    pub resume_from: Option<(PathBuf, u64)>,
    /// Train LoRA adapters on a frozen base (use_peft).
    pub lora: Option<LoraConfig>,
}

impl ParallelOptions {
    /// Whether a LoRA run trains modules whole (lora_modules_to_save) or rows of a table
    /// (trainable tokens, which start as the table's): those are read whole, so the model is
    /// loaded before it is sharded (no efficient loading).
    pub fn trains_whole_modules(&self) -> bool {
        self.lora
            .as_ref()
            .is_some_and(|l| !l.modules_to_save.is_empty() || !l.trainable_token_indices.is_empty())
    }

    /// Whether each rank reads only its ZeRO-3 / FSDP slices from `model_dir` (efficient
    /// loading, on a fresh start without tensor parallelism): the model is first a skeleton.
    pub fn reads_shards(&self, ctx: &DistContext) -> bool {
        ctx.plan().efficient_loading()
            && !self.trains_whole_modules()
            && matches!(self.strategy, Strategy::Fsdp(..))
            && ctx.group(&[Axis::Tp]).size() == 1
            && self.resume_from.is_none()
            // Each rank keeps its share of the experts from the whole model.
            && ctx.ep().is_none()
    }
}

/// Where a resumed run's optimizer state comes from.
pub enum Resume {
    Fresh,
    /// Every parameter's whole state (a full checkpoint).
    Full(AdamW),
    /// A sharded checkpoint, read slice by slice.
    Sharded(ShardedReader),
}

/// The optimizer as the strategy keeps it.
pub enum Optimizer {
    /// DDP: the whole state on every rank; gradients reduced by [`ddp::Ddp`] first.
    Replicated(AdamW, Ddp),
    Zero(ZeroOptimizer),
    Fsdp(FsdpOptimizer),
}

impl Optimizer {
    /// This rank's AdamW state: the whole of it under DDP, its slices under ZeRO and FSDP.
    pub fn state(&self) -> &AdamW {
        match self {
            Optimizer::Replicated(opt, _) => opt,
            Optimizer::Zero(z) => z.state(),
            Optimizer::Fsdp(f) => f.state(),
        }
    }

    /// The whole AdamW state of what this rank trains (its tensor-parallel slices): its own
    /// under DDP, gathered from the data-parallel shards under ZeRO and FSDP (collective
    /// there: every rank calls it).
    pub fn gather_full_state(&self) -> Result<std::borrow::Cow<'_, AdamW>> {
        Ok(match self.sharded() {
            Some(sharded) => std::borrow::Cow::Owned(sharded.gather_full_state()?),
            None => std::borrow::Cow::Borrowed(self.state()),
        })
    }

    /// The FSDP / ZeRO-3 optimizer, whose units hold the parameters' slices.
    pub fn fsdp(&self) -> Option<&FsdpOptimizer> {
        match self {
            Optimizer::Fsdp(f) => Some(f),
            _ => None,
        }
    }

    /// Whether this rank's gradients need no data-parallel reduction (one replica, unsharded):
    /// they may then stay in the compute dtype.
    pub fn single_replica(&self) -> bool {
        matches!(self, Optimizer::Replicated(_, ddp) if ddp.replicas() == 1)
    }

    /// The ZeRO or FSDP optimizer, whose ranks each keep a slice of the state.
    pub fn sharded(&self) -> Option<&dyn ShardedOptimizer> {
        match self {
            Optimizer::Replicated(..) => None,
            Optimizer::Zero(z) => Some(z),
            Optimizer::Fsdp(f) => Some(f),
        }
    }

    /// One update from this rank's accumulated gradients (`grads`; empty under FSDP, whose
    /// units hold theirs): partial tensor-parallel gradients summed over tp (`tp`), the
    /// data-parallel reduction the strategy does, clipping to `max_grad_norm` by the global
    /// norm, and AdamW at `lr`. `first`: the run's first step (tp's checks). Returns the
    /// global gradient norm; when it is not finite nothing is updated (every rank sees the
    /// same norm). Every trainer's step ends here.
    pub fn step(
        &mut self,
        params: &Params,
        grads: &mut BTreeMap<String, Tensor>,
        tp: Option<&TpGrads>,
        (max_grad_norm, lr): (f64, f64),
        first: bool,
    ) -> Result<f64> {
        // FSDP's units sum their partial slices over tp themselves.
        if let (Some(tp), false) = (tp, matches!(self, Optimizer::Fsdp(_))) {
            tp.sync(grads, first)?;
        }
        match self {
            Optimizer::Replicated(opt, ddp) => {
                ddp.reduce(grads)?;
                let norm_sq = ddp.norm_sq(grads, tp)?;
                // The clipping factor is applied by the update's own pass.
                let (norm, coef) = grad_clip_coef(grads, max_grad_norm, norm_sq)?;
                // A non-finite gradient never reaches the weights (the trainer stops or
                // skips the step).
                if norm.is_finite() {
                    opt.step_scaled(params, grads, lr, coef)?;
                }
                Ok(norm)
            }
            // Reduction, clipping and the update of this rank's slice happen inside.
            Optimizer::Zero(z) => z.step(params, grads, max_grad_norm, lr),
            Optimizer::Fsdp(f) => f.step(max_grad_norm, lr, first),
        }
    }

    /// Bytes of gradients this rank holds between backward and update, for `full` bytes of
    /// whole fp32 gradients.
    pub fn grad_bytes(&self, full: usize) -> usize {
        match self {
            Optimizer::Replicated(..) => full,
            Optimizer::Zero(z) if z.stage == ZeroStage::Two => full.div_ceil(z.shard_size()),
            Optimizer::Zero(_) => full,
            Optimizer::Fsdp(f) => f.grad_bytes(),
        }
    }
}

/// The model's hidden size from its config.json (a composite's text_config), for sizes
/// DeepSpeed derives from it ("auto" buckets).
pub fn hidden_size(config_json: &str) -> usize {
    crate::models::params::config_number(config_json, "hidden_size").unwrap_or(0)
}

/// How the layers' weights go into wrap units, if they do: ZeRO-3 / FSDP gather each unit
/// per use; ZeRO-2 (full fine-tuning) keeps them gathered and reduces each unit's gradients
/// as backward finishes it. Offload puts the slices (parameters, fsdp_offload_params /
/// offload_param) and the reduced gradients (any offload) in host memory.
fn unit_plan(
    opts: &ParallelOptions,
    plan: &LaunchPlan,
    config_json: &str,
) -> Option<(WrapPolicy, Prefetch, Holding)> {
    let offload = plan.offload_optimizer();
    let mut holding = Holding {
        resident: false,
        overlap: true,
        host_params: offload && plan.offload_params(),
        host_grads: offload,
    };
    match opts.strategy {
        Strategy::Fsdp(policy, prefetch) => {
            let ds = plan
                .deepspeed
                .as_ref()
                .filter(|_| plan.distributed_type == DistributedType::DeepSpeed);
            if let Some(o) = ds.and_then(|d| d.overlap_comm) {
                holding.overlap = o;
            }
            Some((policy, prefetch, holding))
        }
        Strategy::Zero(ZeroStage::Two) if opts.lora.is_none() => {
            let (policy, overlap) = zero2_units(plan, hidden_size(config_json));
            holding.resident = true;
            holding.overlap = overlap;
            Some((policy, Prefetch::BOTH, holding))
        }
        _ => None,
    }
}

/// The launch's sequence split (ring attention over cp, Ulysses over sp), if it has one.
fn launch_split(ctx: &DistContext) -> Result<Option<SeqSplit>> {
    SeqSplit::from_context(ctx).map_err(|e| Error::Config {
        file: "the launch's parallelism config".into(),
        key: "parallelism_config_cp_size".into(),
        message: e.to_string(),
    })
}

/// Splits `model`'s sequences as `split` says; an error names the launch's key and the
/// model's config (`config_json`).
fn split_sequences<N: CausalModel>(
    model: &mut Model<N>,
    split: Option<&SeqSplit>,
    config_json: &str,
) -> Result<()> {
    let Some(split) = split else {
        return Ok(());
    };
    model
        .split_sequences(split.clone())
        .map_err(|e| Error::Config {
            file: config_json.into(),
            key: match split.ring {
                true => "parallelism_config_cp_size",
                false => "parallelism_config_sp_size",
            }
            .into(),
            message: e.to_string(),
        })
}

/// A model made parallel.
pub struct Parallelized {
    pub optimizer: Optimizer,
    /// Under tensor parallelism: the global gradient norm over the tp group.
    pub tp_grads: Option<TpGrads>,
}

/// Applies the strategies to `model` in their fixed order (see the module docs) and builds
/// the optimizer the data-parallel strategy keeps, from `resume`'s state when resuming.
pub fn parallelize<N: CausalModel>(
    model: &mut Model<N>,
    ctx: &DistContext,
    opts: &ParallelOptions,
    resume: Resume,
) -> Result<Parallelized> {
    let main = ctx.is_main_process();
    let config_json = opts.model_dir.join("config.json").display().to_string();
    let plan = ctx.plan();
    let tp = ctx.group(&[Axis::Tp]);
    let split = launch_split(ctx)?;
    // Rank 0's weights on every rank (DDP's start; under tp, every data-parallel rank holds
    // the same slices) before any strategy takes its share.
    ddp::sync_parameters(&ctx.group(batch_axes(split.as_ref())), &model.params)?;
    let (mut full_state, sharded_state) = match resume {
        Resume::Fresh => (None, None),
        Resume::Full(full) => (Some(full), None),
        Resume::Sharded(reader) => (None, Some(reader)),
    };

    // 1. Tensor parallelism: each rank keeps its slices (a resumed model was read whole).
    let mut tp_grads = None;
    if tp.size() > 1 {
        if model.tp().is_none() {
            model.parallelize(tp.clone()).map_err(|e| Error::Config {
                file: config_json.clone(),
                key: "parallelism_config_tp_size".into(),
                message: format!("the model cannot be split over tp = {}: {e}", tp.size()),
            })?;
        }
        if let Some(full) = &full_state {
            full_state = Some(tp_state::slice_state(
                full,
                model.tp_plan(),
                tp.rank(),
                tp.size(),
            )?);
        }
        tp_grads = Some(TpGrads::new(model.tp_plan(), tp.clone()));
    }

    // 2. Expert parallelism: each rank of the ep group keeps its share of every mixture's
    // experts (a resumed run's optimizer state too); tokens travel to them.
    if let Some(ep) = ctx.ep() {
        expert::check_strategy(opts, ctx, ep.size())?;
        model.shard_experts(ep.clone()).map_err(|e| Error::Config {
            file: config_json.clone(),
            key: "parallelism_config_ep_size".into(),
            message: format!("the experts cannot be split over ep = {}: {e}", ep.size()),
        })?;
        if let Some(full) = full_state {
            let plan = model.expert_plan();
            full_state = Some(plan.slice_state(full, ep.rank(), &model.params)?);
        }
    }

    // 3. Sequence split: ring attention over cp or Ulysses over sp; attention and tiling.
    model.attention = opts.attention;
    split_sequences(model, split.as_ref(), &config_json)?;
    model.tiled_loss = opts.tiled_loss;
    model.tiled_mlp = opts.tiled_mlp;
    // The layers run on wrap units under ZeRO-3 / FSDP, and under ZeRO-2 (resident units
    // whose gradients are reduced during backward) but for LoRA, whose adapters train whole.
    let units = unit_plan(opts, plan, model.config_json());
    let fsdp = units.is_some();
    if opts.tiled_mlp && !model.net().supports_tiled_mlp() && main {
        tracing::warn!(
            "tiled_mlp: ignored, this model's layers do not tile their MLP \
             (CausalModel::supports_tiled_mlp is false)"
        );
    }
    let one_pass = crate::nn::tiled_loss::one_pass_dtype(opts.dtype, ctx.device().is_cuda());
    if opts.tiled_loss && model.net().logit_softcap().is_some() && !one_pass && main {
        tracing::warn!(
            "use_liger_kernel: soft-capped logits (final_logit_softcapping) run fused in the \
             one-pass loss only (f32 on the CPU, GPUs); here the loss is computed from the logits"
        );
    }
    if opts.tiled_mlp && fsdp && main {
        tracing::warn!(
            "tiled_mlp: the tiled MLP needs each layer's weights as plain tensors; under \
             ZeRO-2/3 / FSDP (wrap units) the MLPs run untiled"
        );
    }
    if opts.tiled_loss && (tp.size() > 1 || fsdp) && main {
        tracing::warn!(
            "use_liger_kernel: the fused, tiled loss needs the LM head whole on each rank; \
             under tensor parallelism or FSDP the loss is computed from the logits instead"
        );
    }

    // 4. Activation checkpointing: each decoder layer recomputed in backward, its input kept
    // in host memory when asked (on a GPU; a CPU run's inputs are there already).
    let checkpointing = opts.gradient_checkpointing || plan.activation_checkpointing();
    let offload = opts.offload_activations || plan.activation_checkpointing_offload();
    if offload && main && (!checkpointing || ctx.device().is_cpu()) {
        let why = match checkpointing {
            false => "it needs activation checkpointing (gradient_checkpointing, or the launch's fsdp_activation_checkpointing)",
            true => "on a CPU the layer inputs are in host memory already",
        };
        tracing::warn!(
            "activation_offloading / fsdp_activation_checkpointing_offload: no effect: {why}"
        );
    }
    if checkpointing {
        model.checkpointing = Some(Checkpointing::new(offload && !ctx.device().is_cpu()));
    }

    // 5. Data parallelism over the ranks that see different tokens; ZeRO / FSDP shard over
    // dp_shard (and the sequence chunks' ranks), summing across dp_replicate (HSDP).
    // Under expert parallelism each layer's experts go into units of their own, sharded over
    // the ranks holding the same experts (`fsdp::ExpertUnits`); ZeRO-1's state, and LoRA's
    // adapters beside a sharded base, are sharded over those ranks too (the ep group's ranks
    // hold the same dense slices there; their gradients are summed over it).
    let shard = ctx.group(shard_axes(split.as_ref()));
    let expert_shard = model.ep().map(|_| {
        ctx.expert_replicas(shard_axes(split.as_ref()))
            .expect("ep groups are made with the ep context")
    });
    let replicate = Some(ctx.group(&[Axis::DpReplicate])).filter(|c| c.size() > 1);
    let offload = offload::decide(plan, ctx.device(), main);
    if let Some(units) = units {
        if opts.reads_shards(ctx) {
            // Each rank reads only its slices from the checkpoint files.
            model.shard_reading(&opts.model_dir, units, shard.clone())?;
        } else {
            // Every rank cuts its slices from the synced values, then drops the full tensors.
            model.shard_with_experts(units, shard.clone(), expert_shard.clone())?;
        }
        let (count, holding) = match &model.sharding {
            Some(s) => (s.units.len(), s.holding()),
            None => (0, Holding::SHARDED),
        };
        if holding.resident && main {
            tracing::info!(
                "ZeRO-2: parameters whole in {count} units, each unit's gradients                  reduce-scattered as backward finishes it ({:?}; overlap_comm {})",
                units.0,
                holding.overlap
            );
        }
    }
    // Under FSDP a LoRA base in the units is frozen: its adapters, whole on every rank, are
    // reduced and their optimizer state sharded as ZeRO-2 does.
    let zero_stage = match opts.strategy {
        Strategy::Zero(stage) if units.is_none() => Some(stage),
        Strategy::Fsdp(..) if model.lora().is_some() => Some(ZeroStage::Two),
        _ => None,
    };
    let (full, sharded) = (full_state.as_ref(), sharded_state.as_ref());
    let prepare = |opt: &mut dyn ShardedOptimizer, params: &Params| {
        sharded_optimizer::prepare(opt, tp_grads.as_ref(), full, sharded, params, offload)
    };
    let optimizer = match (opts.strategy, zero_stage) {
        (Strategy::Ddp, _) => {
            let mut adam = match full_state {
                Some(full) => full,
                None => AdamW::for_params(&model.params, opts.adam)?,
            };
            if offload {
                offload::to_host(&mut adam)?;
            }
            let batch = batch_axes(split.as_ref());
            let mut ddp = Ddp::new(ctx.group(batch))?;
            if let (Some(ep), Some(replicas)) = (model.ep(), ctx.expert_replicas(batch)) {
                ddp = ddp.with_experts(model.expert_plan().clone(), ep.clone(), replicas)?;
            }
            Optimizer::Replicated(adam, ddp)
        }
        (_, Some(stage)) => {
            let hidden = hidden_size(model.config_json());
            let bucket = match zero2_units(plan, hidden).0 {
                WrapPolicy::Buckets(b) => b,
                _ => DEEPSPEED_REDUCE_BUCKET,
            };
            let zero_shard = expert_shard.unwrap_or(shard);
            let mut z = ZeroOptimizer::new(&model.params, opts.adam, stage, zero_shard, replicate)?
                .with_bucket(bucket);
            if let Some(ep) = model.ep() {
                z = z.with_experts(model.expert_plan(), ep.clone());
            }
            prepare(&mut z, &model.params)?;
            Optimizer::Zero(z)
        }
        (_, None) => {
            let sharded = model.sharding.clone().expect("sharded above");
            // The experts' units are sharded over the ranks holding them: every element of
            // the model sits in one slice of the shard group, so the norm needs no ep term.
            let mut f = FsdpOptimizer::new(sharded, opts.adam, replicate)?;
            prepare(&mut f, &model.params)?;
            Optimizer::Fsdp(f)
        }
    };
    Ok(Parallelized {
        optimizer,
        tp_grads,
    })
}
