//! Runnable training programs (one per binary in `src/bin/`) and the bundled assets of the
//! embedded default: a checkable synthetic SFT task and its preference pairs (DPO), a tokenizer trained on it, and a tiny
//! random-init Qwen2 in HF format. `cargo run -p trl-examples --bin make_assets` regenerates
//! `assets/tiny/` deterministically; nothing is downloaded.

pub mod assets;
pub mod dpo;
pub mod grpo;
pub mod phi;
pub mod sft;

use std::process::ExitCode;
use trl_runtime::dist::spawn;
use trl_runtime::train::{Cli, EvalResult, TrainOutcome, TrainerConfig};

/// A trainer program's `main`: TRL's flags and YAML over `defaults`, then `run` as one rank
/// when launched, else TRL_LOCAL_PROCESSES local ranks (default 2) of this program.
///
/// `defaults` (the bundled job's settings) hold while the command names no model and no
/// dataset. Naming either starts from TRL's defaults, as `trl sft --model_name_or_path ...`
/// does, so that a user's model is not trained at the tiny job's max_length 64 and learning
/// rate, nor evaluated on its data; only the program's model stays the default model.
pub fn launch<C: TrainerConfig>(
    defaults: fn() -> trl_runtime::Result<C>,
    run: impl FnOnce(C) -> trl_runtime::Result<()>,
) -> ExitCode {
    let cli = Cli::<C>::parse_trl();
    let resolved = defaults().and_then(|bundled| {
        let bundled_output = bundled.training().output_dir.clone();
        let base = match names_model_or_data(&cli) {
            false => bundled,
            true => {
                let mut trl = C::default();
                trl.training_mut().model_name_or_path =
                    bundled.training().model_name_or_path.clone();
                trl
            }
        };
        let mut resolved = cli.resolve_over(base)?;
        // The bundled job's adapters go beside its full run's checkpoints, not over them.
        let t = resolved.0.training_mut();
        if t.use_peft && t.output_dir == bundled_output && !names_output_dir(&cli) {
            let mut name = bundled_output.into_os_string();
            name.push("-lora");
            t.output_dir = name.into();
        }
        Ok(resolved)
    });
    let (config, ignored) = match resolved {
        Ok(resolved) => resolved,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(code) = spawn::relaunch_unless_launched(2) {
        return code;
    }
    if std::env::var("RANK").map_or(true, |r| r == "0") {
        for line in ignored {
            eprintln!("warning: {line}");
        }
    }
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The bundled job's settings: `file` in assets/tiny (TRL's keys), its relative paths read
/// from the repository root, so the program runs from any directory.
pub fn bundled_job<C: TrainerConfig>(file: &str) -> trl_runtime::Result<C> {
    let (mut config, _) = C::read(&assets::default_dir().join(file))?;
    // Canonical, so that what the run writes (an adapter's base_model_name_or_path) reads
    // as a plain path, not `examples/../assets/tiny/../..`.
    let root = assets::default_dir().join("../..");
    let root = std::fs::canonicalize(&root).unwrap_or(root);
    let t = config.training_mut();
    let paths = [&mut t.model_name_or_path, &mut t.dataset_name]
        .into_iter()
        .chain(t.eval_dataset_name.as_mut());
    for path in paths.filter(|p| p.is_relative()) {
        *path = root.join(&*path);
    }
    Ok(config)
}

/// The paths the flags name: their values applied over empty model, dataset and output
/// paths (empty: not named).
fn named_by_flags<C: TrainerConfig>(cli: &Cli<C>) -> C {
    let mut probe = C::default();
    let t = probe.training_mut();
    t.model_name_or_path = Default::default();
    t.dataset_name = Default::default();
    t.output_dir = Default::default();
    // A flag that does not apply is reported by `resolve_over`, which reads them again.
    let _ = cli.apply(&mut probe);
    probe
}

/// Whether the flags name a model or a dataset (a `--config` file replaces the defaults
/// anyway).
fn names_model_or_data<C: TrainerConfig>(cli: &Cli<C>) -> bool {
    let probe = named_by_flags(cli);
    let t = probe.training();
    let named = |p: &std::path::Path| !p.as_os_str().is_empty();
    named(&t.model_name_or_path) || named(&t.dataset_name) || !t.datasets.0.is_empty()
}

/// Whether the flags name the output directory (a --config file replaces the defaults, so
/// its output_dir counts as named).
fn names_output_dir<C: TrainerConfig>(cli: &Cli<C>) -> bool {
    cli.config.is_some()
        || !named_by_flags(cli)
            .training()
            .output_dir
            .as_os_str()
            .is_empty()
}

/// The held-out figure a finished run prints before and after training, by its name.
#[derive(Debug, Clone, Copy)]
pub enum Figure<'a> {
    /// The evaluation's accuracy figure, as a percentage.
    Accuracy(&'a str),
    /// The evaluation's loss (a trainer whose figure is its loss: distillation's divergence).
    Loss(&'a str),
}

/// What a finished run prints (main process): where a preempted run saved after `step`, else
/// the held-out `figure` before and after, the last loss, the checkpoint and `extra`.
pub fn print_outcome(outcome: &TrainOutcome, step: usize, figure: Figure<'_>, extra: &str) {
    let path = |none: &str| {
        outcome
            .last_checkpoint
            .as_ref()
            .map_or(none.into(), |p| p.display().to_string())
    };
    if outcome.preempted {
        println!(
            "preempted by SIGTERM after step {step}: saved {}",
            path("nothing")
        );
        return;
    }
    let (name, value): (&str, fn(&EvalResult) -> Option<String>) = match figure {
        Figure::Accuracy(name) => (name, |e| e.accuracy.map(|a| format!("{:.1}%", 100.0 * a))),
        Figure::Loss(name) => (name, |e| Some(format!("{:.4}", e.loss))),
    };
    let acc = |e: &Option<EvalResult>| e.as_ref().and_then(value).unwrap_or("n/a".into());
    println!(
        "held-out {name}: before {} -> after {}; final train loss {:.4}; checkpoint {}{extra}",
        acc(&outcome.initial_eval),
        acc(&outcome.final_eval),
        outcome.losses.last().copied().unwrap_or(f64::NAN),
        path("none"),
    );
}
