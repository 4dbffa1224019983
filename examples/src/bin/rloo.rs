//! Online RL as `trl rloo` + `accelerate launch` do it (TRL's RLOOTrainer).
//!
//! `cargo run --release -p trl-examples --bin rloo` runs RLOO on the bundled tiny Qwen2 over
//! the bundled addition prompts (accuracy_reward against each prompt's sum) with 2 CPU
//! processes, completions sampled in the training processes, and reports the held-out reward
//! before and after. Flags are TRL's (`--num_generations 4`, `--beta 0.1`, `--config
//! rloo.yaml`, ...). Launched by `cargo trl launch` or torchrun it runs as one rank.

use std::process::ExitCode;
use trl_examples::grpo;
use trl_runtime::models::AutoModelForCausalLM;

fn main() -> ExitCode {
    grpo::rloo_main::<AutoModelForCausalLM>(grpo::rloo_defaults)
}
