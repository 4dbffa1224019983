//! SFTConfig: TRL's SFT training arguments, [`TrainingArguments`] and the keys only SFT has
//! (packing, padding-free batches, which tokens carry the loss), read from a YAML or TOML file
//! and overridden from the command line, as `trl sft --config file.yaml --learning_rate 1e-4`
//! does ([`SftCli`]).

use super::args::{Cli, TrainingArguments};
use crate::error::Result;

crate::training_arguments! {
    /// SFT's training arguments, with TRL's names.
    struct SFTConfig, flags SFTArgs, base training;
    packing: bool = false;
    /// bfd, bfd_split or wrapped.
    packing_strategy: String = "bfd".into();
    /// All rows of a micro-batch in one sequence, positions restarting per document.
    padding_free: bool = false;
    /// A token count, none, or auto (TRL's default: no padding off AWS Neuron).
    pad_to_multiple_of: crate::config::cli_value::PadMultiple = Default::default();
    /// Loss on completions only for prompt-completion data (TRL: on when unset).
    completion_only_loss: Option<bool> = None;
    /// Loss on assistant turns only ({% generation %} spans of the chat template).
    assistant_only_loss: bool = false;
    /// nll, or dft (Dynamic Fine-Tuning: each token's loss weighted by its detached
    /// probability, TRL's loss_type "dft").
    loss_type: String = "nll".into();
    /// The column holding a language-modeling row's text (rows without messages, a prompt
    /// or input_ids).
    dataset_text_field: String = "text".into();
    /// The token that ends each sequence (appended to text and completions; generation's
    /// stop); unset: the tokenizer's. It must be in the vocabulary.
    eos_token: Option<String> = None;
    /// Another chat template: a .jinja / .j2 file, or a tokenizer directory whose template and
    /// end-of-sequence token are taken (TRL's clone_chat_template, without adding tokens).
    chat_template_path: Option<std::path::PathBuf> = None;
    /// Held-out prompts scored by greedy generation (exact match) at each evaluation.
    eval_generation_samples: usize = 100;
}

crate::trainer_config!(SFTConfig, flags SFTArgs, base training,
    about "Supervised fine-tuning (TRL's SFT) on Candle",
    accuracy "eval_accuracy", metrics ["eval_entropy", "eval_mean_token_accuracy"], validate validate_sft);

/// `trl sft`-style command line: an optional config file and flags that override it.
pub type SftCli = Cli<SFTConfig>;

/// SFTConfig's own checks.
fn validate_sft(config: &SFTConfig, source: &str) -> Result<()> {
    if !matches!(config.loss_type.as_str(), "nll" | "dft") {
        return Err(crate::Error::config(
            source,
            "loss_type",
            format!("'{}' is not accepted: use nll or dft", config.loss_type),
        ));
    }
    if crate::data::PackingStrategy::parse(&config.packing_strategy).is_none() {
        return Err(crate::Error::config(
            source,
            "packing_strategy",
            format!(
                "'{}' is not accepted: use one of {}",
                config.packing_strategy,
                crate::data::pack::PACKING_STRATEGIES.join(", ")
            ),
        ));
    }
    Ok(())
}

impl SFTConfig {
    /// A config with these shared arguments and SFT's defaults.
    pub fn with(training: TrainingArguments) -> Self {
        SFTConfig {
            training,
            ..Default::default()
        }
    }
}
