//! When the trainer logs, evaluates and saves, as transformers decides it (its
//! TrainingArguments' checks and defaults, and DefaultFlowCallback): `logging_strategy`,
//! `eval_strategy` and `save_strategy` (no, steps or epoch; `best` for saves),
//! `logging_first_step`, `eval_on_start`, `eval_delay`, and the best checkpoint
//! (`metric_for_best_model`, `greater_is_better`, `load_best_model_at_end`). The arguments
//! are read and checked by [`super::TrainingArguments::flow`].
//!
//! Two defaults are ours. Without `eval_strategy` the trainer evaluates before training, every
//! `eval_steps` when given, and after the last step (transformers evaluates only when a
//! strategy says so). And the last step is always logged, as transformers' end-of-training
//! summary is, unless logging is off.

/// transformers' IntervalStrategy, with the steps of `steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interval {
    No,
    Steps(usize),
    Epoch,
}

impl Interval {
    /// `name` (no, steps or epoch), `steps` for steps.
    pub fn parse(name: &str, steps: usize) -> Option<Self> {
        match name {
            "no" => Some(Interval::No),
            "steps" => Some(Interval::Steps(steps)),
            "epoch" => Some(Interval::Epoch),
            _ => None,
        }
    }
}

/// The evaluation metric that picks the best checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct BestMetric {
    /// As logged (`eval_loss`): transformers prefixes `eval_` to a name without it.
    pub key: String,
    pub greater_is_better: bool,
}

impl BestMetric {
    /// Whether `value` beats `best` (strictly, as transformers compares).
    pub fn improves(&self, value: f64, best: Option<f64>) -> bool {
        match (best, self.greater_is_better) {
            (None, _) => !value.is_nan(),
            (Some(b), true) => value > b,
            (Some(b), false) => value < b,
        }
    }
}

/// What is due after a step.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    pub log: bool,
    pub evaluate: bool,
    pub save: bool,
}

/// When the trainer logs, evaluates and saves (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Flow {
    pub logging: Interval,
    pub logging_first_step: bool,
    pub eval: Interval,
    /// Our default without eval_strategy and eval_steps: evaluate after the last step.
    pub eval_after_last: bool,
    /// Evaluate before the first step.
    pub eval_on_start: bool,
    /// Steps (or epochs, for epoch evaluation) before the first evaluation.
    pub eval_delay: f64,
    pub save: Interval,
    /// save_strategy best: save whenever an evaluation improves the best metric.
    pub save_best: bool,
    /// Set when a best checkpoint is tracked (metric_for_best_model, load_best_model_at_end or
    /// save_strategy best): kept by save_total_limit, recorded in trainer_state.json.
    pub best: Option<BestMetric>,
    /// Read the best checkpoint back after training (and evaluate that model).
    pub load_best_at_end: bool,
}

impl Flow {
    /// What is due after optimizer step `step` of `total`: `epoch` is the epochs completed
    /// (fractional within one), `epoch_ended` whether this step finished one.
    pub fn due(&self, step: usize, total: usize, epoch: f64, epoch_ended: bool) -> Due {
        let last = step >= total;
        let every = |i: Interval| matches!(i, Interval::Steps(n) if step.is_multiple_of(n));
        let delayed = |at: f64| self.eval_delay <= at;
        // DefaultFlowCallback.on_step_end; at the last step it also evaluates and saves.
        let mut due = Due {
            log: (step == 1 && self.logging_first_step) || every(self.logging),
            evaluate: (every(self.eval) || (last && matches!(self.eval, Interval::Steps(_))))
                && delayed(step as f64),
            save: every(self.save) || (last && matches!(self.save, Interval::Steps(_))),
        };
        // on_epoch_end, which the training loop also calls when it stops within an epoch.
        if epoch_ended || last {
            due.log |= self.logging == Interval::Epoch;
            due.evaluate |= self.eval == Interval::Epoch && delayed(epoch);
            due.save |= self.save == Interval::Epoch;
        }
        if last {
            due.log |= self.logging != Interval::No;
            due.evaluate |= self.eval_after_last;
        }
        due
    }
}
