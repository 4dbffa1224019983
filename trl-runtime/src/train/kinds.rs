//! What a trainer is to the tools: its name, how a program's arguments read as its own, what
//! its rows cost a rank, and its scaffold. Each trainer's file declares its [`TrainerKind`];
//! `super::registry` lists them.

use super::args::{Cli, TrainerConfig, TrainingArguments};
use crate::parallel::estimate::Workload;

/// A trainer as the tools see it.
pub struct TrainerKind {
    /// `cargo trl new --trainer NAME`, `cargo trl plan --trainer NAME`.
    pub name: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// A program's arguments (without its name) read as this trainer's, flags over the
    /// `--config FILE` they name; None when they are not its arguments.
    pub read: fn(&[String]) -> Option<ReadArgs>,
    /// What `cargo trl new --trainer NAME` writes.
    pub scaffold: Scaffold,
}

/// A program's arguments as a trainer reads them.
#[derive(Debug, Clone)]
pub struct ReadArgs {
    pub training: TrainingArguments,
    /// They name the model (`--model_name_or_path`, or a config file that may).
    pub names_model: bool,
    /// What its rows cost a rank.
    pub workload: Workload,
}

/// A trainer's scaffold: its config and bundled data (paths in this repository, which
/// `cargo trl new` carries), and what the crate's `src/main.rs` and README say of it.
pub struct Scaffold {
    /// The config file the program reads (written at the crate's root under its file name).
    pub config: &'static str,
    /// The bundled data the config names: (path in the new crate, path in this repository).
    pub data: &'static [(&'static str, &'static str)],
    /// Its types in `trl_runtime::train`: the config and its command line, and its task
    /// (None: SFT, the `Trainer`'s default).
    pub config_type: &'static str,
    pub cli_type: &'static str,
    pub task_type: Option<&'static str>,
    /// The generic type the model is wrapped in (the reward trainer's
    /// `SequenceClassifier<Model>`), None for the model itself.
    pub model_wrapper: Option<&'static str>,
    /// What the program does ("Supervised fine-tuning").
    pub summary: &'static str,
    /// A flag its docs show overriding the config (`--learning_rate 1e-3`).
    pub example_flag: &'static str,
    /// What its data holds, beside "a small addition dataset (`data/`...)".
    pub data_note: &'static str,
    /// TRL's row formats it reads.
    pub formats: &'static str,
    /// What its held-out evaluation reports ("accuracy").
    pub metric: &'static str,
    /// Rust items `src/main.rs` defines for the trainer (a reward function), and the
    /// statements that hand them over before the config is read ("" for none).
    pub items: &'static str,
    pub setup: &'static str,
}

/// `args` read as trainer config `C` (its flags over the `--config FILE` they name), with its
/// `workload`.
pub fn read_as<C: TrainerConfig>(
    args: &[String],
    workload: fn(&C) -> Workload,
) -> Option<ReadArgs> {
    let argv = std::iter::once("program".to_string()).chain(args.iter().cloned());
    let cli = Cli::<C>::try_parse_trl_from(argv).ok()?;
    let (config, _) = cli.resolve().ok()?;
    let names_model = cli.config.is_some()
        || args
            .iter()
            .any(|a| a.replace('-', "_").starts_with("__model_name_or_path"));
    Some(ReadArgs {
        training: config.training().clone(),
        names_model,
        workload: workload(&config),
    })
}
