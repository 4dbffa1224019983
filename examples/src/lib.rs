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
use trl_runtime::train::{Cli, TrainerConfig};

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
