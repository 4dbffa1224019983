//! The online RL programs: `trl grpo` / `trl rloo` + `accelerate launch` behaviour for any
//! [`CausalModel`].

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::models::CausalModel;
use trl_runtime::train::{
    Distillation, DistillationConfig, GRPOConfig, Grpo, RLOOConfig, Rloo, Task, Trainer,
};

/// The bundled job (assets/tiny/grpo.yaml): the addition prompts, from a policy that mostly
/// copies the first number, settings that run in about ten seconds on two cores.
pub fn embedded_defaults() -> trl_runtime::Result<GRPOConfig> {
    crate::bundled_job("grpo.yaml")
}

/// RLOO's bundled job (assets/tiny/rloo.yaml): the same prompts and rewards.
pub fn rloo_defaults() -> trl_runtime::Result<RLOOConfig> {
    crate::bundled_job("rloo.yaml")
}

fn run<N: CausalModel, T: Task<N>>(
    config: T::Config,
    figure: crate::Figure<'_>,
) -> trl_runtime::Result<()> {
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<N, T>::load(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() {
        crate::print_outcome(&outcome, trainer.state.global_step, figure, "");
    }
    Ok(())
}

/// The online trainers' held-out figure: the mean reward.
const REWARD: crate::Figure<'static> = crate::Figure::Accuracy("reward");

/// `trl grpo` for model `N`.
pub fn main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<GRPOConfig>) -> ExitCode {
    crate::launch::<GRPOConfig>(defaults, |c| run::<N, Grpo>(c, REWARD))
}

/// `trl rloo` for model `N`.
pub fn rloo_main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<RLOOConfig>) -> ExitCode {
    crate::launch::<RLOOConfig>(defaults, |c| run::<N, Rloo>(c, REWARD))
}

/// Distillation's bundled job (assets/tiny/distillation.yaml): the same prompts, completed by
/// the tiny model and distilled from the bundled teacher.
pub fn distillation_defaults() -> trl_runtime::Result<DistillationConfig> {
    crate::bundled_job("distillation.yaml")
}

/// `trl distillation` for model `N` (the student; the teacher is any built-in model).
pub fn distillation_main<N: CausalModel>(
    defaults: fn() -> trl_runtime::Result<DistillationConfig>,
) -> ExitCode {
    let figure = crate::Figure::Loss("divergence from the teacher");
    crate::launch::<DistillationConfig>(defaults, |c| run::<N, Distillation>(c, figure))
}
