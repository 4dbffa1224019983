//! Unpaired preference training as `trl kto` + `accelerate launch` do it (TRL's KTOTrainer).
//!
//! `cargo run --release -p trl-examples --bin kto` trains the bundled tiny Qwen2 on the
//! bundled preference pairs, unpaired into desirable (the right sum) and undesirable rows,
//! with 2 CPU processes, and reports the held-out reward margin before and after. Flags are
//! TRL's (`--beta 0.1`, `--desirable_weight 1.0`, `--config kto.yaml`, ...). Launched by
//! `cargo trl launch` or torchrun it runs as one rank.

use std::process::ExitCode;
use trl_examples::dpo;
use trl_runtime::models::AutoModelForCausalLM;

fn main() -> ExitCode {
    dpo::kto_main::<AutoModelForCausalLM>(dpo::kto_defaults)
}
