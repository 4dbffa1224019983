//! The SFT program shared by the `sft` binaries: `trl sft` + `accelerate launch` behaviour
//! for any [`CausalModel`].

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::models::CausalModel;
use trl_runtime::train::{SFTConfig, Trainer};

/// Defaults of the embedded job: the bundled assets, and settings that train the tiny model
/// in a few minutes on two cores.
pub fn embedded_defaults() -> SFTConfig {
    let assets = crate::assets::default_dir();
    SFTConfig {
        training: trl_runtime::train::TrainingArguments {
            model_name_or_path: assets.join("model"),
            dataset_name: assets.join("data/train.jsonl"),
            eval_dataset_name: Some(assets.join("data/eval.jsonl")),
            output_dir: "output/sft-tiny".into(),
            per_device_train_batch_size: 16,
            learning_rate: 2e-3,
            lr_scheduler_type: "cosine".into(),
            warmup_ratio: 0.05,
            weight_decay: 0.01,
            num_train_epochs: 24.0,
            max_length: 64,
            logging_steps: 25,
            save_steps: 1000,
            save_total_limit: Some(2),
            eval_steps: Some(500),
            ..Default::default()
        },
        assistant_only_loss: true,
        eval_generation_samples: 200,
        ..SFTConfig::default()
    }
}

fn run<N: CausalModel>(config: SFTConfig) -> trl_runtime::Result<()> {
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<N>::load(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() {
        let curve = trainer.config.training.output_dir.join("loss.svg");
        let extra = format!("; loss curve {}", curve.display());
        crate::print_outcome(&outcome, trainer.state.global_step, "accuracy", &extra);
    }
    Ok(())
}

/// `trl sft` for model `N`: TRL's flags and YAML over `defaults`, one rank when launched,
/// else TRL_LOCAL_PROCESSES local ranks (default 2) of this program.
pub fn main<N: CausalModel>(defaults: fn() -> SFTConfig) -> ExitCode {
    crate::launch::<SFTConfig>(defaults, run::<N>)
}
