//! SFTConfig: TRL's training arguments (same names, TRL/HF defaults where they make sense
//! here), read from a YAML or TOML file and overridden from the command line, as
//! `trl sft --config file.yaml --learning_rate 1e-4` does. One field list feeds the struct, its
//! defaults, the command-line flags and the merge, so they cannot drift apart.

use super::trl_keys::Alias;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use crate::config::cli_value::CliValue;

/// A parsed flag value. The wrapper keeps clap from giving `Option<Option<T>>` fields its
/// special optional-value meaning: every flag here takes one value of the field's type.
#[derive(Debug, Clone)]
pub struct Flag<T>(pub T);

fn parse<T: CliValue>(s: &str) -> std::result::Result<Flag<T>, String> {
    T::parse_cli(s).map(Flag)
}

macro_rules! sft_config {
    ($( $(#[doc = $doc:literal])* $name:ident : $ty:ty = $default:expr ;)*) => {
        /// Training arguments, with TRL's names.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct SFTConfig {
            $( $(#[doc = $doc])* pub $name: $ty, )*
            /// Keys of a file that have no field here (TRL / transformers arguments we do not
            /// implement, or typos): `SFTConfig::read` applies or refuses them
            /// (train::trl_keys) and leaves this empty.
            #[serde(flatten, skip_serializing)]
            pub other: std::collections::BTreeMap<String, serde_yaml::Value>,
        }

        impl Default for SFTConfig {
            fn default() -> Self {
                SFTConfig { $( $name: $default, )* other: Default::default() }
            }
        }

        /// Every field name of [`SFTConfig`].
        pub const FIELDS: &[&str] = &[$( stringify!($name) ),*];

        /// Command-line overrides: every field of [`SFTConfig`] as `--name value`.
        #[derive(Debug, Clone, Default, clap::Args)]
        #[command(rename_all = "snake_case")]
        pub struct SFTArgs {
            $( $(#[doc = $doc])*
               #[arg(long, value_parser = parse::<$ty>, num_args = 0..=1, default_missing_value = "true")]
               pub $name: Option<Flag<$ty>>, )*
        }

        impl SFTArgs {
            /// Writes the flags that were given over `config`.
            pub fn apply(&self, config: &mut SFTConfig) {
                $( if let Some(v) = &self.$name { config.$name = v.0.clone(); } )*
            }
        }
    };
}

sft_config! {
    /// Where checkpoints, metrics.jsonl and the loss plot go.
    output_dir: PathBuf = PathBuf::from("output");
    /// A model directory in HF format (config.json, safetensors, tokenizer files).
    model_name_or_path: PathBuf = PathBuf::from("assets/tiny/model");
    /// Training data: a .jsonl or .parquet file in one of TRL's formats.
    dataset_name: PathBuf = PathBuf::from("assets/tiny/data/train.jsonl");
    /// Held-out data for eval loss (and task accuracy for the bundled task).
    eval_dataset_name: Option<PathBuf> = None;
    /// Skip malformed dataset rows (with a count) instead of failing.
    skip_bad_rows: bool = false;
    per_device_train_batch_size: usize = 8;
    per_device_eval_batch_size: usize = 8;
    gradient_accumulation_steps: usize = 1;
    learning_rate: f64 = 2e-5;
    /// constant, constant_with_warmup, linear or cosine.
    lr_scheduler_type: String = "linear".into();
    warmup_steps: usize = 0;
    warmup_ratio: f64 = 0.0;
    weight_decay: f64 = 0.0;
    adam_beta1: f64 = 0.9;
    adam_beta2: f64 = 0.999;
    adam_epsilon: f64 = 1e-8;
    /// Clip gradients to this global L2 norm (0 disables).
    max_grad_norm: f64 = 1.0;
    num_train_epochs: f64 = 3.0;
    /// Optimizer steps to run; overrides num_train_epochs when positive.
    max_steps: i64 = -1;
    /// Examples (or packed rows) are cut to this many tokens.
    max_length: usize = 1024;
    packing: bool = false;
    /// bfd, bfd_split or wrapped.
    packing_strategy: String = "bfd".into();
    /// All rows of a micro-batch in one sequence, positions restarting per document.
    padding_free: bool = false;
    pad_to_multiple_of: Option<usize> = None;
    /// Loss on completions only for prompt-completion data (TRL: on when unset).
    completion_only_loss: Option<bool> = None;
    /// Loss on assistant turns only ({% generation %} spans of the chat template).
    assistant_only_loss: bool = false;
    logging_steps: usize = 10;
    save_steps: usize = 500;
    save_total_limit: Option<usize> = None;
    /// Evaluate every this many steps (and at the end) when an eval dataset is given.
    eval_steps: Option<usize> = None;
    /// Held-out prompts scored by greedy generation (exact match) at each evaluation.
    eval_generation_samples: usize = 100;
    seed: u64 = 42;
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
    /// default, as in TRL's SFTConfig: `--gradient_checkpointing false` trades memory for speed.
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

impl SFTConfig {
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
}

/// `trl sft`-style command line: an optional config file and flags that override it.
#[derive(Debug, clap::Parser)]
// Repeated flags: the last one wins, as with HF's argument parser.
#[command(
    about = "Supervised fine-tuning (TRL's SFT) on Candle",
    rename_all = "snake_case",
    args_override_self = true
)]
pub struct SftCli {
    /// A YAML or TOML file with SFTConfig fields.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub args: SFTArgs,
    /// TRL / transformers flags without a field here (`--report_to wandb`), taken out before
    /// clap parses the rest ([`SftCli::parse_trl`]) and handled as in a file.
    #[arg(skip)]
    pub other: std::collections::BTreeMap<String, serde_yaml::Value>,
}

impl SftCli {
    /// Parses the process's arguments like `trl sft` does: TRL's and transformers' flags that
    /// SFTConfig has no field for are accepted (see [`Self::apply`]); anything else is clap's.
    pub fn parse_trl() -> Self {
        Self::parse_trl_from(std::env::args())
    }

    /// As [`Self::parse_trl`] over `args` (the program name first). Exits on bad flags, as
    /// clap's `parse` does.
    pub fn parse_trl_from(args: impl IntoIterator<Item = String>) -> Self {
        use clap::Parser;
        let (rest, other) = super::trl_keys::take_flags(args);
        let mut cli = Self::parse_from(rest);
        cli.other = other;
        cli
    }

    /// As [`Self::parse_trl_from`], returning clap's error instead of exiting (for tools that
    /// read a training program's arguments, such as the launcher).
    pub fn try_parse_trl_from(
        args: impl IntoIterator<Item = String>,
    ) -> std::result::Result<Self, clap::Error> {
        use clap::Parser;
        let (rest, other) = super::trl_keys::take_flags(args);
        let mut cli = Self::try_parse_from(rest)?;
        cli.other = other;
        Ok(cli)
    }

    /// The training arguments these flags give, as a TRL program reads them: defaults, then
    /// the `--config` file, then the flags, validated; with the `SOURCE: ignored: KEY: why`
    /// lines of the keys that have no effect.
    pub fn resolve(&self) -> Result<(SFTConfig, Vec<String>)> {
        let (mut config, mut ignored) = match &self.config {
            Some(path) => {
                let (config, lines) = SFTConfig::read(path)?;
                let source = path.display().to_string();
                (config, ignored_lines(&source, lines))
            }
            None => (SFTConfig::default(), Vec::new()),
        };
        ignored.extend(ignored_lines("command line", self.apply(&mut config)?));
        config.validate("command line")?;
        Ok((config, ignored))
    }

    /// Writes the flags over `config`, then applies, refuses or names the TRL flags without a
    /// field (as for a file); returns the `KEY: why` lines of those without effect.
    pub fn apply(&self, config: &mut SFTConfig) -> Result<Vec<String>> {
        self.args.apply(config);
        config.other.extend(self.other.clone());
        config.apply_other("command line")
    }
}

fn ignored_lines(source: &str, lines: Vec<String>) -> Vec<String> {
    lines
        .into_iter()
        .map(|l| format!("{source}: ignored: {l}"))
        .collect()
}

impl SFTConfig {
    /// Applies `other` (TRL's and transformers' keys without a field here; see
    /// [`super::trl_keys`]): sets the fields aliases name, refuses what would change what is
    /// trained, and returns the `KEY: why` lines of those without effect.
    fn apply_other(&mut self, source: &str) -> Result<Vec<String>> {
        let other = std::mem::take(&mut self.other);
        let (aliases, ignored) = super::trl_keys::classify(other, FIELDS, source)?;
        for alias in aliases {
            match alias {
                Alias::GradientCheckpointing(on) => self.gradient_checkpointing = on,
                Alias::MaxLength(n) => self.max_length = n,
            }
        }
        Ok(ignored)
    }

    /// Reads a YAML (.yaml/.yml) or TOML (.toml) file. TRL's and transformers' arguments
    /// without a field here are applied, refused or named once (printed by the main process);
    /// any other key is an error naming it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let (config, ignored) = Self::read(path.as_ref())?;
        let main = std::env::var("RANK").map_or(true, |r| r.trim() == "0");
        for line in ignored.iter().filter(|_| main) {
            eprintln!("warning: {}: ignored: {line}", path.as_ref().display());
        }
        Ok(config)
    }

    /// As [`Self::from_file`], returning the `KEY: why` lines of the keys without effect.
    pub fn read(path: &Path) -> Result<(Self, Vec<String>)> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        let bad = |message: String| Error::Config {
            file: path.display().to_string(),
            key: "<document>".into(),
            message,
        };
        let config: SFTConfig = match path.extension().and_then(|e| e.to_str()) {
            Some("toml") => toml::from_str(&text).map_err(|e| bad(e.to_string()))?,
            _ => serde_yaml::from_str(&text).map_err(|e| bad(e.to_string()))?,
        };
        let mut config = config;
        let ignored = config.apply_other(&path.display().to_string())?;
        config.validate(&path.display().to_string())?;
        Ok((config, ignored))
    }

    /// Defaults, then the `--config` file, then the flags ([`SftCli::resolve`]); the keys
    /// without effect are named on the main process.
    pub fn from_cli(cli: &SftCli) -> Result<Self> {
        let (config, ignored) = cli.resolve()?;
        if std::env::var("RANK").map_or(true, |r| r.trim() == "0") {
            for line in ignored {
                eprintln!("warning: {line}");
            }
        }
        Ok(config)
    }

    /// Checks values that have a fixed set of choices or bounds.
    pub fn validate(&self, source: &str) -> Result<()> {
        let err = |key: &str, message: String| {
            Err(Error::Config {
                file: source.into(),
                key: key.into(),
                message,
            })
        };
        crate::train::SchedulerKind::parse(&self.lr_scheduler_type).map_err(|e| Error::Config {
            file: source.into(),
            key: "lr_scheduler_type".into(),
            message: e.to_string(),
        })?;
        if crate::nn::AttentionImpl::parse(&self.attn_implementation).is_none() {
            return err(
                "attn_implementation",
                format!(
                    "'{}' is not accepted: use one of {}",
                    self.attn_implementation,
                    crate::nn::AttentionImpl::NAMES.join(", ")
                ),
            );
        }
        if crate::data::PackingStrategy::parse(&self.packing_strategy).is_none() {
            return err(
                "packing_strategy",
                format!(
                    "'{}' is not accepted: use one of {}",
                    self.packing_strategy,
                    crate::data::pack::PACKING_STRATEGIES.join(", ")
                ),
            );
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
            ("logging_steps", self.logging_steps),
            ("save_steps", self.save_steps),
        ] {
            if v == 0 {
                return err(key, "must be at least 1".into());
            }
        }
        if self.learning_rate.is_nan() || self.learning_rate < 0.0 {
            return err(
                "learning_rate",
                format!("{} must be a non-negative number", self.learning_rate),
            );
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return err(
                "warmup_ratio",
                format!("{} must be between 0 and 1", self.warmup_ratio),
            );
        }
        if let Some(mp) = &self.mixed_precision {
            precision(mp).map_err(|message| Error::Config {
                file: source.into(),
                key: "mixed_precision".into(),
                message,
            })?;
        }
        if self.max_steps <= 0 && self.num_train_epochs <= 0.0 {
            return err(
                "max_steps",
                "set max_steps or a positive num_train_epochs".into(),
            );
        }
        Ok(())
    }
}
