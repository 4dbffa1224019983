//! Learning-rate schedules with HF's names, formulas and keyword arguments
//! (transformers.get_scheduler with `lr_scheduler_kwargs`).

use crate::config::cli_value::KwArgs;
use crate::config::named::{named, Named};
use crate::error::{Error, Result};

named! {
    /// The schedules, by transformers' names.
    SchedulerKind {
        /// Constant; HF ignores warmup here (a warning says to use constant_with_warmup).
        Constant = "constant",
        ConstantWithWarmup = "constant_with_warmup",
        Linear = "linear",
        Cosine = "cosine",
        CosineWithRestarts = "cosine_with_restarts",
        Polynomial = "polynomial",
        InverseSqrt = "inverse_sqrt",
        CosineWithMinLr = "cosine_with_min_lr",
        CosineWarmupWithMinLr = "cosine_warmup_with_min_lr",
        WarmupStableDecay = "warmup_stable_decay",
    }
}

impl SchedulerKind {
    pub fn parse(name: &str) -> Result<Self> {
        if let Some(kind) = Self::from_name(name) {
            return Ok(kind);
        }
        let why = match name {
            "reduce_lr_on_plateau" | "greedy" => {
                "follows the evaluation loss, which is not implemented".to_string()
            }
            _ => {
                format!("is not supported: use one of {}", Self::NAMES.join(", "))
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

/// A schedule's keyword arguments (the ones its kind takes), with transformers' defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SchedulerArgs {
    /// constant, constant_with_warmup and linear take none.
    None,
    /// Cosine waves: 0.5 is one half-wave down; whole restarts for cosine_with_restarts.
    Cosine { num_cycles: f64 },
    /// Decay to `lr_end` as the `power`-th power of the remaining fraction.
    Polynomial { lr_end: f64, power: f64 },
    /// The time scale (default: the warmup steps, or 10,000 without warmup).
    InverseSqrt { timescale: Option<usize> },
    /// A cosine down to `min_lr_rate` times the rate; cosine_warmup_with_min_lr's warmup may
    /// start at `warmup_lr_rate`.
    MinLr {
        num_cycles: f64,
        min_lr_rate: f64,
        warmup_lr_rate: Option<f64>,
    },
    /// Warmup, a constant stretch (`num_stable_steps`, default what the decay leaves), a
    /// decay of `num_decay_steps`; both curves (warmup, decay) from and to `min_lr_ratio`.
    Wsd {
        num_decay_steps: usize,
        num_stable_steps: Option<usize>,
        curves: (Curve, Curve),
        min_lr_ratio: f64,
        num_cycles: f64,
    },
}

impl SchedulerArgs {
    /// transformers' defaults for `kind` (warmup-stable-decay's decay steps have none: 0).
    pub fn defaults(kind: SchedulerKind) -> Self {
        use SchedulerKind::*;
        match kind {
            Constant | ConstantWithWarmup | Linear => SchedulerArgs::None,
            Cosine => SchedulerArgs::Cosine { num_cycles: 0.5 },
            CosineWithRestarts => SchedulerArgs::Cosine { num_cycles: 1.0 },
            Polynomial => SchedulerArgs::Polynomial {
                lr_end: 1e-7,
                power: 1.0,
            },
            InverseSqrt => SchedulerArgs::InverseSqrt { timescale: None },
            CosineWithMinLr | CosineWarmupWithMinLr => SchedulerArgs::MinLr {
                num_cycles: 0.5,
                min_lr_rate: 0.0,
                warmup_lr_rate: None,
            },
            WarmupStableDecay => SchedulerArgs::Wsd {
                num_decay_steps: 0,
                num_stable_steps: None,
                curves: (Curve::Linear, Curve::Cosine),
                min_lr_ratio: 0.0,
                num_cycles: 0.5,
            },
        }
    }

    /// `kwargs` for `kind` at base rate `base_lr`, checked as transformers' functions check
    /// them. Err: (the key, why).
    pub fn from_kwargs(
        kind: SchedulerKind,
        kwargs: &KwArgs,
        base_lr: f64,
    ) -> std::result::Result<Self, (String, String)> {
        let bad = |k: &str, why: &str| (format!("lr_scheduler_kwargs.{k}"), why.to_string());
        let keys = kind.keys();
        if let Some(k) = kwargs.0.keys().find(|k| !keys.contains(&k.as_str())) {
            let takes = match keys {
                [] => "takes none".to_string(),
                keys => format!("takes {}", keys.join(", ")),
            };
            return Err(bad(
                k,
                &format!("not an argument of this schedule ({takes})"),
            ));
        }
        let get = |k: &str| kwargs.0.get(k);
        let number = |k: &str| -> std::result::Result<Option<f64>, (String, String)> {
            get(k)
                .map(|v| v.as_f64().ok_or_else(|| bad(k, "expected a number")))
                .transpose()
        };
        let count = |k: &str| -> std::result::Result<Option<usize>, (String, String)> {
            get(k)
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| bad(k, "expected a whole number"))
                })
                .transpose()
        };
        let curve = |k: &str, default: Curve| match get(k).map(|v| v.as_str()) {
            None => Ok(default),
            Some(Some("linear")) => Ok(Curve::Linear),
            Some(Some("cosine")) => Ok(Curve::Cosine),
            Some(Some("1-sqrt")) => Ok(Curve::OneMinusSqrt),
            Some(_) => Err(bad(k, "expected linear, cosine or 1-sqrt")),
        };
        let args = match SchedulerArgs::defaults(kind) {
            SchedulerArgs::Cosine { num_cycles } if kind == SchedulerKind::CosineWithRestarts => {
                SchedulerArgs::Cosine {
                    num_cycles: count("num_cycles")?.map_or(num_cycles, |n| n as f64),
                }
            }
            SchedulerArgs::Cosine { num_cycles } => SchedulerArgs::Cosine {
                num_cycles: number("num_cycles")?.unwrap_or(num_cycles),
            },
            SchedulerArgs::Polynomial { lr_end, power } => {
                let lr_end = number("lr_end")?.unwrap_or(lr_end);
                if base_lr <= lr_end {
                    return Err(bad("lr_end", "must be smaller than learning_rate"));
                }
                SchedulerArgs::Polynomial {
                    lr_end,
                    power: number("power")?.unwrap_or(power),
                }
            }
            SchedulerArgs::InverseSqrt { .. } => SchedulerArgs::InverseSqrt {
                timescale: count("timescale")?,
            },
            SchedulerArgs::MinLr { num_cycles, .. } => SchedulerArgs::MinLr {
                num_cycles: number("num_cycles")?.unwrap_or(num_cycles),
                min_lr_rate: match (number("min_lr")?, number("min_lr_rate")?) {
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
                },
                warmup_lr_rate: number("warmup_lr_rate")?,
            },
            SchedulerArgs::Wsd {
                curves, num_cycles, ..
            } => SchedulerArgs::Wsd {
                num_decay_steps: count("num_decay_steps")?
                    .ok_or_else(|| bad("num_decay_steps", "the decay's steps must be set"))?,
                num_stable_steps: count("num_stable_steps")?,
                curves: (
                    curve("warmup_type", curves.0)?,
                    curve("decay_type", curves.1)?,
                ),
                min_lr_ratio: number("min_lr_ratio")?.unwrap_or(0.0),
                num_cycles: number("num_cycles")?.unwrap_or(num_cycles),
            },
            none => none,
        };
        Ok(args)
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
        let (w, t) = (self.warmup_steps, self.total_steps);
        let progress = (step as f64 - w as f64) / t.saturating_sub(w).max(1) as f64;
        match (self.kind, self.args) {
            (SchedulerKind::Constant, _) => 1.0,
            (_, SchedulerArgs::Wsd { .. }) => self.warmup_stable_decay(step),
            (SchedulerKind::CosineWarmupWithMinLr, SchedulerArgs::MinLr { .. }) => {
                self.cosine_warmup_with_min_lr(step)
            }
            _ if step < w => step as f64 / w.max(1) as f64,
            (SchedulerKind::Linear, _) => {
                (t.saturating_sub(step) as f64 / t.saturating_sub(w).max(1) as f64).max(0.0)
            }
            (SchedulerKind::CosineWithRestarts, SchedulerArgs::Cosine { num_cycles }) => {
                match progress {
                    p if p >= 1.0 => 0.0,
                    p => half_cosine((num_cycles * p) % 1.0).max(0.0),
                }
            }
            (_, SchedulerArgs::Cosine { num_cycles }) => {
                half_cosine(num_cycles * 2.0 * progress).max(0.0)
            }
            (
                _,
                SchedulerArgs::MinLr {
                    num_cycles,
                    min_lr_rate,
                    ..
                },
            ) => floored(half_cosine(num_cycles * 2.0 * progress), min_lr_rate),
            (_, SchedulerArgs::Polynomial { lr_end, power }) => {
                let end = lr_end / self.base_lr;
                if step > t {
                    return end;
                }
                (1.0 - end) * (1.0 - progress).powf(power) + end
            }
            (_, SchedulerArgs::InverseSqrt { timescale }) => {
                let scale = timescale.unwrap_or(if w > 0 { w } else { 10_000 }) as f64;
                1.0 / ((step as f64 + scale - w as f64) / scale).sqrt()
            }
            // constant_with_warmup after its warmup.
            (_, SchedulerArgs::None) => 1.0,
        }
    }

    /// transformers' get_cosine_with_min_lr_schedule_with_warmup_lr_rate: its warmup counts
    /// the current step (or starts at warmup_lr_rate), and its decay starts one step in.
    fn cosine_warmup_with_min_lr(&self, step: usize) -> f64 {
        let SchedulerArgs::MinLr {
            num_cycles,
            min_lr_rate,
            warmup_lr_rate,
        } = self.args
        else {
            unreachable!("called for MinLr")
        };
        let (s, w, t) = (
            step as f64,
            self.warmup_steps as f64,
            self.total_steps as f64,
        );
        if s < w {
            return match warmup_lr_rate {
                None => (s + 1.0) / w.max(1.0),
                Some(r) => r + (1.0 - r) * s / (w - 1.0).max(1.0),
            };
        }
        let progress = (s - w + 1.0) / (t - w).max(1.0);
        floored(half_cosine(num_cycles * 2.0 * progress), min_lr_rate)
    }

    /// transformers' get_wsd_schedule: warmup from min_lr_ratio, a constant stretch, a decay
    /// to it.
    fn warmup_stable_decay(&self, step: usize) -> f64 {
        let SchedulerArgs::Wsd {
            num_decay_steps: decay,
            num_stable_steps,
            curves: (warmup_type, decay_type),
            min_lr_ratio,
            num_cycles,
        } = self.args
        else {
            unreachable!("called for Wsd")
        };
        let w = self.warmup_steps;
        let stable = num_stable_steps.unwrap_or_else(|| self.total_steps.saturating_sub(w + decay));
        if step < w {
            let p = step as f64 / w.max(1) as f64;
            return floored(
                match warmup_type {
                    Curve::Linear => p,
                    Curve::Cosine => 1.0 - half_cosine(p),
                    Curve::OneMinusSqrt => 1.0 - (1.0 - p).sqrt(),
                },
                min_lr_ratio,
            );
        }
        if step < w + stable {
            return 1.0;
        }
        if step < w + stable + decay {
            let p = (step - w - stable) as f64 / decay.max(1) as f64;
            return floored(
                match decay_type {
                    Curve::Linear => 1.0 - p,
                    Curve::Cosine => half_cosine(num_cycles * 2.0 * p),
                    Curve::OneMinusSqrt => 1.0 - p.sqrt(),
                },
                min_lr_ratio,
            );
        }
        min_lr_ratio
    }

    pub fn lr(&self, step: usize) -> f64 {
        self.base_lr * self.factor(step)
    }
}

/// 0.5 (1 + cos(pi x)): from 1 at x = 0 down to 0 at x = 1.
fn half_cosine(x: f64) -> f64 {
    0.5 * (1.0 + (std::f64::consts::PI * x).cos())
}

/// `f` raised to a floor of `rate`, as transformers' min-rate schedules do.
fn floored(f: f64, rate: f64) -> f64 {
    (f * (1.0 - rate) + rate).max(0.0)
}
