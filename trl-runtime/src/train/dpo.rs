//! DPO as a [`Task`]: TRL 1.16's DPOTrainer (`DPOConfig`'s keys, its tokenization, losses and
//! metrics) over preference pairs, under whatever strategy the launch sets up.
//!
//! The reference model is the policy before training, so its log-probabilities are computed
//! in a first pass by the policy itself (TRL's `precompute_ref_log_probs`, which TRL also does
//! with the policy when no separate reference is given): no second copy of the model exists,
//! under ZeRO-3 / FSDP / tp it is sharded exactly as the policy is, and with LoRA it is the
//! base with zero adapters. The values are kept in `output_dir/ref_logps.json` for resuming.
//!
//! A micro-batch holds its pairs' chosen sequences then their rejected ones (TRL's order), in
//! one forward. Per-token log-probabilities come from the tiled head (the logits never exist
//! whole); each sequence's sum is a small matmul, exchanged over the sequence-parallel ranks
//! when sequences are split. The loss ([`super::dpo_loss`]) is computed on those sums, and the
//! backward weighs each token by its sequence's gradient.

use super::args::{NameList, TrainingArguments};
use super::core::{Core, EvalResult, StepGrads, Task, TaskStep};
use super::dpo_loss::{DpoLoss, FDivergence, LossType, PairLogps};
use super::eval_rounds::EvalSlots;
use super::kinds::{read_as, Scaffold, TrainerKind};
use super::reference::{
    mix_synced, precompute_ref_logps, resume_ref_logps, save_ref_logps, save_synced, sync_refusal,
    HeldReference, Mixing, RefLogps,
};
use super::router::RouterLosses;
use crate::config::cli_value::NumberList;
use crate::config::named::Named;
use crate::context_parallel::split::{kept_columns, pad_to_multiple};
use crate::data::preference::{
    parse_preference, tokenize_preference, PreferencePair, PreferenceRecord,
};
use crate::data::{
    collate, Batch, BatchDeal, CollateOptions, Example, PackedSequence, TextTokenizer,
};
use crate::error::{Error, Result};
use crate::models::CausalModel;
use crate::nn::IGNORE_INDEX;
use crate::parallel::estimate::Workload;
use candle_core::{Device, Tensor};
use std::time::Instant;

crate::training_arguments! {
    /// DPO's training arguments, with TRL 1.16's names (`DPOConfig`).
    struct DPOConfig, flags DPOArgs, base training;
    /// Deviation from the reference (IPO's tau).
    beta: f64 = 0.1;
    /// One or more of TRL's loss types, summed with `loss_weights`.
    loss_type: NameList = NameList(vec!["sigmoid".into()]);
    /// One weight per loss type (default 1 each).
    loss_weights: Option<NumberList> = None;
    /// Robust DPO's flip probability, EXO's epsilon.
    label_smoothing: f64 = 0.0;
    /// LD-DPO: weight of completion tokens beyond the shorter completion's length.
    ld_alpha: Option<f64> = None;
    /// reverse_kl, forward_kl, js_divergence or alpha_divergence (f-DPO).
    f_divergence_type: String = "reverse_kl".into();
    f_alpha_divergence_coef: f64 = 0.5;
    discopop_tau: f64 = 0.05;
    /// WPO: each pair weighed by its sequences' probabilities.
    use_weighting: bool = false;
    /// The reference log-probabilities are always computed before training here.
    precompute_ref_log_probs: bool = false;
    /// Rows per forward of that first pass (default: the train / eval batch size).
    precompute_ref_batch_size: Option<usize> = None;
    /// TR-DPO: mix the policy into the reference every `ref_model_sync_steps` steps.
    sync_ref_model: bool = false;
    ref_model_mixup_alpha: f64 = 0.6;
    ref_model_sync_steps: usize = 512;
    /// No dropout in the policy: LoRA's dropout is off, as peft's is under TRL.
    disable_dropout: bool = true;
    /// All sequences of a micro-batch in one row, positions restarting per sequence.
    padding_free: bool = false;
    /// A token count, none, or auto (TRL's default: no padding off AWS Neuron).
    pad_to_multiple_of: crate::config::cli_value::PadMultiple = Default::default();
    /// keep_start (TRL's) or keep_end (deprecated in TRL) for sequences over max_length.
    truncation_mode: String = "keep_start".into();
}

crate::trainer_config!(DPOConfig, flags DPOArgs, base training,
    about "Direct preference optimization (TRL's DPO) on Candle",
    accuracy "eval_rewards/accuracies",
    metrics ["eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins",
        "eval_logps/chosen", "eval_logps/rejected", "eval_logits/chosen", "eval_logits/rejected",
        "eval_entropy", "eval_mean_token_accuracy"],
    validate validate_dpo);

/// `trl dpo`-style command line.
pub type DpoCli = super::args::Cli<DPOConfig>;

const F_DIVERGENCES: &[&str] = &[
    "reverse_kl",
    "forward_kl",
    "js_divergence",
    "alpha_divergence",
];

impl DPOConfig {
    /// The loss these keys describe (validated).
    pub fn loss(&self) -> std::result::Result<DpoLoss, (&'static str, String)> {
        let mut terms = Vec::new();
        let weights = self.loss_weights.as_ref().map(|w| w.0.clone());
        if let Some(w) = &weights {
            if w.len() != self.loss_type.0.len() {
                return Err((
                    "loss_weights",
                    format!(
                        "{} weights for {} loss types: give one per loss_type",
                        w.len(),
                        self.loss_type.0.len()
                    ),
                ));
            }
        }
        for (i, name) in self.loss_type.0.iter().enumerate() {
            let kind = LossType::from_name(name).ok_or_else(|| {
                (
                    "loss_type",
                    format!("'{name}' is not one of {}", LossType::NAMES.join(", ")),
                )
            })?;
            terms.push((kind, weights.as_ref().map_or(1.0, |w| w[i])));
        }
        let f_divergence = match self.f_divergence_type.as_str() {
            "reverse_kl" => FDivergence::ReverseKl,
            "forward_kl" => FDivergence::ForwardKl,
            "js_divergence" => FDivergence::Js,
            "alpha_divergence" => FDivergence::Alpha(self.f_alpha_divergence_coef),
            other => {
                return Err((
                    "f_divergence_type",
                    format!("'{other}' is not one of {}", F_DIVERGENCES.join(", ")),
                ))
            }
        };
        if f_divergence != FDivergence::ReverseKl {
            if let Some((kind, _)) = terms.iter().find(|(k, _)| !k.takes_f_divergence()) {
                return Err((
                    "f_divergence_type",
                    format!("{kind:?} has no f-divergence generalization (TRL refuses it too): use reverse_kl"),
                ));
            }
        }
        let eps = self.label_smoothing;
        if terms.iter().any(|(k, _)| *k == LossType::Robust) && !(0.0..0.5).contains(&eps) {
            return Err((
                "label_smoothing",
                format!("{eps}: robust DPO's flip probability must lie in [0, 0.5)"),
            ));
        }
        if terms.iter().any(|(k, _)| *k == LossType::ExoPair) && !(eps > 0.0 && eps < 1.0) {
            return Err((
                "label_smoothing",
                format!("{eps}: exo_pair takes log(label_smoothing), so it must lie in (0, 1) (the paper uses 1e-3)"),
            ));
        }
        if self.use_weighting
            && terms
                .iter()
                .any(|(k, _)| matches!(k, LossType::Aot | LossType::AotUnpaired))
        {
            return Err((
                "use_weighting",
                "WPO's weights are per pair, and aot / aot_unpaired sort the pairs (TRL refuses it too): drop one".into(),
            ));
        }
        Ok(DpoLoss {
            beta: self.beta,
            terms,
            label_smoothing: eps,
            f_divergence,
            discopop_tau: self.discopop_tau,
            weighting: self.use_weighting,
        })
    }
}

/// DPOConfig's own checks.
fn validate_dpo(config: &DPOConfig, source: &str) -> Result<()> {
    let fail = |key: &str, message: String| Err(Error::config(source, key, message));
    if let Err((key, message)) = config.loss() {
        return fail(key, message);
    }
    if config.beta <= 0.0 {
        return fail("beta", format!("{}: must be positive", config.beta));
    }
    if let Some(a) = config.ld_alpha.filter(|a| !(0.0..=1.0).contains(a)) {
        return fail("ld_alpha", format!("{a}: must lie in [0, 1]"));
    }
    if config.sync_ref_model {
        let t = &config.training;
        let refusal = sync_refusal(t.use_peft, config.precompute_ref_log_probs, mixing(config));
        if let Some((key, why)) = refusal {
            return fail(key, why);
        }
    }
    if !["keep_start", "keep_end"].contains(&config.truncation_mode.as_str()) {
        return fail(
            "truncation_mode",
            format!("'{}': use keep_start or keep_end", config.truncation_mode),
        );
    }
    Ok(())
}

/// A micro-batch of pairs, collated: its chosen sequences then its rejected ones.
struct Micro {
    /// This rank's part of the rows, on its device.
    batch: Batch,
    /// Per local position (flattened rows): the sequence its target belongs to (0 where it
    /// has none), u32.
    owner: Tensor,
    /// Per local position: its weight in its sequence's log-probability (0 off the targets;
    /// 1, or ld_alpha beyond the shorter completion).
    weights: Tensor,
    /// Per local position: 1 at a target (the logits metric averages over them).
    members: Tensor,
    chosen_len: Vec<f64>,
    rejected_len: Vec<f64>,
    /// Targets of the chosen and of the rejected sequences, whole.
    targets: [f64; 2],
    /// Input tokens of the micro-batch's rows, whole (padding excluded).
    tokens: usize,
}

/// What one forward gave per sequence (summed over the sequence's ranks).
struct SequenceSums {
    /// This rank's part of each sequence's log-probability, with its graph.
    local: Tensor,
    /// [chosen logps.., rejected logps..] whole.
    logps: Vec<f64>,
    /// The mean logits summed over the chosen targets and over the rejected ones, whole.
    logit_sums: [f64; 2],
    /// TRL's token figures, whole: the entropy summed over every target (chosen and
    /// rejected), and the chosen targets that are their position's argmax.
    token_sums: [f64; 2],
    /// WPO: each sequence's mean over its targets of log p - log sum_v p_v^2, whole.
    aligned: Option<Vec<f64>>,
}

/// Preference training.
pub struct Dpo {
    loss: DpoLoss,
    train: Vec<PreferencePair>,
    eval: Vec<PreferencePair>,
    ref_train: RefLogps,
    ref_eval: RefLogps,
    collate_options: CollateOptions,
    max_length: usize,
    keep_end: bool,
    ld_alpha: Option<f64>,
    ref_batch_size: Option<usize>,
    sync: Option<HeldReference>,
}

/// TRL's figures of a step or an evaluation: `mean(k)` of the reward sums of
/// `PairLogps::add_reward_sums`, and the mean logits of the chosen and rejected sequences.
fn figures(mean: impl Fn(usize) -> f64, logits: [f64; 2]) -> Vec<(&'static str, f64)> {
    vec![
        ("rewards/chosen", mean(0)),
        ("rewards/rejected", mean(1)),
        ("rewards/accuracies", mean(2)),
        ("rewards/margins", mean(3)),
        ("logps/chosen", mean(4)),
        ("logps/rejected", mean(5)),
        ("logits/chosen", logits[0]),
        ("logits/rejected", logits[1]),
    ]
}

/// TRL's `entropy` (over the chosen and rejected completions) and `mean_token_accuracy` (over
/// the chosen ones).
fn token_figures([entropy, accuracy]: [f64; 2]) -> [(&'static str, f64); 2] {
    [("entropy", entropy), ("mean_token_accuracy", accuracy)]
}

/// The preference rows tokenized; `which` (training / evaluation) names them in warnings.
fn tokenize_pairs(
    rows: &[PreferenceRecord],
    which: &str,
    tok: &TextTokenizer,
    config: &DPOConfig,
) -> Result<Vec<PreferencePair>> {
    let mut pairs = Vec::with_capacity(rows.len());
    let mut dropped = 0;
    for r in rows {
        let p = tokenize_preference(r, tok)?;
        // A prompt that fills max_length leaves no completion token (TRL drops such rows).
        if config.truncation_mode == "keep_start"
            && p.prompt_ids.len() >= config.training.max_length
        {
            dropped += 1;
            continue;
        }
        pairs.push(p);
    }
    if dropped > 0 {
        tracing::warn!(
            "{which} data: dropped {dropped} pair(s) whose prompt alone fills max_length = {}",
            config.training.max_length
        );
    }
    Ok(pairs)
}

impl Dpo {
    /// One sequence: the prompt and a completion, labelled on the completion, truncated.
    fn sequence(&self, prompt: &[u32], completion: &[u32]) -> PackedSequence {
        let mut ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
        let mut labels: Vec<i64> = std::iter::repeat_n(IGNORE_INDEX, prompt.len())
            .chain(completion.iter().map(|&t| t as i64))
            .collect();
        if ids.len() > self.max_length {
            let start = if self.keep_end {
                ids.len() - self.max_length
            } else {
                0
            };
            ids = ids[start..start + self.max_length].to_vec();
            labels = labels[start..start + self.max_length].to_vec();
        }
        PackedSequence::single(&Example {
            input_ids: ids,
            labels,
        })
    }

    /// The micro-batch of `pairs`, this rank's part of it.
    fn micro<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        pairs: &[&PreferencePair],
    ) -> Result<Micro> {
        let n = pairs.len();
        let seqs: Vec<PackedSequence> = pairs
            .iter()
            .map(|p| self.sequence(&p.prompt_ids, &p.chosen_ids))
            .chain(
                pairs
                    .iter()
                    .map(|p| self.sequence(&p.prompt_ids, &p.rejected_ids)),
            )
            .collect();
        let rows: Vec<&PackedSequence> = seqs.iter().collect();
        let batch = collate(&rows, self.collate_options, &Device::Cpu)?;
        let (n_rows, len) = batch.input_ids.dims2()?;
        let targets: Vec<i64> = batch.targets()?.flatten_all()?.to_vec1()?;
        // Each position's sequence: its row, or under padding-free the piece it lies in.
        let mut owner = vec![usize::MAX; n_rows * len];
        if self.collate_options.padding_free {
            let mut at = 0;
            for (k, s) in seqs.iter().enumerate() {
                owner[at..at + s.len()].fill(k);
                at += s.len();
            }
        } else {
            for (i, o) in owner.iter_mut().enumerate() {
                *o = i / len;
            }
        }
        // Targets per sequence; LD-DPO weighs those beyond the shorter completion.
        let is_target = |i: usize| targets[i] != IGNORE_INDEX && owner[i] != usize::MAX;
        let mut count = vec![0usize; 2 * n];
        (0..n_rows * len)
            .filter(|&i| is_target(i))
            .for_each(|i| count[owner[i]] += 1);
        let mut seen = vec![0usize; 2 * n];
        let mut weight = vec![0f32; n_rows * len];
        for i in (0..n_rows * len).filter(|&i| is_target(i)) {
            let k = owner[i];
            seen[k] += 1;
            let shared = count[k % n].min(count[n + k % n]);
            weight[i] = match self.ld_alpha {
                Some(a) if seen[k] > shared => a as f32,
                _ => 1.0,
            };
        }
        // This rank's columns of each row, flattened as the model's per-token outputs are.
        let split = core.model.split();
        let kept = kept_columns(split, len)?.unwrap_or_else(|| (0..len).collect());
        let local: Vec<usize> = (0..n_rows)
            .flat_map(|r| kept.iter().map(move |&c| r * len + c))
            .collect();
        let device = core.ctx.device();
        let at = |f: &dyn Fn(usize) -> f32| -> Result<Tensor> {
            let v: Vec<f32> = local.iter().map(|&g| f(g)).collect();
            Ok(Tensor::from_vec(v, local.len(), device)?)
        };
        let owners: Vec<u32> = local
            .iter()
            .map(|&g| if is_target(g) { owner[g] as u32 } else { 0 })
            .collect();
        let completion =
            |s: &PackedSequence| s.labels.iter().filter(|&&l| l != IGNORE_INDEX).count() as f64;
        let total = |r: std::ops::Range<usize>| count[r].iter().sum::<usize>() as f64;
        Ok(Micro {
            owner: Tensor::from_vec(owners, local.len(), device)?,
            weights: at(&|g| weight[g])?,
            members: at(&|g| is_target(g) as u8 as f32)?,
            chosen_len: seqs[..n].iter().map(completion).collect(),
            rejected_len: seqs[n..].iter().map(completion).collect(),
            targets: [total(0..n), total(n..2 * n)],
            tokens: seqs.iter().map(|s| s.len()).sum(),
            batch: batch.part(split)?.to_device(device)?,
        })
    }

    /// The policy's forward over a micro-batch: per-sequence sums (whole, and this rank's
    /// part with its graph when `train`); with `weights`, WPO's per-sequence means too (a
    /// second pass over the head: only where the loss uses them).
    fn forward<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        micro: &Micro,
        train: bool,
        weights: bool,
    ) -> Result<SequenceSums> {
        let b = &micro.batch;
        let weighting = weights && self.loss.weighting;
        let out = core.model.forward_token_logps(
            &b.input_ids,
            &b.position_ids,
            &b.targets()?,
            train,
            weighting,
        )?;
        // Each sequence's sum over its targets: one scatter-add over the positions.
        let n = micro.chosen_len.len();
        let per_sequence = |per_token: &Tensor, weights: &Tensor| -> Result<Tensor> {
            let zeros = Tensor::zeros(2 * n, per_token.dtype(), per_token.device())?;
            Ok(zeros.index_add(&micro.owner, &(per_token * weights)?, 0)?)
        };
        let local = per_sequence(&out.logps, &micro.weights)?;
        let mut values: Vec<f64> = local
            .detach()
            .to_dtype(candle_core::DType::F64)?
            .to_vec1()?;
        // Each target's mean logit, entropy and top-1 flag, summed per sequence in one pass
        // and read back in one transfer.
        let figures = Tensor::cat(&[&out.mean_logits.unsqueeze(1)?, &out.stats], 1)?
            .broadcast_mul(&micro.members.unsqueeze(1)?)?;
        let zeros = Tensor::zeros((2 * n, 3), figures.dtype(), figures.device())?;
        let sums: Vec<Vec<f32>> = zeros.index_add(&micro.owner, &figures, 0)?.to_vec2()?;
        let part = |c: usize, r: std::ops::Range<usize>| {
            sums[r].iter().map(|row| row[c] as f64).sum::<f64>()
        };
        // Logits over the chosen and the rejected, entropy over both, hits over the chosen.
        values.extend([
            part(0, 0..n),
            part(0, n..2 * n),
            part(1, 0..2 * n),
            part(2, 0..n),
        ]);
        // WPO (TRL's use_weighting): sums of log p - log sum p^2 and target counts.
        if let Some(lss) = &out.log_sum_sq {
            let aligned = (out.logps.detach() - lss)?;
            for t in [
                per_sequence(&aligned, &micro.members)?,
                per_sequence(&micro.members, &micro.members)?,
            ] {
                let v: Vec<f32> = t.to_vec1()?;
                values.extend(v.iter().map(|&x| x as f64));
            }
        }
        // A sequence split over ranks: each holds part of its sums.
        let mut values = core.sequence_sum(values)?;
        let logit_sums = [values[2 * n], values[2 * n + 1]];
        let token_sums = [values[2 * n + 2], values[2 * n + 3]];
        let aligned = (values.len() > 2 * n + 4).then(|| {
            let (sums, counts) = values[2 * n + 4..].split_at(2 * n);
            sums.iter()
                .zip(counts)
                .map(|(s, c)| s / c.max(1.0))
                .collect()
        });
        values.truncate(2 * n);
        Ok(SequenceSums {
            local,
            logps: values,
            logit_sums,
            token_sums,
            aligned,
        })
    }

    /// The reference's log-probabilities (chosen, rejected) of each pair of `rows`:
    /// precomputed, or under TR-DPO after a mix its forward over the step's `micros`, its
    /// weights swapped in once for all of them.
    fn references<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
        micros: &[Micro],
    ) -> Result<Vec<Vec<(f64, f64)>>> {
        match self.sync.as_ref().filter(|s| s.mixed()) {
            Some(sync) => sync.run(core, || {
                micros
                    .iter()
                    .map(|micro| self.pair_logps_of(core, micro))
                    .collect()
            }),
            None => Ok(rows
                .iter()
                .map(|idx| idx.iter().map(|&k| self.ref_train[k]).collect())
                .collect()),
        }
    }

    fn pair_logps(micro: &Micro, sums: &SequenceSums, reference: &[(f64, f64)]) -> PairLogps {
        let n = micro.chosen_len.len();
        PairLogps {
            chosen: sums.logps[..n].to_vec(),
            rejected: sums.logps[n..].to_vec(),
            ref_chosen: reference.iter().map(|r| r.0).collect(),
            ref_rejected: reference.iter().map(|r| r.1).collect(),
            chosen_len: micro.chosen_len.clone(),
            rejected_len: micro.rejected_len.clone(),
            chosen_targets: micro.targets[0],
            // WPO: each pair weighed by exp(its chosen mean) x exp(its rejected mean).
            weights: sums
                .aligned
                .as_ref()
                .map(|a| (0..n).map(|j| (a[j] + a[n + j]).exp()).collect()),
        }
    }

    /// The forward (no gradient) over `pairs` dealt as accelerate deals an evaluation
    /// DataLoader (`deal`): this rank's batch of every round, so that every rank runs as many
    /// forwards (the last ones filled from the start). `f` gets the round, the batch's pair
    /// indices, micro-batch and sums. `weights`: as [`Self::forward`].
    fn each_batch<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        pairs: &[PreferencePair],
        deal: BatchDeal,
        weights: bool,
        router: &RouterLosses,
        mut f: impl FnMut(usize, &[usize], &Micro, &SequenceSums, f64) -> Result<()>,
    ) -> Result<()> {
        for round in 0..deal.rounds() {
            let idx = deal.rows(round, core.dp.rank());
            let rows: Vec<&PreferencePair> = idx.iter().map(|&k| &pairs[k]).collect();
            let micro = self.micro(core, &rows)?;
            // The policy's router loss (evaluation), per batch (0 when off).
            let aux = router.begin(&micro.batch)?;
            let sums = router.during(&aux, || self.forward(core, &micro, false, weights))?;
            let aux = router.end(aux).unwrap_or(0.0);
            f(round, &idx, &micro, &sums, aux)?;
        }
        Ok(())
    }

    /// The reference's log-probabilities of `pairs`, computed before training in batches of
    /// `batch_size` per rank (the policy before its first step is the reference).
    fn reference<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        pairs: &[PreferencePair],
        batch_size: usize,
    ) -> Result<RefLogps> {
        precompute_ref_logps(core, pairs.len(), batch_size, |idx| {
            let rows: Vec<&PreferencePair> = idx.iter().map(|&k| &pairs[k]).collect();
            self.pair_logps_of(core, &self.micro(core, &rows)?)
        })
    }

    /// The current weights' log-probabilities (chosen, rejected) of a micro-batch's pairs
    /// (no WPO weights: the reference's alone).
    fn pair_logps_of<N: CausalModel>(&self, core: &Core<'_, N>, micro: &Micro) -> Result<RefLogps> {
        let r = self.forward(core, micro, false, false)?;
        let n = micro.chosen_len.len();
        Ok((0..n).map(|j| (r.logps[j], r.logps[n + j])).collect())
    }
}

/// Per round and rank, what an evaluation batch adds to TRL's figures: its loss (a mean over
/// its pairs), the sums over its targets (entropy and its count, the chosen and rejected
/// mean logits and their counts, the chosen argmax hits), its pairs, its router loss (a
/// mixture of experts'; 0 without) and its pairs' reward sums (`PairLogps::add_reward_sums`).
const EVAL_SLOT: usize = 16;

/// TRL's eval_loss and figures from the evaluation's slots ([`EVAL_SLOT`]), as
/// transformers' evaluation loop and TRL's DPOTrainer compute them (see [`EvalSlots`]): the
/// loss a mean over real rows; entropy, mean logits and token accuracy over the ranks
/// `gather_for_metrics` keeps; rewards and log-probs over every rank's pairs (a plain
/// `gather`, the refill included). A batch's loss includes its router loss times
/// `router_weight` (TRL's DPOTrainer adds it to each batch's).
fn trl_dpo_evaluation(slots: &EvalSlots, router_weight: f64) -> (f64, Vec<(&'static str, f64)>) {
    let rewards = |k: usize| slots.gathered_ratio(10 + k, 8);
    let logits = [slots.kept_ratio(3, 4), slots.kept_ratio(5, 6)];
    let figures = figures(rewards, logits)
        .into_iter()
        .chain(token_figures([
            slots.kept_ratio(1, 2),
            slots.kept_ratio(7, 4),
        ]))
        .collect();
    (slots.loss(|s| s[0] + router_weight * s[9]), figures)
}

/// DPO in the trainers' registry ([`super::kinds`]).
pub const KIND: TrainerKind = TrainerKind {
    name: "dpo",
    about: "preference pairs (TRL's DPOTrainer)",
    read: |args| read_as::<DPOConfig>(args, workload),
    scaffold: Scaffold {
        config: "templates/sft/dpo.yaml",
        data: &[
            ("data/pref_train.jsonl", "assets/tiny/data/pref_train.jsonl"),
            ("data/pref_eval.jsonl", "assets/tiny/data/pref_eval.jsonl"),
        ],
        config_type: "DPOConfig",
        cli_type: "DpoCli",
        task_type: Some("Dpo"),
        model_wrapper: None,
        summary: "Preference training (TRL's DPO)",
        example_flag: "--beta 0.2",
        data_note: ": preference pairs, the right sum chosen",
        formats: "prompt/chosen/rejected, conversational or standard, prompt explicit or implicit",
        metric: "reward accuracy",
        items: "",
        setup: "",
    },
};

/// TR-DPO's mixing of the reference: `ref_model_mixup_alpha` every `ref_model_sync_steps`.
fn mixing(config: &DPOConfig) -> Mixing {
    Mixing {
        alpha: config.ref_model_mixup_alpha,
        every: config.ref_model_sync_steps,
    }
}

/// A micro-batch of n pairs is 2n sequences; TR-DPO keeps a copy of the weights.
pub fn workload(config: &DPOConfig) -> Workload {
    Workload {
        sequences_per_row: 2,
        weight_copies: usize::from(config.sync_ref_model),
        ..Workload::default()
    }
}

impl<N: CausalModel> Task<N> for Dpo {
    type Config = DPOConfig;
    fn load(config: &DPOConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let args = &config.training;
        let loss = config.loss().expect("validated");
        let (train, eval) = args.load_data(&parse_preference)?;
        let train = tokenize_pairs(&train, "training", tokenizer, config)?;
        let eval = match eval {
            Some(rows) => tokenize_pairs(&rows, "evaluation", tokenizer, config)?,
            None => Vec::new(),
        };
        Ok(Dpo {
            loss,
            train,
            eval,
            ref_train: Vec::new(),
            ref_eval: Vec::new(),
            collate_options: CollateOptions {
                pad_token_id: tokenizer.pad_token_id,
                padding_free: config.padding_free,
                pad_to_multiple_of: config.pad_to_multiple_of.0,
            },
            max_length: args.max_length,
            keep_end: config.truncation_mode == "keep_end",
            ld_alpha: config.ld_alpha,
            ref_batch_size: config.precompute_ref_batch_size,
            sync: None,
        })
    }

    /// With `disable_dropout` (TRL's default), LoRA's dropout is off: TRL disables every
    /// dropout module, peft's among them.
    fn training_arguments(config: &DPOConfig) -> TrainingArguments {
        let mut args = config.training.clone();
        if config.disable_dropout {
            args.lora_dropout = 0.0;
        }
        args
    }

    fn num_rows(&self) -> usize {
        self.train.len()
    }

    fn workload(config: &DPOConfig) -> Workload {
        workload(config)
    }

    fn prepare(&mut self, config: &DPOConfig, core: &Core<'_, N>) -> Result<()> {
        // Sequences split over sp (cp) need lengths that divide into sp (2 x cp) chunks.
        self.collate_options.pad_to_multiple_of =
            pad_to_multiple(core.model.split(), config.pad_to_multiple_of.0);
        let args = &core.args;
        if core.state.global_step > 0 && config.sync_ref_model {
            self.sync = Some(HeldReference::resume(mixing(config), core)?);
        }
        if core.state.global_step > 0 {
            // A resumed policy is no longer the reference: read what the first pass computed.
            let rows = (self.train.len(), self.eval.len());
            (self.ref_train, self.ref_eval) =
                resume_ref_logps(&args.output_dir, "DPO", rows, "pairs")?;
            return Ok(());
        }
        if config.sync_ref_model {
            // A copy of the policy before training: this rank's share, in the compute dtype.
            self.sync = Some(HeldReference::of_policy(mixing(config), core)?);
        } else if !config.precompute_ref_log_probs && core.ctx.is_main_process() {
            tracing::info!("precompute_ref_log_probs is false: the reference log-probabilities are computed before training anyway (the policy before its first step is the reference), the same values TRL computes on the fly");
        }
        let start = Instant::now();
        let batch = |per_device| self.ref_batch_size.unwrap_or(per_device);
        let (train, eval) = (
            batch(args.per_device_train_batch_size),
            batch(args.per_device_eval_batch_size),
        );
        self.ref_train = self.reference(core, &self.train, train)?;
        self.ref_eval = self.reference(core, &self.eval, eval)?;
        if core.ctx.is_main_process() {
            tracing::info!(
                "reference log-probabilities of {} + {} pairs computed in {:.1}s",
                self.train.len(),
                self.eval.len(),
                start.elapsed().as_secs_f64()
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
        let scale = 1.0 / (rows.len() * core.dp.size()) as f64;
        let mut loss = 0.0;
        let mut tokens = 0usize;
        // Sums over this rank's pairs: rewards chosen, rejected, accuracy, margin, logps.
        let mut sums = [0f64; 6];
        let mut pairs = 0usize;
        // Per micro-batch, its logit sums and target counts, then its token figures' sums and
        // counts (TRL averages those metrics over micro-batches); summed over the ranks once,
        // with the rest.
        let mut logits = Vec::with_capacity(8 * rows.len());
        let micros = rows
            .iter()
            .map(|idx| {
                let batch: Vec<&PreferencePair> = idx.iter().map(|&k| &self.train[k]).collect();
                self.micro(core, &batch)
            })
            .collect::<Result<Vec<_>>>()?;
        let references = self.references(core, rows, &micros)?;
        // A mixture of experts' router loss over the policy's forward (TRL adds it per
        // micro-batch; the reference's forward has none).
        let router = RouterLosses::new(core, rows.len());
        for (i, (micro, reference)) in micros.iter().zip(&references).enumerate() {
            let aux = router.begin(&micro.batch)?;
            let seq = core.training_forward(i, || {
                router.during(&aux, || self.forward(core, micro, true, true))
            })?;
            let p = Self::pair_logps(micro, &seq, reference);
            let out = self.loss.compute(&p)?;
            loss += out.loss;
            tokens += micro.tokens;
            // d(step loss)/d(each sequence's log-prob) weighs its tokens in the backward.
            let g: Vec<f32> = out
                .d_chosen
                .iter()
                .chain(&out.d_rejected)
                .map(|&d| (d * scale) as f32)
                .collect();
            let g = Tensor::new(g.as_slice(), seq.local.device())?;
            let surrogate = (&seq.local * g)?.sum_all()?;
            let store = core.model.backward(&surrogate)?;
            core.accumulate(grads, store, rows.len())?;
            router.end(aux);
            p.add_reward_sums(self.loss.beta, &mut sums);
            pairs += p.chosen.len();
            logits.extend([
                seq.logit_sums[0],
                micro.targets[0],
                seq.logit_sums[1],
                micro.targets[1],
                seq.token_sums[0],
                micro.targets[0] + micro.targets[1],
                seq.token_sums[1],
                micro.targets[0],
            ]);
        }
        // Every rank holding a row's chunk (sp, cp) or slice (tp) has the same figures for
        // it: the data-parallel ranks' sum is the step's, in one collective.
        let mut local = vec![loss, pairs as f64, tokens as f64];
        local.extend(sums);
        local.extend(logits);
        let g = core.global_sum(&local)?;
        let total_pairs = g[1].max(1.0);
        let tokens = g[2] as usize;
        let micro_batches = rows.len() as f64;
        let mean = |k: usize| g[3 + k] / total_pairs;
        // The k-th ratio of each micro-batch's figures, averaged over the micro-batches (0
        // for one without targets, as TRL appends).
        let per_micro = |k: usize| {
            g[9..]
                .chunks(8)
                .map(|m| m[2 * k] / m[2 * k + 1].max(1.0))
                .sum::<f64>()
                / micro_batches
        };
        let mut loss = g[0] / (micro_batches * core.dp.size() as f64);
        let aux = router.mean(core)?;
        if let Some(aux) = aux {
            loss += core.router_loss_weight * aux;
        }
        Ok(TaskStep {
            loss,
            tokens,
            metrics: figures(mean, [per_micro(0), per_micro(1)])
                .into_iter()
                .chain(token_figures([per_micro(2), per_micro(3)]))
                .chain(aux.map(|a| ("aux_loss", a)))
                .collect(),
        })
    }

    /// The loss and figures over the held-out pairs, dealt and reduced as TRL's evaluation
    /// deals and reduces them (see [`trl_dpo_evaluation`]).
    fn evaluate(&self, config: &DPOConfig, core: &Core<'_, N>) -> Result<Option<EvalResult>> {
        if self.eval.is_empty() {
            return Ok(None);
        }
        let bs = config.training.per_device_eval_batch_size;
        let (rank, world) = (core.dp.rank(), core.dp.size());
        let deal = BatchDeal {
            len: self.eval.len(),
            batch: bs,
            world,
            drop_last: config.training.dataloader_drop_last,
        };
        // TR-DPO after a mix: the current reference's log-probabilities.
        let mixed = match self.sync.as_ref().filter(|s| s.mixed()) {
            Some(sync) => Some(sync.run(core, || self.reference(core, &self.eval, bs))?),
            None => None,
        };
        let ref_eval = mixed.as_ref().unwrap_or(&self.ref_eval);
        let router = RouterLosses::for_evaluation(core);
        let mut slots = EvalSlots::new(deal, EVAL_SLOT);
        self.each_batch(
            core,
            &self.eval,
            deal,
            true,
            &router,
            |round, idx, micro, seq, aux| {
                let reference: Vec<(f64, f64)> = idx.iter().map(|&k| ref_eval[k]).collect();
                let p = Self::pair_logps(micro, seq, &reference);
                let mut sums = [0f64; 6];
                p.add_reward_sums(self.loss.beta, &mut sums);
                let [chosen, rejected] = micro.targets;
                let [entropy, hits] = seq.token_sums;
                let counts = [
                    self.loss.compute(&p)?.loss,
                    entropy,
                    chosen + rejected,
                    seq.logit_sums[0],
                    chosen,
                    seq.logit_sums[1],
                    rejected,
                    hits,
                    idx.len() as f64,
                    aux,
                ];
                slots.set(round, rank, &[&counts[..], &sums].concat());
                Ok(())
            },
        )?;
        let slots = slots.summed(|v| core.global_sum(v))?;
        let (loss, figures) = trl_dpo_evaluation(&slots, core.router_loss_weight);
        let aux_loss = (core.router_loss_weight != 0.0).then(|| slots.kept_mean(9));
        let accuracy = figures.iter().find(|(k, _)| *k == "rewards/accuracies");
        Ok(Some(EvalResult {
            loss,
            accuracy: accuracy.map(|(_, v)| *v),
            aux_loss,
            // The accuracy is logged as the evaluation's own.
            figures: figures
                .into_iter()
                .filter(|(k, _)| *k != "rewards/accuracies")
                .collect(),
        }))
    }

    /// TR-DPO's reference weights beside each checkpoint (each rank its share).
    fn save_state(&self, core: &Core<'_, N>, step: usize) -> Result<()> {
        save_synced(&self.sync, core, step)
    }

    /// TR-DPO's sync (TRL's SyncRefModelCallback): every `ref_model_sync_steps` steps the
    /// reference becomes alpha x policy + (1 - alpha) x reference, on each rank's own share.
    fn after_step(&mut self, core: &Core<'_, N>) -> Result<()> {
        mix_synced(&mut self.sync, core)
    }

    fn progress_note(&self, metrics: &[(&'static str, f64)]) -> String {
        super::core::figure_note(metrics, "rewards/accuracies", "acc", 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 7 pairs in batches of 3 on 2 ranks: the last round holds one real pair (rank 0's
    /// first), so `gather_for_metrics` keeps rank 0's loss once and its token sums alone,
    /// while the rewards, gathered whole, are the mean over all six pairs of the round.
    #[test]
    fn the_refill_is_cut_from_the_loss_and_token_figures_not_the_rewards() {
        let deal = BatchDeal {
            len: 7,
            batch: 3,
            world: 2,
            drop_last: false,
        };
        // loss, entropy sum and count, chosen and rejected logit sums and counts, hits,
        // pairs, router loss, then the six reward sums (rewards/chosen first).
        let slot = |loss: f64, entropy: f64, reward: f64| {
            let mut s = [loss, entropy, 4.0, 0.0, 2.0, 0.0, 2.0, 1.0, 3.0, 0.0];
            s[3] = entropy / 2.0;
            [&s[..], &[reward, 0.0, 0.0, 0.0, 0.0, 0.0]].concat()
        };
        let slots = [
            slot(0.6, 8.0, 0.3),
            slot(0.7, 12.0, 0.6),
            slot(0.5, 4.0, 0.9),
            slot(0.9, 40.0, 3.0),
        ]
        .concat();
        let (loss, figures) =
            trl_dpo_evaluation(&EvalSlots::from_values(deal, EVAL_SLOT, slots), 0.0);
        let figure = |k: &str| figures.iter().find(|(n, _)| *n == k).unwrap().1;
        // (3 x 0.6 + 3 x 0.7 + 1 x 0.5) / 7; rank 1's 0.9 is all refill.
        assert!((loss - 4.4 / 7.0).abs() < 1e-12, "{loss}");
        // Rounds: (8 + 12) / 8 and 4 / 4.
        assert!((figure("entropy") - 1.75).abs() < 1e-12);
        assert!((figure("logits/chosen") - (10.0 / 4.0 + 2.0 / 2.0) / 2.0).abs() < 1e-12);
        assert!((figure("mean_token_accuracy") - 0.5).abs() < 1e-12);
        // Rounds: 0.9 / 6 and 3.9 / 6, the refill's pairs included.
        assert!((figure("rewards/chosen") - 0.4).abs() < 1e-12);
    }
}
