//! Reward modelling as a [`Task`]: TRL 1.16's RewardTrainer (`RewardConfig`'s keys and
//! defaults) over preference pairs, training a sequence classifier with one output
//! ([`RewardModel`]: the causal body and a `score` head) under whatever strategy the launch
//! sets up, saved as transformers' `...ForSequenceClassification`.
//!
//! A micro-batch holds its pairs' chosen sequences then their rejected ones (TRL's
//! collator's order), packed in one row with positions restarting per sequence (attention
//! stays within each: the values of TRL's right-padded batch, without computing the padding);
//! each sequence's reward is the score at its last token that is not the pad (transformers'
//! rule). The loss is the Bradley-Terry
//! -log sigmoid(r_chosen - r_rejected - margin) averaged over the pairs, plus
//! `center_rewards_coefficient` x mean((r_chosen + r_rejected)^2). The score runs at every
//! position of this rank's part of the rows and each row's read position is picked by a
//! weight, so sequences split over sp / cp ranks sum their rewards over the group and the
//! backward weighs each position by its row's gradient.

use super::args::TrainingArguments;
use super::core::{Core, EvalResult, StepGrads, Task, TaskStep};
use super::eval_rounds::EvalSlots;
use super::kinds::{read_as, Scaffold, TrainerKind};
use crate::config::cli_value::PadMultiple;
use crate::context_parallel::split::{kept_columns, pad_to_multiple};
use crate::data::dataset::columns;
use crate::data::preference::{parse_preference, tokenize_preference, PreferenceRecord};
use crate::data::TextTokenizer;
use crate::data::{collate, Batch, BatchDeal, CollateOptions, Example, PackedSequence};
use crate::error::{Error, Result};
use crate::models::sequence_classification::{classifier_start, read_position, SequenceClassifier};
use crate::models::CausalModel;
use crate::nn::IGNORE_INDEX;
use crate::parallel::estimate::Workload;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

pub use crate::models::sequence_classification::RewardModel;

crate::training_arguments! {
    /// The reward trainer's training arguments, with TRL 1.16's names and defaults
    /// (`RewardConfig`).
    struct RewardConfig, flags RewardArgs, base training;
    /// Pushes the rewards towards mean zero: this times mean((r_chosen + r_rejected)^2) is
    /// added to the loss (TRL recommends 0.01).
    center_rewards_coefficient: Option<f64> = None;
    /// A token count, none, or auto (no padding off AWS Neuron).
    pad_to_multiple_of: PadMultiple = Default::default();
    /// No dropout in the model (LoRA's dropout off).
    disable_dropout: bool = true;
    /// The end-of-sequence token appended to standard completions (default the tokenizer's).
    eos_token: Option<String> = None;
    /// A chat template: a tokenizer directory or a Jinja file.
    chat_template_path: Option<std::path::PathBuf> = None;
}

crate::trainer_config!(RewardConfig, flags RewardArgs, base training,
    about "Reward modelling (TRL's RewardTrainer) on Candle",
    accuracy "eval_accuracy",
    metrics ["eval_margin", "eval_mean_reward", "eval_min_reward", "eval_max_reward"],
    validate validate_reward,
    base_defaults reward_defaults);

/// `trl reward`-style command line.
pub type RewardCli = super::args::Cli<RewardConfig>;

/// RewardConfig's learning rate (1e-4), where transformers' differs; LoRA adapters for a
/// sequence classifier (TRL's reward script asks `--lora_task_type SEQ_CLS`: peft then trains
/// the score head whole) unless told otherwise.
fn reward_defaults(training: &mut TrainingArguments, given: &dyn Fn(&str) -> bool) {
    if !given("learning_rate") {
        training.learning_rate = 1e-4;
    }
    if !given("lora_task_type") {
        training.lora_task_type = "SEQ_CLS".into();
    }
}

fn validate_reward(config: &RewardConfig, source: &str) -> Result<()> {
    let t = &config.training;
    if t.router_aux_loss_coef.is_some_and(|c| c != 0.0) {
        return Err(Error::config(source, "router_aux_loss_coef", "the reward loss has no router term (transformers' sequence classifiers return none, and TRL adds none): drop the key"));
    }
    Ok(())
}

/// A tokenized pair: the whole chosen and rejected sequences (prompt included), and its
/// margin when the data gives one.
#[derive(Debug, Clone)]
struct RewardPair {
    chosen: Vec<u32>,
    rejected: Vec<u32>,
    margin: Option<f64>,
}

/// A row as read: text or messages to tokenize, or TRL's processed `chosen_ids` /
/// `rejected_ids`; and its `margin`.
enum RewardRecord {
    Text(PreferenceRecord),
    Ids(Vec<u32>, Vec<u32>),
}

fn parse_reward(v: &Value) -> std::result::Result<(RewardRecord, Option<f64>), String> {
    let obj = columns(v)?;
    let margin = match obj.get("margin") {
        None | Some(Value::Null) => None,
        Some(m) => Some(
            m.as_f64()
                .ok_or_else(|| format!("margin {m} is not a number"))?,
        ),
    };
    let ids = |key: &str| -> Option<std::result::Result<Vec<u32>, String>> {
        let a = obj.get(key)?.as_array()?;
        Some(
            a.iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or(format!("{key} holds {t}, not a token id"))
                })
                .collect(),
        )
    };
    // TRL's processed columns, and their legacy names (which TRL renames).
    let record = match (ids("chosen_ids"), ids("rejected_ids")) {
        (Some(c), Some(r)) => RewardRecord::Ids(c?, r?),
        _ => match (ids("chosen_input_ids"), ids("rejected_input_ids")) {
            (Some(c), Some(r)) => RewardRecord::Ids(c?, r?),
            _ => RewardRecord::Text(parse_preference(v)?),
        },
    };
    Ok((record, margin))
}

/// Rows tokenized as TRL's RewardTrainer (prompt + completion as one text or conversation,
/// EOS added to standard completions); pairs with a sequence over `max_length` dropped.
fn tokenize_pairs(
    rows: Vec<(RewardRecord, Option<f64>)>,
    tok: &TextTokenizer,
    max_length: usize,
    which: &str,
) -> Result<Vec<RewardPair>> {
    let with_margin = rows.iter().filter(|(_, m)| m.is_some()).count();
    if with_margin != 0 && with_margin != rows.len() {
        return Err(Error::config(
            format!("the {which} data"),
            "margin",
            format!(
                "{with_margin} of {} rows have a margin: give every row one, or none",
                rows.len()
            ),
        ));
    }
    let mut pairs = Vec::with_capacity(rows.len());
    let mut dropped = 0;
    for (record, margin) in rows {
        let (chosen, rejected) = match record {
            RewardRecord::Ids(c, r) => (c, r),
            RewardRecord::Text(r) => {
                let p = tokenize_preference(&r, tok)?;
                let whole = |c: &[u32]| [p.prompt_ids.as_slice(), c].concat();
                (whole(&p.chosen_ids), whole(&p.rejected_ids))
            }
        };
        if chosen.is_empty() || rejected.is_empty() {
            return Err(Error::config(
                format!("the {which} data"),
                "chosen_ids",
                format!(
                    "pair {} has an empty sequence: a reward is read at a sequence's last token",
                    pairs.len() + dropped + 1
                ),
            ));
        }
        if chosen.len() > max_length || rejected.len() > max_length {
            dropped += 1;
            continue;
        }
        pairs.push(RewardPair {
            chosen,
            rejected,
            margin,
        });
    }
    if dropped > 0 {
        tracing::warn!("{which} data: dropped {dropped} pair(s) with a sequence over max_length = {max_length} (TRL filters them too)");
    }
    Ok(pairs)
}

/// A micro-batch: its chosen sequences then its rejected ones, packed in one row.
struct Micro {
    /// This rank's part of the rows, on its device.
    batch: Batch,
    /// Per local position: its sequence, u32.
    row: Tensor,
    /// Per local position: 1 where its sequence's reward is read, else 0.
    read: Tensor,
    margins: Vec<f64>,
    /// Input tokens of the rows, whole (padding excluded).
    tokens: usize,
}

/// Reward model training.
pub struct Reward {
    train: Vec<RewardPair>,
    eval: Vec<RewardPair>,
    collate_options: CollateOptions,
    center: Option<f64>,
}

/// What a micro-batch's forward gave: each sequence's reward, whole, and this rank's part
/// of them with its graph.
struct Rewards {
    local: Tensor,
    values: Vec<f64>,
}

/// The pair loss and its derivative by each chosen and rejected reward.
struct PairLoss {
    loss: f64,
    d_chosen: Vec<f64>,
    d_rejected: Vec<f64>,
}

/// -log sigmoid(z), computed without overflow.
fn softplus_neg(z: f64) -> f64 {
    (-z).max(0.0) + (-z.abs()).exp().ln_1p()
}

/// TRL's loss of `n` pairs (`rewards`: chosen then rejected).
fn pair_loss(rewards: &[f64], margins: &[f64], center: Option<f64>) -> PairLoss {
    let n = margins.len();
    let (c, r) = rewards.split_at(n);
    let mut out = PairLoss {
        loss: 0.0,
        d_chosen: vec![0.0; n],
        d_rejected: vec![0.0; n],
    };
    for j in 0..n {
        let z = c[j] - r[j] - margins[j];
        out.loss += softplus_neg(z) / n as f64;
        // d/dz of -log sigmoid(z) = -(1 - sigmoid(z)) = -sigmoid(-z).
        let d = -1.0 / (1.0 + z.exp()) / n as f64;
        out.d_chosen[j] = d;
        out.d_rejected[j] = -d;
        if let Some(k) = center {
            let s = c[j] + r[j];
            out.loss += k * s * s / n as f64;
            out.d_chosen[j] += 2.0 * k * s / n as f64;
            out.d_rejected[j] += 2.0 * k * s / n as f64;
        }
    }
    out
}

/// Per micro-batch, what TRL's figures need: [loss (its mean over the pairs), pairs, chosen
/// above rejected, margin sum, reward sum] summed over the ranks, and [max, -min] of the
/// rewards taken over them.
const SUMS: usize = 5;

impl Reward {
    /// The micro-batch of `pairs`, this rank's part of it.
    fn micro<N: CausalModel>(&self, core: &Core<'_, N>, pairs: &[&RewardPair]) -> Result<Micro> {
        let seqs: Vec<PackedSequence> = pairs
            .iter()
            .map(|p| &p.chosen)
            .chain(pairs.iter().map(|p| &p.rejected))
            .map(|ids| {
                PackedSequence::single(&Example {
                    input_ids: ids.clone(),
                    labels: vec![IGNORE_INDEX; ids.len()],
                })
            })
            .collect();
        let rows: Vec<&PackedSequence> = seqs.iter().collect();
        // One row, positions restarting per sequence: no padding computed.
        let batch = collate(&rows, self.collate_options, &Device::Cpu)?;
        let len = batch.input_ids.dim(1)?;
        // Each sequence's read position (transformers' rule on its padded row), at its offset.
        let pad = self.collate_options.pad_token_id;
        let mut owner = vec![0u32; len];
        let mut read_at = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for (k, s) in seqs.iter().enumerate() {
            owner[at..at + s.len()].fill(k as u32);
            read_at.push(at + read_position(&s.input_ids, pad));
            at += s.len();
        }
        let mut is_read = vec![false; len];
        read_at.iter().for_each(|&c| is_read[c] = true);
        let split = core.model.split();
        let kept = kept_columns(split, len)?.unwrap_or_else(|| (0..len).collect());
        let row: Vec<u32> = kept.iter().map(|&c| owner[c]).collect();
        let read: Vec<f32> = kept
            .iter()
            .map(|&c| f32::from(u8::from(is_read[c])))
            .collect();
        let device = core.ctx.device();
        let n = row.len();
        Ok(Micro {
            row: Tensor::from_vec(row, n, device)?,
            read: Tensor::from_vec(read, n, device)?,
            margins: pairs.iter().map(|p| p.margin.unwrap_or(0.0)).collect(),
            tokens: seqs.iter().map(|s| s.len()).sum(),
            batch: batch.part(split)?.to_device(device)?,
        })
    }

    /// The model's rewards of a micro-batch's sequences (whole on every rank of a split).
    fn forward<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        micro: &Micro,
        train: bool,
    ) -> Result<Rewards> {
        let b = &micro.batch;
        let scores = core.model.forward(&b.input_ids, &b.position_ids)?;
        let scores = match train {
            true => scores,
            false => scores.detach(),
        };
        let flat = scores.to_dtype(DType::F32)?.flatten_all()?;
        let rows = 2 * micro.margins.len();
        let zeros = Tensor::zeros(rows, DType::F32, flat.device())?;
        let local = zeros.index_add(&micro.row, &(flat * &micro.read)?, 0)?;
        let values: Vec<f64> = local.detach().to_dtype(DType::F64)?.to_vec1()?;
        // A sequence split over ranks: its reward is on the rank holding its read position.
        let values = core.sequence_sum(values)?;
        Ok(Rewards { local, values })
    }

    /// A micro-batch's figures: its [`SUMS`] and its [max, -min].
    fn figures(rewards: &[f64], margins: &[f64], loss: f64) -> ([f64; SUMS], [f64; 2]) {
        let n = margins.len();
        let (c, r) = rewards.split_at(n);
        let above = (0..n).filter(|&j| c[j] > r[j]).count() as f64;
        let margin: f64 = (0..n).map(|j| c[j] - r[j]).sum();
        let max = rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let min = rewards.iter().copied().fold(f64::INFINITY, f64::min);
        (
            [loss, n as f64, above, margin, rewards.iter().sum()],
            [max, -min],
        )
    }

    /// TRL's figures averaged over micro-batches, from each one's summed [`SUMS`] and
    /// reduced [max, -min]: accuracy and margin per pair, the mean reward per sequence.
    fn trl_figures(sums: &[f64], extremes: &[f64]) -> Vec<(&'static str, f64)> {
        let m = (sums.len() / SUMS).max(1) as f64;
        let mean = |f: &dyn Fn(&[f64]) -> f64| sums.chunks(SUMS).map(f).sum::<f64>() / m;
        let ext = |k: usize, sign: f64| extremes.chunks(2).map(|e| sign * e[k]).sum::<f64>() / m;
        vec![
            ("min_reward", ext(1, -1.0)),
            ("mean_reward", mean(&|s| s[4] / (2.0 * s[1]).max(1.0))),
            ("max_reward", ext(0, 1.0)),
            ("accuracy", mean(&|s| s[2] / s[1].max(1.0))),
            ("margin", mean(&|s| s[3] / s[1].max(1.0))),
        ]
    }
}

pub const KIND: TrainerKind = TrainerKind {
    name: "reward",
    about: "a reward model on preference pairs (TRL's RewardTrainer)",
    read: |args| read_as::<RewardConfig>(args, workload),
    scaffold: Scaffold {
        config: "templates/sft/reward.yaml",
        data: &[
            ("data/pref_train.jsonl", "assets/tiny/data/pref_train.jsonl"),
            ("data/pref_eval.jsonl", "assets/tiny/data/pref_eval.jsonl"),
        ],
        config_type: "RewardConfig",
        cli_type: "RewardCli",
        task_type: Some("Reward"),
        model_wrapper: Some("trl_runtime::models::sequence_classification::SequenceClassifier"),
        summary: "Reward modelling (TRL's RewardTrainer)",
        example_flag: "--center_rewards_coefficient 0.01",
        data_note: ": preference pairs (the right sum chosen)",
        formats: "prompt/chosen/rejected (standard or conversational, an optional margin), or chosen_ids/rejected_ids",
        metric: "pair accuracy",
        items: "",
        setup: "",
    },
};

/// Two sequences a row; the model's head is one row wide.
pub fn workload(_config: &RewardConfig) -> Workload {
    Workload {
        sequences_per_row: 2,
        ..Workload::default()
    }
}

impl<N: CausalModel> Task<SequenceClassifier<N>> for Reward {
    type Config = RewardConfig;

    /// With `disable_dropout` (TRL's default), LoRA's dropout is off.
    fn training_arguments(config: &RewardConfig) -> TrainingArguments {
        let mut args = config.training.clone();
        if config.disable_dropout {
            args.lora_dropout = 0.0;
        }
        args
    }

    /// TRL's order: eos_token, then chat_template_path.
    fn tokenizer(config: &RewardConfig, tokenizer: TextTokenizer) -> Result<TextTokenizer> {
        super::sft::tokenizer_keys(tokenizer, &config.eos_token, &config.chat_template_path)
    }

    /// The classifier the run starts from: `model_name_or_path` read as TRL reads it
    /// (`AutoModelForSequenceClassification`, one label, the tokenizer's pad token), made
    /// under output_dir from a causal LM ([`classifier_start`]).
    fn starting_model(
        _config: &RewardConfig,
        args: &mut TrainingArguments,
        tokenizer: &TextTokenizer,
    ) -> Result<()> {
        let out = &args.output_dir;
        std::fs::create_dir_all(out)
            .map_err(|e| Error::io(format!("cannot create {}", out.display()), e))?;
        let start = classifier_start(
            &args.model_name_or_path,
            out,
            args.seed,
            tokenizer.pad_token_id,
        )?;
        if start != args.model_name_or_path {
            tracing::info!(
                "reward model: starting from {} (the classifier of {}, its score head initialised from seed {})",
                start.display(),
                args.model_name_or_path.display(),
                args.seed
            );
        }
        args.model_name_or_path = start;
        Ok(())
    }

    fn load(config: &RewardConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let args = &config.training;
        let (train, eval) = args.load_data(&parse_reward)?;
        let train = tokenize_pairs(train, tokenizer, args.max_length, "training")?;
        let eval = match eval {
            Some(rows) => tokenize_pairs(rows, tokenizer, args.max_length, "evaluation")?,
            None => Vec::new(),
        };
        if train.is_empty() {
            return Err(Error::config(
                args.dataset_name.display().to_string(),
                "dataset_name",
                "no pair to train on (each needs both sequences within max_length)",
            ));
        }
        Ok(Reward {
            train,
            eval,
            collate_options: CollateOptions {
                pad_token_id: tokenizer.pad_token_id,
                padding_free: true,
                pad_to_multiple_of: config.pad_to_multiple_of.0,
            },
            center: config.center_rewards_coefficient,
        })
    }

    fn num_rows(&self) -> usize {
        self.train.len()
    }

    fn workload(config: &RewardConfig) -> Workload {
        workload(config)
    }

    fn prepare(
        &mut self,
        config: &RewardConfig,
        core: &Core<'_, SequenceClassifier<N>>,
    ) -> Result<()> {
        // Sequences split over sp (cp) need lengths that divide into sp (2 x cp) chunks.
        self.collate_options.pad_to_multiple_of =
            pad_to_multiple(core.model.split(), config.pad_to_multiple_of.0);
        if core.ctx.is_main_process() {
            tracing::info!(
                "Reward: {} training pairs, {} held out",
                self.train.len(),
                self.eval.len()
            );
        }
        Ok(())
    }

    fn step(
        &mut self,
        core: &Core<'_, SequenceClassifier<N>>,
        rows: &[Vec<usize>],
        grads: &mut StepGrads,
    ) -> Result<TaskStep> {
        // d(step loss)/d(micro-batch loss): the mean over micro-batches, and over the ranks.
        let scale = 1.0 / (rows.len() * core.dp.size()) as f64;
        let mut sums = vec![0.0];
        let mut extremes = Vec::with_capacity(2 * rows.len());
        for (i, idx) in rows.iter().enumerate() {
            let pairs: Vec<&RewardPair> = idx.iter().map(|&k| &self.train[k]).collect();
            let micro = self.micro(core, &pairs)?;
            let rewards = core.training_forward(i, || self.forward(core, &micro, true))?;
            let out = pair_loss(&rewards.values, &micro.margins, self.center);
            let g: Vec<f32> = out
                .d_chosen
                .iter()
                .chain(&out.d_rejected)
                .map(|&d| (d * scale) as f32)
                .collect();
            let g = Tensor::new(g.as_slice(), rewards.local.device())?;
            let store = core.model.backward(&(&rewards.local * g)?.sum_all()?)?;
            core.accumulate(grads, store, rows.len())?;
            sums[0] += micro.tokens as f64;
            let (s, e) = Self::figures(&rewards.values, &micro.margins, out.loss);
            sums.extend(s);
            extremes.extend(e);
        }
        let g = core.global_sum(&sums)?;
        let extremes = core.global_max(&extremes)?;
        // transformers' logged loss: the mean of the micro-batches' (each a mean over its
        // pairs), over the ranks too, as the gradient weighs them.
        let loss =
            g[1..].chunks(SUMS).map(|s| s[0]).sum::<f64>() / (rows.len() * core.dp.size()) as f64;
        // num_tokens is the trainer's own (the input tokens, padding not counted).
        Ok(TaskStep {
            loss,
            tokens: g[0] as usize,
            metrics: Self::trl_figures(&g[1..], &extremes),
        })
    }

    /// The held-out pairs in batches of per_device_eval_batch_size per rank (the last round
    /// filled from the start, as accelerate deals them): the loss a mean over the real pairs,
    /// the figures averaged over the batches as TRL's.
    fn evaluate(
        &self,
        _config: &RewardConfig,
        core: &Core<'_, SequenceClassifier<N>>,
    ) -> Result<Option<EvalResult>> {
        if self.eval.is_empty() {
            return Ok(None);
        }
        let deal = BatchDeal {
            len: self.eval.len(),
            batch: core.args.per_device_eval_batch_size.max(1),
            world: core.dp.size(),
            drop_last: false,
        };
        let rank = core.dp.rank();
        // Per round and rank: its loss, accuracy and margin (means over its pairs), its reward
        // sum and count, its largest reward and its smallest negated.
        let mut slots = EvalSlots::new(deal, 7);
        for round in 0..deal.rounds() {
            let idx = deal.rows(round, rank);
            let pairs: Vec<&RewardPair> = idx.iter().map(|&k| &self.eval[k]).collect();
            let micro = self.micro(core, &pairs)?;
            let rewards = self.forward(core, &micro, false)?;
            let loss = pair_loss(&rewards.values, &micro.margins, self.center).loss;
            let ([_, n, above, margin, sum], [max, neg_min]) =
                Self::figures(&rewards.values, &micro.margins, loss);
            let n = n.max(1.0);
            slots.set(
                round,
                rank,
                &[loss, above / n, margin / n, sum, 2.0 * n, max, neg_min],
            );
        }
        let slots = slots.summed(|v| core.global_sum(v))?;
        // As TRL gathers them: accuracy and margin per rank with gather_for_metrics (the
        // refill of a short last round cut), the rewards whole with gather.
        let figures = vec![
            ("min_reward", -slots.gathered_max(6)),
            ("mean_reward", slots.gathered_ratio(3, 4)),
            ("max_reward", slots.gathered_max(5)),
            ("margin", slots.kept_mean(2)),
            // TRL logs the training tokens so far with the evaluation too.
            ("num_tokens", core.state.num_input_tokens_seen as f64),
        ];
        Ok(Some(EvalResult {
            loss: slots.loss(|s| s[0]),
            accuracy: Some(slots.kept_mean(1)),
            aux_loss: None,
            figures,
        }))
    }

    fn progress_note(&self, metrics: &[(&'static str, f64)]) -> String {
        super::core::figure_note(metrics, "accuracy", "acc", 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pair loss's derivatives are its slopes (central differences), with and without
    /// centering and margins.
    #[test]
    fn the_pair_loss_derivative_is_its_slope() {
        let rewards = [0.3, -1.2, 0.7, 0.1];
        for (margins, center) in [([0.0, 0.0], None), ([0.5, -0.2], Some(0.01))] {
            let out = pair_loss(&rewards, &margins, center);
            for k in 0..4 {
                let h = 1e-6;
                let at = |d: f64| {
                    let mut r = rewards;
                    r[k] += d;
                    pair_loss(&r, &margins, center).loss
                };
                let fd = (at(h) - at(-h)) / (2.0 * h);
                let d = [out.d_chosen.clone(), out.d_rejected.clone()].concat()[k];
                assert!((fd - d).abs() < 1e-8, "{k}: {fd} vs {d}");
            }
        }
        // -log sigmoid stays finite far out.
        assert!((softplus_neg(-800.0) - 800.0).abs() < 1e-9);
        assert!(softplus_neg(800.0) < 1e-300);
    }
}
