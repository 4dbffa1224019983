//! What every trainer shares: a [`Core`] (data-parallel groups, the model parallel as the
//! launch plan says, its optimizer, schedule, resume state, checkpoints and a clean stop on
//! SIGTERM) and the [`Task`] trait a trainer's own part implements (SFT in `sft.rs`, DPO in
//! `dpo.rs`): rows in, a loss and gradients out. A new trainer is a new task: it never
//! decides strategy.

use super::args::{TrainerConfig, TrainingArguments};
use super::checkpoint::{self, TrainerState};
use crate::comm::{Communicator, ReduceOp};
use crate::data::{DistributedSampler, TextTokenizer};
use crate::dist::mesh::DP;
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::generation::GenerationConfig;
use crate::models::{AutoModelForCausalLM, CausalModel};
use crate::nn::AttentionImpl;
use crate::parallel::{
    batch_axes, build, Built, CheckpointFormat, Optimizer, ParallelOptions, Strategy,
};
use crate::parallel::{GatherMode, Model};
use crate::tp::{state as tp_state, TpGrads};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    pub loss: f64,
    pub learning_rate: f64,
    pub grad_norm: f64,
    /// Input tokens processed by all ranks in this step (padding excluded).
    pub tokens: usize,
    /// Why training stops after this step, whose loss or gradient norm was not finite
    /// (on_nonfinite stop); its update was not applied.
    pub stop: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct EvalResult {
    pub loss: f64,
    /// The task's accuracy: exact-match of greedy answers on held-out prompts (SFT), the
    /// share of pairs whose chosen reward is the higher (DPO).
    pub accuracy: Option<f64>,
    /// A mixture of experts' router load-balancing loss, TRL's `eval_aux_loss` (its weighted
    /// part is in `loss`, added to each batch's as TRL adds it).
    pub aux_loss: Option<f64>,
    /// The task's other figures under TRL's names, logged with `eval_` before them (DPO's
    /// rewards, log-probs and mean logits).
    pub figures: Vec<(&'static str, f64)>,
}

/// `eval loss 1.2345, accuracy 50.0%` (the accuracy where the task has one).
impl std::fmt::Display for EvalResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "eval loss {:.4}", self.loss)?;
        match self.accuracy {
            Some(a) => write!(f, ", accuracy {:.1}%", 100.0 * a),
            None => Ok(()),
        }
    }
}

impl EvalResult {
    /// The value logged as `key` (`eval_loss`, `accuracy`'s name, `eval_` and a figure's).
    pub fn metric(&self, key: &str, accuracy: &str) -> Option<f64> {
        match key {
            "eval_loss" => Some(self.loss),
            "eval_aux_loss" => self.aux_loss,
            k if k == accuracy && self.accuracy.is_some() => self.accuracy,
            k => self
                .figures
                .iter()
                .find(|(name, _)| k.strip_prefix("eval_") == Some(*name))
                .map(|(_, v)| *v),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct TrainOutcome {
    pub losses: Vec<f64>,
    pub initial_eval: Option<EvalResult>,
    pub final_eval: Option<EvalResult>,
    /// Stopped by SIGTERM (a checkpoint was saved first).
    pub preempted: bool,
    /// The checkpoint of the model the run ends with: the last one written, or with
    /// load_best_model_at_end the best (rank 0; None elsewhere).
    pub last_checkpoint: Option<PathBuf>,
}

/// What a task's forward and backward over one step's micro-batches gave.
#[derive(Debug, Clone, Default)]
pub struct TaskStep {
    /// The step's loss, the same on every rank.
    pub loss: f64,
    /// Input tokens processed by all ranks (padding excluded).
    pub tokens: usize,
    /// The task's own figures, logged under these names (TRL's).
    pub metrics: Vec<(&'static str, f64)>,
}

/// What a trainer trains on and how: its rows, a step's loss and gradients, its evaluation.
/// The [`Core`] it is handed holds the model (already parallel), the groups and the step
/// state; the task never chooses a strategy.
pub trait Task<N: CausalModel>: Sized {
    /// Its arguments: [`TrainingArguments`] and the task's own keys.
    type Config: TrainerConfig;
    /// The shared arguments the run uses (the task may adjust what its keys imply).
    fn training_arguments(config: &Self::Config) -> TrainingArguments {
        config.training().clone()
    }
    /// The tokenizer the task trains with, from the model directory's (SFT: its eos_token
    /// and chat_template_path).
    fn tokenizer(_config: &Self::Config, tokenizer: TextTokenizer) -> Result<TextTokenizer> {
        Ok(tokenizer)
    }
    /// The model directory the run starts from, set in `args` (the reward trainer's
    /// classifier made from a causal LM); `model_name_or_path` as given by default.
    fn starting_model(
        _config: &Self::Config,
        _args: &mut TrainingArguments,
        _tokenizer: &TextTokenizer,
    ) -> Result<()> {
        Ok(())
    }
    /// Reads and tokenizes the data (before the model is built: the rows fix the steps).
    fn load(config: &Self::Config, tokenizer: &TextTokenizer) -> Result<Self>;
    /// Told the run's data-parallel ranks before [`Self::num_rows`] is asked (GRPO's rows
    /// are its completions, whose count depends on them).
    fn layout(&mut self, _config: &Self::Config, _dp_ranks: usize) -> Result<()> {
        Ok(())
    }
    /// Training rows the sampler deals out.
    fn num_rows(&self) -> usize;
    /// This step's micro-batches (row indices each) from the sampler's `rows`: a task may
    /// deal them its own way (TRL's GRPO repeats each prompt `num_generations` times in a
    /// row). As the sampler dealt them by default.
    fn deal(&self, rows: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
        rows
    }
    /// Once the model is built and parallel (collation for its sequence split; DPO's
    /// reference log-probabilities).
    fn prepare(&mut self, config: &Self::Config, core: &Core<'_, N>) -> Result<()>;
    /// Forward and backward of this rank's micro-batches (`rows`: row indices per
    /// micro-batch), each micro-batch's gradients handed to [`Core::accumulate`].
    fn step(
        &mut self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
        grads: &mut StepGrads,
    ) -> Result<TaskStep>;
    /// After each checkpoint of `step` is in place (collective): the task's own state
    /// beside it, for a resumed run's `prepare` to read.
    fn save_state(&self, _core: &Core<'_, N>, _step: usize) -> Result<()> {
        Ok(())
    }
    /// What its rows cost a rank (sequences per row, weight copies), for the planner; the
    /// same as its registry entry's (`super::kinds`) for the same arguments.
    fn workload(_config: &Self::Config) -> crate::parallel::estimate::Workload {
        Default::default()
    }
    /// After the optimizer step (TRL's `on_step_end` callbacks; `core.state.global_step`
    /// counts it).
    fn after_step(&mut self, _core: &Core<'_, N>) -> Result<()> {
        Ok(())
    }
    /// Evaluation on the held-out rows, if there are any (collective).
    fn evaluate(&self, config: &Self::Config, core: &Core<'_, N>) -> Result<Option<EvalResult>>;
    /// What the progress bar shows beside the loss.
    fn progress_note(&self, _metrics: &[(&'static str, f64)]) -> String {
        String::new()
    }
}

/// The progress bar's note of figure `key` among `metrics`: ` LABEL value` (`digits` after
/// the point), empty when the step has none.
pub(super) fn figure_note(
    metrics: &[(&'static str, f64)],
    key: &str,
    label: &str,
    digits: usize,
) -> String {
    metrics
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(String::new(), |(_, v)| format!(" {label} {v:.digits$}"))
}

/// One optimizer step's gradients, summed over its micro-batches.
pub struct StepGrads {
    grads: BTreeMap<String, Tensor>,
    /// On the run's first step: the parameters that got a gradient from some micro-batch.
    reached: Option<HashSet<String>>,
}

/// Everything a trainer does whatever it trains on: the model parallel as the launch says,
/// the optimizer, the schedule, the data-parallel order of rows, resume state, checkpoints.
pub struct Core<'a, N: CausalModel = AutoModelForCausalLM> {
    /// The shared training arguments of the task's config.
    pub args: TrainingArguments,
    pub ctx: &'a DistContext,
    /// The data-parallel ranks: they draw different examples.
    pub dp: Arc<dyn Communicator>,
    /// The ranks that see different tokens: `dp` and, under sequence parallelism, the sp
    /// ranks holding the other chunks. Token counts and gradients are summed over it.
    pub batch_group: Arc<dyn Communicator>,
    pub model: Model<N>,
    pub tokenizer: TextTokenizer,
    pub optimizer: Optimizer,
    pub strategy: Strategy,
    /// Each rank read only its ZeRO-3 / FSDP slices of the model (efficient loading).
    pub read_shards: bool,
    /// Under tensor parallelism: the global gradient norm over the tp group (DDP clips with
    /// it; ZeRO and FSDP optimizers hold their own copy).
    pub(super) tp_grads: Option<TpGrads>,
    /// How intermediate checkpoints hold sharded state (the final one is always full).
    pub checkpoint_format: CheckpointFormat,
    pub(super) schedule: crate::train::LrSchedule,
    pub(super) sampler: DistributedSampler,
    /// This epoch's micro-batches of this rank (epoch, row indices), cached across its steps.
    pub(super) order: Option<(u64, Vec<Vec<usize>>)>,
    pub state: TrainerState,
    /// Micro-batches per epoch and rank (transformers' len(train_dataloader)).
    pub(super) micro_batches_per_epoch: usize,
    pub(super) steps_per_epoch: usize,
    pub(super) stop: Arc<AtomicBool>,
    /// What `parallel::estimate` predicts this rank holds, computed once at load.
    pub(super) predicted: Option<crate::parallel::estimate::Estimate>,
    /// Whether the first step's gradients were checked for parameters that got none.
    pub(super) unused_checked: bool,
    /// The weight of a mixture of experts' router load-balancing loss (0: none is added).
    pub router_loss_weight: f64,
}

/// Which checkpoint a run resumes from: `resume_from_checkpoint`, or on a launcher's restart
/// (TORCHELASTIC_RESTART_COUNT > 0, as torchrun sets it) the latest in output_dir. `latest`
/// with none there yet (a first start, a restart before the first save) starts from scratch
/// with a note, so that one command serves the first start and every restart.
pub(super) fn resume_spec(config: &TrainingArguments) -> Option<String> {
    let restart = restart_count();
    let spec = config
        .resume_from_checkpoint
        .clone()
        .or_else(|| restart.map(|_| "latest".to_string()))?;
    let latest = spec == "latest" || spec.eq_ignore_ascii_case("true");
    if latest && checkpoint::list(&config.output_dir).is_empty() {
        tracing::info!(
            "resume_from_checkpoint latest: no complete checkpoint in {} yet, starting from scratch",
            config.output_dir.display()
        );
        return None;
    }
    if let Some(n) = restart {
        tracing::info!("restart {n}: resuming from the {spec} checkpoint");
    }
    Some(spec)
}

/// Which restart of the launcher's group this process belongs to (TORCHELASTIC_RESTART_COUNT,
/// as torchrun sets it); None on the first start.
fn restart_count() -> Option<u32> {
    std::env::var("TORCHELASTIC_RESTART_COUNT")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|&n| n > 0)
}

/// Where a run starts: a fresh state, or the trainer state of the checkpoint
/// `config.resume_from_checkpoint` names (its directory and step, for the model's resume),
/// its data position on this run's layout (`sampler`'s, see [`convert_position`]).
fn resume_state(
    config: &TrainingArguments,
    total_steps: usize,
    sampler: &DistributedSampler,
    steps_per_epoch: usize,
) -> Result<(TrainerState, Option<(PathBuf, u64)>)> {
    let mut state = TrainerState {
        total_steps,
        seed: config.data_order_seed(),
        ..Default::default()
    };
    let this = checkpoint::RunKind::of_run(&config.model_name_or_path, config.use_peft);
    checkpoint::check_output_dir(&config.output_dir, &this, config.overwrite_output_dir)?;
    let mut resume_from = None;
    if let Some(spec) = &config.resume_from_checkpoint {
        let ckpt = checkpoint::resolve(&config.output_dir, spec)?;
        state = checkpoint::read_trainer_state(&ckpt)?;
        if state.total_steps != total_steps {
            tracing::warn!(
                "resuming a run planned for {} steps with a config that gives {total_steps}",
                state.total_steps
            );
        }
        state.total_steps = total_steps;
        tracing::info!(
            "resumed from {} at step {}",
            ckpt.display(),
            state.global_step
        );
        resume_from = Some((ckpt, state.global_step as u64));
        let micro = (
            config.per_device_train_batch_size,
            config.gradient_accumulation_steps,
        );
        convert_position(&mut state, sampler, micro, steps_per_epoch, config);
    }
    let (batch, accumulation) = (
        config.per_device_train_batch_size,
        config.gradient_accumulation_steps,
    );
    state.effective_batch = Some(batch * sampler.world * accumulation);
    Ok((state, resume_from))
}

/// A resumed `state`'s data position on this run's layout (`sampler`'s ranks, micro-batches
/// of `batch` rows, `accumulation` per step): the rest of the saved epoch is dealt from the
/// position the saved run reached (the same rounds when the layout is the same), and a
/// different effective batch is said, with the accumulation that keeps it when one does; the
/// run's steps are then counted on this layout (`max_steps` holds as given).
fn convert_position(
    state: &mut TrainerState,
    sampler: &DistributedSampler,
    (batch, accumulation): (usize, usize),
    steps_per_epoch: usize,
    args: &TrainingArguments,
) {
    // Positions of the epoch dealt before the checkpoint, all ranks: the saved run's own
    // start plus its steps at its effective batch (a checkpoint written before the effective
    // batch was recorded is read as this layout's).
    let Some(saved) = state.effective_batch else {
        return;
    };
    let seen = state.epoch_start_row + state.step_in_epoch * saved;
    state.epoch_start_row = seen.min(sampler.len);
    state.step_in_epoch = 0;
    let per_step = batch * sampler.world * accumulation;
    if saved == per_step {
        return;
    }
    let keeps = (saved % (batch * sampler.world) == 0)
        .then(|| saved / (batch * sampler.world))
        .filter(|&a| a > 0)
        .map_or(String::new(), |a| {
            format!("; --gradient_accumulation_steps {a} keeps it at {saved}")
        });
    tracing::warn!(
        "resuming a run trained at an effective batch of {saved} rows per step with {per_step} ({batch} per device x {} data-parallel ranks x {accumulation} accumulation steps){keeps}: the rest of epoch {} ({} of its {} rows) goes on from where it stopped",
        sampler.world,
        state.epoch,
        sampler.len - state.epoch_start_row,
        sampler.len
    );
    if args.max_steps > 0 {
        return;
    }
    // The epoch's rest, then the epochs (or fraction) left, at this layout's steps.
    let rest = sampler.steps_from(batch, accumulation, state.epoch_start_row);
    let after = (args.num_train_epochs - (state.epoch + 1) as f64).max(0.0);
    let later = (after * steps_per_epoch as f64).ceil() as usize;
    state.total_steps = state.global_step + rest + later;
}

/// How `args` ask for the model to be built under `strategy`, resuming from `resume_from`.
pub(super) fn parallel_options(
    args: &TrainingArguments,
    ctx: &DistContext,
    strategy: Strategy,
    resume_from: Option<(PathBuf, u64)>,
) -> Result<ParallelOptions> {
    let dir = &args.model_name_or_path;
    Ok(ParallelOptions {
        strategy,
        model_dir: dir.clone(),
        dtype: args.compute_dtype()?,
        attention: AttentionImpl::for_device(&args.attn_implementation, ctx.device())
            .expect("validated"),
        tiled_loss: args.use_liger_kernel,
        tiled_mlp: args.tiled_mlp,
        gradient_checkpointing: args.gradient_checkpointing,
        offload_activations: args.activation_offloading,
        adam: args.adam(),
        resume_from,
        lora: args.lora(&crate::models::auto::config_model_type(dir)?.unwrap_or_default()),
    })
}

/// Trainable parameters that the first step's backward did not reach are an error (they
/// would train on silently: only weight decay would move them), unless
/// `ddp_find_unused_parameters` says they are expected, as PyTorch's DDP asks.
fn check_unused(without: &[String], find_unused: Option<bool>) -> Result<()> {
    if without.is_empty() {
        return Ok(());
    }
    let shown = without
        .iter()
        .take(8)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    let more = match without.len() {
        n if n > 8 => format!(" and {} more", n - 8),
        _ => String::new(),
    };
    if find_unused == Some(true) {
        tracing::warn!(
            "{} parameter(s) got no gradient in the first step ({shown}{more}); \
             ddp_find_unused_parameters is true, so they are updated with zero gradients",
            without.len()
        );
        return Ok(());
    }
    Err(Error::Config {
        file: "the training arguments".into(),
        key: "ddp_find_unused_parameters".into(),
        message: format!(
            "{} trainable parameter(s) got no gradient in the first step: {shown}{more}. \
             Usual causes: an op without a backward pass between the parameter and the loss \
             (candle_nn::rotary_emb::rope / rope_i, candle_nn::ops::rms_norm, softmax_last_dim, \
             candle_flash_attn on a CPU: use trl_runtime::nn's drop-ins, which have one), a \
             tensor detached on the way, or a branch the forward did not take. If parameters \
             are unused on purpose, pass --ddp_find_unused_parameters true (they then get \
             zero gradients)",
            without.len()
        ),
    })
}

/// Values a DeepSpeed config fixes must match the training arguments (transformers refuses a
/// mismatch too); "auto" in a JSON leaves them to the arguments.
fn check_deepspeed_values(
    config: &TrainingArguments,
    plan: &crate::config::LaunchPlan,
) -> Result<()> {
    let Some(ds) = &plan.deepspeed else {
        return Ok(());
    };
    let file = ds
        .config_file
        .as_ref()
        .map_or("the launch's deepspeed_config".into(), |p| {
            p.display().to_string()
        });
    // (DeepSpeed's key, its value, the training argument, ours)
    let pairs = [
        (
            "gradient_accumulation_steps",
            ds.gradient_accumulation_steps.map(|n| n as f64),
            "gradient_accumulation_steps",
            config.gradient_accumulation_steps as f64,
        ),
        (
            "gradient_clipping",
            ds.gradient_clipping,
            "max_grad_norm",
            config.max_grad_norm,
        ),
        (
            "train_micro_batch_size_per_gpu",
            ds.train_micro_batch_size_per_gpu.map(|n| n as f64),
            "per_device_train_batch_size",
            config.per_device_train_batch_size as f64,
        ),
    ];
    for (key, theirs, arg, ours) in pairs {
        if let Some(theirs) = theirs.filter(|t| (t - ours).abs() > 1e-12) {
            return Err(Error::Config {
                file,
                key: key.into(),
                message: format!(
                    "{theirs} differs from the training argument {arg} = {ours}: make them equal (or write \"auto\" in the DeepSpeed JSON)"
                ),
            });
        }
    }
    Ok(())
}

impl<'a, N: CausalModel> Core<'a, N> {
    /// The model of `args.model_name_or_path`, parallel as `strategy` says, resumed where
    /// asked, for `rows` training rows.
    pub(super) fn load(
        args: &TrainingArguments,
        ctx: &'a DistContext,
        strategy: Strategy,
        rows: usize,
        tokenizer: TextTokenizer,
    ) -> Result<Self> {
        check_deepspeed_values(args, ctx.plan())?;
        let dp = ctx.group(DP);
        let dir = args.model_name_or_path.clone();
        let config_file = dir.join("config.json");
        let router_loss_weight = match std::fs::read_to_string(&config_file) {
            Ok(json) => args.router_loss_weight(&json, &config_file.display().to_string())?,
            Err(_) => 0.0,
        };
        let dtype = args.compute_dtype()?;
        if dtype != DType::F32 {
            tracing::info!("mixed precision: {dtype:?} weights and compute, fp32 master weights, optimizer state and gradient accumulation");
        }
        let sampler = DistributedSampler {
            len: rows,
            world: dp.size(),
            rank: dp.rank(),
            seed: args.data_order_seed(),
            shuffle: args.train_sampling_strategy != "sequential",
            drop_last: args.dataloader_drop_last,
        };
        let batch = args.per_device_train_batch_size;
        let micro_batches_per_epoch = sampler.deal(batch).rounds();
        if micro_batches_per_epoch == 0 {
            let fix = match args.dataloader_drop_last {
                true => ", and dataloader_drop_last is true: lower per_device_train_batch_size, add data, or set dataloader_drop_last false",
                false => ": add data",
            };
            return Err(Error::Config {
                file: args.dataset_name.display().to_string(),
                key: "per_device_train_batch_size".into(),
                message: format!(
                    "{rows} training rows cannot fill one micro-batch of {batch} rows on each of {} ranks{fix}",
                    dp.size()
                ),
            });
        }
        let by_length = ["group_by_length", "batch_rebalance"];
        if ctx.rank() == 0 && by_length.contains(&args.train_sampling_strategy.as_str()) {
            tracing::warn!(
                "train_sampling_strategy {}: rows are shuffled at random here (ordering them by length is not built)",
                args.train_sampling_strategy
            );
        }
        // As transformers' Trainer: an epoch's last step takes the micro-batches left.
        let steps_per_epoch = micro_batches_per_epoch.div_ceil(args.gradient_accumulation_steps);
        let dealt = micro_batches_per_epoch * batch * dp.size();
        if ctx.rank() == 0 && dealt < rows {
            tracing::warn!(
                "{} of {rows} training rows are left out of each epoch (a different set, by the shuffle): they do not fill a micro-batch of {batch} rows on each of {} ranks (dataloader_drop_last true; false trains them)",
                rows - dealt,
                dp.size()
            );
        } else if ctx.rank() == 0 && dealt > rows && dp.size() > 1 {
            tracing::info!(
                "{} rows of each epoch's start are trained twice, filling the last micro-batches of {} ranks as accelerate does ({rows} rows; dataloader_drop_last true leaves out the rest instead)",
                dealt - rows,
                dp.size()
            );
        }
        let total_steps = args.total_steps(steps_per_epoch);
        // A restart resumes from the run's latest checkpoint (see resume_spec).
        let args = &TrainingArguments {
            resume_from_checkpoint: resume_spec(args),
            ..args.clone()
        };
        let (state, resume_from) = resume_state(args, total_steps, &sampler, steps_per_epoch)?;
        // The model, parallel as the launch says, resumed where asked.
        let Built {
            model,
            optimizer,
            tp_grads,
            checkpoint_format,
            read_shards,
        } = build::<N>(ctx, &parallel_options(args, ctx, strategy, resume_from)?)?;
        // The ranks that see different tokens: data-parallel ones, and those holding the other
        // chunks of the same rows.
        let batch_group = ctx.group(batch_axes(model.split()));
        let schedule = args.schedule(state.total_steps)?;
        let stop = Arc::new(AtomicBool::new(false));
        // SLURM sends SIGTERM before preemption: finish the step, save, exit cleanly.
        let _ = signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone());
        Ok(Core {
            args: args.clone(),
            checkpoint_format,
            ctx,
            batch_group,
            dp,
            model,
            tokenizer,
            optimizer,
            strategy,
            read_shards,
            tp_grads,
            unused_checked: false,
            schedule,
            sampler,
            order: None,
            state,
            micro_batches_per_epoch,
            steps_per_epoch,
            stop,
            predicted: None,
            router_loss_weight,
        })
    }

    /// How a model run beside this one and never trained (distillation's teacher, in `dir`)
    /// is held ([`crate::parallel::build_frozen`]): the run's strategy, dtype and attention;
    /// no LoRA, no checkpointing, nothing resumed.
    pub fn frozen_options(&self, dir: &std::path::Path) -> Result<ParallelOptions> {
        let args = TrainingArguments {
            model_name_or_path: dir.to_path_buf(),
            use_peft: false,
            ..self.args.clone()
        };
        let mut opts = parallel_options(&args, self.ctx, self.strategy, None)?;
        opts.gradient_checkpointing = false;
        opts.offload_activations = false;
        Ok(opts)
    }

    /// Every parameter's full value, whichever strategy holds them (collective under ZeRO-3 /
    /// FSDP and tensor parallelism: every rank calls it).
    pub fn gather_weights(&self) -> Result<BTreeMap<String, Tensor>> {
        let mine = match &self.model.sharding {
            Some(sharding) => sharding.gather_full()?,
            None => self
                .model
                .params
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .collect(),
        };
        self.model.gather_split(mine, tp_state::gather_full)
    }

    pub fn total_steps(&self) -> usize {
        self.state.total_steps
    }

    pub fn steps_per_epoch(&self) -> usize {
        self.steps_per_epoch
    }

    /// Steps of the current epoch: all of them, or a resumed epoch's rest.
    fn steps_in_this_epoch(&self) -> usize {
        let (b, a) = (
            self.args.per_device_train_batch_size,
            self.args.gradient_accumulation_steps,
        );
        self.sampler.steps_from(b, a, self.state.epoch_start_row)
    }

    /// Epochs completed, with the fraction of the current one's micro-batches trained
    /// (transformers' state.epoch).
    pub fn epoch(&self) -> f64 {
        let per_round = self.args.per_device_train_batch_size * self.dp.size();
        let before = self.state.epoch_start_row / per_round.max(1);
        let done = before + self.state.step_in_epoch * self.args.gradient_accumulation_steps;
        let all = self.micro_batches_per_epoch;
        self.state.epoch as f64 + done.min(all) as f64 / all as f64
    }

    /// Examples per optimizer step across all data-parallel ranks.
    pub fn effective_batch_size(&self) -> usize {
        self.args.per_device_train_batch_size
            * self.dp.size()
            * self.args.gradient_accumulation_steps
    }

    /// Sums over the data-parallel ranks (each counted once).
    pub fn global_sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        let t = Tensor::new(values, &Device::Cpu)?;
        Ok(self.dp.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?)
    }

    /// Each value's largest over the data-parallel ranks.
    pub fn global_max(&self, values: &[f64]) -> Result<Vec<f64>> {
        let t = Tensor::new(values, &Device::Cpu)?;
        Ok(self.dp.all_reduce(&t, ReduceOp::Max)?.to_vec1::<f64>()?)
    }

    /// Sums over every rank that sees different tokens (sequence chunks included).
    pub fn batch_sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        let t = Tensor::new(values, &Device::Cpu)?;
        Ok(self
            .batch_group
            .all_reduce(&t, ReduceOp::Sum)?
            .to_vec1::<f64>()?)
    }

    /// Sums over the ranks holding the other chunks of the same rows (a sequence split over
    /// sp / cp ranks: each holds part of each row's sums); `values` as they are without one.
    pub fn sequence_sum(&self, values: Vec<f64>) -> Result<Vec<f64>> {
        let Some(split) = self.model.split() else {
            return Ok(values);
        };
        let t = Tensor::new(values.as_slice(), &Device::Cpu)?;
        Ok(split
            .group
            .all_reduce(&t, ReduceOp::Sum)?
            .to_vec1::<f64>()?)
    }

    /// The row indices of this rank's micro-batches in the current step.
    /// The last step of an epoch takes the micro-batches left, fewer where
    /// gradient_accumulation_steps does not divide them.
    pub(super) fn step_rows(&mut self) -> Vec<Vec<usize>> {
        let (b, a) = (
            self.args.per_device_train_batch_size,
            self.args.gradient_accumulation_steps,
        );
        // The epoch's order is computed once per epoch, not every step (a resumed epoch's
        // from where the saved run stopped).
        let epoch = self.state.epoch as u64;
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let start = self.state.epoch_start_row;
            self.order = Some((epoch, self.sampler.batches_from(epoch, b, start)));
        }
        let batches = &self.order.as_ref().expect("set above").1;
        let start = (self.state.step_in_epoch * a).min(batches.len());
        batches[start..(start + a).min(batches.len())].to_vec()
    }

    /// Runs `f` (a micro-batch's training forward) with this step's random draws, LoRA's
    /// dropout masks and NEFTune's embedding noise: drawn from the step and micro-batch, the
    /// same on the ranks that share a row and when a layer is recomputed.
    pub fn training_forward<R>(&self, micro: usize, f: impl FnOnce() -> R) -> R {
        let key = (self.args.seed << 32) ^ ((self.state.global_step as u64) << 8) ^ micro as u64;
        let noise = self.args.neftune_noise_alpha.map(|alpha| (alpha, key));
        crate::nn::embedding::with_neftune(noise, || crate::nn::lora::with_dropout(key, f))
    }

    /// Gradients for a new step (on the run's first step, it records which parameters got one).
    pub(super) fn begin_step(&self) -> StepGrads {
        StepGrads {
            grads: BTreeMap::new(),
            reached: (!self.unused_checked).then(HashSet::new),
        }
    }

    /// Whether a step of `micro_batches` keeps its gradients in the compute dtype
    /// ([`crate::parallel::estimate::native_gradients`]).
    pub(super) fn native_gradients(&self, micro_batches: usize) -> bool {
        let gpu = self.ctx.device().is_cuda();
        let single = self.optimizer.single_replica();
        crate::parallel::estimate::native_gradients(gpu, micro_batches, single)
    }

    /// Adds one micro-batch's gradients (`store`, from [`Model::backward`]) to the step's, of
    /// `micro_batches` in the step.
    pub fn accumulate(
        &self,
        acc: &mut StepGrads,
        store: GradStore,
        micro_batches: usize,
    ) -> Result<()> {
        if let Some(sharding) = &self.model.sharding {
            // Sharded units reduced their gradients during the backward itself; a frozen
            // base's units reduce nothing, and the adapters' gradients are collected below.
            sharding.finish_backward()?;
            if !sharding.frozen() {
                return Ok(());
            }
        }
        let native_grads = self.native_gradients(micro_batches);
        for (name, var) in self.model.params.iter() {
            let g = match store.get(var.as_tensor()) {
                Some(g) => {
                    if let Some(reached) = acc.reached.as_mut() {
                        reached.insert(name.clone());
                    }
                    g.clone()
                }
                None => var.as_tensor().zeros_like()?,
            };
            if native_grads {
                acc.grads.insert(name.clone(), g);
                continue;
            }
            // Accumulated in fp32 whatever the compute dtype (DeepSpeed's bf16 default); on
            // a GPU the sum grows in place, reading each micro-batch's gradient as it is.
            let mut slot = acc.grads.remove(name);
            crate::kernels::precision::accumulate(&mut slot, g, DType::F32)?;
            if let Some(sum) = slot {
                acc.grads.insert(name.clone(), sum);
            }
        }
        Ok(())
    }

    /// Ends a step: on the run's first, the check that every parameter got a gradient; then
    /// the optimizer step and the state advanced. Returns (learning rate, gradient norm).
    pub(super) fn finish_step(&mut self, acc: StepGrads) -> Result<(f64, f64)> {
        let StepGrads { mut grads, reached } = acc;
        let first = reached.is_some();
        // The run's first step checks that every parameter got a gradient, and under tp
        // that the plan's replicated and partial parameters are what their gradients say.
        if let Some(reached) = reached {
            self.unused_checked = true;
            let mut without: Vec<String> = match &self.model.sharding {
                Some(sharding) => sharding.take_without_grad(),
                None => Vec::new(),
            };
            // Parameters outside the units (all of them unsharded; LoRA adapters beside a
            // sharded base; none otherwise under FSDP).
            without.extend(
                self.model
                    .params
                    .iter()
                    .map(|(name, _)| name)
                    .filter(|n| !reached.contains(n.as_str()))
                    .cloned(),
            );
            // Routed experts may see no token in a step by design.
            let net = self.model.net();
            let without: Vec<String> = without
                .into_iter()
                .filter(|n| !net.may_skip_grad(n))
                .collect();
            check_unused(&without, self.args.ddp_find_unused_parameters)?;
        }
        let lr = self.schedule.lr(self.state.global_step);
        let grad_norm = self.optimizer.step(
            &self.model.params,
            &mut grads,
            self.tp_grads.as_ref(),
            (self.args.max_grad_norm, lr),
            first,
        )?;
        self.state.global_step += 1;
        self.state.step_in_epoch += 1;
        if self.state.step_in_epoch == self.steps_in_this_epoch() {
            self.state.epoch += 1;
            self.state.step_in_epoch = 0;
            self.state.epoch_start_row = 0;
        }
        Ok((lr, grad_norm))
    }

    /// Greedy answers to `prompts`, one left-padded batch through the KV cache under the
    /// model's strategy (`parallel::generate`), each answer cut before its EOS. Where forwards
    /// are collective every rank calls it as often, and ranks step together.
    pub fn generate(&self, prompts: &[&[u32]], max_new: usize) -> Result<Vec<Vec<u32>>> {
        let tok = &self.tokenizer;
        let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let (ids, mask) = crate::generation::left_pad(prompts, tok.pad_token_id)?;
        let cfg = GenerationConfig {
            max_new_tokens: max_new,
            eos_token_id: tok.eos_token_id.into_iter().collect(),
            pad_token_id: Some(tok.pad_token_id),
            ..GenerationConfig::default()
        };
        let out = self.model.generate(&ids, &mask, &cfg, GatherMode::Auto)?;
        Ok(out
            .to_vec2::<u32>()?
            .into_iter()
            .map(|row| {
                let answer = &row[width..];
                let end = answer
                    .iter()
                    .position(|t| Some(*t) == tok.eos_token_id)
                    .unwrap_or(answer.len());
                answer[..end].to_vec()
            })
            .collect())
    }

    /// Forwards a rank runs for `own` batches of `per` out of `total` dealt over the
    /// data-parallel ranks: with collective forwards every rank runs rank 0's count (the most).
    pub fn rounds(&self, total: usize, per: usize, own: usize) -> usize {
        if self.lockstep() {
            total.div_ceil(self.dp.size()).div_ceil(per)
        } else {
            own
        }
    }

    /// Whether every forward is collective (sharded parameters, or layers split over tp), so
    /// that all ranks must run the same number of them.
    pub fn lockstep(&self) -> bool {
        self.model.sharding.is_some() || self.model.tp().is_some()
    }

    pub(super) fn stop_requested(&self) -> Result<bool> {
        let flag = Tensor::new(&[self.stop.load(Ordering::Relaxed) as u8], &Device::Cpu)?;
        Ok(self
            .ctx
            .world()
            .all_reduce(&flag, ReduceOp::Max)?
            .to_vec1::<u8>()?[0]
            == 1)
    }

    /// Trainable parameters at full size (tensor-parallel slices counted whole).
    fn trainable_parameters(&self) -> usize {
        let mut split = HashMap::new();
        for e in self.model.tp_plan() {
            split.insert(e.name.as_str(), e.full_shape.iter().product::<usize>());
        }
        self.model
            .params
            .iter()
            .map(|(n, v)| split.get(n.as_str()).copied().unwrap_or(v.elem_count()))
            .sum()
    }

    /// What the run is about to do: sizes, batch, strategy and memory, and the worker report
    /// (on the main process).
    pub(super) fn announce_start(&self) -> Result<()> {
        let tp_note = match self.model.tp() {
            Some(tp) => format!(
                "; each data-parallel rank is {} tensor-parallel ranks splitting every layer",
                tp.size()
            ),
            None => String::new(),
        };
        let what = match self.model.lora() {
            // peft's print_trainable_parameters, counted over the whole model.
            Some(lora) => {
                let trainable = self.trainable_parameters();
                let all = self.model.num_parameters() + trainable;
                format!(
                    "LoRA adapters (r {}, {}): {trainable} trainable of {all} parameters ({:.2}%)",
                    lora.r,
                    lora.targets,
                    100.0 * trainable as f64 / all as f64
                )
            }
            None => format!("{} parameters", self.model.num_parameters()),
        };
        tracing::info!(
            "training {what} for {} steps ({} per epoch): effective batch {} = {} per device x {} data-parallel ranks x {} accumulation steps{tp_note}",
            self.state.total_steps,
            self.steps_per_epoch,
            self.effective_batch_size(),
            self.args.per_device_train_batch_size,
            self.dp.size(),
            self.args.gradient_accumulation_steps
        );
        let mem = self.memory();
        let sp_note = match self.model.split() {
            Some(s) if s.ring => format!(" x {} context-parallel", s.group.size()),
            Some(s) => format!(" x {} sequence-parallel", s.group.size()),
            None => String::new(),
        };
        tracing::info!(
            "{:?} over {} data-parallel{sp_note} rank(s): model state per rank {:.1} MiB = parameters {:.1} + gradients {:.1} + optimizer {:.1} (fp32 AdamW keeps master weights and two moments)",
            self.strategy,
            self.dp.size(),
            mem.total() as f64 / 1048576.0,
            mem.parameters as f64 / 1048576.0,
            mem.gradients as f64 / 1048576.0,
            mem.optimizer as f64 / 1048576.0
        );
        let report = self.report()?;
        if self.ctx.is_main_process() {
            tracing::info!("worker report: {report}");
        }
        Ok(())
    }

    /// metrics.jsonl on the main process: a fresh run starts it over; a resumed run continues
    /// it from the step it resumed at (the lines of steps after it, which it trains again, are
    /// dropped), after a line marking the restart when the launcher restarted it.
    pub(super) fn open_metrics(&self) -> Result<Option<std::fs::File>> {
        if !self.ctx.is_main_process() {
            return Ok(None);
        }
        let path = self.args.output_dir.join("metrics.jsonl");
        let io = |e| Error::io(format!("cannot write {}", path.display()), e);
        let resumed = self.args.resume_from_checkpoint.is_some();
        if !resumed {
            return Ok(Some(std::fs::File::create(&path).map_err(io)?));
        }
        let step = self.state.global_step as u64;
        let kept: String = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_none_or(|s| s <= step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        crate::models::params::write_atomic(&path, kept.as_bytes())?;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(io)?;
        if let Some(n) = restart_count() {
            let line = serde_json::json!({ "restart": n, "resumed_at_step": step });
            std::io::Write::write_all(&mut file, format!("{line}\n").as_bytes()).map_err(io)?;
        }
        Ok(Some(file))
    }
}
