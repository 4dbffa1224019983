//! On-policy distillation as `trl distillation` + `accelerate launch` do it (TRL's
//! DistillationTrainer).
//!
//! `cargo run --release -p trl-examples --bin distillation` distils the bundled teacher (a
//! wider, deeper Qwen2 over the same vocabulary) into the bundled tiny Qwen2 on its own
//! completions of the bundled addition prompts, with 2 CPU processes, and reports the
//! held-out divergence from the teacher before and after. Flags are TRL's (`--beta 0.5`,
//! `--temperature 0.9`, `--teacher_model_name_or_path DIR`, `--config distillation.yaml`,
//! ...). Launched by `cargo trl launch` or torchrun it runs as one rank.

use std::process::ExitCode;
use trl_examples::grpo;
use trl_runtime::models::AutoModelForCausalLM;

fn main() -> ExitCode {
    grpo::distillation_main::<AutoModelForCausalLM>(grpo::distillation_defaults)
}
