//! On-policy distillation as a [`Task`]: TRL 1.16's DistillationTrainer (`DistillationConfig`'s
//! keys and defaults). The student samples one completion per prompt (GRPO's rounds, with
//! `num_generations` 1: a round is a step's `per_device_train_batch_size x
//! gradient_accumulation_steps` prompts per rank, generated once and trained on over the
//! step's micro-batches), and is trained to match the teacher's next-token distribution at
//! every completion token under the divergence `beta` names ([`crate::nn::divergence`]:
//! forward KL at 0, reverse KL at 1, the generalised JSD between), both distributions at
//! `temperature`. As TRL: the loss is the divergence summed over the generation batch's
//! completion tokens over their count; its figures are `entropy` (the student's, per token)
//! and the completions' lengths.
//!
//! The teacher is a transformers checkpoint over the student's vocabulary (any built-in
//! architecture and width), held as the launch holds the student
//! ([`crate::parallel::build_frozen`]): split over tp and the sequence ranks alike, sharded in
//! units under ZeRO-3 / FSDP, whole under DDP and ZeRO-1/2; its weights are constants. The
//! loss runs over both LM heads in tiles where they are whole, never holding either model's
//! logits at once.

use super::args::TrainingArguments;
use super::core::{Core, EvalResult, StepGrads, Task, TaskStep};
use super::grpo::{EvalPass, GRPOConfig, Grpo, Metrics, Sample};
use super::kinds::{read_as, Scaffold, TrainerKind};
use crate::config::cli_value::PadMultiple;
use crate::data::TextTokenizer;
use crate::error::{Error, Result};
use crate::models::{AutoModelForCausalLM, CausalModel};
use crate::parallel::estimate::Workload;
use crate::parallel::Model;
use candle_core::{DType, Tensor};
use std::path::{Path, PathBuf};

crate::training_arguments! {
    /// The distillation trainer's training arguments, with TRL 1.16's names and defaults
    /// (`DistillationConfig`).
    struct DistillationConfig, flags DistillationArgs, base training;
    /// The teacher: a transformers checkpoint directory over the student's vocabulary.
    teacher_model_name_or_path: Option<PathBuf> = None;
    /// Tokens sampled per completion.
    max_completion_length: usize = 512;
    /// Shuffle the prompts each epoch (by seed).
    shuffle_dataset: bool = true;
    /// A token count, none, or auto (no padding off AWS Neuron).
    pad_to_multiple_of: PadMultiple = Default::default();
    /// Sampling's temperature, and the loss's: both distributions are of logits / temperature.
    temperature: f64 = 1.0;
    top_p: f64 = 1.0;
    /// 0: off.
    top_k: usize = 0;
    min_p: Option<f64> = None;
    repetition_penalty: f64 = 1.0;
    /// Generation runs in the training process here: true is refused.
    use_vllm: bool = false;
    /// The divergence: 0 forward KL(teacher || student), 1 reverse KL(student || teacher),
    /// between the generalised Jensen-Shannon divergence.
    beta: f64 = 1.0;
    /// No dropout in the student (LoRA's dropout off).
    disable_dropout: bool = false;
    /// A program that generates the completions instead (JSON lines, docs/grpo.md; not a
    /// TRL key: fixed completions for tests and external samplers).
    rollout_command: Option<String> = None;
}

crate::trainer_config!(DistillationConfig, flags DistillationArgs, base training,
    about "On-policy distillation (TRL's DistillationTrainer) on Candle",
    accuracy "eval_entropy",
    metrics [],
    validate validate_distillation,
    base_defaults super::grpo::trl_defaults);

/// `trl distillation`-style command line.
pub type DistillationCli = super::args::Cli<DistillationConfig>;

fn validate_distillation(config: &DistillationConfig, source: &str) -> Result<()> {
    let fail = |key: &str, m: String| Err(Error::config(source, key, m));
    if !(0.0..=1.0).contains(&config.beta) {
        return fail(
            "beta",
            format!(
                "{}: beta is in [0, 1] (0 forward KL, 0.5 JSD, 1 reverse KL)",
                config.beta
            ),
        );
    }
    if !(config.temperature > 0.0 && config.temperature.is_finite()) {
        return fail(
            "temperature",
            format!("{}: give a positive temperature", config.temperature),
        );
    }
    if config.use_vllm {
        return fail("use_vllm", "the student generates in the training processes here (KV cache, sharded as it trains): no vLLM; drop the key".into());
    }
    let t = &config.training;
    if t.router_aux_loss_coef.is_some_and(|c| c != 0.0) {
        return fail(
            "router_aux_loss_coef",
            "the distillation loss has no router term (TRL's adds none): drop the key".into(),
        );
    }
    Ok(())
}

impl DistillationConfig {
    /// The rounds' settings as GRPO's keys: one completion per prompt, a round per step.
    pub fn rounds(&self) -> GRPOConfig {
        GRPOConfig {
            training: self.training.clone(),
            rollout_command: self.rollout_command.clone(),
            num_generations: 1,
            max_completion_length: self.max_completion_length,
            shuffle_dataset: self.shuffle_dataset,
            pad_to_multiple_of: self.pad_to_multiple_of,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            disable_dropout: self.disable_dropout,
            ..Default::default()
        }
    }
}

/// The teacher's directory, as given.
fn teacher_dir(config: &DistillationConfig) -> Result<PathBuf> {
    config.teacher_model_name_or_path.clone().ok_or_else(|| {
        Error::config(
            "training arguments",
            "teacher_model_name_or_path",
            "no teacher: give a transformers checkpoint directory over the student's vocabulary",
        )
    })
}

/// A checkpoint's vocabulary size (a composite's text_config's).
fn vocab_size(dir: &Path) -> Result<usize> {
    use crate::models::params::{config_number, read_config};
    let (text, source) = read_config(dir)?;
    config_number(&text, "vocab_size").ok_or_else(|| Error::config(source, "vocab_size", "missing"))
}

/// On-policy distillation training.
pub struct Distillation {
    rounds: Grpo,
    /// The shared keys as GRPO reads them, for the rounds' methods.
    config: GRPOConfig,
    teacher_dir: PathBuf,
    teacher: Option<Model<AutoModelForCausalLM>>,
    beta: f64,
    temperature: f64,
}

/// Distillation in the trainers' registry ([`super::kinds`]).
pub const KIND: TrainerKind = TrainerKind {
    name: "distillation",
    about: "on-policy distillation from a teacher (TRL's DistillationTrainer)",
    read: |args| read_as::<DistillationConfig>(args, workload),
    scaffold: Scaffold {
        config: "templates/sft/distillation.yaml",
        data: &[
            ("data/grpo_train.jsonl", "assets/tiny/data/grpo_train.jsonl"),
            ("data/grpo_eval.jsonl", "assets/tiny/data/grpo_eval.jsonl"),
            ("teacher/config.json", "assets/tiny/teacher/config.json"),
            (
                "teacher/model.safetensors",
                "assets/tiny/teacher/model.safetensors",
            ),
            (
                "teacher/tokenizer.json",
                "assets/tiny/teacher/tokenizer.json",
            ),
            (
                "teacher/tokenizer_config.json",
                "assets/tiny/teacher/tokenizer_config.json",
            ),
        ],
        config_type: "DistillationConfig",
        cli_type: "DistillationCli",
        task_type: Some("Distillation"),
        model_wrapper: None,
        summary: "On-policy distillation (TRL's DistillationTrainer)",
        example_flag: "--beta 0.5",
        data_note: ": prompts the student completes",
        formats: "prompt (text or messages)",
        metric: "loss",
        items: "",
        setup: "",
    },
};

/// A micro-batch's rows are completions; the teacher is a frozen model held as the student
/// is (its parameter count from its checkpoint's files; 0 when they cannot be read yet).
pub fn workload(config: &DistillationConfig) -> Workload {
    let held_parameters = config
        .teacher_model_name_or_path
        .as_ref()
        .and_then(|dir| crate::models::params::WeightFiles::open(dir).ok())
        .map_or(0, |files| files.parameter_count());
    Workload {
        sequences_per_row: 1,
        held_parameters,
        ..Workload::default()
    }
}

impl Distillation {
    /// Seconds this rank spent getting completions.
    pub fn generation_seconds(&self) -> f64 {
        self.rounds.generation_seconds()
    }

    fn teacher(&self) -> Result<&Model<AutoModelForCausalLM>> {
        self.teacher
            .as_ref()
            .ok_or_else(|| Error::Parallelism("distillation: the teacher is not loaded".into()))
    }

    /// Per local position of `samples`' micro-batch: its weight (`scale` where it predicts a
    /// counted completion token, else 0), and the batch itself.
    fn weighted<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        samples: &[Sample],
        scale: impl Fn(usize) -> f64,
    ) -> Result<(crate::data::Batch, Vec<f64>)> {
        let (batch, owner, _) = self.rounds.collate_samples(core, samples)?;
        let weights = owner
            .iter()
            .map(|o| o.map_or(0.0, |(r, t)| samples[r].mask[t] * scale(r)))
            .collect();
        Ok((batch, weights))
    }

    /// The loss of one evaluation part (a rank's rows of an eval step): the mean divergence
    /// over its completion tokens, as TRL's eval step computes it; with its entropy sum and
    /// token count, every value summed over the sequence's ranks.
    fn eval_part<N: CausalModel>(&self, core: &Core<'_, N>, part: &[Sample]) -> Result<[f64; 3]> {
        let tokens: f64 = part.iter().flat_map(|s| &s.mask).sum();
        let (batch, weights) = self.weighted(core, part, |_| 1.0 / tokens.max(1.0))?;
        let (loss, _, entropy) = core.model.distillation_loss(
            self.teacher()?,
            (&batch.input_ids, &batch.position_ids),
            &weights,
            (self.beta, self.temperature),
            false,
        )?;
        let local = vec![scalar(&loss)?, entropy.iter().sum(), entropy.len() as f64];
        let sums = core.sequence_sum(local)?;
        Ok([sums[0], sums[1], sums[2]])
    }
}

/// A scalar tensor's value.
fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

impl<N: CausalModel> Task<N> for Distillation {
    type Config = DistillationConfig;

    fn load(config: &DistillationConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let teacher_dir = teacher_dir(config)?;
        let student = vocab_size(&config.training.model_name_or_path)?;
        let teacher = vocab_size(&teacher_dir)?;
        if student != teacher {
            return Err(Error::config(
                teacher_dir.join("config.json").display().to_string(),
                "vocab_size",
                format!("the teacher's vocabulary has {teacher} tokens, the student's {student}: distillation compares the whole next-token distributions, so both need one vocabulary (TRL's GOLD trainer distils across tokenizers)"),
            ));
        }
        let rounds = config.rounds();
        Ok(Distillation {
            rounds: Grpo::load_rounds(&rounds, tokenizer)?.for_distillation(),
            config: rounds,
            teacher_dir,
            teacher: None,
            beta: config.beta,
            temperature: config.temperature,
        })
    }

    fn training_arguments(config: &DistillationConfig) -> TrainingArguments {
        <Grpo as Task<N>>::training_arguments(&config.rounds())
    }

    fn layout(&mut self, _config: &DistillationConfig, dp_ranks: usize) -> Result<()> {
        <Grpo as Task<N>>::layout(&mut self.rounds, &self.config, dp_ranks)
    }

    fn num_rows(&self) -> usize {
        <Grpo as Task<N>>::num_rows(&self.rounds)
    }

    fn workload(config: &DistillationConfig) -> Workload {
        workload(config)
    }

    fn prepare(&mut self, _config: &DistillationConfig, core: &Core<'_, N>) -> Result<()> {
        self.rounds.prepare(&self.config, core)?;
        let opts = core.frozen_options(&self.teacher_dir)?;
        let teacher = crate::parallel::build_frozen(core.ctx, &opts)?;
        if core.ctx.is_main_process() {
            let mut held = match &teacher.sharding {
                Some(s) => format!(
                    "sharded in {} units over {} ranks",
                    s.units.len(),
                    s.root().comm().size()
                ),
                None => "whole on each rank".into(),
            };
            if let Some(tp) = teacher.tp() {
                held += &format!(", split over tp = {}", tp.size());
            }
            if let Some(split) = teacher.split() {
                held += &format!(", sequences split over {} ranks", split.group.size());
            }
            tracing::info!(
                "distillation: teacher {} ({held}), beta {} ({}), temperature {}",
                self.teacher_dir.display(),
                self.beta,
                match self.beta {
                    0.0 => "forward KL",
                    1.0 => "reverse KL",
                    _ => "generalised JSD",
                },
                self.temperature
            );
        }
        self.teacher = Some(teacher);
        Ok(())
    }

    fn step(
        &mut self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
        grads: &mut StepGrads,
    ) -> Result<TaskStep> {
        let started = std::time::Instant::now();
        let mut tokens = 0usize;
        let mut metrics: Metrics = Vec::new();
        // [loss, then per micro-batch: entropy sum, token count].
        let mut local = vec![0.0];
        for (i, idx) in rows.iter().enumerate() {
            let part = self.rounds.slice_for(core, idx[0])?;
            metrics.extend(part.metrics);
            tokens += part.tokens;
            // Each counted token weighs 1 / the round's counted tokens over all ranks: the
            // loss summed over the ranks is TRL's (its gradient the mean over processes).
            let n = part.loss_tokens.max(1.0);
            let (batch, weights) = self.weighted(core, &part.samples, |_| 1.0 / n)?;
            let teacher = self.teacher()?;
            let (loss, _, entropy) = core.training_forward(i, || {
                core.model.distillation_loss(
                    teacher,
                    (&batch.input_ids, &batch.position_ids),
                    &weights,
                    (self.beta, self.temperature),
                    true,
                )
            })?;
            local[0] += scalar(&loss)?;
            local.push(entropy.iter().sum());
            local.push(entropy.len() as f64);
            let store = core.model.backward(&loss)?;
            core.accumulate(grads, store, rows.len())?;
        }
        let g = core.batch_sum(&local)?;
        // TRL's entropy: per micro-batch over every process's tokens, averaged over them.
        let per_micro: Vec<f64> = g[1..]
            .chunks(2)
            .map(|c| match c[1] > 0.0 {
                true => c[0] / c[1],
                false => 0.0,
            })
            .collect();
        metrics.push((
            "entropy",
            per_micro.iter().sum::<f64>() / per_micro.len().max(1) as f64,
        ));
        // TRL's step_time: this rank's seconds for the step's generation, forwards and backwards.
        metrics.push(("step_time", started.elapsed().as_secs_f64()));
        Ok(TaskStep {
            loss: g[0],
            tokens,
            metrics,
        })
    }

    /// TRL's evaluation: each held-out prompt completed once (as in training), the loss each
    /// rank's part's mean divergence, `eval_entropy` and the completions' lengths per step.
    fn evaluate(
        &self,
        _config: &DistillationConfig,
        core: &Core<'_, N>,
    ) -> Result<Option<EvalResult>> {
        let per = core.args.per_device_eval_batch_size.max(1);
        let step = |samples: &[Sample], _: EvalPass| -> Result<(f64, Metrics)> {
            let (mut loss, mut entropy, mut count) = (0.0, 0.0, 0.0);
            for part in samples.chunks(per) {
                let [l, e, c] = self.eval_part(core, part)?;
                loss += l * part.len() as f64;
                entropy += e;
                count += c;
            }
            let figure = match count > 0.0 {
                true => entropy / count,
                false => 0.0,
            };
            Ok((loss / samples.len() as f64, vec![("entropy", figure)]))
        };
        Ok(self
            .rounds
            .evaluate_with(core, step)?
            .map(|(loss, figures)| EvalResult {
                loss,
                accuracy: None,
                aux_loss: None,
                figures,
            }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainerConfig;

    /// TRL's DistillationConfig keys: defaults, a teacher key named as without effect, and
    /// values that would change what is trained refused by name.
    #[test]
    fn trl_distillation_keys_are_applied_named_or_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("distillation.yaml");
        let read = |recipe: &str| {
            std::fs::write(&file, recipe).unwrap();
            DistillationConfig::read(&file)
        };
        let (config, ignored) =
            read("teacher_model_name_or_path: t\nteacher_model_revision: main\n").unwrap();
        assert_eq!(config.training.learning_rate, 1e-6);
        assert_eq!((config.beta, config.temperature), (1.0, 1.0));
        assert_eq!(config.max_completion_length, 512);
        assert!(
            ignored
                .iter()
                .any(|l| l.starts_with("teacher_model_revision: the teacher is read")),
            "{ignored:?}"
        );
        for (recipe, key) in [
            ("beta: 1.5\n", "beta"),
            ("temperature: .nan\n", "temperature"),
            ("temperature: 0\n", "temperature"),
            ("use_vllm: true\n", "use_vllm"),
            ("generation_kwargs: {top_k: 5}\n", "generation_kwargs"),
        ] {
            let e = read(recipe).unwrap_err().to_string();
            assert!(e.contains(key), "{recipe}: {e}");
        }
        // An empty mapping changes nothing.
        let empty = read("generation_kwargs: {}\n");
        assert!(empty.is_ok(), "{:?}", empty.err());
    }
}
