//! Builds the parallel model a trainer trains, in one call: the model read from its
//! checkpoint directory (sliced for tensor parallelism as it is read, or only its structure
//! when ZeRO-3 / FSDP read their slices themselves), or from the checkpoint a resumed run
//! continues, with its optimizer state read as the strategy holds it; the strategies applied
//! by [`super::parallelize`]; and the checkpoint format the launch asks for. Trainers keep
//! their data, schedule and loop; none of them decides anything about a strategy.

use super::sharded_state::{self, ShardedReader};
use super::{parallelize, CheckpointFormat, Model, Optimizer, ParallelOptions, Resume, Strategy};
use crate::dist::mesh::Axis;
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::models::{peft, CausalModel, Params};
use crate::optim::{AdamW, OPTIMIZER_FILE};
use crate::tp::TpGrads;
use std::path::Path;

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

/// Loads, resumes and parallelizes model `N` as `opts` and the context's plan say.
pub fn build<N: CausalModel>(ctx: &DistContext, opts: &ParallelOptions) -> Result<Built<N>> {
    let tp = ctx.group(&[Axis::Tp]);
    let (dir, dtype, device) = (&opts.model_dir, opts.dtype, ctx.device().clone());
    let read_shards = opts.reads_shards(ctx);
    let tp_error = |e| tp_error(dir, tp.size(), e);
    // Split over tp as it is read: each rank reads only its slices.
    let read_split = || Model::<N>::from_pretrained_split(dir, dtype, &device, tp.clone());
    if ctx.plan().efficient_loading() && opts.trains_whole_modules() && ctx.is_main_process() {
        tracing::warn!(
            "efficient loading (fsdp_cpu_ram_efficient_loading / zero3_init_flag): off for this \
             run, whose lora_modules_to_save (or trainable token rows) train whole and are read \
             whole; each rank loads the model, then shards its frozen base"
        );
    }
    let (mut model, resume) = match (&opts.resume_from, &opts.lora) {
        (None, _) if read_shards => (
            Model::<N>::skeleton_for(dir, dtype, &device)?,
            Resume::Fresh,
        ),
        (None, _) => (read_split().map_err(tp_error)?, Resume::Fresh),
        (Some((ckpt, step)), Some(lora)) => {
            // A LoRA checkpoint holds the adapters: the base is the model directory's.
            let mut model = read_split().map_err(tp_error)?;
            warn_left_out(ctx, &model.add_adapters(lora)?);
            if !ckpt.join(peft::ADAPTER_CONFIG).exists() {
                return Err(Error::config(
                    ckpt.display().to_string(),
                    "resume_from_checkpoint",
                    "not a LoRA checkpoint (no adapter_config.json): resume a use_peft run's \
                     checkpoint, or drop use_peft",
                ));
            }
            let (_, tensors) = peft::read(ckpt, dtype, &device, &model.lora_sites()?.1)?;
            let source = ckpt.join(peft::ADAPTER_WEIGHTS).display().to_string();
            model.set_trainable(&tensors, &source)?;
            let trained = Params::from_tensors(tensors)?;
            (
                model,
                Resume::Full(read_state(&trained, ckpt, *step, opts)?),
            )
        }
        (Some((ckpt, _)), None) if sharded_state::is_sharded(ckpt) => {
            // Slices are read by whoever owns them; unsharded strategies, and tensor-parallel
            // runs (which cut their tp slices from whole tensors), read it all.
            let reader = ShardedReader::open(ckpt)?;
            let slices = matches!(opts.strategy, Strategy::Fsdp(..) | Strategy::Zero(_));
            // Under ep each rank keeps its share of the experts from the whole state.
            if tp.size() > 1 || !slices || ctx.ep().is_some() {
                let (params, full) = reader.full_state(opts.adam)?;
                let params = params
                    .into_iter()
                    .map(|(n, t)| Ok((n, t.to_dtype(dtype)?.to_device(&device)?)))
                    .collect::<Result<_>>()?;
                // The model directory gives only the config: the weights are the checkpoint's.
                let json = Model::<N>::skeleton_for(dir, dtype, &device)?
                    .config_json()
                    .to_string();
                let model = Model::with_params(json, Params::from_tensors(params)?)?;
                (model, Resume::Full(full))
            } else {
                (read_split().map_err(tp_error)?, Resume::Sharded(reader))
            }
        }
        (Some((ckpt, step)), None) => {
            let model = Model::from_pretrained(ckpt, dtype, &device)?;
            let full = read_state(&model.params, ckpt, *step, opts)?;
            (model, Resume::Full(full))
        }
    };
    if let (Some(lora), Resume::Fresh) = (&opts.lora, &resume) {
        warn_left_out(ctx, &model.add_adapters(lora)?);
    }

    // Any checkpoint resumes under any strategy and world size: the state is per parameter.
    let mut checkpoint_format = CheckpointFormat::from_plan(ctx.plan());
    if opts.lora.is_some() && checkpoint_format == CheckpointFormat::Sharded {
        // Adapters are small: gathered, they are one peft adapter file.
        if ctx.is_main_process() {
            tracing::warn!(
                "use_peft: checkpoints hold the adapters in peft's format, gathered on rank 0, \
                 not sharded (the launch's sharded state_dict_type applies to full fine-tuning)"
            );
        }
        checkpoint_format = CheckpointFormat::Full;
    }
    if tp.size() > 1 && checkpoint_format == CheckpointFormat::Sharded && ctx.is_main_process() {
        tracing::warn!(
            "sharded checkpoints are written full under tensor parallelism (tp = {}): each \
             parameter is gathered and rank 0 writes HF safetensors",
            tp.size()
        );
    }
    let ep = ctx.ep().map_or(1, |ep| ep.size());
    if ep > 1 && checkpoint_format == CheckpointFormat::Sharded && ctx.is_main_process() {
        tracing::warn!(
            "sharded checkpoints are written full under expert parallelism (ep = {ep}): every \
             rank's experts are gathered and rank 0 writes HF safetensors"
        );
    }
    let parallel = parallelize(&mut model, ctx, opts, resume)?;
    Ok(Built {
        model,
        optimizer: parallel.optimizer,
        tp_grads: parallel.tp_grads,
        checkpoint_format,
        read_shards,
    })
}

/// A model run beside the trained one and never trained (distillation's teacher), held as
/// the launch holds the trained one: read split over tp, its sequences split over the same
/// ranks, and under ZeRO-3 / FSDP sharded in units over the same ranks, each gathered only
/// while it runs (as DeepSpeed and FSDP hold TRL's teacher); whole on every rank under DDP
/// and ZeRO-1/2 (TRL's `prepare_deepspeed` holds a teacher at stage 0 there). Its weights are
/// constants: no gradients, no optimizer state, no activation checkpointing.
pub fn build_frozen<N: CausalModel>(ctx: &DistContext, opts: &ParallelOptions) -> Result<Model<N>> {
    let tp = ctx.group(&[Axis::Tp]);
    let dir = &opts.model_dir;
    // With efficient loading each rank reads only its ZeRO-3 / FSDP slices, as for the
    // trained model.
    let read_shards = opts.reads_shards(ctx);
    let mut model = match read_shards {
        true => Model::<N>::skeleton_for(dir, opts.dtype, ctx.device()),
        false => Model::<N>::from_pretrained_split(dir, opts.dtype, ctx.device(), tp.clone()),
    }
    .map_err(|e| tp_error(dir, tp.size(), e))?;
    model.freeze()?;
    model.attention = opts.attention;
    let split = super::launch_split(ctx)?;
    let config_json = dir.join("config.json").display().to_string();
    super::split_sequences(&mut model, split.as_ref(), &config_json)?;
    if let (Strategy::Fsdp(..), Some(units)) = (
        opts.strategy,
        super::unit_plan(opts, ctx.plan(), model.config_json()),
    ) {
        let group = ctx.group(super::shard_axes(split.as_ref()));
        match read_shards {
            true => model.shard_reading(dir, units, group)?,
            false => model.shard(units, group)?,
        }
    }
    Ok(model)
}

/// An error reading `dir`'s model split over tp (a size the group does not divide) as the
/// launch's key names it; other errors as they are.
fn tp_error(dir: &Path, tp: usize, e: Error) -> Error {
    match e {
        Error::TensorParallel { .. } => Error::Config {
            file: dir.join("config.json").display().to_string(),
            key: "parallelism_config_tp_size".into(),
            message: format!("the model cannot be split over tp = {tp}: {e}"),
        },
        other => other,
    }
}

/// The whole optimizer state of `params` in checkpoint `ckpt` (its step, or `step` for files
/// that do not record it).
fn read_state(params: &Params, ckpt: &Path, step: u64, opts: &ParallelOptions) -> Result<AdamW> {
    let mut full = AdamW::for_params(params, opts.adam)?;
    let file = ckpt.join(OPTIMIZER_FILE);
    if !file.exists() {
        // transformers' resume too starts such a checkpoint's optimizer state afresh.
        tracing::warn!(
            "{} holds no optimizer state (written with save_only_model): AdamW starts afresh \
             (zero moments, bias correction from its first step)",
            ckpt.display()
        );
        return Ok(full);
    }
    full.step = full.read_file(&file)?.unwrap_or(step);
    Ok(full)
}

/// Says (rank 0) which targeted layers `plan` gave no adapter: the dense MLP projections
/// beside experts, as peft leaves them.
fn warn_left_out(ctx: &DistContext, plan: &crate::nn::lora::AdapterPlan) {
    let left_out = &plan.left_out;
    if left_out.is_empty() || !ctx.is_main_process() {
        return;
    }
    tracing::warn!(
        "use_peft: {} dense MLP projection(s) beside the experts ({}{}) get no adapter: \
         peft (0.17+, transformers 5) maps every gate_proj / up_proj / down_proj target \
         onto the fused experts, and this run adapts what peft adapts",
        left_out.len(),
        left_out
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join(", "),
        if left_out.len() > 3 { ", ..." } else { "" }
    );
}
