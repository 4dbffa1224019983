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
        crate::print_outcome(&outcome, trainer.state.global_step, "reward accuracy", "");
    }
    Ok(())
}

/// `trl dpo` for model `N`.
pub fn main<N: CausalModel>(defaults: fn() -> DPOConfig) -> ExitCode {
    crate::launch::<DPOConfig>(defaults, run::<N>)
}
