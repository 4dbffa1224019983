//! RLOO as a [`Task`]: TRL 1.16's RLOOTrainer (`RLOOConfig`'s keys and defaults). It shares
//! GRPO's rounds (the sampler, in-process generation or a rollout, the rewards, the held
//! reference, every strategy) and differs where TRL's does ([`super::rloo_loss`]): the policy's
//! log-probabilities at generation are always kept (from the training forward when a round
//! is one micro-batch trained once: the same policy); with beta > 0 the KL to the reference
//! (old minus reference, summed over a completion's tokens) comes out of its reward; the
//! advantage is the reward minus the mean of its group's others (optionally normalised over
//! the generation batch); the loss clips one ratio per completion, of its summed
//! log-probabilities, averaged over the micro-batch's completions.

use super::args::{EntryList, TrainingArguments};
use super::core::{Core, EvalResult, StepGrads, Task, TaskStep};
use super::grpo::{validate_grpo, GRPOConfig, Grpo, SCAFFOLD_REWARD};
use super::kinds::{read_as, Scaffold, TrainerKind};
use super::rloo_loss::Rloo as RlooLoss;
use crate::config::cli_value::{NumberList, PadMultiple};
use crate::data::TextTokenizer;
use crate::error::{Error, Result};
use crate::models::CausalModel;
use crate::parallel::estimate::Workload;

crate::training_arguments! {
    /// RLOO's training arguments, with TRL 1.16's names and defaults (`RLOOConfig`).
    struct RLOOConfig, flags RLOOArgs, base training;
    /// The rewards, as GRPO's (docs/grpo.md): built-in names, reward programs, reward models.
    reward_funcs: EntryList = EntryList(Vec::new());
    /// One weight per reward function (default 1 each).
    reward_weights: Option<NumberList> = None;
    /// A program that generates the completions instead (JSON lines, docs/grpo.md).
    rollout_command: Option<String> = None;
    /// A Rust function that generates them instead (grpo_rewards::register_rollout).
    rollout_func: Option<String> = None;
    /// Completions per prompt.
    num_generations: usize = 2;
    /// Completions per prompt in evaluation (default num_generations).
    num_generations_eval: Option<usize> = None;
    max_completion_length: usize = 512;
    /// Shuffle the prompts each epoch (by seed).
    shuffle_dataset: bool = true;
    /// A token count, none, or auto (no padding off AWS Neuron).
    pad_to_multiple_of: PadMultiple = Default::default();
    /// Completions per generation round over all ranks (or steps_per_generation).
    generation_batch_size: Option<usize> = None;
    /// Micro-batches each round is trained on (default gradient_accumulation_steps).
    steps_per_generation: Option<usize> = None;
    temperature: f64 = 1.0;
    top_p: f64 = 1.0;
    /// 0: off.
    top_k: usize = 0;
    min_p: Option<f64> = None;
    repetition_penalty: f64 = 1.0;
    /// Generation runs in the training process here: true is refused.
    use_vllm: bool = false;
    /// The KL's weight in the reward (0: no reference model).
    beta: f64 = 0.05;
    /// Updates per generated round.
    num_iterations: usize = 1;
    epsilon: f64 = 0.2;
    /// The upper clip (default epsilon).
    epsilon_high: Option<f64> = None;
    /// Advantages normalised over the generation batch (mean 0, std 1).
    normalize_advantages: bool = false;
    /// Rewards clipped to [min, max] before the KL and the baseline.
    reward_clip_range: Option<NumberList> = None;
    /// Completions cut at max_completion_length carry no loss.
    mask_truncated_completions: bool = false;
    /// Mix the policy into the reference every ref_model_sync_steps steps.
    sync_ref_model: bool = false;
    ref_model_mixup_alpha: f64 = 0.6;
    ref_model_sync_steps: usize = 512;
    /// No dropout in the policy (LoRA's dropout off).
    disable_dropout: bool = false;
}

crate::trainer_config!(RLOOConfig, flags RLOOArgs, base training,
    about "REINFORCE leave-one-out (TRL's RLOO) on Candle",
    accuracy "eval_reward",
    metrics [],
    validate validate_rloo,
    base_defaults super::grpo::trl_defaults);

/// `trl rloo`-style command line.
pub type RlooCli = super::args::Cli<RLOOConfig>;

impl RLOOConfig {
    /// The rounds' settings as GRPO's keys (the keys both share; GRPO's own at defaults).
    pub fn rounds(&self) -> GRPOConfig {
        GRPOConfig {
            training: self.training.clone(),
            reward_funcs: self.reward_funcs.clone(),
            reward_weights: self.reward_weights.clone(),
            rollout_command: self.rollout_command.clone(),
            rollout_func: self.rollout_func.clone(),
            num_generations: self.num_generations,
            num_generations_eval: self.num_generations_eval,
            max_completion_length: self.max_completion_length,
            shuffle_dataset: self.shuffle_dataset,
            pad_to_multiple_of: self.pad_to_multiple_of,
            generation_batch_size: self.generation_batch_size,
            steps_per_generation: self.steps_per_generation,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            use_vllm: self.use_vllm,
            beta: self.beta,
            num_iterations: self.num_iterations,
            epsilon: self.epsilon,
            epsilon_high: self.epsilon_high,
            mask_truncated_completions: self.mask_truncated_completions,
            sync_ref_model: self.sync_ref_model,
            ref_model_mixup_alpha: self.ref_model_mixup_alpha,
            ref_model_sync_steps: self.ref_model_sync_steps,
            disable_dropout: self.disable_dropout,
            ..Default::default()
        }
    }

    /// The advantages' and loss's settings.
    pub fn loss(&self) -> RlooLoss {
        RlooLoss {
            epsilon_low: self.epsilon,
            epsilon_high: self.epsilon_high.unwrap_or(self.epsilon),
            beta: self.beta,
            normalize_advantages: self.normalize_advantages,
            reward_clip_range: self.reward_clip_range.as_ref().map(|r| (r.0[0], r.0[1])),
        }
    }
}

/// RLOOConfig's checks: GRPO's on the keys they share, and the clip range.
fn validate_rloo(config: &RLOOConfig, source: &str) -> Result<()> {
    validate_grpo(&config.rounds(), source)?;
    if let Some(range) = &config.reward_clip_range {
        if range.0.len() != 2 || range.0[0] > range.0[1] {
            return Err(Error::config(
                source,
                "reward_clip_range",
                format!("{:?}: give [min, max] with min <= max", range.0),
            ));
        }
    }
    Ok(())
}

/// RLOO training: GRPO's rounds with RLOO's advantages and loss.
pub struct Rloo {
    rounds: Grpo,
    /// The shared keys as GRPO reads them, for the rounds' methods.
    config: GRPOConfig,
}

/// RLOO in the trainers' registry ([`super::kinds`]).
pub const KIND: TrainerKind = TrainerKind {
    name: "rloo",
    about: "online RL with a leave-one-out baseline (TRL's RLOOTrainer)",
    read: |args| read_as::<RLOOConfig>(args, workload),
    scaffold: Scaffold {
        config: "templates/sft/rloo.yaml",
        data: &[
            ("data/grpo_train.jsonl", "assets/tiny/data/grpo_train.jsonl"),
            ("data/grpo_eval.jsonl", "assets/tiny/data/grpo_eval.jsonl"),
        ],
        config_type: "RLOOConfig",
        cli_type: "RlooCli",
        task_type: Some("Rloo"),
        model_wrapper: None,
        summary: "Online RL (TRL's RLOO)",
        example_flag: "--beta 0.1",
        data_note: ": addition prompts with their sums as solution",
        formats: "prompt (text or messages) and the columns rewards read",
        metric: "reward",
        items: SCAFFOLD_REWARD,
        setup: "    trl_runtime::train::grpo_rewards::register_reward(\"exact_sum\", exact_sum);\n",
    },
};

/// What a rank holds: GRPO's (a reference copy when beta > 0, reward models whole).
pub fn workload(config: &RLOOConfig) -> Workload {
    super::grpo::workload(&config.rounds())
}

impl Rloo {
    /// Seconds this rank spent getting completions.
    pub fn generation_seconds(&self) -> f64 {
        self.rounds.generation_seconds()
    }
}

impl<N: CausalModel> Task<N> for Rloo {
    type Config = RLOOConfig;

    fn load(config: &RLOOConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let rounds = config.rounds();
        let grpo = <Grpo as Task<N>>::load(&rounds, tokenizer)?;
        Ok(Rloo {
            rounds: grpo.with_rloo(config.loss()),
            config: rounds,
        })
    }

    fn training_arguments(config: &RLOOConfig) -> TrainingArguments {
        <Grpo as Task<N>>::training_arguments(&config.rounds())
    }

    fn layout(&mut self, _config: &RLOOConfig, dp_ranks: usize) -> Result<()> {
        <Grpo as Task<N>>::layout(&mut self.rounds, &self.config, dp_ranks)
    }

    fn num_rows(&self) -> usize {
        <Grpo as Task<N>>::num_rows(&self.rounds)
    }

    fn workload(config: &RLOOConfig) -> Workload {
        workload(config)
    }

    fn prepare(&mut self, _config: &RLOOConfig, core: &Core<'_, N>) -> Result<()> {
        self.rounds.prepare(&self.config, core)
    }

    fn step(
        &mut self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
        grads: &mut StepGrads,
    ) -> Result<TaskStep> {
        self.rounds.step(core, rows, grads)
    }

    fn evaluate(&self, _config: &RLOOConfig, core: &Core<'_, N>) -> Result<Option<EvalResult>> {
        self.rounds.evaluate(&self.config, core)
    }

    fn save_state(&self, core: &Core<'_, N>, step: usize) -> Result<()> {
        self.rounds.save_state(core, step)
    }

    fn after_step(&mut self, core: &Core<'_, N>) -> Result<()> {
        self.rounds.after_step(core)
    }

    fn progress_note(&self, metrics: &[(&'static str, f64)]) -> String {
        <Grpo as Task<N>>::progress_note(&self.rounds, metrics)
    }
}
