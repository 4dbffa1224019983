//! Training machinery: the optimizer and learning-rate schedules (the trainer comes next).

pub mod optim;
pub mod schedule;

pub use optim::{clip_grad_norm, AdamW, AdamWConfig, ParamState};
pub use schedule::{LrSchedule, SchedulerKind};
