//! SFT as a [`Task`]: TRL's SFT data (packed or truncated rows, completion-only and
//! assistant-only losses), TRL's loss averaging over the target tokens of the whole optimizer
//! step, and evaluation by loss and by greedy answers on held-out prompts.
//!
//! Loss rule (docs/architecture.md): per optimizer step, count the target tokens of every
//! micro-batch on every data-parallel rank; each micro-batch contributes sum(token losses) / that count;
//! gradients are summed across micro-batches and ranks. So 2 ranks x batch 2, 1 rank x 2
//! accumulation steps x batch 2 and 1 rank x batch 4 take the same steps.

use super::config::SFTConfig;
use super::core::{Core, EvalResult, StepGrads, Task, TaskStep};
use super::eval_rounds::EvalSlots;
use super::kinds::{read_as, Scaffold, TrainerKind};
use super::router::RouterLosses;
use crate::context_parallel::split::pad_to_multiple;
use crate::data::dataset::{parse_record_in, to_example, Content, Record, TokenizeOptions};
use crate::data::{
    collate, pack, Batch, BatchDeal, CollateOptions, Example, PackedSequence, PackingStrategy,
    TextTokenizer,
};
use crate::error::Result;
use crate::models::CausalModel;
use crate::nn::LossSum;
use candle_core::Device;

const MAX_NEW_TOKENS: usize = 16;

/// How micro-batches are collated: padding-free rows or padding, lengths rounded so that
/// sequences split over sp (cp) divide into sp (2 x cp) chunks.
fn collate_options(
    config: &SFTConfig,
    split: Option<&crate::context_parallel::SeqSplit>,
    pad_token_id: u32,
) -> CollateOptions {
    CollateOptions {
        pad_token_id,
        padding_free: config.padding_free,
        // Sequences split over sp (cp) need lengths that divide into sp (2 x cp) chunks.
        pad_to_multiple_of: pad_to_multiple(split, config.pad_to_multiple_of.0),
    }
}

/// The tokenized training rows (packed or truncated to max_length), the held-out rows and
/// the held-out prompts scored by generation.
struct TrainData {
    train_rows: Vec<PackedSequence>,
    eval_rows: Vec<PackedSequence>,
    eval_prompts: Vec<(Vec<u32>, String)>,
}

impl TrainData {
    fn load(config: &SFTConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let opts = TokenizeOptions {
            completion_only_loss: config.completion_only_loss.unwrap_or(true),
            assistant_only_loss: config.assistant_only_loss,
        };
        let text_field = &config.dataset_text_field;
        // A row that gives no token to train on is a bad row: named by file and line, or
        // skipped with the others under skip_bad_rows.
        let (train, eval) = config.training.load_data(&|v| {
            let record = parse_record_in(v, text_field)?;
            match opts.untrainable(&record) {
                Some(why) => Err(why),
                None => Ok(record),
            }
        })?;
        let train_examples = tokenize_all(&train, tokenizer, opts)?;
        let train_rows: Vec<PackedSequence> = if config.packing {
            let strategy = PackingStrategy::parse(&config.packing_strategy).expect("validated");
            pack(&train_examples, config.training.max_length, strategy)
        } else {
            train_examples
                .into_iter()
                .map(|e| truncate(e, config.training.max_length))
                .collect()
        };
        let (eval_rows, eval_prompts) = match eval {
            Some(records) => {
                let rows = tokenize_all(&records, tokenizer, opts)?
                    .into_iter()
                    .map(|e| truncate(e, config.training.max_length))
                    .collect();
                let mut prompts = Vec::new();
                for r in records.iter().take(config.eval_generation_samples) {
                    if let Some(p) = prompt_and_answer(r, tokenizer)? {
                        prompts.push(p);
                    }
                }
                (rows, prompts)
            }
            None => (Vec::new(), Vec::new()),
        };
        Ok(TrainData {
            train_rows,
            eval_rows,
            eval_prompts,
        })
    }
}

fn tokenize_all(
    records: &[Record],
    tok: &TextTokenizer,
    opts: TokenizeOptions,
) -> Result<Vec<Example>> {
    records
        .iter()
        .map(|r| to_example(r, tok, opts))
        .filter(|e| !e.as_ref().is_ok_and(Example::is_empty))
        .collect()
}

fn truncate(mut e: Example, max_length: usize) -> PackedSequence {
    e.input_ids.truncate(max_length);
    e.labels.truncate(max_length);
    PackedSequence::single(&e)
}

/// A held-out prompt and its expected answer (the last assistant message / the completion).
fn prompt_and_answer(r: &Record, tok: &TextTokenizer) -> Result<Option<(Vec<u32>, String)>> {
    Ok(match r {
        Record::Messages { messages: m, tools }
            if m.len() >= 2 && m.last().is_some_and(|x| x.role == "assistant") =>
        {
            let prompt = tok
                .apply_chat_template(&m[..m.len() - 1], tools.as_deref(), true)?
                .text;
            Some((
                tok.encode(&prompt, false)?,
                m.last().unwrap().text().trim().to_string(),
            ))
        }
        Record::PromptCompletion {
            prompt: Content::Text(p),
            completion: Content::Text(c),
            ..
        } => Some((tok.encode(p, false)?, c.trim().to_string())),
        _ => None,
    })
}

/// SFT in the trainers' registry ([`super::kinds`]): the default.
pub const KIND: TrainerKind = TrainerKind {
    name: "sft",
    about: "supervised fine-tuning (TRL's SFTTrainer)",
    read: |args| read_as::<SFTConfig>(args, |_| Default::default()),
    scaffold: Scaffold {
        config: "templates/sft/sft.yaml",
        data: &[
            ("data/train.jsonl", "assets/tiny/data/train.jsonl"),
            ("data/eval.jsonl", "assets/tiny/data/eval.jsonl"),
        ],
        config_type: "SFTConfig",
        cli_type: "SftCli",
        task_type: None,
        model_wrapper: None,
        summary: "Supervised fine-tuning",
        example_flag: "--learning_rate 1e-3",
        data_note: "",
        formats: "prompt/completion, messages",
        metric: "accuracy",
        items: "",
        setup: "",
    },
};

/// Supervised fine-tuning: the rows, how they are collated, and the held-out prompts.
pub struct Sft {
    data: TrainData,
    collate_options: CollateOptions,
    /// TRL's loss_type "dft": each token's loss weighted by its probability.
    dft: bool,
}

impl Sft {
    /// A micro-batch's summed loss (its gradients with `train`): the next-token cross-entropy,
    /// or with dft (TRL's Dynamic Fine-Tuning) each target's -log p weighted by its own
    /// probability, detached, from the per-position log-probabilities DPO also takes (so
    /// every layout runs it).
    fn loss<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        batch: &Batch,
        train: bool,
    ) -> Result<LossSum> {
        let (ids, pos, targets) = (&batch.input_ids, &batch.position_ids, &batch.targets()?);
        if !self.dft {
            return match train {
                true => core.model.forward_targets(ids, pos, targets),
                false => core.model.eval_targets(ids, pos, targets),
            };
        }
        let out = core
            .model
            .forward_token_logps(ids, pos, targets, train, false)?;
        // Ignored positions have log p 0: weight 1, loss 0.
        let weight = out.logps.detach().exp()?;
        Ok(LossSum {
            sum: (out.logps.neg()? * weight)?.sum_all()?,
            count: out.count,
            stats: out.stats.sum(0)?,
        })
    }

    /// This step's micro-batches (this rank's part of their rows, on its device) and the
    /// tokens of their rows that this rank counts (each row's once, by the first rank of its
    /// sequence group).
    fn micro_batches<N: CausalModel>(
        &self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
    ) -> Result<(Vec<Batch>, usize)> {
        let mut batches = Vec::with_capacity(rows.len());
        let mut local_tokens = 0usize;
        // The rows' tokens are counted once, by the first rank of their sequence group.
        let counts_tokens = core.model.split().is_none_or(|s| s.group.rank() == 0);
        for micro in rows {
            let rows: Vec<&PackedSequence> =
                micro.iter().map(|&i| &self.data.train_rows[i]).collect();
            if counts_tokens {
                local_tokens += rows.iter().map(|r| r.len()).sum::<usize>();
            }
            let batch = collate(&rows, self.collate_options, &Device::Cpu)?;
            batches.push(
                batch
                    .part(core.model.split())?
                    .to_device(core.ctx.device())?,
            );
        }
        Ok((batches, local_tokens))
    }
}

/// `tokenizer` with TRL's `eos_token` and `chat_template_path` keys applied, in TRL's order
/// (a template directory sets the end-of-sequence token again, from that tokenizer).
pub(crate) fn tokenizer_keys(
    mut tokenizer: TextTokenizer,
    eos_token: &Option<String>,
    chat_template_path: &Option<std::path::PathBuf>,
) -> Result<TextTokenizer> {
    let refused = |key: &str, why: String| crate::Error::config("training arguments", key, why);
    if let Some(eos) = eos_token {
        tokenizer = tokenizer
            .with_eos_token(eos)
            .map_err(|why| refused("eos_token", why))?;
    }
    if let Some(path) = chat_template_path {
        tokenizer = tokenizer
            .with_chat_template_from(path)
            .map_err(|why| refused("chat_template_path", why))?;
    }
    Ok(tokenizer)
}

impl<N: CausalModel> Task<N> for Sft {
    type Config = SFTConfig;
    /// TRL's order: eos_token, then chat_template_path (whose directory form sets the
    /// end-of-sequence token again, from that tokenizer).
    fn tokenizer(config: &SFTConfig, tokenizer: TextTokenizer) -> Result<TextTokenizer> {
        tokenizer_keys(tokenizer, &config.eos_token, &config.chat_template_path)
    }

    fn load(config: &SFTConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        Ok(Sft {
            data: TrainData::load(config, tokenizer)?,
            collate_options: collate_options(config, None, tokenizer.pad_token_id),
            dft: config.loss_type == "dft",
        })
    }

    fn num_rows(&self) -> usize {
        self.data.train_rows.len()
    }

    fn prepare(&mut self, config: &SFTConfig, core: &Core<'_, N>) -> Result<()> {
        self.collate_options =
            collate_options(config, core.model.split(), core.tokenizer.pad_token_id);
        Ok(())
    }

    fn step(
        &mut self,
        core: &Core<'_, N>,
        rows: &[Vec<usize>],
        grads: &mut StepGrads,
    ) -> Result<TaskStep> {
        let (batches, local_tokens) = self.micro_batches(core, rows)?;
        let local_targets: usize = batches.iter().map(|x| x.num_target_tokens).sum();
        let totals = core.batch_sum(&[local_targets as f64, local_tokens as f64])?;
        let (targets, tokens) = (totals[0].max(1.0), totals[1] as usize);
        let mut local_loss = 0.0;
        // Per micro-batch: its targets' summed entropy, argmax hits and count (TRL's figures).
        let mut local_figures = Vec::with_capacity(3 * batches.len());
        // A mixture of experts' router loss, per micro-batch, averaged over the step's
        // micro-batches and the data-parallel ranks (TRL's weighting).
        let router = RouterLosses::new(core, batches.len());
        for (micro, batch) in batches.iter().enumerate() {
            let aux = router.begin(batch)?;
            let ls = core.training_forward(micro, || {
                router.during(&aux, || self.loss(core, batch, true))
            })?;
            let (loss, figures) = read_back(&ls)?;
            local_loss += loss;
            local_figures.extend(figures);
            let store = core.model.backward(&(ls.sum / targets)?)?;
            core.accumulate(grads, store, batches.len())?;
            router.end(aux);
        }
        // One collective for the loss and every micro-batch's figures.
        let sums = core.batch_sum(&[&[local_loss][..], &local_figures].concat())?;
        let mut loss = sums[0] / targets;
        let mut metrics = mean_token_figures(&sums[1..]).to_vec();
        if let Some(aux) = router.mean(core)? {
            loss += core.router_loss_weight * aux;
            metrics.push(("aux_loss", aux));
        }
        Ok(TaskStep {
            loss,
            tokens,
            metrics,
        })
    }

    /// Eval loss over the held-out rows and exact-match accuracy of greedy answers, each rank
    /// taking every dp-th row and prompt. With sharded parameters the ranks run the same
    /// number of forwards (ranks with fewer rows repeat a row and drop the result).
    fn evaluate(&self, config: &SFTConfig, core: &Core<'_, N>) -> Result<Option<EvalResult>> {
        let data = &self.data;
        if data.eval_rows.is_empty() {
            return Ok(None);
        }
        let (rank, world) = (core.dp.rank(), core.dp.size());
        let deal = BatchDeal {
            len: data.eval_rows.len(),
            batch: config.training.per_device_eval_batch_size,
            world,
            drop_last: config.training.dataloader_drop_last,
        };
        // Each round's sums of every rank in its slot: loss, targets, entropy, argmax hits,
        // and a mixture of experts' router loss (whole rows' on every chunk of them: each
        // chunk adds its share).
        let mut slots = EvalSlots::new(deal, 5);
        let router = RouterLosses::for_evaluation(core);
        let chunks = (core.batch_group.size() / world).max(1) as f64;
        for round in 0..deal.rounds() {
            let rows: Vec<&PackedSequence> = deal
                .rows(round, rank)
                .into_iter()
                .map(|i| &data.eval_rows[i])
                .collect();
            let batch = collate(&rows, self.collate_options, &Device::Cpu)?
                .part(core.model.split())?
                .to_device(core.ctx.device())?;
            let aux = router.begin(&batch)?;
            let ls = router.during(&aux, || self.loss(core, &batch, false))?;
            let (loss, [entropy, hits, targets]) = read_back(&ls)?;
            let aux = router.end(aux).unwrap_or(0.0) / chunks;
            slots.set(round, rank, &[loss, targets, entropy, hits, aux]);
        }
        let mut correct = 0.0;
        // Greedy answers in batches of the eval batch size; a rank short of prompts still
        // runs the rounds collective forwards need, on a prompt whose answers it drops.
        let prompts: Vec<_> = data.eval_prompts.iter().skip(rank).step_by(world).collect();
        let per = config.training.per_device_eval_batch_size.max(1);
        let own = prompts.len().div_ceil(per);
        for round in 0..core.rounds(data.eval_prompts.len(), per, own) {
            let chunk: Vec<_> = prompts
                .iter()
                .skip(round * per)
                .take(per)
                .copied()
                .collect();
            let asked: Vec<&[u32]> = match chunk.is_empty() {
                true => data
                    .eval_prompts
                    .iter()
                    .take(1)
                    .map(|(p, _)| &p[..])
                    .collect(),
                false => chunk.iter().map(|(p, _)| &p[..]).collect(),
            };
            let answers = core.generate(&asked, MAX_NEW_TOKENS)?;
            for ((_, want), got) in chunk.iter().zip(answers) {
                if core.tokenizer.decode(&got, true)?.trim() == want {
                    correct += 1.0;
                }
            }
        }
        // Loss sums come from every sequence chunk; answers are generated whole on each.
        let slots = slots.summed(|v| core.batch_sum(v))?;
        let correct = core.global_sum(&[correct])?[0];
        let (loss, figures) = trl_evaluation(&slots, core.router_loss_weight);
        let aux_loss = (core.router_loss_weight != 0.0).then(|| slots.kept_mean(4));
        Ok(Some(EvalResult {
            loss,
            accuracy: (!data.eval_prompts.is_empty())
                .then(|| correct / data.eval_prompts.len() as f64),
            aux_loss,
            figures: figures.to_vec(),
        }))
    }
}

/// TRL's eval_loss, eval_entropy and eval_mean_token_accuracy from each round's per-rank
/// sums (loss, targets, entropy, hits), as transformers' evaluation loop and TRL's
/// SFTTrainer compute them (see [`EvalSlots`]): a rank's batch loss is its mean over its
/// targets, repeated once per real row; entropy and accuracy are per round over the ranks
/// `gather_for_metrics` keeps. A batch's loss includes its router loss times `router_weight`
/// (TRL's SFTTrainer adds it to each batch's).
fn trl_evaluation(slots: &EvalSlots, router_weight: f64) -> (f64, [(&'static str, f64); 2]) {
    (
        slots.loss(|s| s[0] / s[1].max(1.0) + router_weight * s[4]),
        [
            ("entropy", slots.kept_ratio(2, 1)),
            ("mean_token_accuracy", slots.kept_ratio(3, 1)),
        ],
    )
}

/// A micro-batch's summed loss and its targets' summed entropy, argmax hits and count (this
/// rank's part), read from the device in one transfer.
fn read_back(ls: &LossSum) -> Result<(f64, [f64; 3])> {
    let sum = ls
        .sum
        .detach()
        .to_dtype(candle_core::DType::F32)?
        .reshape(1)?;
    let v = candle_core::Tensor::cat(&[&sum, &ls.stats], 0)?.to_vec1::<f32>()?;
    Ok((v[0] as f64, [v[1] as f64, v[2] as f64, ls.count as f64]))
}

/// TRL's `entropy` and `mean_token_accuracy` from [`read_back`]'s figures summed over the ranks:
/// each micro-batch's sums divided by its targets (0 without any), averaged over the
/// micro-batches, as TRL appends one value per micro-batch and logs their mean.
fn mean_token_figures(sums: &[f64]) -> [(&'static str, f64); 2] {
    let (mut entropy, mut accuracy) = (0.0, 0.0);
    let batches = sums.chunks(3);
    let n = batches.len().max(1) as f64;
    for b in batches.filter(|b| b[2] > 0.0) {
        entropy += b[0] / b[2];
        accuracy += b[1] / b[2];
    }
    [
        ("entropy", entropy / n),
        ("mean_token_accuracy", accuracy / n),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch means TRL 1.16 computed under torchrun for 8 rows in batches of 3 on 2 ranks
    /// (the second round's rank-0 batch holds rows 6, 7 and 0): its eval_loss, 5.3273087,
    /// weights each mean by the real rows it stands for (3, 3, 2; rank 1's refill cut).
    #[test]
    fn eval_loss_weights_batch_means_by_their_real_rows() {
        let deal = BatchDeal {
            len: 8,
            batch: 3,
            world: 2,
            drop_last: false,
        };
        let batch = |mean: f64, targets: f64| [mean * targets, targets, 0.0, 0.0, 0.0];
        let slots = [
            batch(5.28835, 10.0),
            batch(5.34399, 10.0),
            batch(5.36073, 9.0),
            batch(5.26521, 10.0),
        ]
        .concat();
        let (loss, _) = trl_evaluation(&EvalSlots::from_values(deal, 5, slots), 0.0);
        assert!((loss - 5.3273087).abs() < 1e-5, "{loss}");
    }

    /// 7 rows in batches of 3 on 2 ranks: the last round holds one real row, so only rank 0's
    /// sums count there (gather_for_metrics cuts the gathered [2] to 1), and its loss once.
    /// A mixture of experts' router loss is added to each batch's loss (weighted by its
    /// coefficient) and logged as the mean over the kept ranks of each round.
    #[test]
    fn the_last_rounds_refill_is_cut_as_accelerate_cuts_it() {
        let deal = BatchDeal {
            len: 7,
            batch: 3,
            world: 2,
            drop_last: false,
        };
        let slots = [
            [6.0, 3.0, 9.0, 1.0, 1.0],
            [12.0, 3.0, 12.0, 2.0, 2.0],
            [3.0, 3.0, 6.0, 3.0, 4.0],
            [30.0, 3.0, 30.0, 0.0, 8.0],
        ]
        .concat();
        let slots = EvalSlots::from_values(deal, 5, slots);
        let (loss, [(_, entropy), (_, accuracy)]) = trl_evaluation(&slots, 0.0);
        assert!((loss - 19.0 / 7.0).abs() < 1e-12, "{loss}");
        assert!((entropy - 2.75).abs() < 1e-12, "{entropy}");
        assert!((accuracy - 0.75).abs() < 1e-12, "{accuracy}");
        // (3 x (2 + 0.1) + 3 x (4 + 0.2) + 1 x (1 + 0.4)) / 7; rank 1's 8 is all refill.
        let (loss, _) = trl_evaluation(&slots, 0.1);
        assert!((loss - 20.3 / 7.0).abs() < 1e-12, "{loss}");
        let aux = slots.kept_mean(4);
        assert!((aux - (1.5 + 4.0) / 2.0).abs() < 1e-12, "{aux}");
    }
}
