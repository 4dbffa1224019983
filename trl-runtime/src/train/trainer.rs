//! The SFT trainer: data, model and resume state wired to `parallel::parallelize` (which
//! applies the strategies the launch plan asks for), gradient accumulation, TRL's loss
//! averaging over the target tokens of the whole optimizer step, logging, evaluation,
//! checkpoints and exact resumption, and a clean stop on SIGTERM.
//!
//! Loss rule (docs/architecture.md): per optimizer step, count the target tokens of every
//! micro-batch on every data-parallel rank; each micro-batch contributes sum(token losses) / that count;
//! gradients are summed across micro-batches and ranks. So 2 ranks x batch 2, 1 rank x 2
//! accumulation steps x batch 2 and 1 rank x batch 4 take the same steps.

use super::args::TrainerConfig;
use super::checkpoint::{self, TrainerState};
use super::config::SFTConfig;
use super::schedule::LrSchedule;
use crate::alloc::StorageBytes;
use crate::comm::{Communicator, ReduceOp};
use crate::data::dataset::{load, to_example, Content, OnBadRow, Record, TokenizeOptions};
use crate::data::sequence::lcm;
use crate::data::{
    collate, pack, Batch, CollateOptions, DistributedSampler, Example, PackedSequence,
    PackingStrategy, TextTokenizer,
};
use crate::dist::mesh::{Axis, DP};
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::models::{AutoModelForCausalLM, CausalModel, Params};
use crate::nn::lora::LoraConfig;
use crate::nn::AttentionImpl;
use crate::optim::AdamW;
use crate::parallel::sharded_state;
use crate::parallel::Model;
use crate::parallel::{
    batch_axes, build, shard_axes, Built, CheckpointFormat, Optimizer, ParallelOptions, Strategy,
};
use crate::tp::{state as tp_state, TpGrads};
use candle_core::{DType, Device, Tensor, D};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

const MAX_NEW_TOKENS: usize = 16;

/// Bytes of model state one rank holds (parameters, gradients after reduction, optimizer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    pub parameters: usize,
    pub gradients: usize,
    pub optimizer: usize,
}

impl MemoryReport {
    pub fn total(&self) -> usize {
        self.parameters + self.gradients + self.optimizer
    }
}

/// Restarts the peak-resident-memory count (Linux: `5` into /proc/self/clear_refs), so that
/// `peak_rss_bytes` measures from here. Returns false where the OS does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Peak resident memory of this process so far (VmHWM), when the OS reports it.
pub fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    pub loss: f64,
    pub learning_rate: f64,
    pub grad_norm: f64,
    /// Input tokens processed by all ranks in this step (padding excluded).
    pub tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    pub loss: f64,
    /// Exact-match accuracy of greedy answers on held-out prompts (when there are any).
    pub accuracy: Option<f64>,
}

#[derive(Debug, Clone, Default)]
pub struct TrainOutcome {
    pub losses: Vec<f64>,
    pub initial_eval: Option<EvalResult>,
    pub final_eval: Option<EvalResult>,
    /// Stopped by SIGTERM (a checkpoint was saved first).
    pub preempted: bool,
    pub last_checkpoint: Option<PathBuf>,
}

pub struct Trainer<'a, N: CausalModel = AutoModelForCausalLM> {
    pub config: SFTConfig,
    ctx: &'a DistContext,
    /// The data-parallel ranks: they draw different examples.
    dp: Arc<dyn Communicator>,
    /// The ranks that see different tokens: `dp` and, under sequence parallelism, the sp
    /// ranks holding the other chunks. Token counts and gradients are summed over it.
    batch_group: Arc<dyn Communicator>,
    pub model: Model<N>,
    pub tokenizer: TextTokenizer,
    tokenizer_dir: PathBuf,
    pub optimizer: Optimizer,
    pub strategy: Strategy,
    /// Each rank read only its ZeRO-3 / FSDP slices of the model (efficient loading).
    pub read_shards: bool,
    /// Under tensor parallelism: the global gradient norm over the tp group (DDP clips with
    /// it; ZeRO and FSDP optimizers hold their own copy).
    tp_grads: Option<TpGrads>,
    /// How intermediate checkpoints hold sharded state (the final one is always full).
    pub checkpoint_format: CheckpointFormat,
    schedule: LrSchedule,
    train_rows: Vec<PackedSequence>,
    eval_rows: Vec<PackedSequence>,
    eval_prompts: Vec<(Vec<u32>, String)>,
    collate_options: CollateOptions,
    sampler: DistributedSampler,
    /// This epoch's sample order (epoch, indices), cached across its steps.
    order: Option<(u64, Vec<usize>)>,
    pub state: TrainerState,
    steps_per_epoch: usize,
    stop: Arc<AtomicBool>,
    /// Whether the first step's gradients were checked for parameters that got none.
    unused_checked: bool,
}

/// Where a run starts: a fresh state, or the trainer state of the checkpoint
/// `resume_from_checkpoint` names (its directory and step, for the model's resume).
fn resume_state(
    config: &SFTConfig,
    total_steps: usize,
) -> Result<(TrainerState, Option<(PathBuf, u64)>)> {
    let mut state = TrainerState {
        total_steps,
        seed: config.training.seed,
        ..Default::default()
    };
    let mut resume_from = None;
    if let Some(spec) = &config.training.resume_from_checkpoint {
        let ckpt = checkpoint::resolve(&config.training.output_dir, spec)?;
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
    }
    Ok((state, resume_from))
}

/// How micro-batches are collated: padding-free rows or padding, lengths rounded so that
/// sequences split over sp (cp) divide into sp (2 x cp) chunks.
fn collate_options(
    config: &SFTConfig,
    split: Option<&crate::context_parallel::SeqSplit>,
    pad_token_id: u32,
) -> CollateOptions {
    // Sequences split over sp (cp) need lengths that divide into sp (2 x cp) chunks.
    let parts = match split {
        Some(s) if s.ring => 2 * s.group.size(),
        Some(s) => s.group.size(),
        None => 1,
    };
    let pad_to_multiple_of = match (config.pad_to_multiple_of, parts) {
        (multiple, 1) => multiple,
        (multiple, n) => Some(lcm(multiple.unwrap_or(1), n)),
    };
    CollateOptions {
        pad_token_id,
        padding_free: config.padding_free,
        pad_to_multiple_of,
    }
}

/// The tokenized training rows (packed or truncated to max_length), the held-out rows and
/// the held-out prompts scored by generation.
struct TrainData {
    train_rows: Vec<PackedSequence>,
    eval_rows: Vec<PackedSequence>,
    eval_prompts: Vec<(Vec<u32>, String)>,
}

impl TrainData {
    fn load(config: &SFTConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let policy = if config.training.skip_bad_rows {
            OnBadRow::Skip
        } else {
            OnBadRow::Fail
        };
        let opts = TokenizeOptions {
            completion_only_loss: config.completion_only_loss.unwrap_or(true),
            assistant_only_loss: config.assistant_only_loss,
        };
        let train_examples = tokenize_all(
            &load(&config.training.dataset_name, policy)?.records,
            tokenizer,
            opts,
        )?;
        let train_rows: Vec<PackedSequence> = if config.packing {
            let strategy = PackingStrategy::parse(&config.packing_strategy).expect("validated");
            pack(&train_examples, config.training.max_length, strategy)
        } else {
            train_examples
                .into_iter()
                .map(|e| truncate(e, config.training.max_length))
                .collect()
        };
        let (eval_rows, eval_prompts) = match &config.training.eval_dataset_name {
            Some(path) => {
                let records = load(path, policy)?.records;
                let rows = tokenize_all(&records, tokenizer, opts)?
                    .into_iter()
                    .map(|e| truncate(e, config.training.max_length))
                    .collect();
                let mut prompts = Vec::new();
                for r in records.iter().take(config.eval_generation_samples) {
                    if let Some(p) = prompt_and_answer(r, tokenizer)? {
                        prompts.push(p);
                    }
                }
                (rows, prompts)
            }
            None => (Vec::new(), Vec::new()),
        };
        Ok(TrainData {
            train_rows,
            eval_rows,
            eval_prompts,
        })
    }
}

/// Trainable parameters that the first step's backward did not reach are an error (they
/// would train on silently: only weight decay would move them), unless
/// `ddp_find_unused_parameters` says they are expected, as PyTorch's DDP asks.
/// `model_type` of the model directory's config.json (peft's default LoRA targets depend on
/// it).
fn model_type(dir: &std::path::Path) -> Result<String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(path.display().to_string(), "<document>", e.to_string()))?;
    Ok(json["model_type"].as_str().unwrap_or_default().to_string())
}

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
fn check_deepspeed_values(config: &SFTConfig, plan: &crate::config::LaunchPlan) -> Result<()> {
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
            config.training.gradient_accumulation_steps as f64,
        ),
        (
            "gradient_clipping",
            ds.gradient_clipping,
            "max_grad_norm",
            config.training.max_grad_norm,
        ),
        (
            "train_micro_batch_size_per_gpu",
            ds.train_micro_batch_size_per_gpu.map(|n| n as f64),
            "per_device_train_batch_size",
            config.training.per_device_train_batch_size as f64,
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

fn tokenize_all(
    records: &[Record],
    tok: &TextTokenizer,
    opts: TokenizeOptions,
) -> Result<Vec<Example>> {
    records
        .iter()
        .map(|r| to_example(r, tok, opts))
        .filter(|e| !e.as_ref().is_ok_and(Example::is_empty))
        .collect()
}

fn truncate(mut e: Example, max_length: usize) -> PackedSequence {
    e.input_ids.truncate(max_length);
    e.labels.truncate(max_length);
    PackedSequence::single(&e)
}

/// A held-out prompt and its expected answer (the last assistant message / the completion).
fn prompt_and_answer(r: &Record, tok: &TextTokenizer) -> Result<Option<(Vec<u32>, String)>> {
    Ok(match r {
        Record::Messages { messages: m, tools }
            if m.len() >= 2 && m.last().is_some_and(|x| x.role == "assistant") =>
        {
            let prompt = tok
                .apply_chat_template(&m[..m.len() - 1], tools.as_deref(), true)?
                .text;
            Some((
                tok.encode(&prompt, false)?,
                m.last().unwrap().text().trim().to_string(),
            ))
        }
        Record::PromptCompletion {
            prompt: Content::Text(p),
            completion: Content::Text(c),
            ..
        } => Some((tok.encode(p, false)?, c.trim().to_string())),
        _ => None,
    })
}

impl<'a> Trainer<'a> {
    /// The built-in model of the checkpoint's `model_type`: loads model, tokenizer and data as `config` says,
    /// resuming if asked; the strategy comes from the launcher's environment.
    pub fn new(config: SFTConfig, ctx: &'a DistContext) -> Result<Self> {
        Self::load(config, ctx)
    }

    pub fn with_strategy(
        config: SFTConfig,
        ctx: &'a DistContext,
        strategy: Strategy,
    ) -> Result<Self> {
        Self::load_with_strategy(config, ctx, strategy)
    }
}

impl<'a, N: CausalModel> Trainer<'a, N> {
    /// Model `N` (`Trainer::<MyModel>::load`): loads model, tokenizer and data as `config`
    /// says, resuming if asked; the strategy comes from the launcher's environment.
    pub fn load(config: SFTConfig, ctx: &'a DistContext) -> Result<Self> {
        Self::load_with_strategy(config, ctx, Strategy::from_plan(ctx.plan()))
    }

    pub fn load_with_strategy(
        config: SFTConfig,
        ctx: &'a DistContext,
        strategy: Strategy,
    ) -> Result<Self> {
        // `cargo trl launch` asking for this program's tensor-parallel plan.
        super::plan_query::answer_if_asked::<N>(&config.training.model_name_or_path)?;
        config.validate("training arguments")?;
        check_deepspeed_values(&config, ctx.plan())?;
        let dp = ctx.group(DP);
        let dir = config.training.model_name_or_path.clone();
        let tokenizer = TextTokenizer::from_dir(&dir)?;
        let dtype = config.training.compute_dtype()?;
        if dtype != DType::F32 {
            tracing::info!("mixed precision: {dtype:?} weights and compute, fp32 master weights, optimizer state and gradient accumulation");
        }
        let TrainData {
            train_rows,
            eval_rows,
            eval_prompts,
        } = TrainData::load(&config, &tokenizer)?;
        let sampler = DistributedSampler {
            len: train_rows.len(),
            world: dp.size(),
            rank: dp.rank(),
            seed: config.training.seed,
            shuffle: true,
            drop_last: true,
        };
        let per_step = config.training.per_device_train_batch_size
            * config.training.gradient_accumulation_steps;
        let steps_per_epoch = sampler.num_samples() / per_step;
        if steps_per_epoch == 0 {
            return Err(Error::Config {
                file: config.training.dataset_name.display().to_string(),
                key: "per_device_train_batch_size".into(),
                message: format!(
                    "{} training rows cannot fill one global batch of {} (per_device_train_batch_size x {} ranks x gradient_accumulation_steps): lower them or add data",
                    train_rows.len(),
                    per_step * dp.size(),
                    dp.size()
                ),
            });
        }
        let total_steps = config.training.total_steps(steps_per_epoch);
        let adam = config.training.adam();
        let (state, resume_from) = resume_state(&config, total_steps)?;
        // The model, parallel as the launch says, resumed where asked.
        let Built {
            model,
            optimizer,
            tp_grads,
            checkpoint_format,
            read_shards,
        } = build::<N>(
            ctx,
            &ParallelOptions {
                strategy,
                model_dir: dir.clone(),
                dtype,
                attention: AttentionImpl::for_device(
                    &config.training.attn_implementation,
                    ctx.device(),
                )
                .expect("validated"),
                tiled_loss: config.training.use_liger_kernel,
                tiled_mlp: config.training.tiled_mlp,
                gradient_checkpointing: config.training.gradient_checkpointing,
                offload_activations: config.training.activation_offloading,
                adam,
                resume_from,
                lora: config.training.lora(&model_type(&dir)?),
            },
        )?;
        // The ranks that see different tokens: data-parallel ones, and those holding the other
        // chunks of the same rows.
        let split = model.split().cloned();
        let batch_group = ctx.group(batch_axes(split.as_ref()));
        let schedule = config.training.schedule(total_steps)?;
        let collate_options = collate_options(&config, split.as_ref(), tokenizer.pad_token_id);
        let stop = Arc::new(AtomicBool::new(false));
        // SLURM sends SIGTERM before preemption: finish the step, save, exit cleanly.
        let _ = signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone());
        let trainer = Trainer {
            checkpoint_format,
            tokenizer_dir: dir,
            config,
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
            train_rows,
            eval_rows,
            eval_prompts,
            collate_options,
            sampler,
            order: None,
            state,
            steps_per_epoch,
            stop,
        };
        crate::alloc::release_freed_memory();
        Ok(trainer)
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
        match self.model.tp() {
            Some(tp) => tp_state::gather_full(mine, self.model.tp_plan(), tp.as_ref()),
            None => Ok(mine),
        }
    }

    pub fn total_steps(&self) -> usize {
        self.state.total_steps
    }

    pub fn steps_per_epoch(&self) -> usize {
        self.steps_per_epoch
    }

    /// Model state this rank holds under its strategy. Parameters and optimizer state are
    /// measured from the storages they keep allocated (shared storage counted once, a slice
    /// counting what it keeps alive); gradients, which exist only during a step, count what is
    /// kept after the reduction (ZeRO-2 / ZeRO-3: this rank's slice).
    pub fn memory(&self) -> MemoryReport {
        let mut held = StorageBytes::default();
        if let Some(sharding) = &self.model.sharding {
            sharding.add_storage(&mut held);
        }
        // What the layers hold whole: every weight unsharded (a LoRA base among them, frozen
        // in the compute dtype), else the adapters beside the units.
        crate::tp::named_tensors(self.model.net())
            .values()
            .for_each(|t| held.add(t));
        let parameters = held.total;
        self.optimizer.state().add_storage(&mut held);
        let grad_full = self.model.params.num_elements() * 4;
        let gradients = self.optimizer.grad_bytes(grad_full);
        MemoryReport {
            parameters,
            gradients,
            optimizer: held.total - parameters,
        }
    }

    /// What this job runs, as the workers see it (collective: every rank calls it): the
    /// distributed type, the mesh, the strategy and its settings, and the model-state bytes
    /// of every rank. `cargo trl launch --dry-run` prints the same plan before anything runs.
    pub fn report(&self) -> Result<serde_json::Value> {
        let world = self.ctx.world();
        let mine = Tensor::new(&[self.memory().total() as f64], &Device::Cpu)?;
        let bytes = world.all_gather(&mine, 0)?.to_vec1::<f64>()?;
        let d = self.ctx.mesh.dims();
        Ok(serde_json::json!({
            "distributed_type": self.ctx.plan().distributed_type.as_str(),
            "mesh": {
                "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard,
                "cp": d.cp, "sp": d.sp, "tp": d.tp,
            },
            "strategy": self.strategy.name(),
            "activation_checkpointing": self.model.checkpointing.is_some(),
            "read_shards": self.read_shards,
            "offload_optimizer": self.offloaded(),
            "model_state_bytes": bytes.iter().map(|b| *b as u64).collect::<Vec<_>>(),
        }))
    }

    /// Whether the optimizer state lives in host memory while the model computes elsewhere.
    fn offloaded(&self) -> bool {
        let on_host = |a: &crate::optim::AdamW| {
            a.states
                .values()
                .next()
                .is_some_and(|s| s.master.device().is_cpu())
        };
        !self.ctx.device().is_cpu() && on_host(self.optimizer.state())
    }

    /// Examples per optimizer step across all data-parallel ranks.
    pub fn effective_batch_size(&self) -> usize {
        self.config.training.per_device_train_batch_size
            * self.dp.size()
            * self.config.training.gradient_accumulation_steps
    }

    /// Sums over the data-parallel ranks (each counted once).
    fn global_sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        let t = Tensor::new(values, &Device::Cpu)?;
        Ok(self.dp.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?)
    }

    /// Sums over every rank that sees different tokens (sequence chunks included).
    fn batch_sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        let t = Tensor::new(values, &Device::Cpu)?;
        Ok(self
            .batch_group
            .all_reduce(&t, ReduceOp::Sum)?
            .to_vec1::<f64>()?)
    }

    /// This step's micro-batches (this rank's part of their rows, on its device) and the
    /// tokens of their rows that this rank counts (each row's once, by the first rank of its
    /// sequence group).
    fn micro_batches(&mut self) -> Result<(Vec<Batch>, usize)> {
        let (b, a) = (
            self.config.training.per_device_train_batch_size,
            self.config.training.gradient_accumulation_steps,
        );
        // The epoch's order is computed once per epoch, not every step.
        let epoch = self.state.epoch as u64;
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.order = Some((epoch, self.sampler.indices(epoch)));
        }
        let order = &self.order.as_ref().expect("set above").1;
        let start = self.state.step_in_epoch * b * a;
        let mut batches = Vec::with_capacity(a);
        let mut local_tokens = 0usize;
        // The rows' tokens are counted once, by the first rank of their sequence group.
        let counts_tokens = self.model.split().is_none_or(|s| s.group.rank() == 0);
        for m in 0..a {
            let rows: Vec<&PackedSequence> = order[start + m * b..start + (m + 1) * b]
                .iter()
                .map(|&i| &self.train_rows[i])
                .collect();
            if counts_tokens {
                local_tokens += rows.iter().map(|r| r.len()).sum::<usize>();
            }
            let batch = collate(&rows, self.collate_options, &Device::Cpu)?;
            batches.push(
                batch
                    .part(self.model.split())?
                    .to_device(self.ctx.device())?,
            );
        }
        Ok((batches, local_tokens))
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches.
    pub fn train_step(&mut self) -> Result<StepStats> {
        let (batches, local_tokens) = self.micro_batches()?;
        let local_targets: usize = batches.iter().map(|x| x.num_target_tokens).sum();
        let totals = self.batch_sum(&[local_targets as f64, local_tokens as f64])?;
        let (targets, tokens) = (totals[0].max(1.0), totals[1] as usize);
        let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
        // One micro-batch on a GPU with nothing to all-reduce: the gradients stay in the
        // compute dtype (the GPU optimizer reads them as they are, in f32 math); otherwise
        // they are summed in fp32.
        let native_grads = batches.len() == 1
            && self.ctx.device().is_cuda()
            && matches!(&self.optimizer, Optimizer::Replicated(_, ddp) if ddp.replicas() == 1);
        let mut local_loss = 0.0;
        // On the run's first step: the parameters that got a gradient from some micro-batch.
        let first = !self.unused_checked;
        let mut reached: HashSet<&str> = HashSet::new();
        let t0 = Instant::now();
        for (micro, batch) in batches.iter().enumerate() {
            // LoRA dropout masks are drawn from the step and micro-batch (the same on the
            // ranks that share a row, and again when a layer is recomputed).
            let key = (self.config.training.seed << 32)
                ^ ((self.state.global_step as u64) << 8)
                ^ micro as u64;
            let ls = crate::nn::lora::with_dropout(key, || {
                self.model
                    .forward_targets(&batch.input_ids, &batch.position_ids, &batch.targets()?)
            })?;
            local_loss += ls.sum.to_scalar::<f32>()? as f64;
            let store = self.model.backward(&(ls.sum / targets)?)?;
            if let Some(sharding) = &self.model.sharding {
                // Sharded units reduced their gradients during the backward itself; a frozen
                // base's units reduce nothing, and the adapters' gradients are collected below.
                sharding.finish_backward()?;
                if !sharding.frozen() {
                    continue;
                }
            }
            for (name, var) in self.model.params.iter() {
                let g = match store.get(var.as_tensor()) {
                    Some(g) => {
                        if first {
                            reached.insert(name.as_str());
                        }
                        g.clone()
                    }
                    None => var.as_tensor().zeros_like()?,
                };
                if native_grads {
                    grads.insert(name.clone(), g);
                    continue;
                }
                // Accumulated in fp32 whatever the compute dtype (DeepSpeed's bf16 default); on
                // a GPU the sum grows in place, reading each micro-batch's gradient as it is.
                let mut slot = grads.remove(name);
                crate::kernels::precision::accumulate(&mut slot, g, DType::F32)?;
                if let Some(acc) = slot {
                    grads.insert(name.clone(), acc);
                }
            }
        }
        let t1 = Instant::now();
        // The run's first step checks that every parameter got a gradient, and under tp
        // that the plan's replicated and partial parameters are what their gradients say.
        if first {
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
            check_unused(&without, self.config.training.ddp_find_unused_parameters)?;
        }
        let lr = self.schedule.lr(self.state.global_step);
        let t2 = Instant::now();
        let training = &self.config.training;
        let grad_norm = self.optimizer.step(
            &self.model.params,
            &mut grads,
            self.tp_grads.as_ref(),
            (training.max_grad_norm, lr),
            first,
        )?;
        tracing::debug!(
            "step timing: forward+backward {:.3}s, checks {:.3}s, reduce+clip+optimizer {:.3}s",
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            t2.elapsed().as_secs_f64()
        );
        let loss = self.batch_sum(&[local_loss])?[0] / targets;
        self.state.global_step += 1;
        self.state.step_in_epoch += 1;
        if self.state.step_in_epoch == self.steps_per_epoch {
            self.state.epoch += 1;
            self.state.step_in_epoch = 0;
        }
        Ok(StepStats {
            loss,
            learning_rate: lr,
            grad_norm,
            tokens,
        })
    }

    /// Greedy continuation of `prompt` until EOS or `max_new` tokens. With sharded
    /// parameters every forward is collective, so all ranks run exactly `max_new` steps
    /// (tokens after EOS are computed and dropped).
    pub fn generate(&self, prompt: &[u32], max_new: usize) -> Result<Vec<u32>> {
        let lockstep = self.lockstep();
        let mut ids = prompt.to_vec();
        let mut answer_len = None;
        for _ in 0..max_new {
            let n = ids.len();
            let device = self.ctx.device();
            let input = Tensor::from_vec(ids.clone(), (1, n), device)?;
            let pos = Tensor::arange(0i64, n as i64, device)?.unsqueeze(0)?;
            let logits = self.model.forward_full(&input, &pos)?;
            let next = logits
                .get(0)?
                .get(n - 1)?
                .argmax(D::Minus1)?
                .to_scalar::<u32>()?;
            if answer_len.is_none() && Some(next) == self.tokenizer.eos_token_id {
                answer_len = Some(n - prompt.len());
                if !lockstep {
                    break;
                }
            }
            ids.push(next);
        }
        let end = prompt.len() + answer_len.unwrap_or(ids.len() - prompt.len());
        Ok(ids[prompt.len()..end].to_vec())
    }

    /// Eval loss over the held-out rows and exact-match accuracy of greedy answers, each rank
    /// taking every dp-th row and prompt. With sharded parameters the ranks run the same
    /// number of forwards (ranks with fewer rows repeat a row and drop the result).
    pub fn evaluate(&self) -> Result<Option<EvalResult>> {
        if self.eval_rows.is_empty() {
            return Ok(None);
        }
        let lockstep = self.lockstep();
        let (rank, world) = (self.dp.rank(), self.dp.size());
        let bs = self.config.training.per_device_eval_batch_size;
        let mine: Vec<&PackedSequence> = self.eval_rows.iter().skip(rank).step_by(world).collect();
        let chunks: Vec<&[&PackedSequence]> = mine.chunks(bs).collect();
        // Rank 0 has the most rows and prompts.
        let rounds = |total: usize, per: usize, own: usize| {
            if lockstep {
                total.div_ceil(world).div_ceil(per)
            } else {
                own
            }
        };
        let (mut sum, mut count) = (0.0, 0.0);
        let filler = [&self.eval_rows[0]];
        for i in 0..rounds(self.eval_rows.len(), bs, chunks.len()) {
            let chunk = chunks.get(i).copied().unwrap_or(&filler);
            let batch = collate(chunk, self.collate_options, &Device::Cpu)?
                .part(self.model.split())?
                .to_device(self.ctx.device())?;
            let ls = self.model.eval_targets(
                &batch.input_ids,
                &batch.position_ids,
                &batch.targets()?,
            )?;
            if i < chunks.len() {
                sum += ls.sum.to_scalar::<f32>()? as f64;
                count += ls.count as f64;
            }
        }
        let mut correct = 0.0;
        let prompts: Vec<_> = self.eval_prompts.iter().skip(rank).step_by(world).collect();
        for i in 0..rounds(self.eval_prompts.len(), 1, prompts.len()) {
            let Some((prompt, answer)) = prompts.get(i).copied().or(self.eval_prompts.first())
            else {
                break;
            };
            let out = self.generate(prompt, MAX_NEW_TOKENS)?;
            if i < prompts.len() && self.tokenizer.decode(&out, true)?.trim() == answer {
                correct += 1.0;
            }
        }
        // Loss sums come from every sequence chunk; answers are generated whole on each.
        let totals = self.batch_sum(&[sum, count])?;
        let correct = self.global_sum(&[correct])?[0];
        Ok(Some(EvalResult {
            loss: totals[0] / totals[1].max(1.0),
            accuracy: (!self.eval_prompts.is_empty())
                .then(|| correct / self.eval_prompts.len() as f64),
        }))
    }

    /// Whether every forward is collective (sharded parameters, or layers split over tp), so
    /// that all ranks must run the same number of them.
    fn lockstep(&self) -> bool {
        self.model.sharding.is_some() || self.model.tp().is_some()
    }

    fn save_checkpoint(&self) -> Result<Option<PathBuf>> {
        self.save_checkpoint_as(self.checkpoint_format)
    }

    /// Every rank writes its slices into the staging directory; rank 0 adds the config,
    /// tokenizer and index and renames it into place. With HSDP only the first replica writes.
    fn save_sharded_checkpoint(&self) -> Result<Option<PathBuf>> {
        let sharded = self
            .optimizer
            .sharded()
            .expect("DDP checkpoints are written full");
        let (pieces, step) = (sharded.pieces()?, sharded.step_count());
        let out = &self.config.training.output_dir;
        let main = self.ctx.is_main_process();
        let world = self.ctx.world();
        let tmp = checkpoint::staging_dir(out, self.state.global_step);
        if main {
            checkpoint::begin(out, self.state.global_step)?;
            checkpoint::write_model_files(
                &tmp,
                None,
                self.model.config_json(),
                &self.tokenizer_dir,
            )?;
        }
        world.barrier()?;
        // The group the optimizer state is sharded over (sequence chunks' ranks included).
        let shard = self.ctx.group(shard_axes(self.model.split()));
        if self.ctx.group(&[Axis::DpReplicate]).rank() == 0 {
            sharded_state::write_rank(&tmp, shard.rank(), shard.size(), &pieces)?;
        }
        world.barrier()?;
        let path = if main {
            let shapes = self.model.parameter_shapes();
            sharded_state::write_index(&tmp, shard.size(), shapes, step)?;
            Some(checkpoint::finish(
                out,
                &tmp,
                &self.state,
                self.config.training.save_total_limit,
            )?)
        } else {
            None
        };
        world.barrier()?;
        Ok(path)
    }

    /// The whole optimizer state: gathered from the data-parallel shards, then the
    /// tensor-parallel slices joined (collective: every rank calls it).
    fn gather_optimizer_state(&self) -> Result<Cow<'_, AdamW>> {
        let state = self.optimizer.gather_full_state()?;
        Ok(match self.model.tp() {
            Some(tp) => Cow::Owned(tp_state::gather_state(
                state.into_owned(),
                self.model.tp_plan(),
                tp.as_ref(),
            )?),
            None => state,
        })
    }

    /// A LoRA run's checkpoint: the adapters gathered whole (tensor-parallel slices joined)
    /// and written by rank 0 in peft's format, with their optimizer state.
    fn save_adapter_checkpoint(&self, lora: &LoraConfig) -> Result<Option<PathBuf>> {
        let mine: BTreeMap<String, Tensor> = self
            .model
            .params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let tensors = match self.model.tp() {
            Some(tp) => tp_state::gather_full(mine, self.model.tp_plan(), tp.as_ref())?,
            None => mine,
        };
        self.write_checkpoint(checkpoint::Weights::Adapter {
            tensors: &tensors,
            lora,
            base: &self.config.training.model_name_or_path,
        })
    }

    /// Gathers the optimizer state, then rank 0 writes the checkpoint of `weights`.
    fn write_checkpoint(&self, weights: checkpoint::Weights<'_>) -> Result<Option<PathBuf>> {
        let state = self.gather_optimizer_state()?;
        let path = if self.ctx.is_main_process() {
            Some(checkpoint::save(
                &self.config.training.output_dir,
                weights,
                &self.tokenizer_dir,
                &state,
                &self.state,
                self.config.training.save_total_limit,
            )?)
        } else {
            None
        };
        self.ctx.world().barrier()?;
        Ok(path)
    }

    fn save_checkpoint_as(&self, format: CheckpointFormat) -> Result<Option<PathBuf>> {
        if let Some(lora) = self.model.lora() {
            return self.save_adapter_checkpoint(lora);
        }
        let tp = self.model.tp();
        if format == CheckpointFormat::Sharded && tp.is_none() && self.optimizer.sharded().is_some()
        {
            return self.save_sharded_checkpoint();
        }
        // Weights held whole and unsplit are saved as they are; others are gathered.
        let gathered_params;
        let params = match (&self.model.sharding, tp) {
            (None, None) => &self.model.params,
            _ => {
                gathered_params = Params::from_tensors(self.gather_weights()?)?;
                &gathered_params
            }
        };
        self.write_checkpoint(checkpoint::Weights::Full {
            params,
            config_json: self.model.config_json(),
        })
    }

    fn stop_requested(&self) -> Result<bool> {
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
    fn announce_start(&self) -> Result<()> {
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
                    "LoRA adapters (r {}, {:?}): {trainable} trainable of {all} parameters ({:.2}%)",
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
            self.config.training.per_device_train_batch_size,
            self.dp.size(),
            self.config.training.gradient_accumulation_steps
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

    /// metrics.jsonl on the main process: a resumed run continues it, a fresh run starts it over.
    fn open_metrics(&self) -> Result<Option<std::fs::File>> {
        let out_dir = &self.config.training.output_dir;
        Ok(if self.ctx.is_main_process() {
            Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(self.config.training.resume_from_checkpoint.is_some())
                    .write(true)
                    .truncate(self.config.training.resume_from_checkpoint.is_none())
                    .open(out_dir.join("metrics.jsonl"))
                    .map_err(|e| Error::io("cannot open metrics.jsonl", e))?,
            )
        } else {
            None
        })
    }

    /// One metrics line: the step's figures (and evaluation's, when it ran), to metrics.jsonl,
    /// the log and the trainer state's history.
    fn log_step(
        &mut self,
        stats: &StepStats,
        tokens_per_s: f64,
        eval: Option<EvalResult>,
        metrics: Option<&mut std::fs::File>,
    ) -> Result<()> {
        let mut line = serde_json::json!({
            "step": self.state.global_step,
            "epoch": self.state.epoch as f64 + self.state.step_in_epoch as f64 / self.steps_per_epoch as f64,
            "loss": stats.loss,
            "learning_rate": stats.learning_rate,
            "grad_norm": stats.grad_norm,
            "tokens_per_s": tokens_per_s,
        });
        // This rank's resident-memory peak since training began (activations and
        // collective buffers on top of the model state logged at start).
        if let Some(peak) = peak_rss_bytes() {
            line["peak_memory_mib"] = (peak as f64 / 1048576.0).round().into();
        }
        if let Some(e) = eval {
            line["eval_loss"] = e.loss.into();
            if let Some(acc) = e.accuracy {
                line["eval_accuracy"] = acc.into();
            }
        }
        if let Some(f) = metrics {
            writeln!(f, "{line}").map_err(|e| Error::io("cannot write metrics.jsonl", e))?;
        }
        tracing::info!("{line}");
        self.state.log_history.push(line);
        Ok(())
    }

    /// Runs to `total_steps`, logging, evaluating and checkpointing as configured.
    pub fn train(&mut self) -> Result<TrainOutcome> {
        let main = self.ctx.is_main_process();
        let out_dir = self.config.training.output_dir.clone();
        if main {
            std::fs::create_dir_all(&out_dir)
                .map_err(|e| Error::io(format!("cannot create {}", out_dir.display()), e))?;
        }
        self.announce_start()?;
        reset_peak_rss();
        let mut outcome = TrainOutcome {
            initial_eval: self.evaluate()?,
            ..Default::default()
        };
        if let (true, Some(e)) = (main, outcome.initial_eval) {
            tracing::info!(
                "before training: eval loss {:.4}, accuracy {:?}",
                e.loss,
                e.accuracy
            );
        }
        // Under the launcher, rank 0 sends its progress there (its own bar would be piped away).
        let to_launcher = main && crate::progress::lines_requested();
        let bar = progress_bar(
            main && !self.config.training.disable_tqdm && !to_launcher,
            self.state.total_steps,
            self.state.global_step,
        );
        let mut metrics = self.open_metrics()?;
        let (mut window_tokens, mut window_start) = (0usize, Instant::now());
        let mut curve: Vec<(f64, f64)> = Vec::new();
        while self.state.global_step < self.state.total_steps {
            let stats = self.train_step()?;
            let step = self.state.global_step;
            outcome.losses.push(stats.loss);
            curve.push((step as f64, stats.loss));
            window_tokens += stats.tokens;
            let tokens_per_s =
                window_tokens as f64 / window_start.elapsed().as_secs_f64().max(1e-9);
            bar.set_position(step as u64);
            bar.set_message(format!(
                "loss {:.4} lr {:.2e} grad_norm {:.3} {:.0} tok/s",
                stats.loss, stats.learning_rate, stats.grad_norm, tokens_per_s
            ));
            if to_launcher && !self.config.training.disable_tqdm {
                crate::progress::emit(&crate::progress::Event::Step {
                    step: step as u64,
                    total: self.state.total_steps as u64,
                    loss: stats.loss,
                    lr: stats.learning_rate,
                    tokens_per_s,
                });
            }
            let eval_now = self
                .config
                .training
                .eval_steps
                .is_some_and(|n| step.is_multiple_of(n));
            let eval = if eval_now { self.evaluate()? } else { None };
            if step.is_multiple_of(self.config.training.logging_steps)
                || step == self.state.total_steps
                || eval.is_some()
            {
                self.log_step(&stats, tokens_per_s, eval, metrics.as_mut())?;
                (window_tokens, window_start) = (0, Instant::now());
            }
            if step.is_multiple_of(self.config.training.save_steps) {
                outcome.last_checkpoint = self.save_checkpoint()?;
                announce_saved(to_launcher, &outcome.last_checkpoint);
            }
            if self.stop_requested()? {
                bar.abandon_with_message("SIGTERM: saving a checkpoint and stopping");
                // Unless this very step was just saved.
                if !step.is_multiple_of(self.config.training.save_steps) {
                    outcome.last_checkpoint = self.save_checkpoint()?;
                    announce_saved(to_launcher, &outcome.last_checkpoint);
                }
                if let Some(path) = &outcome.last_checkpoint {
                    tracing::info!(
                        "stopped by SIGTERM after step {step}: checkpoint saved at {}",
                        path.display()
                    );
                }
                outcome.preempted = true;
                return Ok(outcome);
            }
        }
        bar.finish();
        // The final checkpoint, unless the last step just wrote it (the same on every rank).
        // It is always full, so that the result opens in transformers.
        if !self
            .state
            .global_step
            .is_multiple_of(self.config.training.save_steps)
            || self.checkpoint_format == CheckpointFormat::Sharded
        {
            outcome.last_checkpoint = self.save_checkpoint_as(CheckpointFormat::Full)?;
            announce_saved(to_launcher, &outcome.last_checkpoint);
        } else if self.ctx.is_main_process() {
            outcome.last_checkpoint = Some(
                self.config
                    .training
                    .output_dir
                    .join(format!("checkpoint-{}", self.state.global_step)),
            );
        }
        outcome.final_eval = self.evaluate()?;
        if let (true, Some(e)) = (main, outcome.final_eval) {
            tracing::info!(
                "after training: eval loss {:.4}, accuracy {:?}",
                e.loss,
                e.accuracy
            );
        }
        if main {
            super::plot::loss_curve(&out_dir.join("loss.svg"), &curve, &self.state.log_history)?;
        }
        Ok(outcome)
    }
}

/// Tells the launcher where the latest checkpoint is (it names it when a job is interrupted).
fn announce_saved(to_launcher: bool, path: &Option<PathBuf>) {
    if let (true, Some(p)) = (to_launcher, path) {
        crate::progress::emit(&crate::progress::Event::Saved {
            path: p.display().to_string(),
        });
    }
}

fn progress_bar(visible: bool, total: usize, position: usize) -> indicatif::ProgressBar {
    if !visible {
        return indicatif::ProgressBar::hidden();
    }
    let bar = crate::progress::styled(indicatif::ProgressBar::new(total as u64));
    bar.set_position(position as u64);
    bar
}
