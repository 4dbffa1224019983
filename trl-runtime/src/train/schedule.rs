//! Learning-rate schedules with HF's names, formulas and keyword arguments
//! (transformers.get_scheduler with `lr_scheduler_kwargs`).

use crate::config::cli_value::KwArgs;
use crate::error::{Error, Result};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerKind {
    /// Constant; HF ignores warmup here (a warning says to use constant_with_warmup).
    Constant,
    ConstantWithWarmup,
    Linear,
    Cosine,
    CosineWithRestarts,
    Polynomial,
    InverseSqrt,
    CosineWithMinLr,
    CosineWarmupWithMinLr,
    WarmupStableDecay,
}

/// transformers' names of the schedules.
pub const SCHEDULERS: &[(&str, SchedulerKind)] = &[
    ("constant", SchedulerKind::Constant),
    ("constant_with_warmup", SchedulerKind::ConstantWithWarmup),
    ("linear", SchedulerKind::Linear),
    ("cosine", SchedulerKind::Cosine),
    ("cosine_with_restarts", SchedulerKind::CosineWithRestarts),
    ("polynomial", SchedulerKind::Polynomial),
    ("inverse_sqrt", SchedulerKind::InverseSqrt),
    ("cosine_with_min_lr", SchedulerKind::CosineWithMinLr),
    (
        "cosine_warmup_with_min_lr",
        SchedulerKind::CosineWarmupWithMinLr,
    ),
    ("warmup_stable_decay", SchedulerKind::WarmupStableDecay),
];

impl SchedulerKind {
    pub fn parse(name: &str) -> Result<Self> {
        if let Some(&(_, kind)) = SCHEDULERS.iter().find(|(n, _)| *n == name) {
            return Ok(kind);
        }
        let why = match name {
            "reduce_lr_on_plateau" | "greedy" => {
                "follows the evaluation loss, which is not implemented".to_string()
            }
            _ => {
                let names: Vec<&str> = SCHEDULERS.iter().map(|(n, _)| *n).collect();
                format!("is not supported: use one of {}", names.join(", "))
            }
        };
        Err(Error::config(
            "training arguments",
            "lr_scheduler_type",
            format!("'{name}' {why}"),
        ))
    }

    /// The `lr_scheduler_kwargs` keys transformers' function for this kind takes (beyond the
    /// warmup and the step count).
    fn keys(self) -> &'static [&'static str] {
        use SchedulerKind::*;
        match self {
            Constant | ConstantWithWarmup | Linear => &[],
            Cosine | CosineWithRestarts => &["num_cycles"],
            Polynomial => &["lr_end", "power"],
            InverseSqrt => &["timescale"],
            CosineWithMinLr => &["num_cycles", "min_lr", "min_lr_rate"],
            CosineWarmupWithMinLr => &["num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"],
            WarmupStableDecay => &[
                "num_decay_steps",
                "num_stable_steps",
                "warmup_type",
                "decay_type",
                "min_lr_ratio",
                "num_cycles",
            ],
        }
    }
}

/// A warmup or decay curve of the warmup-stable-decay schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Curve {
    Linear,
    Cosine,
    OneMinusSqrt,
}

/// A schedule's keyword arguments, with transformers' defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerArgs {
    /// Cosine waves (0.5: one half-wave down); whole restarts for cosine_with_restarts.
    pub num_cycles: f64,
    /// The floor as a fraction of the base rate (cosine_with_min_lr, ...; WSD's min_lr_ratio).
    pub min_lr_rate: f64,
    /// Polynomial decay's end rate and power.
    pub lr_end: f64,
    pub power: f64,
    /// inverse_sqrt's time scale (default: the warmup steps, or 10,000 without warmup).
    pub timescale: Option<usize>,
    /// cosine_warmup_with_min_lr's first warmup factor.
    pub warmup_lr_rate: Option<f64>,
    /// Warmup-stable-decay: its decay and stable steps and its curves.
    pub num_decay_steps: usize,
    pub num_stable_steps: Option<usize>,
    pub warmup_type: Curve,
    pub decay_type: Curve,
}

impl SchedulerArgs {
    /// transformers' defaults for `kind`.
    pub fn defaults(kind: SchedulerKind) -> Self {
        SchedulerArgs {
            num_cycles: if kind == SchedulerKind::CosineWithRestarts {
                1.0
            } else {
                0.5
            },
            min_lr_rate: 0.0,
            lr_end: 1e-7,
            power: 1.0,
            timescale: None,
            warmup_lr_rate: None,
            num_decay_steps: 0,
            num_stable_steps: None,
            warmup_type: Curve::Linear,
            decay_type: Curve::Cosine,
        }
    }

    /// `kwargs` for `kind` at base rate `base_lr`, checked as transformers' functions check
    /// them. Err: (the key, why).
    pub fn from_kwargs(
        kind: SchedulerKind,
        kwargs: &KwArgs,
        base_lr: f64,
    ) -> std::result::Result<Self, (String, String)> {
        let mut a = SchedulerArgs::defaults(kind);
        let bad = |k: &str, why: &str| (format!("lr_scheduler_kwargs.{k}"), why.to_string());
        let number = |k: &str, v: &Value| v.as_f64().ok_or_else(|| bad(k, "expected a number"));
        let count = |k: &str, v: &Value| {
            v.as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| bad(k, "expected a whole number of steps"))
        };
        let curve = |k: &str, v: &Value| match v.as_str() {
            Some("linear") => Ok(Curve::Linear),
            Some("cosine") => Ok(Curve::Cosine),
            Some("1-sqrt") => Ok(Curve::OneMinusSqrt),
            _ => Err(bad(k, "expected linear, cosine or 1-sqrt")),
        };
        let (mut min_lr, mut min_lr_rate) = (None, None);
        for (k, v) in &kwargs.0 {
            if !kind.keys().contains(&k.as_str()) {
                let takes = match kind.keys() {
                    [] => "takes none".to_string(),
                    keys => format!("takes {}", keys.join(", ")),
                };
                return Err(bad(
                    k,
                    &format!("not an argument of this schedule ({takes})"),
                ));
            }
            match k.as_str() {
                "num_cycles" if kind == SchedulerKind::CosineWithRestarts => {
                    a.num_cycles = count(k, v)? as f64
                }
                "num_cycles" => a.num_cycles = number(k, v)?,
                "min_lr" => min_lr = Some(number(k, v)?),
                "min_lr_rate" | "min_lr_ratio" => min_lr_rate = Some(number(k, v)?),
                "lr_end" => a.lr_end = number(k, v)?,
                "power" => a.power = number(k, v)?,
                "timescale" => a.timescale = Some(count(k, v)?),
                "warmup_lr_rate" => a.warmup_lr_rate = Some(number(k, v)?),
                "num_decay_steps" => a.num_decay_steps = count(k, v)?,
                "num_stable_steps" => a.num_stable_steps = Some(count(k, v)?),
                "warmup_type" => a.warmup_type = curve(k, v)?,
                "decay_type" => a.decay_type = curve(k, v)?,
                _ => unreachable!("every key of SchedulerKind::keys is read"),
            }
        }
        use SchedulerKind::*;
        match kind {
            CosineWithMinLr | CosineWarmupWithMinLr => {
                a.min_lr_rate = match (min_lr, min_lr_rate) {
                    (Some(_), Some(_)) => {
                        return Err(bad("min_lr", "only one of min_lr or min_lr_rate is set"))
                    }
                    (Some(lr), None) => lr / base_lr,
                    (None, Some(rate)) => rate,
                    (None, None) => {
                        return Err(bad(
                            "min_lr_rate",
                            "one of min_lr or min_lr_rate must be set",
                        ))
                    }
                }
            }
            WarmupStableDecay => {
                a.min_lr_rate = min_lr_rate.unwrap_or(0.0);
                if !kwargs.0.contains_key("num_decay_steps") {
                    return Err(bad("num_decay_steps", "the decay's steps must be set"));
                }
            }
            Polynomial if base_lr <= a.lr_end => {
                return Err(bad("lr_end", "must be smaller than learning_rate"))
            }
            _ => {}
        }
        Ok(a)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub kind: SchedulerKind,
    pub base_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub args: SchedulerArgs,
}

impl LrSchedule {
    /// `warmup_steps` wins over `warmup_ratio` when both are given, as in HF
    /// (ratio -> ceil(ratio x total_steps)). The kind's default arguments.
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
            args: SchedulerArgs::defaults(kind),
        }
    }

    /// The same schedule with these arguments.
    pub fn with_args(self, args: SchedulerArgs) -> Self {
        LrSchedule { args, ..self }
    }

    /// The multiplier of the base rate at optimizer step `step` (0-based, before the update),
    /// transformers' lr_lambda of the kind.
    pub fn factor(&self, step: usize) -> f64 {
        use SchedulerKind::*;
        let (w, t, a) = (self.warmup_steps, self.total_steps, &self.args);
        let linear_warmup = step as f64 / w.max(1) as f64;
        let cosine = |progress: f64| 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        let progress = || (step as f64 - w as f64) / t.saturating_sub(w).max(1) as f64;
        let floor = |f: f64| (f * (1.0 - a.min_lr_rate) + a.min_lr_rate).max(0.0);
        match self.kind {
            Constant => 1.0,
            CosineWarmupWithMinLr => self.cosine_warmup_with_min_lr(step),
            WarmupStableDecay => self.warmup_stable_decay(step),
            _ if step < w => linear_warmup,
            ConstantWithWarmup => 1.0,
            Linear => (t.saturating_sub(step) as f64 / t.saturating_sub(w).max(1) as f64).max(0.0),
            Cosine => cosine(a.num_cycles * 2.0 * progress()).max(0.0),
            CosineWithMinLr => floor(cosine(a.num_cycles * 2.0 * progress())),
            CosineWithRestarts => match progress() {
                p if p >= 1.0 => 0.0,
                p => cosine((a.num_cycles * p) % 1.0).max(0.0),
            },
            Polynomial => {
                let end = a.lr_end / self.base_lr;
                if step > t {
                    return end;
                }
                let remaining = 1.0 - progress();
                (1.0 - end) * remaining.powf(a.power) + end
            }
            InverseSqrt => {
                let scale = a.timescale.unwrap_or(if w > 0 { w } else { 10_000 }) as f64;
                1.0 / ((step as f64 + scale - w as f64) / scale).sqrt()
            }
        }
    }

    /// transformers' get_cosine_with_min_lr_schedule_with_warmup_lr_rate: its warmup counts
    /// the current step (or starts at warmup_lr_rate), and its decay starts one step in.
    fn cosine_warmup_with_min_lr(&self, step: usize) -> f64 {
        let (s, w, t, a) = (
            step as f64,
            self.warmup_steps as f64,
            self.total_steps as f64,
            &self.args,
        );
        if s < w {
            return match a.warmup_lr_rate {
                None => (s + 1.0) / w.max(1.0),
                Some(r) => r + (1.0 - r) * s / (w - 1.0).max(1.0),
            };
        }
        let progress = (s - w + 1.0) / (t - w).max(1.0);
        let f = 0.5 * (1.0 + (std::f64::consts::PI * a.num_cycles * 2.0 * progress).cos());
        (f * (1.0 - a.min_lr_rate) + a.min_lr_rate).max(0.0)
    }

    /// transformers' get_wsd_schedule: warmup from min_lr_ratio, a constant stretch, a decay
    /// to it.
    fn warmup_stable_decay(&self, step: usize) -> f64 {
        let a = &self.args;
        let (w, decay) = (self.warmup_steps, a.num_decay_steps);
        let stable = a
            .num_stable_steps
            .unwrap_or_else(|| self.total_steps.saturating_sub(w + decay));
        let floor = |f: f64| (f * (1.0 - a.min_lr_rate) + a.min_lr_rate).max(0.0);
        if step < w {
            let p = step as f64 / w.max(1) as f64;
            return floor(match a.warmup_type {
                Curve::Linear => p,
                Curve::Cosine => 0.5 * (1.0 - (std::f64::consts::PI * p).cos()),
                Curve::OneMinusSqrt => 1.0 - (1.0 - p).sqrt(),
            });
        }
        if step < w + stable {
            return 1.0;
        }
        if step < w + stable + decay {
            let p = (step - w - stable) as f64 / decay.max(1) as f64;
            return floor(match a.decay_type {
                Curve::Linear => 1.0 - p,
                Curve::Cosine => {
                    0.5 * (1.0 + (std::f64::consts::PI * a.num_cycles * 2.0 * p).cos())
                }
                Curve::OneMinusSqrt => 1.0 - p.sqrt(),
            });
        }
        a.min_lr_rate
    }

    pub fn lr(&self, step: usize) -> f64 {
        self.base_lr * self.factor(step)
    }
}
