//! The preference programs: `trl dpo` / `trl kto` / `trl reward` + `accelerate launch`
//! behaviour for any [`CausalModel`].

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::models::sequence_classification::SequenceClassifier;
use trl_runtime::models::CausalModel;
use trl_runtime::train::{DPOConfig, Dpo, KTOConfig, Kto, Reward, RewardConfig, Task, Trainer};

/// The bundled job (assets/tiny/dpo.yaml): the bundled preference pairs on the tiny model,
/// settings that train in a couple of minutes on two cores.
pub fn embedded_defaults() -> trl_runtime::Result<DPOConfig> {
    crate::bundled_job("dpo.yaml")
}

/// KTO's bundled job (assets/tiny/kto.yaml): the bundled pairs, unpaired.
pub fn kto_defaults() -> trl_runtime::Result<KTOConfig> {
    crate::bundled_job("kto.yaml")
}

/// The reward trainer's bundled job (assets/tiny/reward.yaml): the bundled pairs.
pub fn reward_defaults() -> trl_runtime::Result<RewardConfig> {
    crate::bundled_job("reward.yaml")
}

/// Trains task `T` as configured; the main process prints the held-out `figure`.
fn run<N: CausalModel, T: Task<N>>(config: T::Config, figure: &str) -> trl_runtime::Result<()> {
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<N, T>::load(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() {
        crate::print_outcome(
            &outcome,
            trainer.state.global_step,
            crate::Figure::Accuracy(figure),
            "",
        );
    }
    Ok(())
}

/// `trl dpo` for model `N`.
pub fn main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<DPOConfig>) -> ExitCode {
    crate::launch::<DPOConfig>(defaults, |c| run::<N, Dpo>(c, "reward accuracy"))
}

/// `trl kto` for model `N`.
pub fn kto_main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<KTOConfig>) -> ExitCode {
    crate::launch::<KTOConfig>(defaults, |c| run::<N, Kto>(c, "reward margin"))
}

/// `trl reward` for a classifier over model `N`.
pub fn reward_main<N: CausalModel>(
    defaults: fn() -> trl_runtime::Result<RewardConfig>,
) -> ExitCode {
    crate::launch::<RewardConfig>(defaults, |c| {
        run::<SequenceClassifier<N>, Reward>(c, "pair accuracy")
    })
}
