//! transformers' `AutoModelForSequenceClassification` over every built-in causal architecture:
//! the causal model's body with a `score` head (`num_labels` outputs, no bias) in place of the
//! LM head, read at each row's last token that is not the pad (transformers'
//! `GenericForSequenceClassification`). A reward model is one (TRL's RewardTrainer saves one
//! with `num_labels` 1), and GRPO scores completions with it
//! (`reward_funcs: [path/to/reward-model]`).

use super::auto::AutoModelForCausalLM;
use super::causal::CausalModel;
use super::params::{read_config, shapes_and_aliases, FilesBackend, WeightFiles};
use crate::error::{Error, Result};
use crate::nn::{Linear, Weight};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// A sequence classifier (a reward model) built from a transformers checkpoint.
pub struct AutoModelForSequenceClassification {
    body: AutoModelForCausalLM,
    score: Linear,
    /// The token that pads rows on the right: a row is read at its last other token. None:
    /// rows are read at their last position, and only one row at a time (transformers).
    pub pad_token_id: Option<u32>,
    device: Device,
}

/// What config.json says of the classifier: the body's config (its text, for
/// [`CausalModel::parse_config`]), the pad token and the number of labels.
struct ClassifierConfig {
    body: String,
    pad_token_id: Option<u32>,
    num_labels: usize,
}

fn classifier_config(text: &str, source: &str) -> Result<ClassifierConfig> {
    let mut config: Value = serde_json::from_str(text)
        .map_err(|e| Error::config(source, "<json>", format!("not a valid model config: {e}")))?;
    let names: Vec<String> = config
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    if !names
        .iter()
        .any(|n| n.ends_with("ForSequenceClassification"))
    {
        return Err(Error::config(
            source,
            "architectures",
            format!(
                "{names:?} is not a sequence classifier: a reward model is a checkpoint saved from transformers' AutoModelForSequenceClassification (TRL's RewardTrainer writes one); a causal LM has no score head"
            ),
        ));
    }
    if super::composite::text_config(&config).is_some() {
        return Err(Error::config(
            source,
            "text_config",
            "a vision-language sequence classifier is not supported: save the language model's classifier (its text config) instead",
        ));
    }
    // transformers: id2label when given (num_labels is derived from it), else num_labels, 2.
    let num_labels = match (config.get("id2label"), config.get("num_labels")) {
        (Some(Value::Object(m)), _) if !m.is_empty() => m.len(),
        (_, Some(n)) => n.as_u64().filter(|&n| n > 0).ok_or_else(|| {
            Error::config(source, "num_labels", format!("{n} is not a positive count"))
        })? as usize,
        _ => 2,
    };
    let pad_token_id = config
        .get("pad_token_id")
        .and_then(Value::as_u64)
        .map(|p| p as u32);
    // The body's head is never used: tie it to the embedding, which every checkpoint has.
    if let Value::Object(m) = &mut config {
        m.insert("tie_word_embeddings".into(), true.into());
    }
    Ok(ClassifierConfig {
        body: config.to_string(),
        pad_token_id,
        num_labels,
    })
}

impl AutoModelForSequenceClassification {
    /// Checks that model directory `dir` holds a sequence classifier of a built-in model type,
    /// reading config.json alone.
    pub fn check_dir(dir: &Path) -> Result<()> {
        let (text, source) = read_config(dir)?;
        let c = classifier_config(&text, &source)?;
        AutoModelForCausalLM::parse_config(&c.body, &source).map(drop)
    }

    /// The classifier of the transformers checkpoint in `dir` (config.json naming a
    /// `...ForSequenceClassification`, and its weights) in `dtype` on `device`: every tensor
    /// present with its shape, nothing unexpected.
    pub fn from_pretrained(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let (text, source) = read_config(dir)?;
        let c = classifier_config(&text, &source)?;
        let config = AutoModelForCausalLM::parse_config(&c.body, &source)?;
        let files = Arc::new(WeightFiles::open(dir)?);
        let vb = FilesBackend::var_builder(&files, dtype, device);
        let body = AutoModelForCausalLM::new(&config, vb.clone())?;
        let Weight::Local(table) = &body.lm_head().weight else {
            unreachable!("a model built from files is held whole")
        };
        let hidden = table.dim(1)?;
        let score = Linear::from_weights(vb.get((c.num_labels, hidden), "score.weight")?, None);
        let (mut shapes, aliases) = shapes_and_aliases(&body);
        shapes.insert("score.weight".into(), vec![c.num_labels, hidden]);
        files.check(&shapes, &aliases)?;
        Ok(AutoModelForSequenceClassification {
            body,
            score,
            pad_token_id: c.pad_token_id,
            device: device.clone(),
        })
    }

    /// The device the weights are on.
    pub fn device(&self) -> Device {
        self.device.clone()
    }

    /// The number of parameters of the classifier in model directory `dir`, from its weight
    /// files' headers; None when `dir` holds no classifier.
    pub fn parameter_count(dir: &Path) -> Option<usize> {
        Self::check_dir(dir).ok()?;
        Some(WeightFiles::open(dir).ok()?.parameter_count())
    }

    pub fn num_labels(&self) -> usize {
        self.score.weight.dims()[0]
    }

    /// Logits [batch, num_labels] (f32) of `input_ids` [batch, seq] (u32), right-padded with
    /// `attention_mask` [batch, seq] 0 on the pads, as transformers computes them: each row
    /// read at its last token that is not the pad.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let _no_grad = crate::kernels::skinny::no_grad();
        let (b, s) = input_ids.dims2()?;
        let mask = attention_mask.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        if let Some(r) = mask
            .iter()
            .position(|m| m.windows(2).any(|w| w[0] == 0 && w[1] != 0))
        {
            return Err(Error::Config {
                file: "attention_mask".into(),
                key: format!("row {r}"),
                message: "padding before a token: pad a classifier's rows on the right (padding_side=\"right\"), as TRL does".into(),
            });
        }
        let ids = input_ids.to_vec2::<u32>()?;
        // transformers: the rightmost position that is not the pad (0 when every one is).
        let read_at: Vec<u32> = match self.pad_token_id {
            Some(pad) => ids
                .iter()
                .map(|row| row.iter().rposition(|&t| t != pad).unwrap_or(0) as u32)
                .collect(),
            None if b == 1 => vec![s as u32 - 1],
            None => {
                return Err(Error::config(
                    "config.json",
                    "pad_token_id",
                    "not set, so rows of a batch cannot be told from their padding: set it (TRL sets the tokenizer's)",
                ))
            }
        };
        let positions = Tensor::arange(0i64, s as i64, input_ids.device())?
            .unsqueeze(0)?
            .repeat((b, 1))?;
        let hidden =
            super::generate::hidden_states(&self.body, (input_ids, &positions), None, false)?;
        let h = hidden.dim(2)?;
        // Row r's state at read_at[r]: row r * s + read_at[r] of the flattened states.
        let flat: Vec<u32> = (0..b).map(|r| r as u32 * s as u32 + read_at[r]).collect();
        let at = Tensor::new(flat, hidden.device())?;
        let pooled = hidden.reshape((b * s, h))?.index_select(&at, 0)?;
        Ok(self.score.forward(&pooled)?.to_dtype(DType::F32)?)
    }
}
