//! Preference training as `trl dpo` + `accelerate launch` do it.
//!
//! `cargo run --release -p trl-examples --bin dpo` trains the bundled tiny Qwen2 on the
//! bundled preference pairs (the addition task: the right sum chosen, a wrong or evasive
//! answer rejected) with 2 CPU processes and reports the held-out reward accuracy before and
//! after. Flags are TRL's (`--beta 0.1`, `--loss_type sigmoid`, `--config dpo.yaml`, ...).
//! Launched by `cargo trl launch` or torchrun it runs as one rank.

use std::process::ExitCode;
use trl_examples::dpo;
use trl_runtime::models::AutoModelForCausalLM;

fn main() -> ExitCode {
    dpo::main::<AutoModelForCausalLM>(dpo::embedded_defaults)
}
