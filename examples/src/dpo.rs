//! The DPO program: `trl dpo` + `accelerate launch` behaviour for any [`CausalModel`].

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::models::CausalModel;
use trl_runtime::train::{DPOConfig, Dpo, Trainer};

/// The bundled job (assets/tiny/dpo.yaml): the bundled preference pairs on the tiny model,
/// settings that train in a couple of minutes on two cores.
pub fn embedded_defaults() -> trl_runtime::Result<DPOConfig> {
    crate::bundled_job("dpo.yaml")
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
pub fn main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<DPOConfig>) -> ExitCode {
    crate::launch::<DPOConfig>(defaults, run::<N>)
}
