//! The SFT program shared by the `sft` binaries: `trl sft` + `accelerate launch` behaviour
//! for any [`CausalModel`].

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::models::CausalModel;
use trl_runtime::train::{SFTConfig, Trainer};

/// The bundled job (assets/tiny/sft.yaml): the tiny model on the addition task, settings
/// that train it in a few minutes on two cores.
pub fn embedded_defaults() -> trl_runtime::Result<SFTConfig> {
    crate::bundled_job("sft.yaml")
}

fn run<N: CausalModel>(config: SFTConfig) -> trl_runtime::Result<()> {
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<N>::load(config, &ctx)?;
    let outcome = trainer.train()?;
    if ctx.is_main_process() {
        let curve = trainer.config.training.output_dir.join("loss.svg");
        let extra = format!("; loss curve {}", curve.display());
        let figure = crate::Figure::Accuracy("accuracy");
        crate::print_outcome(&outcome, trainer.state.global_step, figure, &extra);
    }
    Ok(())
}

/// `trl sft` for model `N`: TRL's flags and YAML over `defaults`, one rank when launched,
/// else TRL_LOCAL_PROCESSES local ranks (default 2) of this program.
pub fn main<N: CausalModel>(defaults: fn() -> trl_runtime::Result<SFTConfig>) -> ExitCode {
    crate::launch::<SFTConfig>(defaults, run::<N>)
}
