//! Builds the parallel model a trainer trains, in one call: the model read from its
//! checkpoint directory (sliced for tensor parallelism as it is read, or only its structure
//! when ZeRO-3 / FSDP read their slices themselves), a resumed run's weights and optimizer state
//! read as the strategy holds them, the strategies applied by [`super::parallelize`], and the
//! checkpoint format the launch asks for. Trainers keep their data, schedule and loop; none
//! of them decides anything about a strategy.

use super::sharded_state::{self, ShardedReader};
use super::{parallelize, CheckpointFormat, Model, Optimizer, ParallelOptions, Resume, Strategy};
use crate::dist::mesh::Axis;
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::models::{CausalModel, Params};
use crate::nn::AttentionImpl;
use crate::optim::{AdamW, AdamWConfig, OPTIMIZER_FILE};
use crate::tp::TpGrads;
use candle_core::DType;
use std::path::PathBuf;

/// What a trainer asks for: the model, how it computes, and where a resumed run continues.
/// The strategy's settings that the launch fixes (activation checkpointing, offload, the
/// checkpoint format) come from the context's plan.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub model_dir: PathBuf,
    pub dtype: DType,
    pub strategy: Strategy,
    pub attention: AttentionImpl,
    /// Fused, tiled LM head + loss (use_liger_kernel).
    pub tiled_loss: bool,
    pub tiled_mlp: bool,
    /// The training arguments' gradient_checkpointing (or-ed with the launch's
    /// fsdp_activation_checkpointing).
    pub gradient_checkpointing: bool,
    /// Keep checkpointed layer inputs in host memory (activation_offloading).
    pub activation_offloading: bool,
    pub adam: AdamWConfig,
    /// A checkpoint directory to continue from, and the optimizer step its trainer state is
    /// at (for optimizer files that do not record it).
    pub resume_from: Option<(PathBuf, u64)>,
}

/// The model made parallel, ready to train.
pub struct Built<N: CausalModel> {
    pub model: Model<N>,
    pub optimizer: Optimizer,
    /// Under tensor parallelism: partial gradients and the global norm over the tp group.
    pub tp_grads: Option<TpGrads>,
    /// How intermediate checkpoints hold sharded state.
    pub checkpoint_format: CheckpointFormat,
    /// Each rank read only its ZeRO-3 / FSDP slices of the model (efficient loading).
    pub read_shards: bool,
}

/// Loads, resumes and parallelizes model `N` as `spec` and the context's plan say.
pub fn build<N: CausalModel>(ctx: &DistContext, spec: ModelSpec) -> Result<Built<N>> {
    let tp = ctx.group(&[Axis::Tp]);
    let dir = &spec.model_dir;
    let device = ctx.device().clone();
    let plan = ctx.plan();
    let sharding = matches!(spec.strategy, Strategy::Fsdp(..));
    // ZeRO-3 / FSDP with efficient loading (and tp 1, a fresh start): the model's structure
    // only; each rank reads its slices when it is sharded.
    let read_shards =
        plan.efficient_loading() && sharding && tp.size() == 1 && spec.resume_from.is_none();
    let tp_error = |e: Error| match e {
        Error::TensorParallel { .. } => Error::Config {
            file: dir.join("config.json").display().to_string(),
            key: "parallelism_config_tp_size".into(),
            message: format!("the model cannot be split over tp = {}: {e}", tp.size()),
        },
        other => other,
    };
    // Split over tp as it is read: each rank reads only its slices.
    let mut model = match read_shards {
        true => Model::<N>::skeleton_for(dir, spec.dtype, &device)?,
        false => Model::<N>::from_pretrained_split(dir, spec.dtype, &device, tp.clone())
            .map_err(tp_error)?,
    };
    let mut resume = Resume::Fresh;
    if let Some((ckpt, step)) = &spec.resume_from {
        if sharded_state::is_sharded(ckpt) {
            // Slices are read by whoever owns them; unsharded strategies, and tensor-parallel
            // runs (which cut their tp slices from whole tensors), read it all.
            let reader = ShardedReader::open(ckpt)?;
            let slices = matches!(spec.strategy, Strategy::Fsdp(..) | Strategy::Zero(_));
            if tp.size() > 1 || !slices {
                let (params, full) = reader.full_state(spec.adam)?;
                let params = params
                    .into_iter()
                    .map(|(n, t)| Ok((n, t.to_dtype(spec.dtype)?.to_device(&device)?)))
                    .collect::<Result<_>>()?;
                let json = model.config_json().to_string();
                model = Model::with_params(json, Params::from_tensors(params)?)?;
                resume = Resume::Full(full);
            } else {
                resume = Resume::Sharded(reader);
            }
        } else {
            model = Model::from_pretrained(ckpt, spec.dtype, &device)?;
            let mut full = AdamW::for_params(&model.params, spec.adam)?;
            full.step = full.read_file(&ckpt.join(OPTIMIZER_FILE))?.unwrap_or(*step);
            resume = Resume::Full(full);
        }
    }
    // Any checkpoint resumes under any strategy and world size: the state is per parameter.
    let checkpoint_format = CheckpointFormat::from_plan(plan);
    if tp.size() > 1 && checkpoint_format == CheckpointFormat::Sharded && ctx.is_main_process() {
        tracing::warn!(
            "sharded checkpoints are written full under tensor parallelism (tp = {}): each \
             parameter is gathered and rank 0 writes HF safetensors",
            tp.size()
        );
    }
    let options = ParallelOptions {
        strategy: spec.strategy,
        model_dir: dir.clone(),
        attention: spec.attention,
        tiled_loss: spec.tiled_loss,
        tiled_mlp: spec.tiled_mlp,
        activation_checkpointing: spec.gradient_checkpointing || plan.activation_checkpointing(),
        offload_activations: spec.activation_offloading,
        offload_optimizer: plan.offload_optimizer(),
        read_shards,
        adam: spec.adam,
    };
    let parallel = parallelize(&mut model, ctx, &options, resume)?;
    Ok(Built {
        model,
        optimizer: parallel.optimizer,
        tp_grads: parallel.tp_grads,
        checkpoint_format,
        read_shards,
    })
}
