//! Runnable training programs (one per binary in `src/bin/`) and the bundled assets of the
//! embedded default: a checkable synthetic SFT task and its preference pairs (DPO), a tokenizer trained on it, and a tiny
//! random-init Qwen2 in HF format. `cargo run -p trl-examples --bin make_assets` regenerates
//! `assets/tiny/` deterministically; nothing is downloaded.

pub mod assets;
pub mod dpo;
pub mod phi;
pub mod sft;

use std::process::ExitCode;
use trl_runtime::dist::spawn;
use trl_runtime::train::{Cli, EvalResult, TrainOutcome, TrainerConfig};

/// A trainer program's `main`: TRL's flags and YAML over `defaults`, then `run` as one rank
/// when launched, else TRL_LOCAL_PROCESSES local ranks (default 2) of this program.
pub fn launch<C: TrainerConfig>(
    defaults: fn() -> C,
    run: impl FnOnce(C) -> trl_runtime::Result<()>,
) -> ExitCode {
    let (config, ignored) = match Cli::<C>::parse_trl().resolve_over(defaults()) {
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

/// What a finished run prints (main process): where a preempted run saved after `step`, else
/// the held-out `accuracy` (its name) before and after, the last loss, the checkpoint and
/// `extra`.
pub fn print_outcome(outcome: &TrainOutcome, step: usize, accuracy: &str, extra: &str) {
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
    let acc = |e: &Option<EvalResult>| {
        e.as_ref()
            .and_then(|e| e.accuracy)
            .map_or("n/a".into(), |a| format!("{:.1}%", 100.0 * a))
    };
    println!(
        "held-out {accuracy}: before {} -> after {}; final train loss {:.4}; checkpoint {}{extra}",
        acc(&outcome.initial_eval),
        acc(&outcome.final_eval),
        outcome.losses.last().copied().unwrap_or(f64::NAN),
        path("none"),
    );
}
