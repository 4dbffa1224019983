//! Reward modelling as `trl reward` + `accelerate launch` do it (TRL's RewardTrainer).
//!
//! `cargo run --release -p trl-examples --bin reward` trains a reward model (the bundled tiny
//! Qwen2 read as a sequence classifier, its `score` head new) on the bundled preference pairs
//! with 2 CPU processes, and reports the held-out pair accuracy before and after; its
//! checkpoints are transformers' `Qwen2ForSequenceClassification`. Flags are TRL's
//! (`--center_rewards_coefficient 0.01`, `--config reward.yaml`, ...). Launched by `cargo trl
//! launch` or torchrun it runs as one rank.

use std::process::ExitCode;
use trl_examples::dpo;
use trl_runtime::models::AutoModelForCausalLM;

fn main() -> ExitCode {
    dpo::reward_main::<AutoModelForCausalLM>(dpo::reward_defaults)
}
