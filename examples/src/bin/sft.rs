//! The main job: supervised fine-tuning as `trl sft` + `accelerate launch` do it.
//!
//! `cargo run --release -p trl-examples --bin sft` trains the bundled tiny Qwen2 on the bundled
//! addition task with 2 CPU processes (host backend) and reports held-out accuracy before and
//! after. Flags are TRL's (`--learning_rate 1e-3`, `--config sft.yaml`, ...). Launched by
//! `cargo trl launch` or torchrun (RANK, WORLD_SIZE, ... set) it runs as one rank; started
//! directly it spawns TRL_LOCAL_PROCESSES local ranks (default 2) of itself.

use std::process::ExitCode;
use trl_examples::sft;
use trl_runtime::models::AutoModelForCausalLM;

fn main() -> ExitCode {
    sft::main::<AutoModelForCausalLM>(sft::embedded_defaults)
}
