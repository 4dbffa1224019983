//! GRPO as a [`Task`]: TRL 1.16's GRPOTrainer (`GRPOConfig`'s keys and defaults, its
//! sampler, advantages, losses and metrics) over prompts, with generation in the training
//! process under whatever strategy the launch set up.
//!
//! A step's rows are completions. As TRL's RepeatSampler deals them, a generation round takes
//! `generation_batch_size / num_generations` prompts, each `num_generations` times in a row,
//! dealt over the data-parallel ranks in blocks of `per_device_train_batch_size x
//! steps_per_generation`; every rank generates its block in one batch through the KV cache
//! (`parallel::Model::generate`: ZeRO-3 / FSDP gather as the planner allows, tp ranks decode
//! their heads), or asks an external rollout program. Rewards are scored per rank, summed over
//! the ranks, and turned into advantages per prompt group. The block is then trained on over
//! `steps_per_generation` micro-batches, `num_iterations` times, the policy's log-probabilities
//! at generation kept as the old ones when the round is reused ([`super::grpo_loss`]).
//!
//! The sampler of the core deals placeholder rows in order (one per completion of the
//! epoch); a micro-batch's first row says which micro-step of the epoch it is, and so which
//! round and slice it trains on.

use super::args::{EntryList, TrainingArguments};
use super::core::{Core, EvalResult, StepGrads, Task, TaskStep};
use super::grpo_loss::{
    nanmean, nanstd, Completion, GrpoLoss, GrpoLossType, LossFigures, LossOut, Scale,
};
use super::grpo_rewards::{
    registered_rollout, rollout, LineProgram, Reward, RewardInput, RolloutClosure, RolloutRequest,
};
use super::kinds::{read_as, Scaffold, TrainerKind};
use super::reference::{HeldReference, Mixing};
use super::rloo_loss::Rloo;
use crate::comm::ReduceOp;
use crate::config::cli_value::{NumberList, PadMultiple};
use crate::context_parallel::split::{kept_columns, pad_to_multiple};
use crate::data::{collate, CollateOptions, Example, PackedSequence, TextTokenizer};
use crate::error::{Error, Result};
use crate::generation::{GenerationConfig, Prompt};
use crate::models::{AutoModelForSequenceClassification, CausalModel};
use crate::nn::IGNORE_INDEX;
use crate::parallel::estimate::Workload;
use crate::parallel::GatherMode;
use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::{Map, Value};

crate::training_arguments! {
    /// GRPO's training arguments, with TRL 1.16's names and defaults (`GRPOConfig`).
    struct GRPOConfig, flags GRPOArgs, base training;
    /// The rewards: TRL's built-in functions by name (accuracy_reward, think_format_reward,
    /// get_soft_overlong_punishment(MAX, CACHE)) and command lines of reward programs
    /// (docs/grpo.md), summed with reward_weights.
    reward_funcs: EntryList = EntryList(Vec::new());
    /// One weight per reward function (default 1 each).
    reward_weights: Option<NumberList> = None;
    /// A program that generates the completions instead (TRL's rollout_func, over JSON lines).
    rollout_command: Option<String> = None;
    /// A Rust function that generates them instead (TRL's rollout_func), by the name the
    /// program registered it under (grpo_rewards::register_rollout).
    rollout_func: Option<String> = None;
    /// Completions per prompt.
    num_generations: usize = 8;
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
    /// The KL term's weight (0: no reference model).
    beta: f64 = 0.0;
    /// Updates per generated round (>1 keeps the old log-probabilities for the ratio).
    num_iterations: usize = 1;
    epsilon: f64 = 0.2;
    /// Two-sided clipping: the unclipped ratio capped at delta.
    delta: Option<f64> = None;
    /// The upper clip (default epsilon).
    epsilon_high: Option<f64> = None;
    /// token or sequence.
    importance_sampling_level: String = "token".into();
    /// sum_then_normalize or normalize_then_sum.
    multi_objective_aggregation: String = "sum_then_normalize".into();
    /// group, batch or none.
    scale_rewards: String = "group".into();
    /// grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo.
    loss_type: String = "dapo".into();
    /// sapo's gate temperature for negative advantages.
    sapo_temperature_neg: f64 = 1.05;
    /// sapo's gate temperature for positive advantages.
    sapo_temperature_pos: f64 = 1.0;
    /// vespo's gamma weight for advantages >= 0: its shape k and rate lambda.
    vespo_k_pos: f64 = 2.0;
    vespo_lambda_pos: f64 = 3.0;
    /// vespo's gamma weight for negative advantages.
    vespo_k_neg: f64 = 3.0;
    vespo_lambda_neg: f64 = 2.0;
    /// Completions cut at max_completion_length carry no loss.
    mask_truncated_completions: bool = false;
    /// Mix the policy into the reference every ref_model_sync_steps steps.
    sync_ref_model: bool = false;
    ref_model_mixup_alpha: f64 = 0.6;
    ref_model_sync_steps: usize = 512;
    /// Train on the tokens whose entropy is in this top fraction only.
    top_entropy_quantile: f64 = 1.0;
    /// The KL term times the importance ratio.
    use_bias_correction_kl: bool = true;
    /// No dropout in the policy (LoRA's dropout off).
    disable_dropout: bool = false;
}

crate::trainer_config!(GRPOConfig, flags GRPOArgs, base training,
    about "Group relative policy optimization (TRL's GRPO) on Candle",
    accuracy "eval_reward",
    metrics [],
    validate validate_grpo,
    base_defaults trl_defaults);

/// `trl grpo`-style command line.
pub type GrpoCli = super::args::Cli<GRPOConfig>;

/// TRL's GRPOConfig defaults for shared keys that differ from transformers' (RLOO's and KTO's
/// too: a learning rate of 1e-6).
pub(crate) fn trl_defaults(training: &mut TrainingArguments, given: &dyn Fn(&str) -> bool) {
    if !given("learning_rate") {
        training.learning_rate = 1e-6;
    }
}

impl GRPOConfig {
    /// The loss these keys describe.
    pub fn loss(&self) -> std::result::Result<GrpoLoss, (&'static str, String)> {
        let kind = GrpoLossType::from_name(&self.loss_type).ok_or_else(|| {
            (
                "loss_type",
                format!(
                    "'{}' is not one of {}",
                    self.loss_type,
                    GrpoLossType::NAMES.join(", ")
                ),
            )
        })?;
        let sequence_level = match self.importance_sampling_level.as_str() {
            "token" => false,
            "sequence" => true,
            other => {
                return Err((
                    "importance_sampling_level",
                    format!("'{other}': use token or sequence"),
                ))
            }
        };
        Ok(GrpoLoss {
            kind,
            epsilon_low: self.epsilon,
            epsilon_high: self.epsilon_high.unwrap_or(self.epsilon),
            delta: self.delta,
            beta: self.beta,
            bias_correction_kl: self.use_bias_correction_kl,
            sequence_level,
            max_completion_length: self.max_completion_length,
            sapo_temperature: [self.sapo_temperature_pos, self.sapo_temperature_neg],
            vespo: [
                self.vespo_k_pos,
                self.vespo_lambda_pos,
                self.vespo_k_neg,
                self.vespo_lambda_neg,
            ],
        })
    }

    /// TRL's warnings for loss types at an importance sampling level their papers do not use.
    pub fn loss_warnings(&self) -> Vec<String> {
        let (kind, level) = (
            self.loss_type.as_str(),
            self.importance_sampling_level.as_str(),
        );
        let mut out = Vec::new();
        if kind == "luspo" && level != "sequence" {
            out.push("loss_type luspo: set importance_sampling_level to sequence to mirror its paper's setup (TRL warns the same)".into());
        }
        if kind == "vespo" && level != "token" {
            out.push("loss_type vespo computes its sequence-level weights itself: leave importance_sampling_level at token (TRL warns the same)".into());
        }
        if level == "sequence" && ["bnpo", "dr_grpo", "dapo", "cispo"].contains(&kind) {
            out.push(format!("importance_sampling_level sequence with loss_type {kind}: the loss sums per-token terms, weighting each sequence by its length; GSPO's setup is loss_type grpo (TRL warns the same)"));
        }
        out
    }

    /// (steps_per_generation, generation_batch_size) on `dp` data-parallel ranks, as
    /// GRPOConfig's __post_init__ derives them.
    pub fn generation_layout(
        &self,
        dp: usize,
    ) -> std::result::Result<(usize, usize), (&'static str, String)> {
        let global = self.training.per_device_train_batch_size * dp;
        let (spg, gbs) = match (self.generation_batch_size, self.steps_per_generation) {
            (None, None) => {
                let spg = self.training.gradient_accumulation_steps;
                (spg, global * spg)
            }
            (Some(g), None) => {
                if g % global != 0 {
                    return Err(("generation_batch_size", format!("{g} must be divisible by the global batch size {global} (per_device_train_batch_size x {dp} data-parallel ranks)")));
                }
                (g / global, g)
            }
            (None, Some(s)) => (s, global * s),
            (Some(_), Some(_)) => {
                return Err(("generation_batch_size", "generation_batch_size and steps_per_generation cannot both be set (TRL refuses it too)".into()))
            }
        };
        if spg == 0 {
            return Err(("steps_per_generation", "must be at least 1".into()));
        }
        if gbs % self.num_generations != 0 {
            return Err(("num_generations", format!("the generation batch of {gbs} completions must be divisible by num_generations {} (whole prompt groups)", self.num_generations)));
        }
        Ok((spg, gbs))
    }
}

/// GRPOConfig's own checks.
pub(crate) fn validate_grpo(config: &GRPOConfig, source: &str) -> Result<()> {
    let fail = |key: &str, message: String| Err(Error::config(source, key, message));
    if let Err((key, message)) = config.loss() {
        return fail(key, message);
    }
    if config.use_vllm {
        return fail("use_vllm", "generation runs in the training process here (KV cache, the policy sharded as it trains, the planner counting its memory): remove use_vllm".into());
    }
    if config.num_generations < 2 {
        return fail(
            "num_generations",
            format!(
                "{}: the advantages need at least 2 completions per prompt (each is measured against its group)",
                config.num_generations
            ),
        );
    }
    if config.num_generations_eval == Some(0) {
        return fail(
            "num_generations_eval",
            "0: give the completions per held-out prompt (at least 1)".into(),
        );
    }
    if config.num_iterations == 0 || config.max_completion_length == 0 {
        let key = if config.num_iterations == 0 {
            "num_iterations"
        } else {
            "max_completion_length"
        };
        return fail(key, "must be at least 1".into());
    }
    if !["group", "batch", "none"].contains(&config.scale_rewards.as_str()) {
        return fail(
            "scale_rewards",
            format!("'{}': use group, batch or none", config.scale_rewards),
        );
    }
    if !["sum_then_normalize", "normalize_then_sum"]
        .contains(&config.multi_objective_aggregation.as_str())
    {
        return fail(
            "multi_objective_aggregation",
            format!(
                "'{}': use sum_then_normalize or normalize_then_sum",
                config.multi_objective_aggregation
            ),
        );
    }
    if !(config.top_entropy_quantile > 0.0 && config.top_entropy_quantile <= 1.0) {
        return fail(
            "top_entropy_quantile",
            format!("{}: must lie in (0, 1]", config.top_entropy_quantile),
        );
    }
    if config.temperature <= 0.0 {
        return fail(
            "temperature",
            format!(
                "{}: must be positive (completions are sampled)",
                config.temperature
            ),
        );
    }
    if let Some(w) = &config.reward_weights {
        if w.0.len() != config.reward_funcs.0.len() {
            return fail(
                "reward_weights",
                format!(
                    "{} weights for {} reward functions: give one per reward function",
                    w.0.len(),
                    config.reward_funcs.0.len()
                ),
            );
        }
    }
    for entry in &config.reward_funcs.0 {
        if let Err(m) = Reward::parse(entry, config.max_completion_length) {
            return fail("reward_funcs", m);
        }
    }
    if config.rollout_command.is_some() && config.rollout_func.is_some() {
        return fail(
            "rollout_func",
            "both rollout_command and rollout_func give completions: keep one".into(),
        );
    }
    if config.sync_ref_model && config.beta == 0.0 {
        return fail("sync_ref_model", "beta is 0, so there is no reference model to sync: set beta > 0 or drop sync_ref_model".into());
    }
    if config.sync_ref_model && config.ref_model_sync_steps == 0 {
        return fail(
            "ref_model_sync_steps",
            "0: give the steps between syncs".into(),
        );
    }
    Ok(())
}

/// A prompt row: the prompt as the dataset holds it, its tokens, its other columns.
#[derive(Debug, Clone)]
struct PromptRow {
    prompt: Value,
    ids: Vec<u32>,
    columns: Map<String, Value>,
}

/// One completion of a round, as a micro-batch trains on it.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub(crate) prompt_ids: Vec<u32>,
    pub(crate) completion_ids: Vec<u32>,
    /// 1 per completion token that counts (0 for a masked truncated completion).
    pub(crate) mask: Vec<f64>,
    advantage: f64,
    old: Option<Vec<f64>>,
    reference: Option<Vec<f64>>,
}

/// A generation round of this rank: its micro-batches, and what it logs.
struct Round {
    /// (epoch, round in the epoch).
    at: (usize, usize),
    slices: Vec<Vec<Sample>>,
    /// Metrics logged at the step that generated it (TRL logs them once per round).
    metrics: Vec<(&'static str, f64)>,
    logged: bool,
    /// Prompt and completion tokens of every rank (TRL's num_input_tokens_seen).
    tokens: usize,
    /// dapo: the round's completion tokens that count, over all ranks.
    loss_tokens: f64,
    /// RLOO with one micro-batch per round: every rank's rewards per function and lengths,
    /// waiting for the training forward's log-probabilities (see [`Grpo::settle`]).
    pending: Option<(Vec<Vec<f64>>, Lengths)>,
}

/// A micro-batch of a round (see [`Grpo::slice_for`]).
pub(crate) struct RoundSlice {
    pub(crate) samples: Vec<Sample>,
    /// The round's figures, with the micro-batch that first trains on it (else empty).
    pub(crate) metrics: Vec<(&'static str, f64)>,
    /// Prompt and completion tokens of every rank, likewise.
    pub(crate) tokens: usize,
    /// The round's counted completion tokens over all ranks.
    pub(crate) loss_tokens: f64,
}

/// Where completions come from when they are not sampled here.
enum Rollout {
    Program(std::cell::RefCell<LineProgram>),
    Func(RolloutClosure),
}

/// GRPO training.
pub struct Grpo {
    train: Vec<PromptRow>,
    eval: Vec<PromptRow>,
    loss: GrpoLoss,
    rewards: Vec<Reward>,
    weights: Vec<f64>,
    rollout: Option<Rollout>,
    g: usize,
    /// Completions per prompt in evaluation.
    g_eval: usize,
    spg: usize,
    gbs: usize,
    iterations: usize,
    /// Per-device micro-batch (completions).
    batch: usize,
    dp: usize,
    scale_rewards: String,
    normalize_then_sum: bool,
    mask_truncated: bool,
    shuffle: bool,
    top_entropy_quantile: f64,
    sampling: GenerationConfig,
    collate_options: CollateOptions,
    reference: Option<HeldReference>,
    mixing: Mixing,
    round: Option<Round>,
    /// RLOO's advantages and loss instead of GRPO's (train/rloo.rs).
    rloo: Option<Rloo>,
    /// Rounds for on-policy distillation (train/distillation.rs): completions and their
    /// length figures only (no rewards, advantages, old or reference log-probabilities).
    distill: bool,
    seed: u64,
    /// Seconds this rank spent getting completions (sampling, or the rollout's answer).
    generation_seconds: f64,
}

/// Token ids per row.
type TokenRows = Vec<Vec<u32>>;
/// Per completion: [prompt, completion, truncated].
type Lengths = Vec<[f64; 3]>;
/// Metrics under TRL's names.
pub(crate) type Metrics = Vec<(&'static str, f64)>;
/// An eval step's policy log-probabilities and entropies, per sample and completion token.
pub(crate) type EvalPass = (Vec<Vec<f64>>, Vec<Vec<f64>>);
/// Per local position of a micro-batch: the (sample, completion token) it predicts.
type Owners = Vec<Option<(usize, usize)>>;
/// A forward's log-probabilities and entropies per sample and completion token, and the
/// local per-position log-probabilities (with their graph) and owners when trained.
type Scored = (Vec<Vec<f64>>, Vec<Vec<f64>>, Option<(Tensor, Owners)>);

/// The ids a completion ends at, as TRL's trainers take them: the model's generation
/// config's `eos_token_id`, with the tokenizer's EOS first when it is not among them.
fn eos_ids(dir: &std::path::Path, tokenizer_eos: Option<u32>) -> Result<Vec<u32>> {
    let mut ids = GenerationConfig::for_model(dir)?.eos_token_id;
    if let Some(eos) = tokenizer_eos.filter(|e| !ids.contains(e)) {
        ids.insert(0, eos);
    }
    Ok(ids)
}

/// Metric names built at run time (rewards/NAME/mean), kept for the run.
fn leak(name: String) -> &'static str {
    Box::leak(name.into_boxed_str())
}

/// torch.quantile's linear interpolation.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn parse_prompt_row(v: &Value) -> std::result::Result<(Value, Map<String, Value>), String> {
    let row = crate::data::dataset::columns(v)?;
    let prompt = row
        .get("prompt")
        .cloned()
        .ok_or_else(|| format!("no `prompt` column (keys {:?}): GRPO rows hold a prompt (text or messages) and the columns its rewards read", row.keys().collect::<Vec<_>>()))?;
    crate::data::dataset::content(&prompt, "prompt")?;
    let columns = row
        .iter()
        .filter(|(k, _)| k.as_str() != "prompt")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok((prompt, columns))
}

fn tokenize_prompts(
    rows: Vec<(Value, Map<String, Value>)>,
    tok: &TextTokenizer,
) -> Result<Vec<PromptRow>> {
    rows.into_iter()
        .map(|(prompt, columns)| {
            let p = match crate::data::dataset::content(&prompt, "prompt")
                .map_err(|m| Error::config("dataset", "prompt", m))?
            {
                crate::data::dataset::Content::Text(t) => Prompt::Text(t),
                crate::data::dataset::Content::Messages(m) => Prompt::Messages(m),
            };
            Ok(PromptRow {
                ids: p.ids(tok)?,
                prompt,
                columns,
            })
        })
        .collect()
}

impl Grpo {
    /// The same rollouts and rewards trained as RLOO (train/rloo.rs).
    pub(crate) fn with_rloo(mut self, rloo: Rloo) -> Self {
        self.rloo = Some(rloo);
        self
    }

    /// The rounds of `config` (prompts, sampling, rewards) without GRPO's check that some
    /// reward is named (distillation's rounds have none).
    pub(crate) fn load_rounds(config: &GRPOConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let args = &config.training;
        let (train, eval) = args.load_data(&parse_prompt_row)?;
        let train = tokenize_prompts(train, tokenizer)?;
        let eval = match eval {
            Some(rows) => tokenize_prompts(rows, tokenizer)?,
            None => Vec::new(),
        };
        let rewards = config
            .reward_funcs
            .0
            .iter()
            .map(|e| {
                Reward::parse(e, config.max_completion_length)
                    .map_err(|m| Error::config("training arguments", "reward_funcs", m))
            })
            .collect::<Result<Vec<_>>>()?;
        let weights = match &config.reward_weights {
            Some(w) => w.0.clone(),
            None => vec![1.0; rewards.len()],
        };
        let sampling = GenerationConfig {
            max_new_tokens: config.max_completion_length,
            do_sample: true,
            temperature: config.temperature,
            top_k: config.top_k,
            top_p: config.top_p,
            min_p: config.min_p,
            repetition_penalty: config.repetition_penalty,
            eos_token_id: eos_ids(&args.model_name_or_path, tokenizer.eos_token_id)?,
            pad_token_id: Some(tokenizer.pad_token_id),
            seed: args.seed,
        };
        Ok(Grpo {
            train,
            eval,
            loss: config.loss().expect("validated"),
            rewards,
            weights,
            rollout: match (&config.rollout_command, &config.rollout_func) {
                (Some(c), _) => Some(Rollout::Program(
                    LineProgram::new(c, "rollout_command").into(),
                )),
                (None, Some(name)) => {
                    Some(Rollout::Func(registered_rollout(name).map_err(|m| {
                        Error::config("training arguments", "rollout_func", m)
                    })?))
                }
                (None, None) => None,
            },
            g: config.num_generations,
            g_eval: config
                .num_generations_eval
                .unwrap_or(config.num_generations),
            spg: 1,
            gbs: config.num_generations,
            iterations: config.num_iterations,
            batch: args.per_device_train_batch_size,
            dp: 1,
            scale_rewards: config.scale_rewards.clone(),
            normalize_then_sum: config.multi_objective_aggregation == "normalize_then_sum",
            mask_truncated: config.mask_truncated_completions,
            shuffle: config.shuffle_dataset,
            top_entropy_quantile: config.top_entropy_quantile,
            sampling,
            collate_options: CollateOptions {
                pad_token_id: tokenizer.pad_token_id,
                padding_free: false,
                pad_to_multiple_of: config.pad_to_multiple_of.0,
            },
            reference: None,
            mixing: Mixing {
                alpha: config.ref_model_mixup_alpha,
                every: if config.sync_ref_model {
                    config.ref_model_sync_steps
                } else {
                    usize::MAX
                },
            },
            round: None,
            rloo: None,
            distill: false,
            seed: args.seed,
            generation_seconds: 0.0,
        })
    }

    /// The same rounds for on-policy distillation (train/distillation.rs).
    pub(crate) fn for_distillation(mut self) -> Self {
        self.distill = true;
        self
    }

    /// The micro-batch whose first sampler row is `first_row`: its round generated when it
    /// is a new one, its slice of this rank's samples, and (the first time the round is
    /// trained on) the round's figures and tokens; the round's counted completion tokens over
    /// all ranks.
    pub(crate) fn slice_for<N: CausalModel>(
        &mut self,
        core: &Core<'_, N>,
        first_row: usize,
    ) -> Result<RoundSlice> {
        let m = first_row / (self.batch * self.dp);
        let (round, slice) = (m / (self.spg * self.iterations), m % self.spg);
        let epoch = core.state.epoch;
        if self.round.as_ref().is_none_or(|r| r.at != (epoch, round)) {
            self.generate_round(core, epoch, round)?;
        }
        let r = self.round.as_mut().expect("generated above");
        let (metrics, tokens) = match r.logged {
            true => (Vec::new(), 0),
            false => {
                r.logged = true;
                (r.metrics.clone(), r.tokens)
            }
        };
        Ok(RoundSlice {
            samples: r.slices[slice].clone(),
            metrics,
            tokens,
            loss_tokens: r.loss_tokens,
        })
    }

    /// Seconds this rank has spent getting completions so far (the generation share of a
    /// step, for `bench train`).
    pub fn generation_seconds(&self) -> f64 {
        self.generation_seconds
    }

    /// Rounds of an epoch (whole ones: TRL's RepeatSampler leaves out the prompts that do
    /// not fill one).
    fn rounds_per_epoch(&self) -> usize {
        self.train.len() / (self.gbs / self.g)
    }

    /// The prompts of `round` of `epoch`, in order, each once.
    fn round_prompts(&self, epoch: usize, round: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.train.len()).collect();
        if self.shuffle {
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(epoch as u64));
            order.shuffle(&mut rng);
        }
        let u = self.gbs / self.g;
        order[round * u..(round + 1) * u].to_vec()
    }

    /// The completion's text and the completion as TRL hands it to rewards.
    fn completion_value(
        tok: &TextTokenizer,
        prompt: &Value,
        ids: &[u32],
    ) -> Result<(String, Value)> {
        let text = tok.decode(ids, true)?;
        let value = match prompt {
            Value::Array(_) => serde_json::json!([{"role": "assistant", "content": text}]),
            _ => Value::String(text.clone()),
        };
        Ok((text, value))
    }

    /// The completions of `rows` with the prompt ids they follow: from the rollout (whose
    /// extra fields join `columns`), or sampled here through the KV cache, row j drawing with
    /// `row_seed(seed, first + j)`. A rollout is told `g`, the completions per prompt
    /// (num_generations; num_generations_eval for held-out rows).
    fn completions<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        (seed, first, g): (u64, u64, usize),
        rows: &[impl std::borrow::Borrow<PromptRow>],
        prompt_values: &[Value],
        columns: &mut [Map<String, Value>],
    ) -> Result<(TokenRows, TokenRows)> {
        let eos: Vec<u32> = self.sampling.eos_token_id.clone();
        // Completions: from the rollout program, or sampled here.
        let ids: Vec<Vec<u32>> = rows.iter().map(|r| r.borrow().ids.clone()).collect();
        let step = core.state.global_step;
        let max_len = self.sampling.max_new_tokens;
        match self.rollout.as_ref() {
            Some(Rollout::Program(program)) => {
                let mut context = Map::new();
                context.insert("num_generations".into(), g.into());
                context.insert("max_completion_length".into(), max_len.into());
                context.insert("step".into(), step.into());
                context.insert("eos_token_id".into(), serde_json::json!(eos));
                let answer = rollout(&mut program.borrow_mut(), prompt_values, &ids, context)?;
                for (c, extra) in columns.iter_mut().zip(answer.extra) {
                    c.extend(extra);
                }
                // The sampler's own log-probabilities are not used: the
                // policy's at generation are (TRL without vLLM).
                Ok((answer.prompt_ids, answer.completion_ids))
            }
            Some(Rollout::Func(f)) => {
                let request = RolloutRequest {
                    prompts: prompt_values,
                    prompt_ids: &ids,
                    num_generations: g,
                    max_completion_length: max_len,
                    step,
                    eos_token_id: &eos,
                };
                let mut answer = f(&request)?;
                answer.extra.resize(rows.len(), Map::new());
                answer
                    .check(rows.len())
                    .map_err(|m| Error::config("training arguments", "rollout_func", m))?;
                for (c, extra) in columns.iter_mut().zip(answer.extra) {
                    c.extend(extra);
                }
                Ok((answer.prompt_ids, answer.completion_ids))
            }
            None => {
                let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
                let (out, width) = self.sample(core, &refs, seed, first)?;
                Ok((ids, cut_at_eos(out, width, &eos)))
            }
        }
    }

    /// Completions of `prompts` sampled as `self.sampling` says, row j drawing with
    /// `row_seed(seed, first + j)`; the rows (prompt pads included) and the padded prompt
    /// width.
    fn sample<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        prompts: &[&[u32]],
        seed: u64,
        first: u64,
    ) -> Result<(TokenRows, usize)> {
        let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let (input, mask) = crate::generation::left_pad(prompts, core.tokenizer.pad_token_id)?;
        let seeds: Vec<u64> = (0..prompts.len() as u64)
            .map(|j| crate::generation::row_seed(seed, first + j))
            .collect();
        let out = core.model.generate_seeded(
            &input.to_vec2::<u32>()?,
            &mask.to_vec2::<u32>()?,
            &self.sampling,
            GatherMode::Auto,
            &seeds,
        )?;
        Ok((out, width))
    }

    /// Each reward function's values for `completion_ids` following `rows` (None where it
    /// gave none), the rewards called with TRL's arguments.
    fn rewards_of<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        rows: &[impl std::borrow::Borrow<PromptRow>],
        (prompts, columns): (&[Value], &[Map<String, Value>]),
        completion_ids: &[Vec<u32>],
    ) -> Result<Vec<Vec<Option<f64>>>> {
        let mut texts = Vec::with_capacity(rows.len());
        let mut values = Vec::with_capacity(rows.len());
        for (r, c) in rows.iter().zip(completion_ids) {
            let (t, v) = Self::completion_value(&core.tokenizer, &r.borrow().prompt, c)?;
            texts.push(t);
            values.push(v);
        }
        for r in &self.rewards {
            r.prepare(core.args.compute_dtype()?, core.ctx.device())?;
        }
        let input = RewardInput {
            prompts,
            completions: &values,
            texts: &texts,
            completion_ids,
            columns,
        };
        self.rewards.iter().map(|r| r.score(&input)).collect()
    }

    /// [prompt, completion, truncated] per completion: truncated when it ends on neither an
    /// EOS id nor the pad.
    fn lengths_of<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        prompt_ids: &[Vec<u32>],
        completion_ids: &[Vec<u32>],
    ) -> Lengths {
        let (eos, pad) = (&self.sampling.eos_token_id, core.tokenizer.pad_token_id);
        prompt_ids
            .iter()
            .zip(completion_ids)
            .map(|(p, c)| {
                let ended = c.last().is_some_and(|t| eos.contains(t) || *t == pad);
                [p.len() as f64, c.len() as f64, f64::from(u8::from(!ended))]
            })
            .collect()
    }

    /// Every rank's rewards per function (NaN where one gave none) and [prompt, completion,
    /// truncated] lengths of the `n` completions of a round, from this rank's block.
    fn score<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        n: usize,
        rows: &[PromptRow],
        (prompt_values, columns): (&[Value], &[Map<String, Value>]),
        (prompt_ids, completion_ids): (&[Vec<u32>], &[Vec<u32>]),
    ) -> Result<(Vec<Vec<f64>>, Lengths)> {
        let block = self.batch * self.spg;
        let rank = core.dp.rank();
        let scored = self.rewards_of(core, rows, (prompt_values, columns), completion_ids)?;
        let k = self.rewards.len();
        // Every rank's rewards, by summing blocks that are 0 elsewhere: [value, present].
        let mut local = vec![0.0; 2 * n * k];
        for (f, values) in scored.into_iter().enumerate() {
            for (j, v) in values.into_iter().enumerate() {
                let at = 2 * ((rank * block + j) * k + f);
                if let Some(v) = v {
                    local[at] = v;
                    local[at + 1] = 1.0;
                }
            }
        }
        // Lengths and truncation, every rank's: [prompt, completion, truncated].
        let lengths_at = local.len();
        local.extend(vec![0.0; 3 * n]);
        let mine = self.lengths_of(core, prompt_ids, completion_ids);
        for (j, l) in mine.iter().enumerate() {
            let at = lengths_at + 3 * (rank * block + j);
            local[at..at + 3].copy_from_slice(l);
        }
        let all = core.global_sum(&local)?;
        let per_func: Vec<Vec<f64>> = (0..k)
            .map(|f| {
                (0..n)
                    .map(|i| {
                        let at = 2 * (i * k + f);
                        if all[at + 1] > 0.0 {
                            all[at]
                        } else {
                            f64::NAN
                        }
                    })
                    .collect()
            })
            .collect();
        let lengths: Vec<[f64; 3]> = (0..n)
            .map(|i| {
                let at = lengths_at + 3 * i;
                [all[at], all[at + 1], all[at + 2]]
            })
            .collect();
        Ok((per_func, lengths))
    }

    /// Generates, scores and prepares this rank's block of `round` of `epoch`.
    fn generate_round<N: CausalModel>(
        &mut self,
        core: &Core<'_, N>,
        epoch: usize,
        round: usize,
    ) -> Result<()> {
        let prompts = self.round_prompts(epoch, round);
        // The round's rows over all ranks: each prompt num_generations times in a row.
        let global: Vec<usize> = prompts
            .iter()
            .flat_map(|&p| std::iter::repeat_n(p, self.g))
            .collect();
        let block = self.batch * self.spg;
        let rank = core.dp.rank();
        let mine: Vec<usize> = global[rank * block..(rank + 1) * block].to_vec();
        let rows: Vec<PromptRow> = mine.iter().map(|&i| self.train[i].clone()).collect();
        let prompt_values: Vec<Value> = rows.iter().map(|r| r.prompt.clone()).collect();
        let mut columns: Vec<Map<String, Value>> = rows.iter().map(|r| r.columns.clone()).collect();
        let started = std::time::Instant::now();
        // Each row draws by its place in the round, whatever rank holds it: sampled runs give
        // the same completions on any layout (and a row's tp / sp ranks draw alike).
        let seed = self.seed ^ ((epoch as u64) << 40) ^ ((round as u64) << 16);
        let first = (rank * block) as u64;
        let (prompt_ids, completion_ids) = self.completions(
            core,
            (seed, first, self.g),
            &rows,
            &prompt_values,
            &mut columns,
        )?;
        self.generation_seconds += started.elapsed().as_secs_f64();
        let n = global.len();
        let (per_func, lengths) = self.score(
            core,
            n,
            &rows,
            (&prompt_values, &columns),
            (&prompt_ids, &completion_ids),
        )?;
        // This rank's samples (their advantages once the KL is known, for RLOO).
        let mut samples: Vec<Sample> = (0..block)
            .map(|j| {
                let truncated = lengths[rank * block + j][2] > 0.0;
                let len = completion_ids[j].len();
                let on = !(self.mask_truncated && truncated);
                Sample {
                    prompt_ids: prompt_ids[j].clone(),
                    completion_ids: completion_ids[j].clone(),
                    mask: vec![on as u8 as f64; len],
                    advantage: 0.0,
                    old: None,
                    reference: None,
                }
            })
            .collect();
        let loss_tokens: f64 =
            core.global_sum(&[samples.iter().map(|s| s.mask.iter().sum::<f64>()).sum()])?[0];
        // TRL keeps the old log-probabilities when a round outlives a step's micro-batches
        // (RLOO always: its KL penalty is the old policy's). A round trained in one
        // micro-batch runs its training forward on the policy that generated it: RLOO takes
        // the old log-probabilities from that forward instead of one of their own.
        let every = self.spg * self.iterations;
        let deferred = self.rloo.is_some() && every == 1;
        let keep_old = !self.distill
            && !deferred
            && (self.rloo.is_some()
                || !core.args.gradient_accumulation_steps.is_multiple_of(every));
        if keep_old {
            let old = self.score_all(core, &samples)?;
            for (s, o) in samples.iter_mut().zip(old) {
                s.old = Some(o);
            }
        }
        if let Some(reference) = &self.reference {
            let refs = reference.run(core, || self.score_all(core, &samples))?;
            for (s, r) in samples.iter_mut().zip(refs) {
                s.reference = Some(r);
            }
        }
        let tokens = lengths.iter().map(|l| (l[0] + l[1]) as usize).sum();
        let (metrics, pending) = match deferred {
            _ if self.distill => (length_metrics(&lengths), None),
            true => (Vec::new(), Some((per_func, lengths))),
            false => {
                let kl = self.sequence_kl(core, &samples, (n, rank * block), true)?;
                let (advantages, mut metrics) =
                    self.advantages(self.g, &per_func, &lengths, kl.as_ref().map(|k| &k.0[..]));
                metrics.extend(kl.map(|k| ("kl", k.1)));
                for (j, s) in samples.iter_mut().enumerate() {
                    s.advantage = advantages[rank * block + j];
                }
                (metrics, None)
            }
        };
        // Shuffled within the block (TRL's shuffle_sequence_dict), then cut into micro-batches.
        if self.spg > 1 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(
                self.seed ^ 0x9e37 ^ ((epoch as u64) << 32) ^ round as u64,
            );
            samples.shuffle(&mut rng);
        }
        let slices = samples.chunks(self.batch).map(|c| c.to_vec()).collect();
        self.round = Some(Round {
            at: (epoch, round),
            slices,
            metrics,
            logged: false,
            tokens,
            loss_tokens,
            pending,
        });
        Ok(())
    }

    /// A deferred RLOO round (one micro-batch, see [`Self::generate_round`]): `logps`, this
    /// rank's training forward's, are its old log-probabilities; its KL, advantages and
    /// figures follow. The figures, when the round was pending.
    fn settle<N: CausalModel>(
        &mut self,
        core: &Core<'_, N>,
        samples: &mut [Sample],
        logps: &[Vec<f64>],
    ) -> Result<Option<Metrics>> {
        let Some((per_func, lengths)) = self.round.as_mut().and_then(|r| r.pending.take()) else {
            return Ok(None);
        };
        for (s, l) in samples.iter_mut().zip(logps) {
            s.old = Some(l.clone());
        }
        let at = core.dp.rank() * self.batch * self.spg;
        let kl = self.sequence_kl(core, samples, (lengths.len(), at), true)?;
        let (advantages, mut metrics) =
            self.advantages(self.g, &per_func, &lengths, kl.as_ref().map(|k| &k.0[..]));
        metrics.extend(kl.map(|k| ("kl", k.1)));
        for (j, s) in samples.iter_mut().enumerate() {
            s.advantage = advantages[at + j];
        }
        Ok(Some(metrics))
    }

    /// RLOO with a reference: each of the `n` completions' KL (old minus reference
    /// log-probabilities, summed over its counted tokens; `samples` are those from `at` on,
    /// the other ranks' when `collective`) and the mean per-token KL, TRL's `kl`.
    fn sequence_kl<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        samples: &[Sample],
        (n, at): (usize, usize),
        collective: bool,
    ) -> Result<Option<(Vec<f64>, f64)>> {
        if self.rloo.as_ref().is_none_or(|r| r.beta == 0.0) {
            return Ok(None);
        }
        // [per completion..., kl sum, tokens]
        let mut local = vec![0.0; n + 2];
        for (j, s) in samples.iter().enumerate() {
            let (old, reference) = (s.old.as_ref(), s.reference.as_ref());
            let (old, reference) = old.zip(reference).expect("RLOO keeps both");
            let kl: f64 = (0..s.mask.len())
                .map(|t| s.mask[t] * (old[t] - reference[t]))
                .sum();
            local[at + j] = kl;
            local[n] += kl;
            local[n + 1] += s.mask.iter().sum::<f64>();
        }
        let all = match collective {
            true => core.global_sum(&local)?,
            false => local,
        };
        Ok(Some((all[..n].to_vec(), all[n] / all[n + 1].max(1.0))))
    }

    /// The loss of a micro-batch: GRPO's, or RLOO's.
    fn compute(&self, completions: &[Completion], scale: Scale) -> LossOut {
        match &self.rloo {
            Some(r) => r.loss(completions, scale.accumulation),
            None => self.loss.compute(completions, scale),
        }
    }

    /// Whether the loss has a KL term (GRPO with beta > 0; RLOO puts it in the reward).
    fn kl_in_loss(&self) -> bool {
        self.rloo.is_none() && self.loss.beta != 0.0
    }

    /// Advantages of the round's completions (all ranks', in groups of `g`; `kl`, RLOO's
    /// per completion) and its reward and length metrics.
    fn advantages(
        &self,
        g: usize,
        per_func: &[Vec<f64>],
        lengths: &[[f64; 3]],
        kl: Option<&[f64]>,
    ) -> (Vec<f64>, Metrics) {
        let n = lengths.len();
        let k = per_func.len();
        let unscorable: Vec<bool> = (0..n)
            .map(|i| per_func.iter().all(|f| f[i].is_nan()))
            .collect();
        let weighted = |i: usize| -> f64 {
            (0..k)
                .map(|f| per_func[f][i] * self.weights[f])
                .filter(|x| !x.is_nan())
                .sum()
        };
        let mut rewards: Vec<f64> = (0..n)
            .map(|i| if unscorable[i] { f64::NAN } else { weighted(i) })
            .collect();
        let (mut advantages, std): (Vec<f64>, Vec<f64>) = if let Some(rloo) = &self.rloo {
            rloo.advantages(g, &rewards, kl)
        } else if self.normalize_then_sum {
            // Each function normalized per group, then summed, then normalized over the batch.
            let mut summed = vec![0.0; n];
            for (fi, f) in per_func.iter().enumerate() {
                for grp in 0..n / g {
                    let s = &f[grp * g..(grp + 1) * g];
                    let (m, sd) = (nanmean(s), nanstd(s));
                    for i in 0..g {
                        let x = (s[i] - m) / (sd + 1e-4);
                        if !x.is_nan() {
                            summed[grp * g + i] += x * self.weights[fi];
                        }
                    }
                }
            }
            for i in 0..n {
                if unscorable[i] {
                    summed[i] = f64::NAN;
                }
            }
            let (m, sd) = (nanmean(&summed), nanstd(&summed));
            (
                (0..n).map(|i| (summed[i] - m) / (sd + 1e-4)).collect(),
                vec![sd; n],
            )
        } else {
            let group_mean: Vec<f64> = (0..n)
                .map(|i| nanmean(&rewards[i / g * g..(i / g + 1) * g]))
                .collect();
            let std: Vec<f64> = match self.scale_rewards.as_str() {
                "batch" => vec![nanstd(&rewards); n],
                _ => (0..n)
                    .map(|i| nanstd(&rewards[i / g * g..(i / g + 1) * g]))
                    .collect(),
            };
            let adv = (0..n)
                .map(|i| {
                    let a = rewards[i] - group_mean[i];
                    match self.scale_rewards.as_str() {
                        "none" => a,
                        _ => a / (std[i] + 1e-4),
                    }
                })
                .collect();
            (adv, std)
        };
        for a in &mut advantages {
            if a.is_nan() {
                *a = 0.0;
            }
        }
        for i in 0..n {
            if unscorable[i] {
                rewards[i] = f64::NAN;
            }
        }
        let m = self.round_metrics(per_func, &rewards, &std, lengths);
        (advantages, m)
    }

    /// A round's reward and length metrics, as TRL names and computes them (`rewards`: the
    /// weighted sums, NaN where no function scored; `std`: each row's group or batch std).
    fn round_metrics(
        &self,
        per_func: &[Vec<f64>],
        rewards: &[f64],
        std: &[f64],
        lengths: &[[f64; 3]],
    ) -> Metrics {
        let n = lengths.len();
        // Metrics, as TRL names and computes them.
        let mut m: Vec<(&'static str, f64)> = Vec::new();
        for (f, reward) in self.rewards.iter().enumerate() {
            m.push((
                leak(format!("rewards/{}/mean", reward.name)),
                nanmean(&per_func[f]),
            ));
            m.push((
                leak(format!("rewards/{}/std", reward.name)),
                nanstd(&per_func[f]),
            ));
        }
        m.push(("reward", nanmean(rewards)));
        m.push(("reward_std", nanstd(rewards)));
        let zero_std = std.iter().filter(|s| s.abs() <= 1e-8).count() as f64 / n as f64;
        m.push(("frac_reward_zero_std", zero_std));
        m.extend(length_metrics(lengths));
        m
    }

    /// The sequences of `samples` as one micro-batch, with each local position's (sample,
    /// completion token) where it predicts one.
    pub(crate) fn collate_samples<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        samples: &[Sample],
    ) -> Result<(crate::data::Batch, Owners, usize)> {
        let seqs: Vec<PackedSequence> = samples
            .iter()
            .map(|s| {
                let ids: Vec<u32> = s
                    .prompt_ids
                    .iter()
                    .chain(&s.completion_ids)
                    .copied()
                    .collect();
                let labels = std::iter::repeat_n(IGNORE_INDEX, s.prompt_ids.len())
                    .chain(s.completion_ids.iter().map(|&t| t as i64))
                    .collect();
                PackedSequence::single(&Example {
                    input_ids: ids,
                    labels,
                })
            })
            .collect();
        let rows: Vec<&PackedSequence> = seqs.iter().collect();
        let batch = collate(&rows, self.collate_options, &Device::Cpu)?;
        let (n_rows, len) = batch.input_ids.dims2()?;
        let split = core.model.split();
        let kept = kept_columns(split, len)?.unwrap_or_else(|| (0..len).collect());
        // Position c of row r predicts the token at c + 1: completion token c + 1 - prompt.
        let mut owner = Vec::with_capacity(n_rows * kept.len());
        for (r, s) in samples.iter().enumerate() {
            let p = s.prompt_ids.len();
            for &c in &kept {
                let t = (c + 1)
                    .checked_sub(p)
                    .filter(|&t| t < s.completion_ids.len());
                owner.push(t.map(|t| (r, t)));
            }
        }
        let part = batch.part(split)?.to_device(core.ctx.device())?;
        Ok((part, owner, kept.len()))
    }

    /// Each completion token's log-probability (and entropy) from one forward over
    /// `samples`: whole per sample (summed over the sequence's ranks), with the local
    /// per-position tensor when `train`.
    fn forward<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        samples: &[Sample],
        train: bool,
    ) -> Result<Scored> {
        let (batch, owner, _) = self.collate_samples(core, samples)?;
        let out = core.model.forward_token_logps_at(
            &batch.input_ids,
            &batch.position_ids,
            &batch.targets()?,
            train,
            false,
            self.sampling.temperature,
        )?;
        let lp: Vec<f32> = out.logps.detach().to_vec1()?;
        let stats: Vec<Vec<f32>> = out.stats.to_vec2()?;
        // Whole values: each rank fills the positions it holds.
        let offsets: Vec<usize> = samples
            .iter()
            .scan(0, |at, s| {
                let o = *at;
                *at += s.completion_ids.len();
                Some(o)
            })
            .collect();
        let total: usize = samples.iter().map(|s| s.completion_ids.len()).sum();
        let mut flat = vec![0.0; 2 * total];
        for (i, o) in owner.iter().enumerate() {
            if let Some((r, t)) = o {
                flat[offsets[*r] + t] = lp[i] as f64;
                flat[total + offsets[*r] + t] = stats[i][0] as f64;
            }
        }
        // Whole values: each rank of a sequence split filled the positions it holds.
        let flat = core.sequence_sum(flat)?;
        let cut = |from: usize| -> Vec<Vec<f64>> {
            samples
                .iter()
                .zip(&offsets)
                .map(|(s, &o)| flat[from + o..from + o + s.completion_ids.len()].to_vec())
                .collect()
        };
        let local = train.then_some((out.logps, owner));
        Ok((cut(0), cut(total), local))
    }

    /// The current weights' log-probabilities of every sample, per micro-batch (no gradient).
    fn score_all<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        samples: &[Sample],
    ) -> Result<Vec<Vec<f64>>> {
        let mut out = Vec::with_capacity(samples.len());
        for chunk in samples.chunks(self.batch) {
            out.extend(self.forward(core, chunk, false)?.0);
        }
        Ok(out)
    }

    /// top_entropy_quantile < 1: per sample, the tokens whose entropy is at or over the
    /// quantile of every rank's counted tokens (TRL's get_high_entropy_mask); of these
    /// samples' alone unless `collective`.
    fn entropy_masks<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        samples: &[Sample],
        entropies: &[Vec<f64>],
        collective: bool,
    ) -> Result<Option<Vec<Vec<bool>>>> {
        if self.top_entropy_quantile >= 1.0 {
            return Ok(None);
        }
        let mine: Vec<f64> = samples
            .iter()
            .zip(entropies)
            .flat_map(|(s, e)| {
                e.iter()
                    .zip(&s.mask)
                    .filter(|(_, &m)| m > 0.0)
                    .map(|(e, _)| *e)
            })
            .collect();
        let mut all = match collective {
            true => Self::gather(core, &mine)?,
            false => mine,
        };
        all.sort_by(f64::total_cmp);
        let threshold = match all.is_empty() {
            true => f64::INFINITY,
            false => quantile(&all, 1.0 - self.top_entropy_quantile),
        };
        Ok(Some(
            samples
                .iter()
                .zip(entropies)
                .map(|(s, e)| {
                    e.iter()
                        .zip(&s.mask)
                        .map(|(e, &m)| m > 0.0 && e * m >= threshold)
                        .collect::<Vec<bool>>()
                })
                .collect::<Vec<_>>(),
        ))
    }

    /// The loss figures of a step from every rank's per-micro-batch `sums` ([kl, tokens,
    /// entropy, low, high, region, count]) and this rank's per-sequence clip means: each a
    /// mean over micro-batches, as TRL appends one per micro-batch.
    fn step_metrics<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        sums: &[f64],
        seq_clips: &[[f64; 2]],
        metrics: &mut Metrics,
    ) -> Result<()> {
        let micro = |k: usize| -> f64 {
            let v: Vec<f64> = sums
                .chunks(7)
                .map(|c| c[k] / c[if k < 3 { 1 } else { 6 }].max(1.0))
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        if self.kl_in_loss() {
            metrics.push(("kl", micro(0)));
        }
        metrics.push(("entropy", micro(2)));
        let figures = self.loss.kind.figures();
        if figures != LossFigures::Clip {
            metrics.extend(figures.single().map(|(name, k)| (name, micro(3 + k))));
            return Ok(());
        }
        metrics.push(("clip_ratio/low_mean", micro(3)));
        metrics.push(("clip_ratio/high_mean", micro(4)));
        metrics.push(("clip_ratio/region_mean", micro(5)));
        // Per micro-batch, the min (max) over every rank's sequences, averaged.
        // Each rank's min (max) per micro-batch, then one Max over the ranks for both: the
        // min as the max of its negation.
        let mut extremes = Vec::with_capacity(2 * seq_clips.len() / self.batch.max(1));
        for chunk in seq_clips.chunks(self.batch) {
            let real = |k: usize| chunk.iter().map(move |c| c[k]).filter(|x| !x.is_nan());
            extremes.push(real(0).map(|x| -x).fold(f64::NEG_INFINITY, f64::max));
            extremes.push(real(1).fold(f64::NEG_INFINITY, f64::max));
        }
        let t = Tensor::new(extremes.as_slice(), &Device::Cpu)?;
        let extremes: Vec<f64> = core.dp.all_reduce(&t, ReduceOp::Max)?.to_vec1()?;
        let lows: Vec<f64> = extremes.iter().step_by(2).map(|x| -x).collect();
        let highs: Vec<f64> = extremes.iter().skip(1).step_by(2).copied().collect();
        let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        metrics.push(("clip_ratio/low_min", avg(&lows)));
        metrics.push(("clip_ratio/high_max", avg(&highs)));
        Ok(())
    }

    /// TRL's evaluation loop over the held-out prompts, each `num_generations_eval` times:
    /// each eval step's samples (from the rollout when one is given, else sampled as in
    /// training, each row by its own seed) and its figures, the step's loss and loss figures
    /// by `loss` (given the step's samples and the policy's pass over them). TRL's eval steps
    /// take `per_device_eval_batch_size` rows per data-parallel rank; each step's figures are
    /// averaged over the steps, the loss weighted by rows. Every rank computes every step (its
    /// rows in rank order), so the figures need no collective. None without held-out rows.
    pub(crate) fn evaluate_with<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        loss_of: impl Fn(&[Sample], EvalPass) -> Result<(f64, Metrics)>,
    ) -> Result<Option<(f64, Metrics)>> {
        if self.eval.is_empty() {
            return Ok(None);
        }
        let g = self.g_eval;
        let rows: Vec<&PromptRow> = self
            .eval
            .iter()
            .flat_map(|r| std::iter::repeat_n(r, g))
            .collect();
        let seed = self.seed ^ 0x0e7a_1000 ^ ((core.state.global_step as u64) << 24);
        let per = core.args.per_device_eval_batch_size.max(1);
        let mut sums: Vec<(&'static str, f64)> = Vec::new();
        let (mut loss, mut steps) = (0.0, 0);
        for (b, batch) in rows.chunks(per * self.dp).enumerate() {
            let (samples, mut figures, pass) =
                self.eval_samples(core, batch, (seed, b * per * self.dp))?;
            let (step_loss, loss_figures) = loss_of(&samples, pass)?;
            figures.extend(loss_figures);
            loss += step_loss * batch.len() as f64;
            steps += 1;
            for (k, v) in figures {
                match sums.iter_mut().find(|(n, _)| *n == k) {
                    Some(at) => at.1 += v,
                    None => sums.push((k, v)),
                }
            }
        }
        let figures = sums
            .into_iter()
            .map(|(k, v)| (k, v / steps as f64))
            .collect();
        Ok(Some((loss / rows.len() as f64, figures)))
    }

    /// One of TRL's eval steps over `batch` (every rank's rows, in rank order, starting at
    /// eval row `first`): its samples (each rank's part one rollout call, as each TRL process
    /// makes its own) with their advantages and reference log-probs, its reward figures, and
    /// the policy's pass over it.
    fn eval_samples<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        batch: &[&PromptRow],
        (seed, first): (u64, usize),
    ) -> Result<(Vec<Sample>, Metrics, EvalPass)> {
        let per = core.args.per_device_eval_batch_size.max(1);
        let prompts: Vec<Value> = batch.iter().map(|r| r.prompt.clone()).collect();
        let mut columns: Vec<Map<String, Value>> =
            batch.iter().map(|r| r.columns.clone()).collect();
        let (mut prompt_ids, mut completion_ids) = (Vec::new(), Vec::new());
        for (p, part) in batch.chunks(per).enumerate() {
            let at = (seed, (first + p * per) as u64, self.g_eval);
            let span = p * per..p * per + part.len();
            let (pi, ci) =
                self.completions(core, at, part, &prompts[span.clone()], &mut columns[span])?;
            prompt_ids.extend(pi);
            completion_ids.extend(ci);
        }
        let per_func: Vec<Vec<f64>> = self
            .rewards_of(core, batch, (&prompts, &columns), &completion_ids)?
            .into_iter()
            .map(|v| v.into_iter().map(|x| x.unwrap_or(f64::NAN)).collect())
            .collect();
        let lengths = self.lengths_of(core, &prompt_ids, &completion_ids);
        let samples: Vec<Sample> = (0..batch.len())
            .map(|j| {
                let on = !(self.mask_truncated && lengths[j][2] > 0.0);
                Sample {
                    prompt_ids: prompt_ids[j].clone(),
                    completion_ids: completion_ids[j].clone(),
                    mask: vec![f64::from(u8::from(on)); completion_ids[j].len()],
                    advantage: 0.0,
                    old: None,
                    reference: None,
                }
            })
            .collect();
        if self.distill {
            return Ok((samples, length_metrics(&lengths), (Vec::new(), Vec::new())));
        }
        let mut samples = samples;
        if let Some(reference) = &self.reference {
            let refs = reference.run(core, || self.score_all(core, &samples))?;
            for (s, r) in samples.iter_mut().zip(refs) {
                s.reference = Some(r);
            }
        }
        // The policy's pass over the step, in eval batches: the loss's, and RLOO's old
        // log-probabilities (the policy at generation is the current one here).
        let (mut logps, mut entropies) = (Vec::new(), Vec::new());
        for chunk in samples.chunks(per) {
            let (l, e, _) = self.forward(core, chunk, false)?;
            logps.extend(l);
            entropies.extend(e);
        }
        if self.rloo.is_some() {
            for (s, l) in samples.iter_mut().zip(&logps) {
                s.old = Some(l.clone());
            }
        }
        let kl = self.sequence_kl(core, &samples, (samples.len(), 0), false)?;
        let (advantages, mut figures) = self.advantages(
            self.g_eval,
            &per_func,
            &lengths,
            kl.as_ref().map(|k| &k.0[..]),
        );
        figures.extend(kl.map(|k| ("kl", k.1)));
        for (s, a) in samples.iter_mut().zip(advantages) {
            s.advantage = a;
        }
        Ok((samples, figures, (logps, entropies)))
    }

    /// An eval step's loss at ratio 1 over `samples` (the mean of the ranks' parts' losses,
    /// as TRL gathers them) and its loss figures, TRL's sums over the parts.
    fn eval_loss<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        samples: &[Sample],
        (logps, entropies): EvalPass,
    ) -> Result<(f64, Metrics)> {
        let per = core.args.per_device_eval_batch_size.max(1);
        let masks = self.entropy_masks(core, samples, &entropies, false)?;
        let tokens: f64 = samples.iter().flat_map(|s| &s.mask).sum();
        let scale = Scale {
            accumulation: 1,
            dapo_normalizer: tokens / self.dp as f64,
        };
        // [kl, tokens, entropy, low, high, region, count] over the parts.
        let mut sums = [0.0; 7];
        let (mut losses, mut seq_clips) = (Vec::new(), Vec::new());
        for (p, part) in samples.chunks(per).enumerate() {
            let at = |j: usize| p * per + j;
            let completions: Vec<Completion> = part
                .iter()
                .enumerate()
                .map(|(j, s)| Completion {
                    logps: logps[at(j)].clone(),
                    old: None,
                    reference: s.reference.clone(),
                    mask: s.mask.clone(),
                    entropy_mask: masks.as_ref().map(|m| m[at(j)].clone()),
                    advantage: s.advantage,
                })
                .collect();
            let out = self.compute(&completions, scale);
            let part_sums = loss_sums(&out, part, &entropies[p * per..]);
            for (s, v) in sums.iter_mut().zip(part_sums) {
                *s += v;
            }
            losses.push(out.loss);
            seq_clips.extend(out.seq_clipped);
        }
        let over = |k: usize, n: usize| sums[k] / sums[n].max(1.0);
        let mut figures = Vec::new();
        if self.kl_in_loss() {
            figures.push(("kl", over(0, 1)));
        }
        figures.push(("entropy", over(2, 1)));
        let mean = losses.iter().sum::<f64>() / losses.len() as f64;
        let kind = self.loss.kind.figures();
        if kind != LossFigures::Clip {
            figures.extend(kind.single().map(|(name, k)| (name, over(3 + k, 6))));
            return Ok((mean, figures));
        }
        figures.push(("clip_ratio/low_mean", over(3, 6)));
        figures.push(("clip_ratio/high_mean", over(4, 6)));
        figures.push(("clip_ratio/region_mean", over(5, 6)));
        let real = |k: usize| {
            seq_clips
                .iter()
                .map(move |c: &[f64; 2]| c[k])
                .filter(|x| !x.is_nan())
        };
        figures.push(("clip_ratio/low_min", real(0).fold(f64::INFINITY, f64::min)));
        figures.push((
            "clip_ratio/high_max",
            real(1).fold(f64::NEG_INFINITY, f64::max),
        ));
        Ok((mean, figures))
    }

    /// Every rank's values of `local` (of varying length), in rank order.
    fn gather<N: CausalModel>(core: &Core<'_, N>, local: &[f64]) -> Result<Vec<f64>> {
        let (rank, world) = (core.dp.rank(), core.dp.size());
        let mut counts = vec![0.0; world];
        counts[rank] = local.len() as f64;
        let counts = core.global_sum(&counts)?;
        let start: usize = counts[..rank].iter().map(|&c| c as usize).sum();
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        let mut all = vec![0.0; total];
        all[start..start + local.len()].copy_from_slice(local);
        core.global_sum(&all)
    }
}

/// GRPO in the trainers' registry ([`super::kinds`]).
pub const KIND: TrainerKind = TrainerKind {
    name: "grpo",
    about: "online RL from prompts and rewards (TRL's GRPOTrainer)",
    read: |args| read_as::<GRPOConfig>(args, workload),
    scaffold: Scaffold {
        config: "templates/sft/grpo.yaml",
        data: &[
            ("data/grpo_train.jsonl", "assets/tiny/data/grpo_train.jsonl"),
            ("data/grpo_eval.jsonl", "assets/tiny/data/grpo_eval.jsonl"),
        ],
        config_type: "GRPOConfig",
        cli_type: "GrpoCli",
        task_type: Some("Grpo"),
        model_wrapper: None,
        summary: "Online RL (TRL's GRPO)",
        example_flag: "--beta 0.04",
        data_note: ": addition prompts with their sums as solution",
        formats: "prompt (text or messages) and the columns rewards read",
        metric: "reward",
        items: SCAFFOLD_REWARD,
        setup: "    trl_runtime::train::grpo_rewards::register_reward(\"exact_sum\", exact_sum);\n",
    },
};

/// The scaffold's own reward, in Rust: what `reward_funcs: [exact_sum]` in its grpo.yaml names.
pub(crate) const SCAFFOLD_REWARD: &str = r#"/// A reward of your own, which grpo.yaml's `reward_funcs` names: 1 when the completion's last
/// number is the row's `solution` column, else 0; None (not scored) for a row without one.
/// It sees what TRL hands a reward function: prompts, completions (and their texts),
/// completion_ids and every dataset column by name.
fn exact_sum(input: &RewardInput<'_>) -> trl_runtime::Result<Vec<Option<f64>>> {
    let mut rewards = Vec::new();
    for (text, row) in input.texts.iter().zip(input.columns) {
        let want = row.get("solution").and_then(|v| v.as_str());
        let got = text.split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty());
        rewards.push(want.map(|w| f64::from(u8::from(got == Some(w)))));
    }
    Ok(rewards)
}"#;

/// A micro-batch's loss sums, [kl, tokens, entropy, low, high, region, count]: the loss's,
/// and the entropy summed over the counted tokens of `samples` (`entropies` per sample).
fn loss_sums(out: &LossOut, samples: &[Sample], entropies: &[Vec<f64>]) -> [f64; 7] {
    let entropy: f64 = samples
        .iter()
        .zip(entropies)
        .map(|(s, e)| e.iter().zip(&s.mask).map(|(e, m)| e * m).sum::<f64>())
        .sum();
    [
        out.kl,
        out.tokens,
        entropy,
        out.clipped[0],
        out.clipped[1],
        out.clipped[2],
        out.count,
    ]
}

/// Each row's completion after the prompt `width`: up to and with its first EOS (TRL's
/// completion mask).
fn cut_at_eos(rows: TokenRows, width: usize, eos: &[u32]) -> TokenRows {
    rows.into_iter()
        .map(|row| {
            let c = &row[width..];
            let end = c
                .iter()
                .position(|t| eos.contains(t))
                .map_or(c.len(), |i| i + 1);
            c[..end].to_vec()
        })
        .collect()
}

/// A round's completion length figures, as TRL names and computes them (num_tokens is the
/// trainer's own: every prompt and completion token generated).
fn length_metrics(lengths: &[[f64; 3]]) -> Metrics {
    let n = lengths.len();
    let mut m: Metrics = Vec::new();
    let lens: Vec<f64> = lengths.iter().map(|l| l[1]).collect();
    let minmax = |v: &[f64]| {
        (
            v.iter().sum::<f64>() / v.len() as f64,
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    let (mean, min, max) = minmax(&lens);
    m.push(("completions/mean_length", mean));
    m.push(("completions/min_length", min));
    m.push(("completions/max_length", max));
    let clipped = lengths.iter().filter(|l| l[2] > 0.0).count() as f64 / n as f64;
    m.push(("completions/clipped_ratio", clipped));
    let mut term: Vec<f64> = lengths
        .iter()
        .filter(|l| l[2] == 0.0)
        .map(|l| l[1])
        .collect();
    if term.is_empty() {
        term.push(0.0);
    }
    let (mean, min, max) = minmax(&term);
    m.push(("completions/mean_terminated_length", mean));
    m.push(("completions/min_terminated_length", min));
    m.push(("completions/max_terminated_length", max));
    m
}

/// A micro-batch's rows are completions; a reference (beta > 0) is a held copy of what the
/// rank trains; every rank holds each reward model whole.
pub fn workload(config: &GRPOConfig) -> Workload {
    let side_parameters = config
        .reward_funcs
        .0
        .iter()
        .filter_map(|e| {
            AutoModelForSequenceClassification::parameter_count(std::path::Path::new(e.trim()))
        })
        .sum();
    Workload {
        sequences_per_row: 1,
        weight_copies: usize::from(config.beta != 0.0),
        side_parameters,
        held_parameters: 0,
    }
}

impl<N: CausalModel> Task<N> for Grpo {
    type Config = GRPOConfig;

    fn load(config: &GRPOConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        // Checked here, not in validation: the planner reads a GRPO command line without one.
        if config.reward_funcs.0.is_empty() {
            return Err(Error::config("training arguments", "reward_funcs", "no reward function: name one (accuracy_reward, think_format_reward, get_soft_overlong_punishment) or give a reward program's command line (docs/grpo.md)"));
        }
        Grpo::load_rounds(config, tokenizer)
    }

    /// Completions are dealt in order (the prompts are shuffled by the task), every
    /// micro-batch full.
    fn training_arguments(config: &GRPOConfig) -> TrainingArguments {
        let mut args = config.training.clone();
        args.train_sampling_strategy = "sequential".into();
        args.dataloader_drop_last = true;
        if config.disable_dropout {
            args.lora_dropout = 0.0;
        }
        args
    }

    fn layout(&mut self, config: &GRPOConfig, dp_ranks: usize) -> Result<()> {
        let (spg, gbs) = config
            .generation_layout(dp_ranks)
            .map_err(|(k, m)| Error::config("training arguments", k, m))?;
        (self.spg, self.gbs, self.dp) = (spg, gbs, dp_ranks);
        // TRL's check: each eval step holds whole groups.
        let per_eval = config.training.per_device_eval_batch_size;
        if !self.eval.is_empty() && !(per_eval * dp_ranks).is_multiple_of(self.g_eval) {
            return Err(Error::config(
                "training arguments",
                "per_device_eval_batch_size",
                format!("the global eval batch ({per_eval} x {dp_ranks} data-parallel ranks) must be divisible by the completions per eval prompt ({}, num_generations_eval or num_generations), as TRL requires", self.g_eval),
            ));
        }
        if self.rounds_per_epoch() == 0 {
            return Err(Error::config(
                config.training.dataset_name.display().to_string(),
                "generation_batch_size",
                format!("{} prompts cannot fill one generation round of {} prompts ({gbs} completions / num_generations {}): add prompts or lower the batch", self.train.len(), gbs / self.g, self.g),
            ));
        }
        Ok(())
    }

    fn num_rows(&self) -> usize {
        self.rounds_per_epoch() * self.gbs * self.iterations
    }

    fn workload(config: &GRPOConfig) -> Workload {
        workload(config)
    }

    fn prepare(&mut self, config: &GRPOConfig, core: &Core<'_, N>) -> Result<()> {
        self.collate_options.pad_to_multiple_of =
            pad_to_multiple(core.model.split(), config.pad_to_multiple_of.0);
        if config.beta != 0.0 {
            self.reference = Some(match core.state.global_step > 0 {
                true => HeldReference::resume(self.mixing, core)?,
                false => HeldReference::of_policy(self.mixing, core)?,
            });
        }
        if core.ctx.is_main_process() {
            let how = match (&config.rollout_command, &config.rollout_func) {
                (Some(c), _) => format!("completions from the rollout program `{c}`"),
                (None, Some(f)) => format!("completions from the rollout function `{f}`"),
                (None, None) => "completions sampled in this process".into(),
            };
            let name = match (self.distill, self.rloo.is_some()) {
                (true, _) => "distillation",
                (_, true) => "RLOO",
                _ => "GRPO",
            };
            tracing::info!(
                "{name}: {} prompts, {} completions each; generation rounds of {} completions ({} per rank, trained on over {} micro-batches x {} iteration(s)); {how}",
                self.train.len(),
                self.g,
                self.gbs,
                self.batch * self.spg,
                self.spg,
                self.iterations
            );
            if self.rloo.is_none() && !self.distill {
                for warning in config.loss_warnings() {
                    tracing::warn!("{warning}");
                }
            }
        }
        Ok(())
    }

    fn step(
        &mut self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
        grads: &mut StepGrads,
    ) -> Result<TaskStep> {
        let mut loss = 0.0;
        let mut tokens = 0usize;
        // Per micro-batch: [kl, tokens, entropy, low, high, region, count].
        let mut sums: Vec<[f64; 7]> = Vec::new();
        let mut seq_clips: Vec<[f64; 2]> = Vec::new();
        let mut metrics = Vec::new();
        for (i, idx) in rows.iter().enumerate() {
            let part = self.slice_for(core, idx[0])?;
            metrics.extend(part.metrics);
            tokens += part.tokens;
            let (loss_tokens, mut samples) = (part.loss_tokens, part.samples);
            let (logps, entropies, local) =
                core.training_forward(i, || self.forward(core, &samples, true))?;
            metrics.extend(self.settle(core, &mut samples, &logps)?.unwrap_or_default());
            let (local, owner) = local.expect("a training forward");
            let entropy_masks = self.entropy_masks(core, &samples, &entropies, true)?;
            let completions: Vec<Completion> = samples
                .iter()
                .enumerate()
                .map(|(j, s)| Completion {
                    logps: logps[j].clone(),
                    old: s.old.clone(),
                    reference: s.reference.clone(),
                    mask: s.mask.clone(),
                    entropy_mask: entropy_masks.as_ref().map(|e| e[j].clone()),
                    advantage: s.advantage,
                })
                .collect();
            let ga = rows.len();
            let scale = Scale {
                accumulation: ga,
                dapo_normalizer: loss_tokens / self.dp as f64 * ga as f64 / self.spg as f64,
            };
            let out = self.compute(&completions, scale);
            loss += out.loss;
            // d(loss)/d(each local position's log-prob); gradients are summed over the
            // data-parallel ranks, TRL's mean over them.
            let g: Vec<f32> = owner
                .iter()
                .map(|o| o.map_or(0.0, |(r, t)| (out.grads[r][t] / self.dp as f64) as f32))
                .collect();
            let g = Tensor::from_vec(g, owner.len(), local.device())?;
            let surrogate = (&local * g)?.sum_all()?;
            let store = core.model.backward(&surrogate)?;
            core.accumulate(grads, store, rows.len())?;
            sums.push(loss_sums(&out, &samples, &entropies));
            seq_clips.extend(out.seq_clipped);
        }
        // One collective for the step's sums: the loss, then each micro-batch's.
        let mut local = vec![loss];
        local.extend(sums.iter().flatten());
        let g = core.global_sum(&local)?;
        let loss = g[0] / self.dp as f64;
        self.step_metrics(core, &g[1..], &seq_clips, &mut metrics)?;
        Ok(TaskStep {
            loss,
            tokens,
            metrics,
        })
    }

    /// TRL's evaluation ([`Grpo::evaluate_with`]): completions scored, and the loss at ratio
    /// 1 (the policy is its own old policy: the advantage term, and the KL when beta > 0);
    /// `eval_reward`, `eval_rewards/NAME/mean`, `eval_entropy`, ...
    fn evaluate(&self, _config: &GRPOConfig, core: &Core<'_, N>) -> Result<Option<EvalResult>> {
        let Some((loss, mut figures)) =
            self.evaluate_with(core, |samples, pass| self.eval_loss(core, samples, pass))?
        else {
            return Ok(None);
        };
        // The mean reward is the evaluation's accuracy figure, `eval_reward`.
        let at = figures.iter().position(|(k, _)| *k == "reward");
        let reward = at.map(|i| figures.remove(i).1);
        Ok(Some(EvalResult {
            loss,
            accuracy: reward,
            aux_loss: None,
            figures,
        }))
    }
    fn save_state(&self, core: &Core<'_, N>, step: usize) -> Result<()> {
        match &self.reference {
            Some(r) => r.save(core, step),
            None => Ok(()),
        }
    }

    fn after_step(&mut self, core: &Core<'_, N>) -> Result<()> {
        match self.reference.as_mut() {
            Some(r) if self.mixing.every != usize::MAX => r.after_step(core),
            _ => Ok(()),
        }
    }

    fn progress_note(&self, metrics: &[(&'static str, f64)]) -> String {
        super::core::figure_note(metrics, "reward", "reward", 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_layout_follows_trl() {
        let mut c = GRPOConfig::default();
        c.training.per_device_train_batch_size = 4;
        c.num_generations = 4;
        assert_eq!(c.generation_layout(2), Ok((1, 8)));
        c.steps_per_generation = Some(3);
        assert_eq!(c.generation_layout(2), Ok((3, 24)));
        c.steps_per_generation = None;
        c.generation_batch_size = Some(12);
        assert!(c.generation_layout(2).is_err());
        c.generation_batch_size = Some(16);
        assert_eq!(c.generation_layout(2), Ok((2, 16)));
        c.num_generations = 3;
        assert!(c.generation_layout(2).is_err());
    }

    /// A TRL GRPO recipe's vLLM and logging keys are named without effect; keys that would
    /// change what is trained are refused.
    #[test]
    fn trl_grpo_keys_are_applied_named_or_refused() {
        use crate::train::TrainerConfig;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("grpo.yaml");
        let recipe = "reward_funcs: [accuracy_reward]\nvllm_mode: colocate\nlog_completions: true\nentropy_coef: 0.0\n";
        std::fs::write(&file, recipe).unwrap();
        let (config, ignored) = GRPOConfig::read(&file).unwrap();
        assert_eq!(config.training.learning_rate, 1e-6);
        assert_eq!(ignored.len(), 3, "{ignored:?}");
        assert!(
            ignored
                .iter()
                .any(|l| l.starts_with("vllm_mode: completions are generated")),
            "{ignored:?}"
        );
        std::fs::write(
            &file,
            "reward_funcs: [accuracy_reward]\nentropy_coef: 0.01\n",
        )
        .unwrap();
        let err = GRPOConfig::read(&file).unwrap_err().to_string();
        assert!(err.contains("entropy_coef"), "{err}");
        std::fs::write(&file, "use_vllm: true\n").unwrap();
        let err = GRPOConfig::read(&file).unwrap_err().to_string();
        assert!(err.contains("use_vllm"), "{err}");
        // TRL 1.16's newer loss types, their keys at TRL's defaults and applied when given.
        let loss = GRPOConfig::default().loss().unwrap();
        assert_eq!(loss.sapo_temperature, [1.0, 1.05]);
        assert_eq!(loss.vespo, [2.0, 3.0, 3.0, 2.0]);
        let recipe = "loss_type: luspo\nsapo_temperature_neg: 2.0\nvespo_lambda_neg: 0.5\n";
        std::fs::write(&file, recipe).unwrap();
        let (config, ignored) = GRPOConfig::read(&file).unwrap();
        assert!(ignored.is_empty(), "{ignored:?}");
        let loss = config.loss().unwrap();
        assert_eq!(loss.kind, GrpoLossType::Luspo);
        assert_eq!((loss.sapo_temperature[1], loss.vespo[3]), (2.0, 0.5));
        assert_eq!(config.loss_warnings().len(), 1, "luspo at token level");
        std::fs::write(&file, "loss_type: gspo\n").unwrap();
        let err = GRPOConfig::read(&file).unwrap_err().to_string();
        assert!(err.contains("loss_type") && err.contains("vespo"), "{err}");
    }

    /// TRL's EOS ids: the generation config's (else config.json's), the tokenizer's first
    /// when missing from them.
    #[test]
    fn eos_ids_follow_trl() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), r#"{"eos_token_id": 9}"#).unwrap();
        assert_eq!(eos_ids(dir.path(), Some(2)).unwrap(), vec![2, 9]);
        assert_eq!(eos_ids(dir.path(), Some(9)).unwrap(), vec![9]);
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [5, 7]}"#,
        )
        .unwrap();
        assert_eq!(eos_ids(dir.path(), Some(7)).unwrap(), vec![5, 7]);
        assert_eq!(eos_ids(dir.path(), Some(2)).unwrap(), vec![2, 5, 7]);
    }

    #[test]
    fn nan_statistics_skip_missing_values() {
        let v = [1.0, f64::NAN, 3.0];
        assert_eq!(nanmean(&v), 2.0);
        assert!((nanstd(&v) - 2f64.sqrt()).abs() < 1e-12);
        assert_eq!(quantile(&[0.0, 1.0, 2.0, 3.0], 0.5), 1.5);
    }
}
