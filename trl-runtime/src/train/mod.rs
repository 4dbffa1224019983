//! Training: the shared training arguments and SFT's configuration, the trainer, optimizer, schedules, checkpoints, plots.

pub mod args;
pub mod checkpoint;
pub mod config;
pub mod core;
pub mod distillation;
pub mod dpo;
pub mod dpo_loss;
mod eval_rounds;
pub mod flow;
pub mod grpo;
pub mod grpo_loss;
pub mod grpo_rewards;
pub mod kinds;
pub mod kto;
pub mod logging;
pub mod memory;
pub mod plan_query;
mod plot;
pub mod reference;
pub mod registry;
pub mod reward;
pub mod rloo;
pub mod rloo_loss;
pub mod router;
mod saving;
pub mod schedule;
pub mod sft;
pub mod trainer;
pub mod trl_keys;

pub use self::core::{Core, EvalResult, StepGrads, StepStats, Task, TaskStep, TrainOutcome};
pub use crate::optim;
pub use crate::optim::{clip_grad_norm, grad_clip_coef, AdamW, AdamWConfig, ParamState};
pub use crate::parallel::{CheckpointFormat, Optimizer, Strategy};
pub use args::{Cli, CliValue, KwArgs, TrainerConfig, TrainingArguments, TrainingFlags};
pub use config::{SFTArgs, SFTConfig, SftCli};
pub use distillation::{Distillation, DistillationArgs, DistillationCli, DistillationConfig};
pub use dpo::{DPOArgs, DPOConfig, Dpo, DpoCli};
pub use grpo::{GRPOArgs, GRPOConfig, Grpo, GrpoCli};
pub use kto::{KTOArgs, KTOConfig, Kto, KtoCli};
pub use memory::{
    memory_peak_bytes, peak_rss_bytes, reset_memory_peak, reset_peak_rss, rss_bytes, MemoryReport,
};
pub use reward::{Reward, RewardArgs, RewardCli, RewardConfig, RewardModel};
pub use rloo::{RLOOArgs, RLOOConfig, Rloo, RlooCli};
pub use router::RouterLosses;
pub use schedule::{Curve, LrSchedule, SchedulerArgs, SchedulerKind};
pub use sft::Sft;
pub use trainer::Trainer;
