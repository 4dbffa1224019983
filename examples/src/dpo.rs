//! The DPO program: `trl dpo` + `accelerate launch` behaviour for any [`CausalModel`].

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::models::CausalModel;
use trl_runtime::train::{DPOConfig, Dpo, Trainer};

/// Defaults of the embedded job: the bundled preference pairs on the tiny model, settings that
/// train in a couple of minutes on two cores.
pub fn embedded_defaults() -> DPOConfig {
    let assets = crate::assets::default_dir();
    DPOConfig {
        training: trl_runtime::train::TrainingArguments {
            model_name_or_path: assets.join("model"),
            dataset_name: assets.join("data/pref_train.jsonl"),
            eval_dataset_name: Some(assets.join("data/pref_eval.jsonl")),
            output_dir: "output/dpo-tiny".into(),
            per_device_train_batch_size: 16,
            learning_rate: 5e-4,
            lr_scheduler_type: "constant".into(),
            num_train_epochs: 1.0,
            max_length: 64,
            logging_steps: 10,
            save_steps: 1000,
            save_total_limit: Some(2),
            ..Default::default()
        },
        ..DPOConfig::default()
    }
}

fn run<N: CausalModel>(config: DPOConfig) -> trl_runtime::Result<()> {
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<N, Dpo>::load(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() {
        let acc = |e: Option<trl_runtime::train::EvalResult>| {
            e.and_then(|e| e.accuracy)
                .map_or("n/a".into(), |a| format!("{:.1}%", 100.0 * a))
        };
        match outcome.preempted {
            true => println!(
                "preempted by SIGTERM after step {}: saved {}",
                trainer.state.global_step,
                outcome
                    .last_checkpoint
                    .as_ref()
                    .map_or("nothing".into(), |p| p.display().to_string())
            ),
            false => println!(
                "held-out reward accuracy: before {} -> after {}; final train loss {:.4}; checkpoint {}",
                acc(outcome.initial_eval),
                acc(outcome.final_eval),
                outcome.losses.last().copied().unwrap_or(f64::NAN),
                outcome
                    .last_checkpoint
                    .as_ref()
                    .map_or("none".into(), |p| p.display().to_string()),
            ),
        }
    }
    Ok(())
}

/// `trl dpo` for model `N`.
pub fn main<N: CausalModel>(defaults: fn() -> DPOConfig) -> ExitCode {
    crate::launch::<DPOConfig>(defaults, run::<N>)
}
