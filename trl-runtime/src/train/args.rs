//! What every trainer's configuration shares, as transformers' TrainingArguments underlies
//! TRL's SFTConfig and DPOConfig: [`TrainingArguments`] (the common keys), the
//! [`TrainerConfig`] trait a trainer's config implements (its own keys beside them), and one
//! reading of defaults, a YAML/TOML file and the command line for all of them ([`Cli`]).
//! One field list feeds each struct, its defaults, its command-line flags and the merge, so
//! they cannot drift apart.

use super::flow::{BestMetric, Flow, Interval};
use super::trl_keys::Alias;
use crate::error::{Error, Result};
use serde::{de::DeserializeOwned, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use crate::config::cli_value::{CliValue, EntryList, KwArgs, NameList};
pub use crate::data::mixture::Mixture;

/// A parsed flag value. The wrapper keeps clap from giving `Option<Option<T>>` fields its
/// special optional-value meaning: every flag here takes one value of the field's type.
#[derive(Debug, Clone)]
pub struct Flag<T>(pub T);

/// clap's value parser for a field of type `T`.
pub fn parse<T: CliValue>(s: &str) -> std::result::Result<Flag<T>, String> {
    T::parse_cli(s).map(Flag)
}

/// A config struct (serde, defaults, `FIELDS`) and its command-line flags (`--name value` for
/// every field, `apply` writing the given ones over a config). With `base`, the struct
/// flattens [`TrainingArguments`] into that field (the file's keys and the flags are one flat
/// list, as in TRL) and keeps the keys it has no field for in `other`.
#[macro_export]
#[doc(hidden)]
macro_rules! training_arguments {
    (
        $(#[doc = $sdoc:literal])*
        struct $Config:ident, flags $Flags:ident $(, base $base:ident)?;
        $( $(#[doc = $doc:literal])* $name:ident : $ty:ty = $default:expr ;)*
    ) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, PartialEq, ::serde::Serialize, ::serde::Deserialize)]
        #[serde(default)]
        pub struct $Config {
            $(
                /// The keys every trainer shares.
                #[serde(flatten)]
                pub $base: $crate::train::TrainingArguments,
            )?
            $( $(#[doc = $doc])* pub $name: $ty, )*
            $(
                #[doc = concat!("Keys of a file that are no field here or in `", stringify!($base), "` (TRL / transformers arguments we do not implement, or typos): reading applies or refuses them (train::trl_keys) and leaves this empty.")]
                #[serde(flatten, skip_serializing)]
                pub other: std::collections::BTreeMap<String, serde_yaml::Value>,
            )?
        }

        impl Default for $Config {
            fn default() -> Self {
                $Config {
                    $( $base: Default::default(), other: Default::default(), )?
                    $( $name: $default, )*
                }
            }
        }

        impl $Config {
            /// The field names of this struct (not of a flattened base).
            pub const FIELDS: &'static [&'static str] = &[$( stringify!($name) ),*];
        }

        #[doc = concat!("Command-line overrides: every field of [`", stringify!($Config), "`] as `--name value`.")]
        #[derive(Debug, Clone, Default, clap::Args)]
        #[command(rename_all = "snake_case")]
        pub struct $Flags {
            $(
                #[command(flatten)]
                pub $base: $crate::train::TrainingFlags,
            )?
            $( $(#[doc = $doc])*
               // Negative numbers are values (`--max_steps -1`, transformers' default).
               #[arg(long, value_parser = $crate::train::args::parse::<$ty>, num_args = 0..=1, default_missing_value = "true", allow_negative_numbers = true)]
               pub $name: Option<$crate::train::args::Flag<$ty>>, )*
        }

        impl $Flags {
            /// Writes the flags that were given over `config`.
            pub fn apply(&self, config: &mut $Config) {
                $( self.$base.apply(&mut config.$base); )?
                $( if let Some(v) = &self.$name { config.$name = v.0.clone(); } )*
            }
        }
    };
}

training_arguments! {
    /// The training arguments every trainer shares, with transformers' and TRL's names
    /// (TrainingArguments, and ScriptArguments' / ModelConfig's model and data keys).
    struct TrainingArguments, flags TrainingFlags;
    /// Where checkpoints, metrics.jsonl and the loss plot go.
    output_dir: PathBuf = PathBuf::from("output");
    /// Lets a run write into an output_dir that holds another run's checkpoints (another
    /// model, or adapters where this run trains the whole model, or the other way round),
    /// whose checkpoints it would mix with its own and rotate away (transformers' key).
    /// Without it such a run stops before training, naming what is there.
    overwrite_output_dir: bool = false;
    /// A model directory in HF format (config.json, safetensors, tokenizer files).
    model_name_or_path: PathBuf = PathBuf::from("assets/tiny/model");
    /// Training data in one of TRL's formats: a .jsonl or .parquet file, or a local dataset
    /// directory (its dataset_train_split, found as `datasets.load_dataset(DIR)` finds it).
    dataset_name: PathBuf = PathBuf::from("assets/tiny/data/train.jsonl");
    /// Held-out data for eval loss (and task accuracy for the bundled task): a file, or a
    /// dataset directory's dataset_test_split (the dataset_name directory again is fine).
    eval_dataset_name: Option<PathBuf> = None;
    /// TRL's dataset mixture, in place of dataset_name: a list of `{path, data_dir,
    /// data_files, split, columns, fraction}` read as TRL's get_dataset reads them, from
    /// local files and directories (see `data::mixture`).
    datasets: Mixture = Mixture::default();
    /// The share of the mixture's rows held out as the evaluation set (between 0 and 1),
    /// chosen by seed.
    test_split_size: Option<f64> = None;
    /// The configuration of a dataset directory whose card (README.md) declares several
    /// (`load_dataset(DIR, name)`); unset: its default one, as `datasets` picks it.
    dataset_config: Option<String> = None;
    /// The split of a dataset_name directory to train on.
    dataset_train_split: String = "train".into();
    /// The split of an eval_dataset_name directory to evaluate on.
    dataset_test_split: String = "test".into();
    /// Skip malformed dataset rows (with a count) instead of failing.
    skip_bad_rows: bool = false;
    per_device_train_batch_size: usize = 8;
    per_device_eval_batch_size: usize = 8;
    gradient_accumulation_steps: usize = 1;
    learning_rate: f64 = 2e-5;
    /// transformers' schedules: constant, constant_with_warmup, linear, cosine,
    /// cosine_with_restarts, polynomial, inverse_sqrt, cosine_with_min_lr,
    /// cosine_warmup_with_min_lr or warmup_stable_decay.
    lr_scheduler_type: String = "linear".into();
    /// The schedule's keyword arguments (`{"min_lr_rate": 0.1}`, `{"num_cycles": 2}`, ...),
    /// checked against the ones transformers' function for it takes.
    lr_scheduler_kwargs: KwArgs = KwArgs::default();
    /// transformers 5's warm-up: a whole number of steps, or a fraction of the run below 1.
    warmup_steps: f64 = 0.0;
    /// The name before transformers 5 (a fraction); `warmup_steps` wins when both are given.
    warmup_ratio: f64 = 0.0;
    weight_decay: f64 = 0.0;
    adam_beta1: f64 = 0.9;
    adam_beta2: f64 = 0.999;
    adam_epsilon: f64 = 1e-8;
    /// Clip gradients to this global L2 norm (0 disables).
    max_grad_norm: f64 = 1.0;
    /// NEFTune: uniform noise of alpha / sqrt(seq x hidden) added to the token embeddings in
    /// training forwards (transformers' hook on the input embeddings); unset: none. Drawn per
    /// step and micro-batch like LoRA's dropout: tensor-parallel ranks add the same noise;
    /// under sequence or context parallelism each rank's chunk is a sequence of its own, as
    /// the hook sees it there.
    neftune_noise_alpha: Option<f64> = None;
    num_train_epochs: f64 = 3.0;
    /// Optimizer steps to run; overrides num_train_epochs when positive.
    max_steps: i64 = -1;
    /// Examples (or packed rows) are cut to this many tokens.
    max_length: usize = 1024;
    /// Lines are logged every this many steps, with the loss and the task's figures averaged
    /// over them (as transformers and TRL log them).
    /// (A fraction below 1: of the run's steps, rounded up, as transformers reads it; so
    /// are save_steps and eval_steps.)
    logging_steps: f64 = 10.0;
    /// A NaN or infinite step loss is logged as the window's mean instead (transformers'
    /// filter); false logs it as it is.
    logging_nan_inf_filter: bool = true;
    /// What a step whose loss or gradient norm is NaN or infinite does (its update is never
    /// applied): `stop` (the run ends with an error naming the step; the checkpoints saved
    /// stay) or `skip` (the step is skipped and training goes on, as DeepSpeed skips an
    /// overflowed step; each is logged).
    on_nonfinite: String = "stop".into();
    save_steps: f64 = 500.0;
    save_total_limit: Option<usize> = None;
    /// Checkpoints hold the model (and trainer state) without the optimizer state, a third
    /// of the size in full fine-tuning; resuming from one starts the optimizer state afresh,
    /// as transformers does. Written full, also where the launch asks for sharded state.
    save_only_model: bool = false;
    /// Evaluate every this many steps when an eval dataset is given (eval_strategy steps;
    /// unset there: logging_steps).
    eval_steps: Option<f64> = None;
    /// transformers' logging_strategy: no, steps (every logging_steps) or epoch.
    logging_strategy: String = "steps".into();
    /// Log the first step too.
    logging_first_step: bool = false;
    /// no, steps (every eval_steps) or epoch, as transformers evaluates. Unset (our default,
    /// with an eval dataset): before training, every eval_steps when given, and after the
    /// last step.
    eval_strategy: Option<String> = None;
    /// Evaluate before the first step (always done without eval_strategy).
    eval_on_start: bool = false;
    /// Steps (epochs, with eval_strategy epoch) to wait before the first evaluation.
    eval_delay: f64 = 0.0;
    /// no, steps (every save_steps and at the end), epoch, or best (when an evaluation
    /// improves metric_for_best_model). Whatever it is, the final model is written after the
    /// last step (as TRL's scripts save it) and a stop by SIGTERM saves.
    save_strategy: String = "steps".into();
    /// The evaluation metric that picks the best checkpoint (loss, accuracy, or
    /// rewards/accuracies for DPO; `eval_` is prefixed as transformers does). Set, the best
    /// checkpoint is kept by save_total_limit and named in trainer_state.json.
    metric_for_best_model: Option<String> = None;
    /// Unset: false for a metric whose name ends in loss, else true.
    greater_is_better: Option<bool> = None;
    /// After training, read the best checkpoint back (evaluating that model last); with
    /// save_total_limit 1, only it is kept. Save and eval strategies must match (or
    /// save_strategy best), as transformers requires.
    load_best_model_at_end: bool = false;
    seed: u64 = 42;
    /// The seed of the data order (each epoch's shuffle, the mixture's held-out rows); unset:
    /// seed, as transformers' data_seed.
    data_seed: Option<u64> = None;
    /// The order rows are trained in: random (each epoch shuffled by the data seed) or
    /// sequential (as stored), as transformers' train_sampling_strategy; group_by_length and
    /// batch_rebalance are taken as random, with a warning at launch.
    train_sampling_strategy: String = "random".into();
    /// Whether each epoch leaves out the rows past the last micro-batch every rank fills
    /// (transformers' dataloader_drop_last). False, its default, trains them: a single
    /// process in a smaller last micro-batch, several processes with their last micro-batches
    /// filled from the epoch's start, as accelerate does; the last step of an epoch may take
    /// fewer than gradient_accumulation_steps micro-batches, as transformers' Trainer does.
    dataloader_drop_last: bool = false;
    /// A checkpoint directory, or `latest` for the newest in output_dir.
    resume_from_checkpoint: Option<String> = None;
    /// Accelerate's mixed precision: no (fp32) or bf16 (bf16 weights and compute, fp32 master
    /// weights and optimizer state). Unset: the launcher's ACCELERATE_MIXED_PRECISION.
    mixed_precision: Option<String> = None;
    /// TRL/transformers' switch for bf16 mixed precision (the same as mixed_precision: bf16).
    bf16: bool = false;
    /// eager (whole score matrix, fastest at short lengths) or flash_attention_2 (blockwise,
    /// memory linear in the sequence length), as transformers names them; sdpa is the first on
    /// a CPU and the second on a GPU, as PyTorch's sdpa dispatches.
    attn_implementation: String = "sdpa".into();
    /// Liger's fused linear cross-entropy: the LM head and the loss run in sequence tiles, so
    /// the [tokens x vocab] logits never exist whole (the other Liger kernels are not needed
    /// on CPU, where Candle's ops are already fused where it matters).
    use_liger_kernel: bool = false;
    /// ALST's TiledMLP: the MLPs run in sequence tiles and are recomputed in backward, so the
    /// [tokens x intermediate] activations are not kept (an extension of TRL's arguments).
    tiled_mlp: bool = false;
    /// Recompute each decoder layer in backward, keeping only its input (activation
    /// checkpointing; also turned on by the launch's fsdp_activation_checkpointing). On by
    /// default, as in TRL's configs: `--gradient_checkpointing false` trades memory for speed.
    gradient_checkpointing: bool = true;
    /// With activation checkpointing on a GPU: keep each layer's input in host memory
    /// between forward and backward (ALST's activation offload; TRL's name).
    activation_offloading: bool = false;
    /// Show the progress bar on rank 0.
    disable_tqdm: bool = false;
    /// Parameters that get no gradient are expected (transformers' name for DDP's
    /// find_unused_parameters): they train with zero gradients. Otherwise (unset or false) a
    /// trainable parameter that the first step's backward does not reach is an error naming
    /// it, in every strategy.
    ddp_find_unused_parameters: Option<bool> = None;
    /// Train LoRA adapters on a frozen base instead of every weight (TRL's ModelConfig keys
    /// below; see `nn::lora`).
    use_peft: bool = false;
    /// The adapters' rank.
    lora_r: usize = 16;
    /// Adapter outputs are scaled by lora_alpha / lora_r (/ sqrt(lora_r) with use_rslora).
    lora_alpha: f64 = 32.0;
    lora_dropout: f64 = 0.05;
    /// The linear layers to adapt: names (`q_proj v_proj`, matched as name suffixes) or
    /// `all-linear` (every linear layer but the LM head); unset: peft's default for the model
    /// type (q_proj and v_proj; Phi-3's qkv_proj).
    lora_target_modules: Option<NameList> = None;
    /// Parameters that are not linear layers to adapt directly (peft's target_parameters):
    /// gpt-oss's fused experts (`mlp.experts.gate_up_proj mlp.experts.down_proj`, or one
    /// layer's, `7.mlp.experts.gate_up_proj`) and router (`mlp.router.weight`), matched as
    /// name suffixes.
    lora_target_parameters: Option<NameList> = None;
    /// Layers trained whole beside the adapters (e.g. `lm_head embed_tokens`). On a model
    /// whose head is tied to its embedding, each named module gets its own trained copy, as
    /// peft does (the tie parts), unless lora_ensure_weight_tying.
    lora_modules_to_save: Option<NameList> = None;
    /// peft's `ensure_weight_tying` (not a TRL flag): a head tied to its embedding stays tied
    /// under LoRA, one trained tensor for both (naming either in lora_modules_to_save trains
    /// it), and a merge keeps the tie.
    lora_ensure_weight_tying: bool = false;
    /// peft's `trainable_token_indices` (not a TRL flag; TRL sets it for tokens a chat
    /// template adds): these rows of the embedding (and of a head tied to it) train whole,
    /// the rest of the table stays frozen.
    lora_trainable_token_indices: Option<NameList> = None;
    /// peft's task type: CAUSAL_LM, the only one a causal LM trainer has.
    lora_task_type: String = "CAUSAL_LM".into();
    /// Rank-stabilised LoRA: scale by lora_alpha / sqrt(lora_r).
    use_rslora: bool = false;
    /// Weight-decomposed LoRA (DoRA): a trained magnitude per output feature beside the
    /// adapters, as peft's use_dora.
    use_dora: bool = false;
    /// TRL's weight of a mixture of experts' router load-balancing loss (unset: config.json's
    /// `router_aux_loss_coef`; 0: off). See [`TrainingArguments::router_loss_weight`].
    router_aux_loss_coef: Option<f64> = None;
}

/// The compute dtype of a mixed-precision name (Accelerate's values).
fn precision(name: &str) -> std::result::Result<candle_core::DType, String> {
    match name.trim().to_ascii_lowercase().as_str() {
        "no" | "fp32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "fp16" => Err("fp16 needs dynamic loss scaling, which is not implemented: use bf16 (same speed on Ampere and newer GPUs, no scaling needed)".into()),
        "fp8" => Err("fp8 training is not implemented: use bf16".into()),
        other => Err(format!("'{other}' is not accepted: use no or bf16")),
    }
}

/// transformers' train_sampling_strategy values.
const SAMPLING_STRATEGIES: &[&str] =
    &["random", "sequential", "group_by_length", "batch_rebalance"];

impl TrainingArguments {
    /// The weight of a mixture of experts' router load-balancing loss in the loss, as TRL
    /// 1.16 sets it: `router_aux_loss_coef` when given, else config.json's (transformers'
    /// default 0.001 for a mixture of experts, 0 for a dense model); 0 turns the loss off. A
    /// non-zero value for a dense model is refused, as TRL refuses it. `config_json` is the
    /// model's config.json from `source`.
    pub fn router_loss_weight(&self, config_json: &str, source: &str) -> Result<f64> {
        let config: serde_json::Value = serde_json::from_str(config_json)
            .map_err(|e| Error::config(source, "<json>", format!("not a model config: {e}")))?;
        // A vision-language wrapper's language model (Qwen3.5-MoE's, Llama 4's) has its
        // experts and its coefficient under text_config.
        let config = config.get("text_config").unwrap_or(&config);
        use crate::models::moe::{DEFAULT_ROUTER_AUX_LOSS_COEF, EXPERT_COUNT_KEYS};
        let moe = EXPERT_COUNT_KEYS
            .iter()
            .any(|k| config.get(*k).and_then(|v| v.as_u64()).unwrap_or(0) > 0);
        let key = "router_aux_loss_coef";
        // DeepSeek's routers (DeepSeek-V3, GLM-4 MoE; Mistral 4 names its experts alike)
        // balance with a bias, outside the loss; transformers' Llama 4 and Gemma 4 compute
        // none either.
        let biased = config.get("n_routed_experts").is_some();
        let model_type = config.get("model_type").and_then(|t| t.as_str());
        let none = model_type.is_some_and(crate::models::router_loss::not_computed_for);
        match (moe, self.router_aux_loss_coef) {
            (_, Some(c)) if (biased || none) && c != 0.0 => {
                let why = match biased {
                    true => " (its routers balance with e_score_correction_bias, outside the loss)",
                    false => "",
                };
                Err(Error::config(
                    "training arguments",
                    key,
                    format!("{c}: transformers computes no router load-balancing loss for {source}{why}: drop it"),
                ))
            }
            (_, None) if none => Ok(0.0),
            (_, Some(c)) if !c.is_finite() || c < 0.0 => Err(Error::config(
                "training arguments",
                key,
                format!("{c}: a weight is a finite number >= 0"),
            )),
            (_, Some(0.0)) | (false, None) => Ok(0.0),
            (false, Some(c)) => Err(Error::config(
                "training arguments",
                key,
                format!("{c}: {source} is not a mixture of experts, so there is no router loss to weight (TRL refuses it too): drop it"),
            )),
            (true, Some(c)) => Ok(c),
            (true, None) => Ok(config
                .get(key)
                .and_then(|v| v.as_f64())
                .unwrap_or(DEFAULT_ROUTER_AUX_LOSS_COEF)),
        }
    }

    /// The seed of the data order: data_seed, else seed.
    pub fn data_order_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.seed)
    }

    /// The training rows and the held-out ones (None without evaluation data), each read by
    /// `parse`: from the `datasets` mixture (its test_split_size rows held out), or from
    /// dataset_name and eval_dataset_name.
    pub fn load_data<R>(
        &self,
        parse: crate::data::dataset::RowParser<'_, R>,
    ) -> Result<(Vec<R>, Option<Vec<R>>)> {
        use crate::data::dataset::{load_rows, OnBadRow};
        let on_bad = match self.skip_bad_rows {
            true => OnBadRow::Skip,
            false => OnBadRow::Fail,
        };
        let (train, held_out) = match self.datasets.is_empty() {
            true => {
                let rows = load_rows(&self.dataset_name, self.train_split(), on_bad, parse)?;
                (rows.records, None)
            }
            false => {
                tracing::info!(
                    "datasets: a mixture of {} dataset(s), in place of dataset_name",
                    self.datasets.0.len()
                );
                let seed = self.data_order_seed();
                let source = "training arguments";
                self.datasets
                    .load(self.test_split_size, seed, on_bad, parse, source)?
            }
        };
        // test_split_size and eval_dataset_name are not both given (validate).
        let eval = match (held_out, &self.eval_dataset_name) {
            (Some(rows), _) => Some(rows),
            (None, Some(path)) => Some(load_rows(path, self.test_split(), on_bad, parse)?.records),
            (None, None) => None,
        };
        Ok((train, eval))
    }

    /// The split of a dataset_name directory to train on.
    pub fn train_split(&self) -> crate::data::Split<'_> {
        crate::data::Split {
            name: &self.dataset_train_split,
            key: "dataset_train_split",
            config: self.dataset_config.as_deref(),
            config_key: "dataset_config",
        }
    }

    /// The split of an eval_dataset_name directory to evaluate on.
    pub fn test_split(&self) -> crate::data::Split<'_> {
        crate::data::Split {
            name: &self.dataset_test_split,
            key: "dataset_test_split",
            config: self.dataset_config.as_deref(),
            config_key: "dataset_config",
        }
    }

    /// Optimizer steps of the run: max_steps when positive, else num_train_epochs' worth.
    pub fn total_steps(&self, steps_per_epoch: usize) -> usize {
        if self.max_steps > 0 {
            self.max_steps as usize
        } else {
            (self.num_train_epochs * steps_per_epoch as f64).ceil() as usize
        }
    }

    /// The dtype weights and activations are computed in: `bf16` or `mixed_precision`, else
    /// the launcher's ACCELERATE_MIXED_PRECISION (as transformers' Trainer defers to it).
    pub fn compute_dtype(&self) -> Result<candle_core::DType> {
        if self.bf16 {
            return Ok(candle_core::DType::BF16);
        }
        let (source, name) = match &self.mixed_precision {
            Some(mp) => ("training arguments", mp.clone()),
            None => match std::env::var("ACCELERATE_MIXED_PRECISION") {
                Ok(v) => ("ACCELERATE_MIXED_PRECISION", v),
                Err(_) => return Ok(candle_core::DType::F32),
            },
        };
        precision(&name).map_err(|message| Error::Config {
            file: source.into(),
            key: "mixed_precision".into(),
            message,
        })
    }

    /// AdamW's settings.
    pub fn adam(&self) -> crate::optim::AdamWConfig {
        crate::optim::AdamWConfig {
            beta1: self.adam_beta1,
            beta2: self.adam_beta2,
            eps: self.adam_epsilon,
            weight_decay: self.weight_decay,
        }
    }

    /// Hub names of the model and datasets (`Qwen/Qwen2.5-0.5B`) replaced by their snapshots
    /// in the Hugging Face cache, as transformers and datasets read them offline; local paths
    /// stay (see [`crate::hub`]).
    pub fn resolve_hub_names(&mut self) -> Result<()> {
        use crate::hub::RepoKind;
        let resolve = |kind, name: &Path, key: &str| {
            crate::hub::resolve(kind, name)
                .map_err(|m| Error::config(name.display().to_string(), key, m))
        };
        self.model_name_or_path = resolve(
            RepoKind::Model,
            &self.model_name_or_path,
            "model_name_or_path",
        )?;
        self.dataset_name = resolve(RepoKind::Dataset, &self.dataset_name, "dataset_name")?;
        if let Some(eval) = &self.eval_dataset_name {
            self.eval_dataset_name = Some(resolve(RepoKind::Dataset, eval, "eval_dataset_name")?);
        }
        Ok(())
    }

    /// The learning-rate schedule of a run of `total_steps`.
    pub fn schedule(&self, total_steps: usize) -> Result<super::LrSchedule> {
        let kind = super::SchedulerKind::parse(&self.lr_scheduler_type)?;
        let args = self.scheduler_args(kind, "training arguments")?;
        // transformers 5: int(warmup_steps) from 1 on, a ratio of the steps below.
        let (steps, ratio) = match self.warmup_steps {
            w if w >= 1.0 => (w as usize, 0.0),
            w if w > 0.0 => (0, w),
            _ => (0, self.warmup_ratio),
        };
        Ok(
            super::LrSchedule::new(kind, self.learning_rate, total_steps, steps, ratio)
                .with_args(args),
        )
    }

    /// lr_scheduler_kwargs read for `kind` (errors name `source` and the key).
    fn scheduler_args(
        &self,
        kind: super::SchedulerKind,
        source: &str,
    ) -> Result<super::SchedulerArgs> {
        super::SchedulerArgs::from_kwargs(kind, &self.lr_scheduler_kwargs, self.learning_rate)
            .map_err(|(key, why)| {
                let kind = &self.lr_scheduler_type;
                Error::config(source, &key, format!("{why} (lr_scheduler_type {kind})"))
            })
    }

    fn validate_peft(&self, source: &str) -> Result<()> {
        let err = |key: &str, message: String| Error::config(source, key, message);
        if !["CAUSAL_LM", "SEQ_CLS"].contains(&self.lora_task_type.as_str()) {
            return Err(err(
                "lora_task_type",
                format!(
                    "'{}': CAUSAL_LM adapters train a causal LM, SEQ_CLS ones a sequence classifier (the reward trainer)",
                    self.lora_task_type
                ),
            ));
        }
        if self.lora_r == 0 {
            return Err(err("lora_r", "must be at least 1".into()));
        }
        let ids = self.lora_trainable_token_indices.as_ref();
        if let Some(bad) = ids.and_then(|l| l.0.iter().find(|i| i.parse::<u32>().is_err())) {
            return Err(err(
                "lora_trainable_token_indices",
                format!("'{bad}' is not a token id (a list of ids: 151646 151647)"),
            ));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(err(
                "lora_dropout",
                format!("{} must be in [0, 1)", self.lora_dropout),
            ));
        }
        Ok(())
    }

    /// The LoRA setup these arguments ask for (None without use_peft), for a model of
    /// `model_type` (whose peft default targets apply when lora_target_modules is unset).
    pub fn lora(&self, model_type: &str) -> Option<crate::nn::lora::LoraConfig> {
        use crate::nn::lora::{LoraConfig, Targets};
        if !self.use_peft {
            return None;
        }
        let names = match &self.lora_target_modules {
            Some(list) => list.0.clone(),
            None => LoraConfig::default_targets(model_type),
        };
        // TRL passes a single name as a string, which peft reads as `all-linear` when it is.
        let targets = match names.as_slice() {
            [one] if one.eq_ignore_ascii_case("all-linear") => Targets::AllLinear,
            _ => Targets::Names(names),
        };
        let sequence_classification = self.lora_task_type == "SEQ_CLS";
        let mut modules_to_save = self
            .lora_modules_to_save
            .as_ref()
            .map_or(Vec::new(), |l| l.0.clone());
        // peft's PeftModelForSequenceClassification trains the classifier head whole.
        if sequence_classification && !modules_to_save.iter().any(|m| m == "score") {
            modules_to_save.push("score".into());
        }
        Some(LoraConfig {
            r: self.lora_r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets,
            modules_to_save,
            rslora: self.use_rslora,
            seed: self.seed,
            dora: self.use_dora,
            target_parameters: self
                .lora_target_parameters
                .as_ref()
                .map_or(Vec::new(), |l| l.0.clone()),
            ensure_weight_tying: self.lora_ensure_weight_tying,
            // Validated as token ids (validate_peft).
            trainable_token_indices: match &self.lora_trainable_token_indices {
                Some(ids) => vec![(
                    "embed_tokens".into(),
                    ids.0.iter().filter_map(|i| i.parse().ok()).collect(),
                )],
                None => Vec::new(),
            },
            sequence_classification,
        })
    }

    /// Applies a key that sets one of these fields under another name (`env`: the process's
    /// environment, as TRL's parser sets it).
    fn apply_alias(&mut self, alias: Alias) {
        match alias {
            Alias::GradientCheckpointing(on) => self.gradient_checkpointing = on,
            Alias::MaxLength(n) => self.max_length = n,
            Alias::EvalStrategy(s) => self.eval_strategy = Some(s),
            Alias::Env(vars) => {
                for (name, value) in vars {
                    tracing::info!("config env: {name}={value}");
                    std::env::set_var(name, value);
                }
            }
        }
    }

    /// When the trainer logs, evaluates and saves in a run of `total_steps`, as these
    /// arguments say, checked and defaulted as transformers' TrainingArguments does
    /// (fractions of the run resolved as its TrainerState resolves them; None: checks only,
    /// a fraction taken as one step). `metrics` are the figures the trainer's evaluation
    /// logs, one of which metric_for_best_model names.
    pub fn flow(&self, metrics: &[&str], source: &str, total_steps: Option<usize>) -> Result<Flow> {
        let err = |key: &str, message: String| Error::config(source, key, message);
        let interval = |key: &str, name: &str, steps: f64, names: &str| {
            let steps = match total_steps {
                Some(total) if steps < 1.0 => (total as f64 * steps).ceil() as usize,
                _ => steps.ceil() as usize,
            };
            Interval::parse(name, steps.max(1))
                .ok_or_else(|| err(key, format!("'{name}' is not accepted: use {names}")))
        };
        let three = "no, steps or epoch";
        let logging = interval(
            "logging_strategy",
            &self.logging_strategy,
            self.logging_steps,
            three,
        )?;
        // transformers: a zero eval_steps is unset; unset, steps evaluation uses logging_steps.
        let eval_steps = self.eval_steps.filter(|n| *n > 0.0);
        let (eval, eval_after_last) = match &self.eval_strategy {
            None => match eval_steps {
                Some(n) => (interval("eval_steps", "steps", n, three)?, false),
                None => (Interval::No, true),
            },
            Some(name) => {
                let steps = eval_steps.unwrap_or(self.logging_steps);
                (interval("eval_strategy", name, steps, three)?, false)
            }
        };
        let save_best = self.save_strategy == "best";
        let save = match save_best {
            true => Interval::No,
            false => interval(
                "save_strategy",
                &self.save_strategy,
                self.save_steps,
                "no, steps, epoch or best",
            )?,
        };
        let steps = (eval_steps.unwrap_or(self.logging_steps), self.save_steps);
        self.check_flow((eval, save), steps, save_best, eval_after_last, source)?;
        Ok(Flow {
            logging,
            logging_first_step: self.logging_first_step,
            eval,
            eval_after_last,
            eval_on_start: self.eval_on_start || self.eval_strategy.is_none(),
            eval_delay: self.eval_delay,
            save,
            save_best,
            best: self.best_metric(save_best, metrics, source)?,
            load_best_at_end: self.load_best_model_at_end,
        })
    }

    /// transformers' checks of the strategies together: evaluation needs data, and
    /// load_best_model_at_end a checkpoint at every evaluation.
    fn check_flow(
        &self,
        (eval, save): (Interval, Interval),
        (eval_steps, save_steps): (f64, f64),
        save_best: bool,
        eval_after_last: bool,
        source: &str,
    ) -> Result<()> {
        let err = |key: &str, message: String| Err(Error::config(source, key, message));
        let eval_data = self.eval_dataset_name.is_some() || self.test_split_size.is_some();
        let strategy = self.eval_strategy.as_deref();
        if strategy.is_some_and(|s| s != "no") && !eval_data {
            return err(
                "eval_strategy",
                format!(
                    "'{}' evaluates, but there is no evaluation data: give eval_dataset_name (or test_split_size with datasets), or drop it",
                    strategy.unwrap_or_default()
                ),
            );
        }
        if self.eval_delay.is_nan() || self.eval_delay < 0.0 {
            return err("eval_delay", format!("{} must be >= 0", self.eval_delay));
        }
        if self.load_best_model_at_end && !save_best {
            let same = matches!(
                (eval, save),
                (Interval::Steps(_), Interval::Steps(_)) | (Interval::Epoch, Interval::Epoch)
            ) && strategy.is_some();
            if !same {
                return err(
                    "load_best_model_at_end",
                    format!(
                        "needs the save and eval strategy to match (or save_strategy best), but found eval_strategy {} and save_strategy {}",
                        strategy.unwrap_or("no"),
                        self.save_strategy
                    ),
                );
            }
            // On the values as given, as transformers checks them: two counts, or two
            // fractions (compared in millionths), never one of each.
            let (e, s) = (eval_steps, save_steps);
            let millionths = |v: f64| (v * 1e6).round() as u64;
            let steps = matches!((eval, save), (Interval::Steps(_), Interval::Steps(_)));
            if steps && (e < 1.0) != (s < 1.0) {
                return err(
                    "load_best_model_at_end",
                    format!("needs save_steps to be a multiple of the evaluation steps, which mixing a fraction of the run with a step count cannot promise (save_steps {s}, eval_steps {e})"),
                );
            }
            if steps && millionths(s) % millionths(e).max(1) != 0 {
                return err(
                    "load_best_model_at_end",
                    format!("needs save_steps to be a multiple of the evaluation steps, but found {s}, which is not a multiple of {e}"),
                );
            }
        }
        if save_best && eval == Interval::No && !eval_after_last {
            return err(
                "save_strategy",
                "best saves when an evaluation improves the best metric, and this run does not evaluate: set eval_strategy (and eval_dataset_name)".into(),
            );
        }
        Ok(())
    }

    /// metric_for_best_model as transformers reads it: `loss` by default where a best model
    /// is needed, `eval_` prefixed, lower better for a loss.
    fn best_metric(
        &self,
        save_best: bool,
        metrics: &[&str],
        source: &str,
    ) -> Result<Option<BestMetric>> {
        let name = match &self.metric_for_best_model {
            Some(m) => m.clone(),
            None if self.load_best_model_at_end || save_best => "loss".to_string(),
            None => return Ok(None),
        };
        let key = match name.starts_with("eval_") {
            true => name.clone(),
            false => format!("eval_{name}"),
        };
        if !metrics.contains(&key.as_str()) {
            return Err(Error::config(
                source,
                "metric_for_best_model",
                format!(
                    "'{key}' is not an evaluation metric of this trainer: use one of {}",
                    metrics.join(", ")
                ),
            ));
        }
        Ok(Some(BestMetric {
            greater_is_better: self.greater_is_better.unwrap_or(!name.ends_with("loss")),
            key,
        }))
    }

    /// Checks values that have a fixed set of choices or bounds.
    pub fn validate(&self, source: &str) -> Result<()> {
        let err = |key: &str, message: String| Error::config(source, key, message);
        let kind = crate::train::SchedulerKind::parse(&self.lr_scheduler_type)
            .map_err(|e| err("lr_scheduler_type", e.to_string()))?;
        self.scheduler_args(kind, source)?;
        if !SAMPLING_STRATEGIES.contains(&self.train_sampling_strategy.as_str()) {
            return Err(err(
                "train_sampling_strategy",
                format!(
                    "'{}' is not accepted: use one of {}",
                    self.train_sampling_strategy,
                    SAMPLING_STRATEGIES.join(", ")
                ),
            ));
        }
        if !["stop", "skip"].contains(&self.on_nonfinite.as_str()) {
            return Err(err(
                "on_nonfinite",
                format!("'{}' is not accepted: use stop or skip", self.on_nonfinite),
            ));
        }
        if crate::nn::AttentionImpl::parse(&self.attn_implementation).is_none() {
            return Err(err(
                "attn_implementation",
                format!(
                    "'{}' is not accepted: use one of {}",
                    self.attn_implementation,
                    crate::nn::AttentionImpl::NAMES.join(", ")
                ),
            ));
        }
        for (key, v) in [
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            (
                "per_device_eval_batch_size",
                self.per_device_eval_batch_size,
            ),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("max_length", self.max_length),
        ] {
            if v == 0 {
                return Err(err(key, "must be at least 1".into()));
            }
        }
        if self.learning_rate.is_nan() || self.learning_rate < 0.0 {
            return Err(err(
                "learning_rate",
                format!("{} must be a non-negative number", self.learning_rate),
            ));
        }
        let every = [
            ("logging_steps", self.logging_steps),
            ("save_steps", self.save_steps),
        ];
        for (key, v) in every
            .into_iter()
            .chain(self.eval_steps.map(|v| ("eval_steps", v)))
        {
            // transformers: above 1 a whole number of steps, below it a fraction of the run.
            let zero_ok = key == "eval_steps";
            if !(v.is_finite()
                && (v > 0.0 || (zero_ok && v == 0.0))
                && (v < 1.0 || v.fract() == 0.0))
            {
                return Err(err(
                    key,
                    format!("{v} must be a whole number of steps, or a fraction of the run's steps below 1 (0.1: every tenth)"),
                ));
            }
        }
        if !(self.warmup_steps >= 0.0 && self.warmup_steps.is_finite()) {
            return Err(err(
                "warmup_steps",
                format!(
                    "{} must be a step count or a fraction of the steps below 1 (0.03: 3%)",
                    self.warmup_steps
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return Err(err(
                "warmup_ratio",
                format!("{} must be between 0 and 1", self.warmup_ratio),
            ));
        }
        if let Some(mp) = &self.mixed_precision {
            precision(mp).map_err(|message| err("mixed_precision", message))?;
        }
        if self.use_peft {
            self.validate_peft(source)?;
        }
        if self.test_split_size.is_some() && self.datasets.is_empty() {
            return Err(err(
                "test_split_size",
                "splits a `datasets` mixture (as TRL's DatasetMixtureConfig does): give datasets, or drop it (dataset_name's eval split is eval_dataset_name)".into(),
            ));
        }
        if self.test_split_size.is_some() && self.eval_dataset_name.is_some() {
            return Err(err(
                "test_split_size",
                "the mixture's held-out rows are the evaluation set, and eval_dataset_name names another: drop one".into(),
            ));
        }
        if self.max_steps <= 0 && self.num_train_epochs <= 0.0 {
            return Err(err(
                "max_steps",
                "set max_steps or a positive num_train_epochs".into(),
            ));
        }
        Ok(())
    }
}

/// A trainer's configuration: [`TrainingArguments`] and its own keys (written with
/// [`training_arguments!`] and `base`), read the same way for every trainer.
pub trait TrainerConfig: Default + Clone + DeserializeOwned + Serialize {
    /// Its command-line flags.
    type Flags: clap::Args + Clone + std::fmt::Debug;
    /// What `--help` says the program does.
    const ABOUT: &'static str;
    /// The name its evaluation's accuracy is logged under.
    const EVAL_ACCURACY: &'static str;
    /// Every figure its evaluation logs (metric_for_best_model names one).
    const EVAL_METRICS: &'static [&'static str];
    fn training(&self) -> &TrainingArguments;
    fn training_mut(&mut self) -> &mut TrainingArguments;
    /// The keys read that have no field (emptied by reading).
    fn other_mut(&mut self) -> &mut BTreeMap<String, serde_yaml::Value>;
    /// Its own field names (suggested for typos beside the shared ones).
    fn own_fields() -> &'static [&'static str];
    fn apply_flags(flags: &Self::Flags, config: &mut Self);
    /// Checks its own keys (the shared ones are checked by [`TrainingArguments::validate`]).
    fn validate_own(&self, source: &str) -> Result<()>;
    /// Its own defaults for shared keys (GRPO's learning rate is TRL's 1e-6), set where a
    /// file does not give them (`given`) and in [`Cli::resolve`]'s defaults.
    fn base_defaults(_training: &mut TrainingArguments, _given: &dyn Fn(&str) -> bool) {}

    /// Checks every key.
    fn validate(&self, source: &str) -> Result<()> {
        self.training().validate(source)?;
        self.training().flow(Self::EVAL_METRICS, source, None)?;
        self.validate_own(source)
    }

    /// Applies the keys without a field (TRL's and transformers' keys; see
    /// [`super::trl_keys`]): sets the fields aliases name, refuses what would change what is
    /// trained, and returns the `KEY: why` lines of those without effect.
    fn apply_other(&mut self, source: &str) -> Result<Vec<String>> {
        let other = std::mem::take(self.other_mut());
        let fields: Vec<&str> = TrainingArguments::FIELDS
            .iter()
            .chain(Self::own_fields())
            .copied()
            .collect();
        let (aliases, ignored) = super::trl_keys::classify(other, &fields, source)?;
        for alias in aliases {
            self.training_mut().apply_alias(alias);
        }
        Ok(ignored)
    }

    /// Reads a YAML (.yaml/.yml) or TOML (.toml) file, returning the `KEY: why` lines of the
    /// keys without effect. TRL's and transformers' arguments without a field here are
    /// applied, refused or named; any other key is an error naming it.
    fn read(path: &Path) -> Result<(Self, Vec<String>)> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        let source = path.display().to_string();
        let bad = |what: &str, e: &dyn std::fmt::Display| {
            Error::config(&source, "<document>", format!("not valid {what}: {e}"))
        };
        let mut value: serde_yaml::Value = match path.extension().and_then(|e| e.to_str()) {
            Some("toml") => {
                let table: toml::Table = toml::from_str(&text).map_err(|e| bad("TOML", &e))?;
                serde_yaml::to_value(table).map_err(|e| bad("TOML", &e))?
            }
            _ => serde_yaml::from_str(&text).map_err(|e| bad("YAML", &e))?,
        };
        let notes = Self::unset_nulls(&mut value);
        let mut config =
            Self::deserialize(&value).map_err(|e| Self::type_error(&source, &value, e))?;
        let given = |k: &str| value.as_mapping().is_some_and(|m| m.contains_key(k));
        Self::base_defaults(config.training_mut(), &given);
        let mut ignored = config.apply_other(&source)?;
        ignored.extend(notes);
        config.validate(&source)?;
        Ok((config, ignored))
    }

    /// A value of the wrong type, with its key: serde does not name the key through the
    /// flattened map of other keys, so each top-level key is read alone to find it.
    fn type_error(source: &str, value: &serde_yaml::Value, e: serde_yaml::Error) -> Error {
        let failing = value.as_mapping().and_then(|map| {
            map.iter().find_map(|(k, v)| {
                let alone = serde_yaml::Mapping::from_iter([(k.clone(), v.clone())]);
                let e = serde_yaml::from_value::<Self>(alone.into()).err()?;
                Some((k.as_str().unwrap_or("<key>").to_string(), e))
            })
        });
        match failing {
            Some((key, e)) => Error::config(source, &key, e.to_string()),
            None => Error::config(source, "<document>", e.to_string()),
        }
    }

    /// A dump of TRL's config writes `null` for arguments it resolves later (`bf16`,
    /// `disable_tqdm`, `lr_scheduler_kwargs`, ...): such a key of ours is left unset, taking
    /// our default. Returns a `KEY: why` line where TRL's resolution differs from ours.
    fn unset_nulls(value: &mut serde_yaml::Value) -> Vec<String> {
        let Some(map) = value.as_mapping_mut() else {
            return Vec::new();
        };
        let ours =
            |k: &str| TrainingArguments::FIELDS.contains(&k) || Self::own_fields().contains(&k);
        let nulls: Vec<serde_yaml::Value> = map
            .iter()
            .filter(|(k, v)| v.is_null() && k.as_str().is_some_and(ours))
            .map(|(k, _)| k.clone())
            .collect();
        let mut notes = Vec::new();
        for key in nulls {
            if key.as_str() == Some("bf16") {
                notes.push("bf16: null (TRL turns it on); here unset, so mixed_precision or the launch decides (set bf16: true for TRL's default)".to_string());
            }
            map.remove(&key);
        }
        notes
    }

    /// As [`Self::read`], the keys without effect printed on the main process.
    fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let (config, ignored) = Self::read(path.as_ref())?;
        let source = path.as_ref().display().to_string();
        warn_on_main(&ignored_lines(&source, ignored));
        Ok(config)
    }

    /// Defaults, then the `--config` file, then the flags ([`Cli::resolve`]); the keys
    /// without effect are named on the main process.
    fn from_cli(cli: &Cli<Self>) -> Result<Self> {
        let (config, ignored) = cli.resolve()?;
        warn_on_main(&ignored);
        Ok(config)
    }
}

fn warn_on_main(lines: &[String]) {
    if std::env::var("RANK").map_or(true, |r| r.trim() == "0") {
        for line in lines {
            eprintln!("warning: {line}");
        }
    }
}

fn ignored_lines(source: &str, lines: Vec<String>) -> Vec<String> {
    lines
        .into_iter()
        .map(|l| format!("{source}: ignored: {l}"))
        .collect()
}

/// A TRL-style command line (`trl sft --config file.yaml --learning_rate 1e-4`): an optional
/// config file and flags that override it.
#[derive(Debug, Clone, clap::Parser)]
// Repeated flags: the last one wins, as with HF's argument parser.
#[command(rename_all = "snake_case", args_override_self = true)]
pub struct Cli<C: TrainerConfig> {
    /// A YAML or TOML file with the config's fields.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub args: C::Flags,
    /// TRL / transformers flags without a field here (`--report_to wandb`), taken out before
    /// clap parses the rest ([`Cli::parse_trl`]) and handled as in a file.
    #[arg(skip)]
    pub other: BTreeMap<String, serde_yaml::Value>,
}

impl<C: TrainerConfig> Cli<C> {
    /// Parses the process's arguments like `trl sft` does: TRL's and transformers' flags that
    /// the config has no field for are accepted (see [`Self::apply`]); anything else is clap's.
    pub fn parse_trl() -> Self {
        Self::parse_trl_from(std::env::args())
    }

    /// As [`Self::parse_trl`] over `args` (the program name first). Exits on bad flags, as
    /// clap's `parse` does.
    pub fn parse_trl_from(args: impl IntoIterator<Item = String>) -> Self {
        Self::try_parse_trl_from(args).unwrap_or_else(|e| e.exit())
    }

    /// As [`Self::parse_trl_from`], returning clap's error instead of exiting (for tools that
    /// read a training program's arguments, such as the launcher).
    pub fn try_parse_trl_from(
        args: impl IntoIterator<Item = String>,
    ) -> std::result::Result<Self, clap::Error> {
        use clap::{CommandFactory, FromArgMatches};
        let fields = [C::own_fields(), TrainingArguments::FIELDS].concat();
        let (rest, other) = super::trl_keys::take_flags(join_lists(args), &fields);
        let matches = Self::command().about(C::ABOUT).try_get_matches_from(rest)?;
        let mut cli = Self::from_arg_matches(&matches)?;
        cli.other = other;
        Ok(cli)
    }

    /// The training arguments these flags give, as a TRL program reads them: defaults, then
    /// the `--config` file, then the flags, validated; with the `SOURCE: ignored: KEY: why`
    /// lines of the keys that have no effect.
    pub fn resolve(&self) -> Result<(C, Vec<String>)> {
        let mut defaults = C::default();
        C::base_defaults(defaults.training_mut(), &|_| false);
        self.resolve_over(defaults)
    }

    /// As [`Self::resolve`], starting from `defaults` instead of `C::default()` when no
    /// `--config` is given (a program's own defaults).
    pub fn resolve_over(&self, defaults: C) -> Result<(C, Vec<String>)> {
        let (mut config, mut ignored) = match &self.config {
            Some(path) => {
                let (config, lines) = C::read(path)?;
                (config, ignored_lines(&path.display().to_string(), lines))
            }
            None => (defaults, Vec::new()),
        };
        ignored.extend(ignored_lines("command line", self.apply(&mut config)?));
        config.training_mut().resolve_hub_names()?;
        config.validate("command line")?;
        Ok((config, ignored))
    }

    /// Writes the flags over `config`, then applies, refuses or names the TRL flags without a
    /// field (as for a file); returns the `KEY: why` lines of those without effect.
    pub fn apply(&self, config: &mut C) -> Result<Vec<String>> {
        C::apply_flags(&self.args, config);
        config.other_mut().extend(self.other.clone());
        config.apply_other("command line")
    }
}

/// Flags that take several values in TRL (`--lora_target_modules q_proj v_proj`, argparse's
/// nargs="+"): their values joined into one with commas, which [`NameList`] and
/// [`EntryList`] split.
fn join_lists(args: impl IntoIterator<Item = String>) -> Vec<String> {
    const LISTS: &[&str] = &[
        "lora_target_modules",
        "lora_target_parameters",
        "lora_modules_to_save",
        "lora_trainable_token_indices",
        "loss_type",
        "loss_weights",
        "reward_funcs",
        "reward_weights",
        "reward_clip_range",
    ];
    let mut out: Vec<String> = Vec::new();
    // Where a list flag's value goes, once the flag is seen.
    let mut list: Option<usize> = None;
    for a in args {
        if let Some(flag) = a.strip_prefix("--") {
            let listed = LISTS.contains(&flag.replace('-', "_").as_str());
            out.push(a);
            list = listed.then_some(out.len());
            continue;
        }
        match list {
            Some(i) if out.len() > i => {
                out[i].push(',');
                out[i].push_str(&a);
            }
            _ => out.push(a),
        }
    }
    out
}

/// Implements [`TrainerConfig`] for a struct written with [`training_arguments!`] and `base`.
#[macro_export]
#[doc(hidden)]
macro_rules! trainer_config {
    ($Config:ident, flags $Flags:ident, base $base:ident, about $about:literal, accuracy $accuracy:literal, metrics [$($metric:literal),*], validate $validate:path $(, base_defaults $defaults:path)?) => {
        impl $crate::train::TrainerConfig for $Config {
            type Flags = $Flags;
            const ABOUT: &'static str = $about;
            const EVAL_ACCURACY: &'static str = $accuracy;
            const EVAL_METRICS: &'static [&'static str] = &["eval_loss", $accuracy $(, $metric)*];
            fn training(&self) -> &$crate::train::TrainingArguments {
                &self.$base
            }
            fn training_mut(&mut self) -> &mut $crate::train::TrainingArguments {
                &mut self.$base
            }
            fn other_mut(&mut self) -> &mut std::collections::BTreeMap<String, serde_yaml::Value> {
                &mut self.other
            }
            fn own_fields() -> &'static [&'static str] {
                Self::FIELDS
            }
            fn apply_flags(flags: &$Flags, config: &mut Self) {
                flags.apply(config)
            }
            fn validate_own(&self, source: &str) -> $crate::Result<()> {
                $validate(self, source)
            }
            $(
                fn base_defaults(
                    training: &mut $crate::train::TrainingArguments,
                    given: &dyn Fn(&str) -> bool,
                ) {
                    $defaults(training, given)
                }
            )?
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The router loss's weight: given, else config.json's (0.001 when it has none, as
    /// transformers' MoE configs default it), 0 turning it off; a dense model refuses any
    /// weight, as TRL does.
    #[test]
    fn the_router_loss_weight_is_given_read_or_refused() {
        let moe = r#"{"num_experts": 4, "router_aux_loss_coef": 0.02}"#;
        let dense = r#"{"hidden_size": 64}"#;
        let with = |coef: Option<f64>| TrainingArguments {
            router_aux_loss_coef: coef,
            ..Default::default()
        };
        assert_eq!(with(None).router_loss_weight(moe, "moe").unwrap(), 0.02);
        assert_eq!(with(Some(0.0)).router_loss_weight(moe, "moe").unwrap(), 0.0);
        assert_eq!(with(Some(0.5)).router_loss_weight(moe, "moe").unwrap(), 0.5);
        let unset = r#"{"num_local_experts": 8}"#;
        assert_eq!(with(None).router_loss_weight(unset, "u").unwrap(), 0.001);
        let err = with(Some(-1.0)).router_loss_weight(moe, "moe").unwrap_err();
        assert!(err.to_string().contains("router_aux_loss_coef"), "{err}");
        assert_eq!(with(None).router_loss_weight(dense, "d").unwrap(), 0.0);
        assert!(with(Some(0.5)).router_loss_weight(dense, "d").is_err());
        // A vision-language wrapper's experts and weight, under text_config.
        let wrapped = r#"{"model_type": "qwen3_5_moe", "text_config": {"num_experts": 4, "router_aux_loss_coef": 0.02}}"#;
        assert_eq!(with(None).router_loss_weight(wrapped, "w").unwrap(), 0.02);
        // Llama 4 (no loss in transformers, the key in its config all the same) and Gemma 4,
        // the text model or the composite: off, and refused when asked.
        for llama4 in [
            r#"{"model_type": "llama4_text", "num_local_experts": 4, "router_aux_loss_coef": 0.001}"#,
            r#"{"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}"#,
            // Gemma 4's mixture (26B-A4B) alike.
            r#"{"model_type": "gemma4_text", "num_experts": 4, "enable_moe_block": true}"#,
            r#"{"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "num_experts": 4}}"#,
        ] {
            assert_eq!(with(None).router_loss_weight(llama4, "l4").unwrap(), 0.0);
            let err = with(Some(0.1))
                .router_loss_weight(llama4, "l4")
                .unwrap_err();
            assert!(err.to_string().contains("no router"), "{err}");
        }
        // DeepSeek's routers (a load-balancing bias, no loss): off, and refused when asked.
        let deepseek = r#"{"n_routed_experts": 8}"#;
        assert_eq!(with(None).router_loss_weight(deepseek, "ds").unwrap(), 0.0);
        assert_eq!(
            with(Some(0.0)).router_loss_weight(deepseek, "ds").unwrap(),
            0.0
        );
        let err = with(Some(0.1))
            .router_loss_weight(deepseek, "ds")
            .unwrap_err();
        assert!(err.to_string().contains("e_score_correction_bias"), "{err}");
    }
}
