//! Learning-rate schedules with HF's names and formulas (transformers.get_scheduler).

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerKind {
    /// Constant; HF ignores warmup here (a warning says to use constant_with_warmup).
    Constant,
    ConstantWithWarmup,
    Linear,
    Cosine,
}

pub const SCHEDULER_NAMES: &[&str] = &["constant", "constant_with_warmup", "linear", "cosine"];

impl SchedulerKind {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "constant" => SchedulerKind::Constant,
            "constant_with_warmup" => SchedulerKind::ConstantWithWarmup,
            "linear" => SchedulerKind::Linear,
            "cosine" => SchedulerKind::Cosine,
            other => {
                return Err(Error::Config {
                    file: "training arguments".into(),
                    key: "lr_scheduler_type".into(),
                    message: format!(
                        "'{other}' is not supported: use one of {}",
                        SCHEDULER_NAMES.join(", ")
                    ),
                })
            }
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub kind: SchedulerKind,
    pub base_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
}

impl LrSchedule {
    /// `warmup_steps` wins over `warmup_ratio` when both are given, as in HF
    /// (ratio -> ceil(ratio x total_steps)).
    pub fn new(
        kind: SchedulerKind,
        base_lr: f64,
        total_steps: usize,
        warmup_steps: usize,
        warmup_ratio: f64,
    ) -> Self {
        let warmup_steps = if warmup_steps > 0 {
            warmup_steps
        } else {
            (warmup_ratio * total_steps as f64).ceil() as usize
        };
        if kind == SchedulerKind::Constant && warmup_steps > 0 {
            tracing::warn!("lr_scheduler_type constant ignores warmup (as in transformers): use constant_with_warmup");
        }
        LrSchedule {
            kind,
            base_lr,
            warmup_steps,
            total_steps,
        }
    }

    /// The multiplier of the base rate at optimizer step `step` (0-based, before the update).
    pub fn factor(&self, step: usize) -> f64 {
        let (w, t) = (self.warmup_steps, self.total_steps);
        if self.kind != SchedulerKind::Constant && step < w {
            return step as f64 / w.max(1) as f64;
        }
        match self.kind {
            SchedulerKind::Constant | SchedulerKind::ConstantWithWarmup => 1.0,
            SchedulerKind::Linear => {
                (t.saturating_sub(step) as f64 / t.saturating_sub(w).max(1) as f64).max(0.0)
            }
            SchedulerKind::Cosine => {
                let progress = (step - w) as f64 / t.saturating_sub(w).max(1) as f64;
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        }
    }

    pub fn lr(&self, step: usize) -> f64 {
        self.base_lr * self.factor(step)
    }
}
