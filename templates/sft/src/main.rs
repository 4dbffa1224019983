//! Supervised fine-tuning with trl-runtime. Run it on 2 local CPU processes with
//! `cargo trl launch --profile multi_cpu`, or with any Accelerate profile / config file.
//! Settings come from sft.yaml; any field can be overridden: `-- --learning_rate 1e-3`.

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::train::{SFTConfig, SftCli, Trainer};

fn run() -> trl_runtime::Result<()> {
    let cli = SftCli::parse_trl();
    let mut config = SFTConfig::from_file(cli.config.as_deref().unwrap_or("sft.yaml".as_ref()))?;
    for line in cli.apply(&mut config)? {
        if std::env::var("RANK").map_or(true, |r| r == "0") {
            eprintln!("warning: command line: ignored: {line}");
        }
    }
    config.validate("command line")?;
    let ctx = DistContext::from_env()?;
    trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::new(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() {
        let acc = |e: Option<trl_runtime::train::EvalResult>| e.and_then(|e| e.accuracy).map_or("n/a".into(), |a| format!("{:.1}%", 100.0 * a));
        println!("held-out accuracy: before {} -> after {}", acc(outcome.initial_eval), acc(outcome.final_eval));
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
