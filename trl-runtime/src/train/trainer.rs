//! The trainer: a [`Core`] driving a [`Task`] (SFT unless named) through its steps, with
//! logging, evaluation, checkpoints and a clean stop on SIGTERM.

use super::args::TrainerConfig;
use super::checkpoint;
use super::core::{Core, EvalResult, StepStats, Task, TrainOutcome};
use super::flow::{Flow, Interval};
use super::memory::{memory_peak_bytes, reset_memory_peak, rss_bytes};
use super::sft::Sft;
use crate::data::TextTokenizer;
use crate::dist::DistContext;
use crate::error::{Error, Result};
use crate::models::{AutoModelForCausalLM, CausalModel};
use crate::parallel::{CheckpointFormat, Strategy};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// A trainer: the [`Core`] and the [`Task`] it runs (SFT unless named). It derefs to its core
/// (`trainer.model`, `trainer.state`, ...).
pub struct Trainer<'a, N: CausalModel = AutoModelForCausalLM, T: Task<N> = Sft> {
    pub config: T::Config,
    pub core: Core<'a, N>,
    pub task: T,
    /// The task's figures of the latest step.
    last_metrics: Vec<(&'static str, f64)>,
    /// What the process held before the model loaded (binary, libraries, tokenizer, data) on
    /// a CPU, where it shares the memory the plan predicts; 0 on a GPU.
    process_base: usize,
    /// Steps whose non-finite update was skipped (on_nonfinite skip).
    skipped_steps: usize,
}

impl<'a, N: CausalModel, T: Task<N>> std::ops::Deref for Trainer<'a, N, T> {
    type Target = Core<'a, N>;
    fn deref(&self) -> &Core<'a, N> {
        &self.core
    }
}

impl<'a, N: CausalModel, T: Task<N>> std::ops::DerefMut for Trainer<'a, N, T> {
    fn deref_mut(&mut self) -> &mut Core<'a, N> {
        &mut self.core
    }
}
impl<'a> Trainer<'a> {
    /// SFT of the built-in model of the checkpoint's `model_type`: loads model, tokenizer and
    /// data as `config` says, resuming if asked; the strategy comes from the launcher's
    /// environment.
    pub fn new(config: crate::train::SFTConfig, ctx: &'a DistContext) -> Result<Self> {
        Self::load(config, ctx)
    }

    pub fn with_strategy(
        config: crate::train::SFTConfig,
        ctx: &'a DistContext,
        strategy: Strategy,
    ) -> Result<Self> {
        Self::load_with_strategy(config, ctx, strategy)
    }
}

impl<'a, N: CausalModel, T: Task<N>> Trainer<'a, N, T> {
    /// Model `N` (`Trainer::<MyModel>::load`): loads model, tokenizer and data as `config`
    /// says, resuming if asked; the strategy comes from the launcher's environment.
    pub fn load(config: T::Config, ctx: &'a DistContext) -> Result<Self> {
        Self::load_with_strategy(config, ctx, Strategy::from_plan(ctx.plan()))
    }

    pub fn load_with_strategy(
        config: T::Config,
        ctx: &'a DistContext,
        strategy: Strategy,
    ) -> Result<Self> {
        let mut args = T::training_arguments(&config);
        config.validate("training arguments")?;
        let tokenizer = T::tokenizer(&config, TextTokenizer::from_dir(&args.model_name_or_path)?)?;
        T::starting_model(&config, &mut args, &tokenizer)?;
        // `cargo trl launch` asking what this program trains and how its model splits.
        let work = T::workload(&config);
        super::plan_query::answer_if_asked::<N>(&args, work)?;
        let mut task = T::load(&config, &tokenizer)?;
        let process_base = match ctx.device().is_cpu() {
            true => {
                // Freed start-up memory is handed back first, so it is not counted twice.
                crate::alloc::release_freed_memory();
                rss_bytes().unwrap_or(crate::parallel::estimate::CPU_PROCESS_RSS)
            }
            false => 0,
        };
        task.layout(&config, ctx.group(crate::dist::mesh::DP).size())?;
        let mut core = Core::load(&args, ctx, strategy, task.num_rows(), tokenizer)?;
        core.estimate_with(&work);
        task.prepare(&config, &core)?;
        crate::alloc::release_freed_memory();
        Ok(Trainer {
            config,
            core,
            task,
            last_metrics: Vec::new(),
            skipped_steps: 0,
            process_base,
        })
    }

    /// The task's figures of the latest step, under TRL's names.
    pub fn last_metrics(&self) -> &[(&'static str, f64)] {
        &self.last_metrics
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches.
    pub fn train_step(&mut self) -> Result<StepStats> {
        if self.core.ctx.device().is_cpu() {
            crate::kernels::cpu_gemm::reserve_packing_buffers();
        }
        let rows = self.task.deal(self.core.step_rows());
        let mut grads = self.core.begin_step();
        let t0 = Instant::now();
        let out = self.task.step(&self.core, &rows, &mut grads)?;
        let t1 = Instant::now();
        let (learning_rate, grad_norm) = self.core.finish_step(grads)?;
        self.task.after_step(&self.core)?;
        tracing::debug!(
            "step timing: forward+backward {:.3}s, checks+reduce+clip+optimizer {:.3}s",
            (t1 - t0).as_secs_f64(),
            t1.elapsed().as_secs_f64()
        );
        self.last_metrics = out.metrics;
        self.core.state.num_input_tokens_seen += out.tokens as u64;
        let stop = match out.loss.is_finite() && grad_norm.is_finite() {
            true => None,
            false => self.nonfinite_step(out.loss, grad_norm, learning_rate),
        };
        Ok(StepStats {
            stop,
            loss: out.loss,
            learning_rate,
            grad_norm,
            tokens: out.tokens,
        })
    }

    /// A step whose loss or gradient norm is not finite (the same on every rank: both are
    /// global), whose update the optimizer did not apply: why training stops, naming the
    /// step, what was not finite and what to try (`on_nonfinite` stop), or None after a
    /// warning (skip).
    fn nonfinite_step(&mut self, loss: f64, grad_norm: f64, lr: f64) -> Option<String> {
        let step = self.core.state.global_step;
        let what = match (loss.is_finite(), grad_norm.is_finite()) {
            (false, false) => format!("the loss ({loss}) and the gradient norm ({grad_norm})"),
            (false, true) => format!("the loss ({loss})"),
            _ => format!("the gradient norm ({grad_norm})"),
        };
        if self.core.args.on_nonfinite == "skip" {
            self.skipped_steps += 1;
            tracing::warn!(
                "step {step}: {what} is not finite: its update was skipped ({} step(s) skipped so far; on_nonfinite skip)",
                self.skipped_steps
            );
            return None;
        }
        let out = &self.core.args.output_dir;
        let kept = match checkpoint::list(out).pop() {
            Some((_, dir)) => format!(
                "the last good checkpoint is {} (resume with --resume_from_checkpoint {})",
                dir.display(),
                dir.display()
            ),
            None => "no checkpoint was saved yet".into(),
        };
        let bf16 = self.core.args.compute_dtype().ok() == Some(candle_core::DType::BF16);
        Some(format!(
            "step {step}: {what} is not finite, so its update was not applied and training \
             stopped; {kept}. Try a lower --learning_rate (this step's was {lr:.3e}), gradient \
             clipping (--max_grad_norm, now {}){}, or --on_nonfinite skip to skip such steps as \
             DeepSpeed skips an overflowed step",
            self.core.args.max_grad_norm,
            match bf16 {
                true => ", fp32 (--mixed_precision no) to rule out bf16 overflow",
                false => "",
            }
        ))
    }

    /// The task's evaluation on the held-out rows (collective: every rank calls it).
    pub fn evaluate(&self) -> Result<Option<EvalResult>> {
        self.task.evaluate(&self.config, &self.core)
    }

    /// One metrics line, to metrics.jsonl, the log and the trainer state's history: the
    /// loss and the task's figures averaged over `window`'s steps (as transformers logs its
    /// loss and TRL its metrics), this step's learning rate and gradient norm, and
    /// evaluation's figures when it ran.
    fn log_step(
        &mut self,
        stats: &StepStats,
        window: &mut Window,
        eval: Option<EvalResult>,
        metrics: Option<&mut std::fs::File>,
    ) -> Result<()> {
        let tokens_per_s = window.tokens_per_s();
        let (loss, figures) = window.take();
        let mut line = serde_json::json!({
            "step": self.core.state.global_step,
            "epoch": self.core.epoch(),
            "loss": loss,
            "learning_rate": stats.learning_rate,
            "grad_norm": stats.grad_norm,
            "num_tokens": self.core.state.num_input_tokens_seen,
            "tokens_per_s": tokens_per_s,
        });
        // The task's own figures (DPO's rewards and log-probs), under TRL's names.
        for (key, value) in figures {
            line[key] = value.into();
        }
        // This rank's memory peak since training began: resident memory on a CPU, the
        // device's live allocations on a GPU.
        let mib = |bytes: usize| (bytes as f64 / 1048576.0).round();
        if let Some(peak) = memory_peak_bytes(self.ctx.device()) {
            line["peak_memory_mib"] = mib(peak).into();
        }
        // Beside it, what `cargo trl plan` predicts for this rank, on a CPU over the memory
        // this process held before the model loaded and the host backend's rings (the plan
        // assumes `CPU_PROCESS_RSS` and full rings: `estimate::cpu_ring_bytes`).
        if let Some(e) = self.core.memory_estimate() {
            let rings = match self.ctx.device().is_cpu() {
                true => crate::comm::shared_memory_bytes(),
                false => 0,
            };
            line["predicted_peak_memory_mib"] = mib(e.peak() + self.process_base + rings).into();
        }
        if let Some(e) = eval {
            line["eval_loss"] = e.loss.into();
            if let Some(aux) = e.aux_loss {
                line["eval_aux_loss"] = aux.into();
            }
            if let Some(acc) = e.accuracy {
                line[<T::Config as TrainerConfig>::EVAL_ACCURACY] = acc.into();
            }
            for (key, value) in &e.figures {
                line[format!("eval_{key}")] = (*value).into();
            }
        }
        if let Some(f) = metrics {
            writeln!(f, "{line}").map_err(|e| Error::io("cannot write metrics.jsonl", e))?;
        }
        tracing::info!("{line}");
        self.core.state.log_history.push(line);
        Ok(())
    }

    /// Runs to `total_steps`, logging, evaluating and checkpointing as the training
    /// arguments' strategies say ([`Flow`]).
    pub fn train(&mut self) -> Result<TrainOutcome> {
        let main = self.ctx.is_main_process();
        let out_dir = self.core.args.output_dir.clone();
        let metrics = <T::Config as TrainerConfig>::EVAL_METRICS;
        let total = Some(self.core.total_steps());
        let flow = self.core.args.flow(metrics, "training arguments", total)?;
        if main {
            std::fs::create_dir_all(&out_dir)
                .map_err(|e| Error::io(format!("cannot create {}", out_dir.display()), e))?;
            checkpoint::clear_stale(&out_dir);
        }
        self.announce_start()?;
        reset_memory_peak(self.ctx.device());
        let mut outcome = TrainOutcome::default();
        if flow.eval_on_start {
            outcome.initial_eval = self.evaluate()?;
        }
        if let (true, Some(e)) = (main, &outcome.initial_eval) {
            tracing::info!("before training: {e}");
        }
        // Under the launcher, rank 0 sends its progress there (its own bar would be piped away).
        let to_launcher = main && crate::progress::lines_requested();
        let bar = progress_bar(
            main && !self.core.args.disable_tqdm && !to_launcher,
            self.state.total_steps,
            self.state.global_step,
        );
        let mut metrics = self.open_metrics()?;
        let mut window = Window::new();
        let mut curve: Vec<(f64, f64)> = Vec::new();
        let mut saved_step = None;
        while self.state.global_step < self.state.total_steps {
            let stats = self.train_step()?;
            let step = self.state.global_step;
            outcome.losses.push(stats.loss);
            curve.push((step as f64, stats.loss));
            let nan_filter = self.core.args.logging_nan_inf_filter;
            window.add(&stats, &self.last_metrics, nan_filter);
            let tokens_per_s = window.tokens_per_s();
            bar.set_position(step as u64);
            bar.set_message(format!(
                "loss {:.4}{} lr {:.2e} grad_norm {:.3} {:.0} tok/s",
                stats.loss,
                self.task.progress_note(&self.last_metrics),
                stats.learning_rate,
                stats.grad_norm,
                tokens_per_s
            ));
            if to_launcher && !self.core.args.disable_tqdm {
                crate::progress::emit(&crate::progress::Event::Step {
                    step: step as u64,
                    total: self.state.total_steps as u64,
                    loss: stats.loss,
                    lr: stats.learning_rate,
                    tokens_per_s,
                });
            }
            let due = flow.due(
                step,
                self.state.total_steps,
                self.core.epoch(),
                self.state.step_in_epoch == 0,
            );
            // A step that stops the run (non-finite) is logged, not evaluated.
            let eval = match due.evaluate && stats.stop.is_none() {
                true => self.evaluate()?,
                false => None,
            };
            let improved = match &eval {
                Some(e) => self.track_best(&flow, e)?,
                None => false,
            };
            if step == self.state.total_steps {
                outcome.final_eval = eval.clone();
            }
            if due.log || eval.is_some() || stats.stop.is_some() {
                self.log_step(&stats, &mut window, eval, metrics.as_mut())?;
            }
            if let Some(why) = stats.stop {
                bar.abandon_with_message("stopped: non-finite values");
                return Err(Error::NonFinite(why));
            }
            if due.save || (flow.save_best && improved) {
                outcome.last_checkpoint = self.save_with_task(None)?;
                announce_saved(to_launcher, &outcome.last_checkpoint);
                saved_step = Some(step);
            }
            if self.stop_requested()? {
                bar.abandon_with_message("SIGTERM: saving a checkpoint and stopping");
                // Unless this very step was just saved.
                if saved_step != Some(step) {
                    outcome.last_checkpoint = self.save_with_task(None)?;
                    announce_saved(to_launcher, &outcome.last_checkpoint);
                }
                if let Some(path) = &outcome.last_checkpoint {
                    tracing::info!(
                        "stopped by SIGTERM after step {step}: checkpoint saved at {}",
                        path.display()
                    );
                }
                outcome.preempted = true;
                return Ok(outcome);
            }
        }
        bar.finish();
        outcome.last_checkpoint = self.final_checkpoint(&flow, to_launcher, saved_step)?;
        if flow.load_best_at_end {
            self.load_best(&flow, &mut outcome)?;
        }
        if let (true, Some(e)) = (main, &outcome.final_eval) {
            tracing::info!("after training: {e}");
        }
        let moved = self.core.take_offload_traffic();
        if main {
            super::memory::log_offload_traffic(moved);
            super::plot::loss_curve(&out_dir.join("loss.svg"), &curve, &self.state.log_history)?;
        }
        Ok(outcome)
    }

    /// Records evaluation `e` in the trainer state when it beats the best of
    /// metric_for_best_model so far; whether it did.
    fn track_best(&mut self, flow: &Flow, e: &EvalResult) -> Result<bool> {
        let Some(best) = &flow.best else {
            return Ok(false);
        };
        let accuracy = <T::Config as TrainerConfig>::EVAL_ACCURACY;
        let value = e.metric(&best.key, accuracy).ok_or_else(|| {
            Error::config(
                "training arguments",
                "metric_for_best_model",
                format!(
                    "'{}' was not measured by this evaluation (SFT measures its accuracy with eval_generation_samples > 0): use loss",
                    best.key
                ),
            )
        })?;
        if !best.improves(value, self.state.best_metric) {
            return Ok(false);
        }
        self.core.state.best_metric = Some(value);
        // transformers names a best step only where checkpoints are saved.
        if flow.save != Interval::No || flow.save_best {
            self.core.state.best_global_step = Some(self.state.global_step);
        }
        Ok(true)
    }

    /// load_best_model_at_end: the best checkpoint read back as the run's model and evaluated;
    /// with save_total_limit 1 it is the only checkpoint left, as transformers leaves it.
    fn load_best(&mut self, flow: &Flow, outcome: &mut TrainOutcome) -> Result<()> {
        let (Some(best), Some(metric)) = (self.state.best_model_checkpoint.clone(), &flow.best)
        else {
            return Ok(());
        };
        let main = self.ctx.is_main_process();
        let value = self.state.best_metric.unwrap_or(f64::NAN);
        // The last step's model, evaluated at that step, needs no reading back.
        if self.state.best_global_step == Some(self.state.global_step) {
            if main {
                tracing::info!(
                    "load_best_model_at_end: the last step is the best ({} {value})",
                    metric.key
                );
            }
        } else {
            if main {
                tracing::info!(
                    "load_best_model_at_end: reading back {} ({} {value})",
                    best.display(),
                    metric.key
                );
            }
            self.core.load_checkpoint(&best)?;
            outcome.final_eval = self.evaluate()?;
        }
        if self.core.args.save_total_limit == Some(1) && main {
            checkpoint::keep_only(&self.core.args.output_dir, &best);
        }
        outcome.last_checkpoint = main.then_some(best);
        Ok(())
    }
}

impl<N: CausalModel, T: Task<N>> Trainer<'_, N, T> {
    /// A checkpoint of this step (`format`, else the configured one), then the task's state
    /// beside it (collective). The trainer state names it as the best checkpoint when this
    /// step's evaluation was the best.
    fn save_with_task(&mut self, format: Option<CheckpointFormat>) -> Result<Option<PathBuf>> {
        let step = self.state.global_step;
        if self.state.best_global_step == Some(step) {
            let dir = self.core.args.output_dir.join(format!("checkpoint-{step}"));
            self.core.state.best_model_checkpoint = Some(dir);
        }
        let saved = match format {
            Some(f) => self.save_checkpoint_as(f)?,
            None => self.save_checkpoint()?,
        };
        self.task.save_state(&self.core, step)?;
        Ok(saved)
    }

    /// The final checkpoint, unless the last step just wrote it (`saved_step`; the same on
    /// every rank). It is always full, so that the result opens in transformers. With
    /// load_best_model_at_end and save_total_limit 1 only the best is kept: a last step that
    /// is not the best is not written, to be deleted.
    fn final_checkpoint(
        &mut self,
        flow: &Flow,
        to_launcher: bool,
        saved_step: Option<usize>,
    ) -> Result<Option<PathBuf>> {
        let step = self.state.global_step;
        if flow.load_best_at_end
            && self.core.args.save_total_limit == Some(1)
            && self.state.best_model_checkpoint.is_some()
            && self.state.best_global_step != Some(step)
        {
            return Ok(None);
        }
        if saved_step != Some(step) || self.checkpoint_format == CheckpointFormat::Sharded {
            let saved = self.save_with_task(Some(CheckpointFormat::Full))?;
            announce_saved(to_launcher, &saved);
            Ok(saved)
        } else {
            let dir = self.core.args.output_dir.join(format!("checkpoint-{step}"));
            Ok(self.ctx.is_main_process().then_some(dir))
        }
    }
}

/// The steps since the last logged line: their losses, the task's figures and tokens.
struct Window {
    steps: usize,
    loss: f64,
    /// Each figure's sum and the steps that gave it (GRPO's reward figures come only with
    /// the steps that generated: TRL averages what was logged).
    figures: Vec<(&'static str, f64, usize)>,
    tokens: usize,
    start: Instant,
}

impl Window {
    fn new() -> Self {
        Window {
            steps: 0,
            loss: 0.0,
            figures: Vec::new(),
            tokens: 0,
            start: Instant::now(),
        }
    }

    /// A step's figures; with `nan_filter` (transformers' logging_nan_inf_filter) a NaN or
    /// infinite loss counts as transformers counts it: the window's sum over one more step.
    fn add(&mut self, stats: &StepStats, figures: &[(&'static str, f64)], nan_filter: bool) {
        self.loss += match nan_filter && !stats.loss.is_finite() {
            true => self.loss / (1 + self.steps) as f64,
            false => stats.loss,
        };
        self.steps += 1;
        self.tokens += stats.tokens;
        for &(key, value) in figures {
            match self.figures.iter_mut().find(|(k, _, _)| *k == key) {
                Some((_, sum, n)) => {
                    *sum += value;
                    *n += 1;
                }
                None => self.figures.push((key, value, 1)),
            }
        }
    }

    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9)
    }

    /// The mean loss and figures, and a new window.
    fn take(&mut self) -> (f64, Vec<(&'static str, f64)>) {
        let n = self.steps.max(1) as f64;
        let figures = self
            .figures
            .iter()
            .map(|&(k, sum, count)| (k, sum / count as f64))
            .collect();
        let loss = self.loss / n;
        *self = Window::new();
        (loss, figures)
    }
}

/// Tells the launcher where the latest checkpoint is (it names it when a job is interrupted).
fn announce_saved(to_launcher: bool, path: &Option<PathBuf>) {
    if let (true, Some(p)) = (to_launcher, path) {
        crate::progress::emit(&crate::progress::Event::Saved {
            path: p.display().to_string(),
        });
    }
}

fn progress_bar(visible: bool, total: usize, position: usize) -> indicatif::ProgressBar {
    if !visible {
        return indicatif::ProgressBar::hidden();
    }
    let bar = crate::progress::styled(indicatif::ProgressBar::new(total as u64));
    bar.set_position(position as u64);
    bar
}
