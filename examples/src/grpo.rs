//! The online RL programs: `trl grpo` / `trl rloo` + `accelerate launch` behaviour for any
//! [`CausalModel`].

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::models::CausalModel;
use trl_runtime::train::{
    Distillation, DistillationConfig, GRPOConfig, Grpo, RLOOConfig, Rloo, Task, Trainer,
};

/// The bundled job (assets/tiny/grpo.yaml): the bundled addition prompts on the tiny model,
/// settings that run in a minute on two cores.
pub fn embedded_defaults() -> trl_runtime::Result<GRPOConfig> {
    crate::bundled_job("grpo.yaml")
}

/// RLOO's bundled job (assets/tiny/rloo.yaml): the same prompts and rewards.
pub fn rloo_defaults() -> trl_runtime::Result<RLOOConfig> {
    crate::bundled_job("rloo.yaml")
}

fn run<N: CausalModel, T: Task<N>>(config: T::Config) -> trl_runtime::Result<()> {
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<N, T>::load(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() {
        crate::print_outcome(&outcome, trainer.state.global_step, "reward", "");
    }
    Ok(())
}

/// `trl grpo` for model `N`.
pub fn main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<GRPOConfig>) -> ExitCode {
    crate::launch::<GRPOConfig>(defaults, run::<N, Grpo>)
}

/// `trl rloo` for model `N`.
pub fn rloo_main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<RLOOConfig>) -> ExitCode {
    crate::launch::<RLOOConfig>(defaults, run::<N, Rloo>)
}

/// Distillation's bundled job (assets/tiny/distillation.yaml): the same prompts, completed by
/// the tiny model and distilled from the bundled teacher.
pub fn distillation_defaults() -> trl_runtime::Result<DistillationConfig> {
    crate::bundled_job("distillation.yaml")
}

fn run_distillation<N: CausalModel>(config: DistillationConfig) -> trl_runtime::Result<()> {
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<N, Distillation>::load(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() && !outcome.preempted {
        let loss = |e: &Option<trl_runtime::train::EvalResult>| {
            e.as_ref()
                .map_or("n/a".into(), |e| format!("{:.4}", e.loss))
        };
        println!(
            "held-out divergence from the teacher: before {} -> after {}; final train loss {:.4}; checkpoint {}",
            loss(&outcome.initial_eval),
            loss(&outcome.final_eval),
            outcome.losses.last().copied().unwrap_or(f64::NAN),
            outcome
                .last_checkpoint
                .as_ref()
                .map_or("none".into(), |p| p.display().to_string()),
        );
    } else if ctx.is_main_process() {
        crate::print_outcome(&outcome, trainer.state.global_step, "entropy", "");
    }
    Ok(())
}

/// `trl distillation` for model `N` (the student; the teacher is any built-in model).
pub fn distillation_main<N: CausalModel>(
    defaults: fn() -> trl_runtime::Result<DistillationConfig>,
) -> ExitCode {
    crate::launch::<DistillationConfig>(defaults, run_distillation::<N>)
}
