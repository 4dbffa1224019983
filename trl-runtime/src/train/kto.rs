//! KTO as a [`Task`]: TRL 1.16's KTOTrainer (`KTOConfig`'s keys and defaults) on unpaired
//! rows, each a prompt, a completion and a label (desirable or not); preference pairs are
//! unpaired as TRL's `unpair_preference_dataset` does.
//!
//! A row's implied reward is beta x (policy - reference log-probability of its completion).
//! The loss (`kto`) is 1 - sigmoid(beta (log-ratio - KL)) for a desirable row and
//! 1 - sigmoid(beta (KL - log-ratio)) for an undesirable one, weighted by
//! `desirable_weight` / `undesirable_weight`, averaged over the micro-batch. The KL is
//! estimated from mismatched pairs: each row's prompt with the completion of the row before it
//! in its batch of `per_device_train_batch_size` (rotated once, in data order, before any
//! sampling: TRL's default sampler is sequential for this reason), the policy's against the
//! reference's log-probability, averaged over the micro-batch and over the data-parallel
//! ranks, at least 0, with no gradient. `apo_zero_unpaired` needs no KL.
//!
//! The reference is the policy before its first step: its log-probabilities of every row and
//! every mismatched pair are computed once before training (TRL's `precompute_ref_log_probs`;
//! the same values TRL otherwise computes on the fly) and kept beside the run for a resume.
//! With `sync_ref_model` (TR-DPO's mixing, as DPO has it) the reference's own weights are held
//! and mixed with the policy every `ref_model_sync_steps` steps; after a mix its
//! log-probabilities come from its forward, the weights swapped in.

use super::args::TrainingArguments;
use super::core::{Core, EvalResult, StepGrads, Task, TaskStep};
use super::kinds::{read_as, Scaffold, TrainerKind};
use super::reference::{
    mix_synced, precompute_ref_logps, resume_ref_logps, save_ref_logps, save_synced, sync_refusal,
    HeldReference, Mixing, RefLogps,
};
use super::router::RouterLosses;
use crate::config::cli_value::PadMultiple;
use crate::context_parallel::split::{kept_columns, pad_to_multiple};
use crate::data::dataset::{columns, content, tools, Content};
use crate::data::preference::{parse_preference, tokenize_preference, PreferenceRecord};
use crate::data::TextTokenizer;
use crate::data::{collate, Batch, BatchDeal, CollateOptions, Example, PackedSequence};
use crate::error::{Error, Result};
use crate::models::CausalModel;
use crate::nn::IGNORE_INDEX;
use crate::parallel::estimate::Workload;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

crate::training_arguments! {
    /// KTO's training arguments, with TRL 1.16's names and defaults (`KTOConfig`).
    struct KTOConfig, flags KTOArgs, base training;
    /// The implied reward's scale.
    beta: f64 = 0.1;
    /// kto, or apo_zero_unpaired (no KL estimate).
    loss_type: String = "kto".into();
    /// The weight of a desirable row's loss.
    desirable_weight: f64 = 1.0;
    /// The weight of an undesirable row's loss.
    undesirable_weight: f64 = 1.0;
    /// The reference's log-probabilities computed before training (here always: the
    /// reference is the policy before its first step).
    precompute_ref_log_probs: bool = false;
    /// Rows per batch of that pass (default per_device_train_batch_size).
    precompute_ref_batch_size: Option<usize> = None;
    /// A token count, none, or auto (no padding off AWS Neuron).
    pad_to_multiple_of: PadMultiple = Default::default();
    /// TR-DPO's reference mixing: the policy mixed into the reference every
    /// ref_model_sync_steps steps.
    sync_ref_model: bool = false;
    ref_model_mixup_alpha: f64 = 0.6;
    ref_model_sync_steps: usize = 512;
    /// No dropout in the policy (LoRA's dropout off).
    disable_dropout: bool = true;
}

crate::trainer_config!(KTOConfig, flags KTOArgs, base training,
    about "Kahneman-Tversky optimization (TRL's KTO) on Candle",
    accuracy "eval_rewards/margins",
    metrics ["eval_kl", "eval_rewards/chosen", "eval_rewards/rejected"],
    validate validate_kto,
    base_defaults kto_defaults);

/// `trl kto`-style command line.
pub type KtoCli = super::args::Cli<KTOConfig>;

/// TRL's KTOConfig defaults for shared keys that differ from transformers': its learning
/// rate, and a sequential sampler (each row's mismatched completion is its neighbour's).
fn kto_defaults(training: &mut TrainingArguments, given: &dyn Fn(&str) -> bool) {
    super::grpo::trl_defaults(training, given);
    if !given("train_sampling_strategy") {
        training.train_sampling_strategy = "sequential".into();
    }
}

impl KTOConfig {
    /// Whether the loss estimates the KL from mismatched pairs.
    pub fn calculate_kl(&self) -> bool {
        self.loss_type == "kto"
    }
}

/// KTOConfig's checks, as KTOTrainer's.
fn validate_kto(config: &KTOConfig, source: &str) -> Result<()> {
    let fail = |key: &str, message: String| Err(Error::config(source, key, message));
    if !["kto", "apo_zero_unpaired"].contains(&config.loss_type.as_str()) {
        return fail(
            "loss_type",
            format!("'{}': use kto or apo_zero_unpaired", config.loss_type),
        );
    }
    let t = &config.training;
    if config.calculate_kl() && t.train_sampling_strategy != "sequential" {
        return fail("train_sampling_strategy", format!("'{}': the kto loss estimates the KL from each row's neighbour in data order and needs sequential (TRL refuses it too)", t.train_sampling_strategy));
    }
    if config.calculate_kl() && t.per_device_train_batch_size <= 1 {
        return fail("per_device_train_batch_size", format!("{}: the kto loss needs at least 2 rows per batch, else its KL estimate is the implied reward itself (TRL refuses it too)", t.per_device_train_batch_size));
    }
    if config.desirable_weight <= 0.0 || config.undesirable_weight <= 0.0 {
        let key = match config.desirable_weight <= 0.0 {
            true => "desirable_weight",
            false => "undesirable_weight",
        };
        return fail(key, "must be positive".into());
    }
    if config.sync_ref_model {
        let refusal = sync_refusal(t.use_peft, config.precompute_ref_log_probs, mixing(config));
        if let Some((key, why)) = refusal {
            return fail(key, why);
        }
    }
    Ok(())
}

/// A tokenized KTO row: its prompt, completion and mismatched completion, and its label.
#[derive(Debug, Clone)]
struct KtoRow {
    prompt_ids: Vec<u32>,
    completion_ids: Vec<u32>,
    kl_ids: Vec<u32>,
    desirable: bool,
}

/// A row as read: unpaired (a completion and its label), or a preference pair to unpair.
enum KtoRecord {
    Unpaired(PreferenceRecord, bool),
    Paired(PreferenceRecord),
}

/// `prompt` with one completion, as the preference tokenizer reads it.
fn single(prompt: &PreferenceRecord, completion: &Content) -> PreferenceRecord {
    PreferenceRecord {
        prompt: prompt.prompt.clone(),
        chosen: completion.clone(),
        rejected: completion.clone(),
        tools: prompt.tools.clone(),
    }
}

/// Reads one row: `{"prompt", "completion", "label"}` (strings or message lists), or a
/// preference row (prompt, chosen, rejected).
fn parse_kto(v: &Value) -> std::result::Result<KtoRecord, String> {
    let obj = columns(v)?;
    if obj.contains_key("chosen") || obj.contains_key("rejected") {
        return parse_preference(v).map(KtoRecord::Paired);
    }
    let field = |key: &str| {
        obj.get(key).ok_or_else(|| {
            let keys: Vec<&String> = obj.keys().collect();
            format!("no `{key}` (keys {keys:?}): KTO rows need prompt, completion and label, or a preference pair (chosen, rejected)")
        })
    };
    let prompt = content(field("prompt")?, "prompt")?;
    let completion = content(field("completion")?, "completion")?;
    let desirable = match field("label")? {
        Value::Bool(b) => *b,
        Value::Number(n) if n.as_f64() == Some(1.0) => true,
        Value::Number(n) if n.as_f64() == Some(0.0) => false,
        other => return Err(format!("label {other}: true (desirable) or false")),
    };
    if matches!(prompt, Content::Messages(_)) != matches!(completion, Content::Messages(_)) {
        return Err("prompt and completion must both be strings or both be message lists".into());
    }
    let record = PreferenceRecord {
        prompt,
        chosen: completion.clone(),
        rejected: completion,
        tools: tools(&obj)?,
    };
    Ok(KtoRecord::Unpaired(record, desirable))
}

/// Unpaired rows as TRL's `unpair_preference_dataset` leaves them: in batches of 1000 pairs
/// (its map's), each batch's chosen completions (desirable), then its rejected ones.
fn unpair(records: Vec<KtoRecord>) -> Vec<(PreferenceRecord, bool)> {
    let mut out = Vec::with_capacity(records.len());
    let mut pairs: Vec<PreferenceRecord> = Vec::new();
    let flush = |pairs: &mut Vec<PreferenceRecord>, out: &mut Vec<(PreferenceRecord, bool)>| {
        out.extend(pairs.iter().map(|p| (single(p, &p.chosen), true)));
        out.extend(pairs.iter().map(|p| (single(p, &p.rejected), false)));
        pairs.clear();
    };
    for r in records {
        match r {
            KtoRecord::Unpaired(record, desirable) => {
                flush(&mut pairs, &mut out);
                out.push((record, desirable));
            }
            KtoRecord::Paired(p) => {
                pairs.push(p);
                if pairs.len() == 1000 {
                    flush(&mut pairs, &mut out);
                }
            }
        }
    }
    flush(&mut pairs, &mut out);
    out
}

/// The rows tokenized as TRL's KTOTrainer tokenizes them (EOS after a text completion, the
/// completion where prompt and prompt + completion part), those whose prompt fills
/// `max_length` dropped, then each batch of `batch` rows given its mismatched completions.
fn tokenize_rows(
    records: Vec<KtoRecord>,
    tok: &TextTokenizer,
    (max_length, batch): (usize, usize),
    which: &str,
) -> Result<Vec<KtoRow>> {
    let mut rows = Vec::new();
    let mut dropped = 0;
    for (record, desirable) in unpair(records) {
        let p = tokenize_preference(&record, tok)?;
        if p.prompt_ids.len() >= max_length {
            dropped += 1;
            continue;
        }
        rows.push(KtoRow {
            prompt_ids: p.prompt_ids,
            completion_ids: p.chosen_ids,
            kl_ids: Vec::new(),
            desirable,
        });
    }
    if dropped > 0 {
        tracing::warn!("{which} data: dropped {dropped} row(s) whose prompt alone fills max_length = {max_length}");
    }
    // (x1, y1) ... (xn, yn) -> (x1, yn), (x2, y1), ..., (xn, yn-1) within each batch.
    for chunk in rows.chunks_mut(batch.max(1)) {
        let n = chunk.len();
        let completions: Vec<Vec<u32>> = chunk.iter().map(|r| r.completion_ids.clone()).collect();
        for (i, r) in chunk.iter_mut().enumerate() {
            r.kl_ids = completions[(i + n - 1) % n].clone();
        }
    }
    Ok(rows)
}

/// Sequences collated: this rank's part, and per local position its sequence and whether it
/// predicts a completion token.
struct Micro {
    batch: Batch,
    owner: Tensor,
    members: Tensor,
    n: usize,
    /// Tokens of the sequences, whole (padding excluded).
    tokens: usize,
}

/// A forward's per-sequence sums: this rank's part of each log-probability (with its graph
/// when trained), and whole: log-probabilities, then [mean-logit sum, entropy sum, targets].
struct Sums {
    local: Tensor,
    logps: Vec<f64>,
    figures: Vec<[f64; 3]>,
}

/// KTO's figures of a micro-batch, summed over the ranks: [kl, chosen rows, rejected rows,
/// chosen rewards, rejected rewards, chosen logps, rejected logps, chosen logits, chosen
/// targets, rejected logits, rejected targets, entropy, targets].
const FIGURES: usize = 13;

/// KTO training.
pub struct Kto {
    train: Vec<KtoRow>,
    eval: Vec<KtoRow>,
    ref_train: RefLogps,
    ref_eval: RefLogps,
    beta: f64,
    calculate_kl: bool,
    weights: [f64; 2],
    collate_options: CollateOptions,
    max_length: usize,
    ref_batch_size: Option<usize>,
    /// sync_ref_model: the reference's own weights, mixed with the policy's.
    sync: Option<HeldReference>,
}

impl Kto {
    /// The prompt and a completion, labelled on the completion, cut to max_length (its start
    /// kept, as TRL's collator cuts).
    fn sequence(&self, prompt: &[u32], completion: &[u32]) -> PackedSequence {
        let mut ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
        let mut labels: Vec<i64> = std::iter::repeat_n(IGNORE_INDEX, prompt.len())
            .chain(completion.iter().map(|&t| t as i64))
            .collect();
        ids.truncate(self.max_length);
        labels.truncate(self.max_length);
        PackedSequence::single(&Example {
            input_ids: ids,
            labels,
        })
    }

    /// The rows' sequences (`kl`: with their mismatched completions) as one micro-batch.
    fn micro<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        rows: &[&KtoRow],
        kl: bool,
    ) -> Result<Micro> {
        let seqs: Vec<PackedSequence> = rows
            .iter()
            .map(|r| match kl {
                true => self.sequence(&r.prompt_ids, &r.kl_ids),
                false => self.sequence(&r.prompt_ids, &r.completion_ids),
            })
            .collect();
        let refs: Vec<&PackedSequence> = seqs.iter().collect();
        let batch = collate(&refs, self.collate_options, &Device::Cpu)?;
        let (n_rows, len) = batch.input_ids.dims2()?;
        let targets: Vec<i64> = batch.targets()?.flatten_all()?.to_vec1()?;
        let split = core.model.split();
        let kept = kept_columns(split, len)?.unwrap_or_else(|| (0..len).collect());
        let local: Vec<usize> = (0..n_rows)
            .flat_map(|r| kept.iter().map(move |&c| r * len + c))
            .collect();
        let device = core.ctx.device();
        let owners: Vec<u32> = local.iter().map(|&g| (g / len) as u32).collect();
        let members: Vec<f32> = local
            .iter()
            .map(|&g| f32::from(u8::from(targets[g] != IGNORE_INDEX)))
            .collect();
        Ok(Micro {
            owner: Tensor::from_vec(owners, local.len(), device)?,
            members: Tensor::from_vec(members, local.len(), device)?,
            n: seqs.len(),
            tokens: seqs.iter().map(|s| s.len()).sum(),
            batch: batch.part(split)?.to_device(device)?,
        })
    }

    /// The policy's forward over `micro`: per-sequence sums, whole over the sequence's ranks.
    fn forward<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        micro: &Micro,
        train: bool,
    ) -> Result<Sums> {
        let b = &micro.batch;
        let out = core.model.forward_token_logps(
            &b.input_ids,
            &b.position_ids,
            &b.targets()?,
            train,
            false,
        )?;
        let n = micro.n;
        let zeros = Tensor::zeros(n, out.logps.dtype(), out.logps.device())?;
        let local = zeros.index_add(&micro.owner, &(&out.logps * &micro.members)?, 0)?;
        let entropy = out.stats.narrow(1, 0, 1)?;
        let ones = micro.members.ones_like()?.unsqueeze(1)?;
        let figures = Tensor::cat(&[&out.mean_logits.unsqueeze(1)?, &entropy, &ones], 1)?
            .broadcast_mul(&micro.members.unsqueeze(1)?)?;
        let zeros = Tensor::zeros((n, 3), figures.dtype(), figures.device())?;
        let sums: Vec<Vec<f32>> = zeros.index_add(&micro.owner, &figures, 0)?.to_vec2()?;
        let mut values: Vec<f64> = local.detach().to_dtype(DType::F64)?.to_vec1()?;
        values.extend(sums.iter().flatten().map(|&x| x as f64));
        // A sequence split over ranks: each holds part of its sums.
        let values = core.sequence_sum(values)?;
        Ok(Sums {
            local,
            logps: values[..n].to_vec(),
            figures: values[n..].chunks(3).map(|c| [c[0], c[1], c[2]]).collect(),
        })
    }

    /// The reference's log-probabilities of `rows` (and of their mismatched pairs), computed
    /// before training in batches of `batch` per rank.
    fn reference<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        rows: &[KtoRow],
        batch: usize,
    ) -> Result<RefLogps> {
        precompute_ref_logps(core, rows.len(), batch, |idx| {
            let batch: Vec<&KtoRow> = idx.iter().map(|&k| &rows[k]).collect();
            self.logps_of(core, &batch)
        })
    }

    /// The current weights' log-probabilities of `rows`: (completion, mismatched completion;
    /// 0 without a KL estimate).
    fn logps_of<N: CausalModel>(&self, core: &Core<'_, N>, rows: &[&KtoRow]) -> Result<RefLogps> {
        let main = self.forward(core, &self.micro(core, rows, false)?, false)?;
        let kl = match self.calculate_kl {
            true => Some(self.forward(core, &self.micro(core, rows, true)?, false)?),
            false => None,
        };
        Ok((0..rows.len())
            .map(|j| (main.logps[j], kl.as_ref().map_or(0.0, |s| s.logps[j])))
            .collect())
    }

    /// The reference's log-probabilities of each micro-batch of `rows`: precomputed, or
    /// after a sync's mix the reference's forward, its weights swapped in once for all.
    fn references<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
    ) -> Result<Vec<RefLogps>> {
        match self.sync.as_ref().filter(|s| s.mixed()) {
            Some(sync) => sync.run(core, || {
                rows.iter()
                    .map(|idx| {
                        let batch: Vec<&KtoRow> = idx.iter().map(|&k| &self.train[k]).collect();
                        self.logps_of(core, &batch)
                    })
                    .collect()
            }),
            None => Ok(rows
                .iter()
                .map(|idx| idx.iter().map(|&k| self.ref_train[k]).collect())
                .collect()),
        }
    }

    /// The KL estimate of a micro-batch: the mean over its rows of policy minus reference
    /// log-probability of the mismatched pairs, averaged over the data-parallel ranks, at
    /// least 0 (0 for apo_zero_unpaired).
    fn kl<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        rows: &[&KtoRow],
        refs: &[(f64, f64)],
    ) -> Result<f64> {
        if !self.calculate_kl {
            return Ok(0.0);
        }
        let s = self.forward(core, &self.micro(core, rows, true)?, false)?;
        let local: f64 =
            s.logps.iter().zip(refs).map(|(p, r)| p - r.1).sum::<f64>() / rows.len().max(1) as f64;
        Ok((core.global_sum(&[local])?[0] / core.dp.size() as f64).max(0.0))
    }

    /// Each row's loss and its derivative by the row's log-probability, given its log-ratio
    /// to the reference and the KL estimate.
    fn loss_of(&self, desirable: bool, ratio: f64, kl: f64) -> (f64, f64) {
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let b = self.beta;
        // d/dx sigmoid(b x) = b s (1 - s).
        match (desirable, self.calculate_kl) {
            (true, _) => {
                let s = sigmoid(b * (ratio - kl));
                (
                    self.weights[0] * (1.0 - s),
                    -self.weights[0] * b * s * (1.0 - s),
                )
            }
            (false, true) => {
                let s = sigmoid(b * (kl - ratio));
                (
                    self.weights[1] * (1.0 - s),
                    self.weights[1] * b * s * (1.0 - s),
                )
            }
            (false, false) => {
                let s = sigmoid(b * ratio);
                (self.weights[1] * s, self.weights[1] * b * s * (1.0 - s))
            }
        }
    }

    /// One micro-batch of `rows` (their reference log-probabilities `refs`) on one of `dp`
    /// data-parallel ranks: its loss (a mean over the rows), each row's derivative, and this
    /// rank's [`FIGURES`] (of the KL, which every rank holds, its share).
    fn losses(
        &self,
        rows: &[&KtoRow],
        refs: &[(f64, f64)],
        sums: &Sums,
        (kl, dp): (f64, usize),
    ) -> (f64, Vec<f64>, [f64; FIGURES]) {
        let n = rows.len().max(1) as f64;
        let mut f = [0.0; FIGURES];
        f[0] = kl / dp as f64;
        let mut loss = 0.0;
        let mut grads = Vec::with_capacity(rows.len());
        for (j, row) in rows.iter().enumerate() {
            let ratio = sums.logps[j] - refs[j].0;
            let (l, d) = self.loss_of(row.desirable, ratio, kl);
            loss += l / n;
            grads.push(d / n);
            let side = usize::from(!row.desirable);
            f[1 + side] += 1.0;
            f[3 + side] += self.beta * ratio;
            f[5 + side] += sums.logps[j];
            f[7 + 2 * side] += sums.figures[j][0];
            f[8 + 2 * side] += sums.figures[j][2];
            f[11] += sums.figures[j][1];
            f[12] += sums.figures[j][2];
        }
        (loss, grads, f)
    }
}

/// TRL's figures from each micro-batch's [`FIGURES`] (every rank's): each appended per
/// micro-batch where TRL appends it, and averaged over those, as TRL's log averages.
fn figures(micros: &[f64]) -> Vec<(&'static str, f64)> {
    let mut out: Vec<(&'static str, f64, f64)> = Vec::new();
    let mut add = |name: &'static str, v: f64| match out.iter_mut().find(|(n, _, _)| *n == name) {
        Some(at) => {
            at.1 += v;
            at.2 += 1.0;
        }
        None => out.push((name, v, 1.0)),
    };
    for f in micros.chunks(FIGURES) {
        add("kl", f[0]);
        add("entropy", if f[12] > 0.0 { f[11] / f[12] } else { 0.0 });
        if f[8] > 0.0 {
            add("logits/chosen", f[7] / f[8]);
        }
        if f[10] > 0.0 {
            add("logits/rejected", f[9] / f[10]);
        }
        if f[1] > 0.0 {
            add("rewards/chosen", f[3] / f[1]);
            add("logps/chosen", f[5] / f[1]);
        }
        if f[2] > 0.0 {
            add("rewards/rejected", f[4] / f[2]);
            add("logps/rejected", f[6] / f[2]);
        }
        if f[1] > 0.0 && f[2] > 0.0 {
            add("rewards/margins", f[3] / f[1] - f[4] / f[2]);
        }
    }
    out.into_iter().map(|(n, s, c)| (n, s / c)).collect()
}

/// KTO in the trainers' registry ([`super::kinds`]).
pub const KIND: TrainerKind = TrainerKind {
    name: "kto",
    about: "unpaired desirable / undesirable completions (TRL's KTOTrainer)",
    read: |args| read_as::<KTOConfig>(args, workload),
    scaffold: Scaffold {
        config: "templates/sft/kto.yaml",
        data: &[
            ("data/pref_train.jsonl", "assets/tiny/data/pref_train.jsonl"),
            ("data/pref_eval.jsonl", "assets/tiny/data/pref_eval.jsonl"),
        ],
        config_type: "KTOConfig",
        cli_type: "KtoCli",
        task_type: Some("Kto"),
        model_wrapper: None,
        summary: "Unpaired preference training (TRL's KTO)",
        example_flag: "--beta 0.2",
        data_note: ": preference pairs (the right sum chosen), unpaired into desirable and undesirable rows",
        formats: "prompt/completion/label, or prompt/chosen/rejected pairs to unpair",
        metric: "reward margin",
        items: "",
        setup: "",
    },
};

/// sync_ref_model's mixing: `ref_model_mixup_alpha` every `ref_model_sync_steps`.
fn mixing(config: &KTOConfig) -> Mixing {
    Mixing {
        alpha: config.ref_model_mixup_alpha,
        every: config.ref_model_sync_steps,
    }
}

/// A micro-batch's rows are one sequence each (the mismatched pairs' forward keeps no
/// graph); the reference's log-probabilities are computed before training; sync_ref_model
/// holds a copy of the weights.
pub fn workload(config: &KTOConfig) -> Workload {
    Workload {
        sequences_per_row: 1,
        weight_copies: usize::from(config.sync_ref_model),
        ..Workload::default()
    }
}

impl<N: CausalModel> Task<N> for Kto {
    type Config = KTOConfig;

    fn load(config: &KTOConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let args = &config.training;
        let (train, eval) = args.load_data(&parse_kto)?;
        let at = (args.max_length, args.per_device_train_batch_size);
        let train = tokenize_rows(train, tokenizer, at, "training")?;
        let eval = match eval {
            Some(rows) => tokenize_rows(rows, tokenizer, at, "evaluation")?,
            None => Vec::new(),
        };
        if train.is_empty() {
            return Err(Error::config(
                args.dataset_name.display().to_string(),
                "dataset_name",
                "no row to train on (each needs a prompt shorter than max_length)".to_string(),
            ));
        }
        Ok(Kto {
            train,
            eval,
            ref_train: Vec::new(),
            ref_eval: Vec::new(),
            beta: config.beta,
            calculate_kl: config.calculate_kl(),
            weights: [config.desirable_weight, config.undesirable_weight],
            collate_options: CollateOptions {
                pad_token_id: tokenizer.pad_token_id,
                padding_free: false,
                pad_to_multiple_of: config.pad_to_multiple_of.0,
            },
            max_length: args.max_length,
            ref_batch_size: config.precompute_ref_batch_size,
            sync: None,
        })
    }

    /// With `disable_dropout` (TRL's default), LoRA's dropout is off.
    fn training_arguments(config: &KTOConfig) -> TrainingArguments {
        let mut args = config.training.clone();
        if config.disable_dropout {
            args.lora_dropout = 0.0;
        }
        args
    }

    fn num_rows(&self) -> usize {
        self.train.len()
    }

    fn workload(config: &KTOConfig) -> Workload {
        workload(config)
    }

    fn prepare(&mut self, config: &KTOConfig, core: &Core<'_, N>) -> Result<()> {
        self.collate_options.pad_to_multiple_of =
            pad_to_multiple(core.model.split(), config.pad_to_multiple_of.0);
        let args = &core.args;
        let mixing = mixing(config);
        if config.sync_ref_model {
            // A copy of the policy before training (this rank's share), or a resumed run's.
            self.sync = Some(match core.state.global_step > 0 {
                true => HeldReference::resume(mixing, core)?,
                false => HeldReference::of_policy(mixing, core)?,
            });
        }
        if core.state.global_step > 0 {
            // A resumed policy is no longer the reference: read what the first pass computed.
            let rows = (self.train.len(), self.eval.len());
            (self.ref_train, self.ref_eval) =
                resume_ref_logps(&args.output_dir, "KTO", rows, "rows")?;
            return Ok(());
        }
        let batch = |per_device| self.ref_batch_size.unwrap_or(per_device);
        self.ref_train =
            self.reference(core, &self.train, batch(args.per_device_train_batch_size))?;
        self.ref_eval = self.reference(core, &self.eval, batch(args.per_device_eval_batch_size))?;
        if core.ctx.is_main_process() {
            let desirable = self.train.iter().filter(|r| r.desirable).count();
            tracing::info!(
                "KTO: {} rows ({desirable} desirable); reference log-probabilities computed before training",
                self.train.len()
            );
            let model = &args.model_name_or_path;
            save_ref_logps(&args.output_dir, model, &self.ref_train, &self.ref_eval)?;
        }
        Ok(())
    }

    fn step(
        &mut self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
        grads: &mut StepGrads,
    ) -> Result<TaskStep> {
        // d(step loss)/d(row loss): the mean over micro-batches, and over the ranks.
        let scale = 1.0 / (rows.len() * core.dp.size()) as f64;
        let router = RouterLosses::new(core, rows.len());
        let mut local = vec![0.0, 0.0];
        let references = self.references(core, rows)?;
        for (i, (idx, refs)) in rows.iter().zip(references).enumerate() {
            let batch: Vec<&KtoRow> = idx.iter().map(|&k| &self.train[k]).collect();
            // TRL estimates the KL before the policy's forward, with no gradient.
            let kl = self.kl(core, &batch, &refs)?;
            let micro = self.micro(core, &batch, false)?;
            let aux = router.begin(&micro.batch)?;
            let sums = core.training_forward(i, || {
                router.during(&aux, || self.forward(core, &micro, true))
            })?;
            let (loss, d, f) = self.losses(&batch, &refs, &sums, (kl, core.dp.size()));
            let g: Vec<f32> = d.iter().map(|&d| (d * scale) as f32).collect();
            let g = Tensor::new(g.as_slice(), sums.local.device())?;
            let store = core.model.backward(&(&sums.local * g)?.sum_all()?)?;
            core.accumulate(grads, store, rows.len())?;
            router.end(aux);
            local[0] += loss;
            local[1] += micro.tokens as f64;
            local.extend(f);
        }
        let g = core.global_sum(&local)?;
        let mut loss = g[0] / (rows.len() * core.dp.size()) as f64;
        let aux = router.mean(core)?;
        if let Some(aux) = aux {
            loss += core.router_loss_weight * aux;
        }
        Ok(TaskStep {
            loss,
            tokens: g[1] as usize,
            metrics: figures(&g[2..])
                .into_iter()
                .chain(aux.map(|a| ("aux_loss", a)))
                .collect(),
        })
    }

    /// The held-out rows in batches of per_device_eval_batch_size per rank (the last round
    /// filled from the start, as accelerate deals them), each batch's KL and loss as in
    /// training; the loss a mean over the real rows, the figures averaged over the batches.
    fn evaluate(&self, _config: &KTOConfig, core: &Core<'_, N>) -> Result<Option<EvalResult>> {
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
        // After a sync's mix: the current reference's log-probabilities.
        let batch = core.args.per_device_eval_batch_size.max(1);
        let mixed = match self.sync.as_ref().filter(|s| s.mixed()) {
            Some(sync) => Some(sync.run(core, || self.reference(core, &self.eval, batch))?),
            None => None,
        };
        let ref_eval = mixed.as_ref().unwrap_or(&self.ref_eval);
        // [loss x real rows, real rows] then each batch's figures.
        let mut local = vec![0.0, 0.0];
        for round in 0..deal.rounds() {
            let idx = deal.rows(round, rank);
            let batch: Vec<&KtoRow> = idx.iter().map(|&k| &self.eval[k]).collect();
            let refs: Vec<(f64, f64)> = idx.iter().map(|&k| ref_eval[k]).collect();
            let kl = self.kl(core, &batch, &refs)?;
            let sums = self.forward(core, &self.micro(core, &batch, false)?, false)?;
            let (loss, _, f) = self.losses(&batch, &refs, &sums, (kl, core.dp.size()));
            let real = deal.real_rows(round, rank) as f64;
            local[0] += loss * real;
            local[1] += real;
            local.extend(f);
        }
        let g = core.global_sum(&local)?;
        let mut figures = figures(&g[2..]);
        let at = figures.iter().position(|(k, _)| *k == "rewards/margins");
        let margins = at.map(|i| figures.remove(i).1);
        Ok(Some(EvalResult {
            loss: g[0] / g[1].max(1.0),
            accuracy: margins,
            aux_loss: None,
            figures,
        }))
    }

    /// The synced reference's weights beside each checkpoint (each rank its share).
    fn save_state(&self, core: &Core<'_, N>, step: usize) -> Result<()> {
        save_synced(&self.sync, core, step)
    }

    /// sync_ref_model (TRL's SyncRefModelCallback): every `ref_model_sync_steps` steps the
    /// reference becomes alpha x policy + (1 - alpha) x reference.
    fn after_step(&mut self, core: &Core<'_, N>) -> Result<()> {
        mix_synced(&mut self.sync, core)
    }

    fn progress_note(&self, metrics: &[(&'static str, f64)]) -> String {
        super::core::figure_note(metrics, "rewards/margins", "margin", 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pairs unpair as TRL's unpair_preference_dataset (each batch's chosen, then its
    /// rejected); the loss's derivative is its slope (central differences) for each label
    /// and loss type.
    #[test]
    fn pairs_unpair_and_the_loss_derivative_is_its_slope() {
        let pair = |c: &str, r: &str| {
            KtoRecord::Paired(PreferenceRecord {
                prompt: Content::Text("p".into()),
                chosen: Content::Text(c.into()),
                rejected: Content::Text(r.into()),
                tools: None,
            })
        };
        let out = unpair(vec![pair("a", "b"), pair("c", "d")]);
        let got: Vec<(String, bool)> = out
            .iter()
            .map(|(r, l)| match &r.chosen {
                Content::Text(t) => (t.clone(), *l),
                _ => unreachable!(),
            })
            .collect();
        let want = [("a", true), ("c", true), ("b", false), ("d", false)];
        assert_eq!(got, want.map(|(t, l)| (t.to_string(), l)));
        for calculate_kl in [true, false] {
            let kto = Kto {
                train: vec![],
                eval: vec![],
                ref_train: vec![],
                ref_eval: vec![],
                beta: 0.3,
                calculate_kl,
                weights: [1.5, 0.7],
                collate_options: CollateOptions {
                    pad_token_id: 0,
                    padding_free: false,
                    pad_to_multiple_of: None,
                },
                max_length: 8,
                ref_batch_size: None,
                sync: None,
            };
            for desirable in [true, false] {
                let (_, d) = kto.loss_of(desirable, 0.4, 0.1);
                let h = 1e-6;
                let fd = (kto.loss_of(desirable, 0.4 + h, 0.1).0
                    - kto.loss_of(desirable, 0.4 - h, 0.1).0)
                    / (2.0 * h);
                assert!(
                    (fd - d).abs() < 1e-8,
                    "{calculate_kl} {desirable}: {fd} vs {d}"
                );
            }
        }
    }
}
