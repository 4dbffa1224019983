//! Training: SFT configuration, the trainer, optimizer, schedules, checkpoints, plots.

pub mod checkpoint;
pub mod config;
pub mod logging;
pub mod optim;
mod plot;
pub mod schedule;
pub mod sharded_state;
pub mod trainer;
pub mod trl_keys;

pub use crate::parallel::{CheckpointFormat, Optimizer, Strategy};
pub use config::{SFTArgs, SFTConfig, SftCli};
pub use optim::{clip_grad_norm, AdamW, AdamWConfig, ParamState};
pub use schedule::{LrSchedule, SchedulerKind};
pub use trainer::{
    peak_rss_bytes, reset_peak_rss, EvalResult, MemoryReport, StepStats, TrainOutcome, Trainer,
};
