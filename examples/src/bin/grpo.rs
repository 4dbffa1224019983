//! Online RL as `trl grpo` + `accelerate launch` do it.
//!
//! `cargo run --release -p trl-examples --bin grpo` runs GRPO over the bundled addition
//! prompts (accuracy_reward against each prompt's sum) with 2 CPU processes, completions
//! sampled in the training processes, from a tiny Qwen2 that mostly copies the question's first
//! number (assets/tiny/grpo-start), and reports the held-out reward before and after (about
//! 10% -> 75%). Flags are TRL's (`--num_generations 4`, `--beta 0.04`, `--config
//! grpo.yaml`, ...). Launched by `cargo trl launch` or torchrun it runs as one rank.

use std::process::ExitCode;
use trl_examples::grpo;
use trl_runtime::models::AutoModelForCausalLM;

fn main() -> ExitCode {
    grpo::main::<AutoModelForCausalLM>(grpo::embedded_defaults)
}
