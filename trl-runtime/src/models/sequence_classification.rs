//! transformers' `AutoModelForSequenceClassification` over every built-in causal architecture:
//! the causal model's body with a `score` head (`num_labels` outputs, no bias) in place of the
//! LM head, read at each row's last token that is not the pad (transformers'
//! `GenericForSequenceClassification`). A reward model is one (TRL's RewardTrainer saves one
//! with `num_labels` 1), and GRPO scores completions with it
//! (`reward_funcs: [path/to/reward-model]`).
//!
//! [`SequenceClassifier`] is the same network as a [`CausalModel`] whose head is `score`, so
//! that the trainer trains it under every strategy (the reward trainer, train/reward.rs);
//! [`classifier_start`] makes the checkpoint it starts from out of a causal LM, as
//! transformers' `from_pretrained` does when a causal LM is read as a classifier (its
//! `lm_head` left out, `score` initialised afresh).

use super::auto::AutoModelForCausalLM;
use super::causal::CausalModel;
use super::causal::LayerInputs;
use super::params::{read_config, shapes_and_aliases, FilesBackend, WeightFiles};
use crate::error::{Error, Result};
use crate::nn::{Linear, Weight};
use crate::Parallelize;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A sequence classifier (a reward model) built from a transformers checkpoint.
pub struct AutoModelForSequenceClassification {
    net: RewardModel,
    /// The token that pads rows on the right: a row is read at its last other token. None:
    /// rows are read at their last position, and only one row at a time (transformers).
    pub pad_token_id: Option<u32>,
    device: Device,
}

/// What config.json says of the classifier: the body's config (its text, for
/// [`CausalModel::parse_config`]), the pad token and the number of labels.
fn classifier_config(text: &str, source: &str) -> Result<ClassifierConfig<String>> {
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

/// A classifier's config: its body's, its number of labels and its pad token.
#[derive(Debug, Clone)]
pub struct ClassifierConfig<C> {
    pub body: C,
    pub num_labels: usize,
    pub pad_token_id: Option<u32>,
}

/// transformers' `...ForSequenceClassification` over causal model `N`, trainable: `N`'s
/// body (its LM head tied to the embedding and never used, so it is no parameter) and the
/// `score` head, whose outputs at every position are [`CausalModel::lm_head`]'s "logits"
/// (a reward per position; the trainer reads each row's at its last token). `score` is
/// replicated under tensor parallelism.
#[derive(Parallelize)]
pub struct SequenceClassifier<N: CausalModel = AutoModelForCausalLM> {
    #[parallel(name = "")]
    pub body: N,
    pub score: Linear,
}

/// The classifier over the built-in model of its `model_type`.
pub type RewardModel = SequenceClassifier<AutoModelForCausalLM>;

impl<N: CausalModel> CausalModel for SequenceClassifier<N> {
    type Config = ClassifierConfig<N::Config>;

    fn parse_config(text: &str, source: &str) -> Result<Self::Config> {
        let c = classifier_config(text, source)?;
        Ok(ClassifierConfig {
            body: N::parse_config(&c.body, source)?,
            num_labels: c.num_labels,
            pad_token_id: c.pad_token_id,
        })
    }

    fn new(config: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        let body = N::new(&config.body, vb.clone())?;
        let hidden = match &body.lm_head().weight {
            Weight::Local(w) => w.dim(1)?,
            Weight::Sharded(s) => s.dims()[1],
        };
        let score = crate::nn::linear_no_bias(hidden, config.num_labels, vb.pp("score"))?;
        Ok(SequenceClassifier { body, score })
    }

    fn embed(&self, input_ids: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor> {
        self.body.embed(input_ids, cx)
    }

    fn num_layers(&self) -> usize {
        self.body.num_layers()
    }

    fn layer(&self, l: usize, x: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor> {
        self.body.layer(l, x, cx)
    }

    fn final_norm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.body.final_norm(x)
    }

    /// The score head (no soft-capping: transformers' classifiers apply none).
    fn lm_head(&self) -> &Linear {
        &self.score
    }

    fn may_skip_grad(&self, name: &str) -> bool {
        self.body.may_skip_grad(name)
    }

    fn heads(&self) -> Option<(usize, usize)> {
        self.body.heads()
    }

    fn supports_tiled_mlp(&self) -> bool {
        self.body.supports_tiled_mlp()
    }
}

/// Where transformers reads a sequence's score: its rightmost token that is not the pad (its
/// first when every one is), whatever the attention mask says.
pub fn read_position(ids: &[u32], pad_token_id: u32) -> usize {
    ids.iter().rposition(|&t| t != pad_token_id).unwrap_or(0)
}

/// The file beside the linked weights that holds a fresh `score`.
const SCORE_FILE: &str = "score.safetensors";
/// What a start directory was made from (reused when it matches).
const START_SOURCE: &str = "start_source.json";

/// The classifier checkpoint a reward model trains from, as TRL's RewardTrainer loads
/// `model_name_or_path` (`AutoModelForSequenceClassification`, `num_labels` 1, the
/// tokenizer's pad token in the config): `dir` itself when it holds such a classifier with
/// that pad token; otherwise `under/reward-model-start-HASH` made from it: config.json as
/// transformers writes the classifier's, links to `dir`'s weight files and tokenizer, an index
/// that leaves the LM head out, and for a causal LM a `score` of normal(0,
/// initializer_range) values drawn from `seed` (transformers draws its own: the same law, not
/// the same values). HASH stands for the source (its path, config and weight files' sizes
/// and times), the seed and the pad token; the directory is made once, by a rename.
pub fn classifier_start(dir: &Path, under: &Path, seed: u64, pad_token_id: u32) -> Result<PathBuf> {
    let (text, source) = read_config(dir)?;
    let mut config: Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(&source, "<json>", format!("not a valid model config: {e}")))?;
    let arch = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let is_classifier = arch.ends_with("ForSequenceClassification");
    if is_classifier {
        let c = classifier_config(&text, &source)?;
        if c.num_labels != 1 {
            return Err(Error::config(
                &source,
                "num_labels",
                format!("{}: a reward model has one output (TRL refuses others too): start from a causal LM or a classifier saved with num_labels 1", c.num_labels),
            ));
        }
        if c.pad_token_id == Some(pad_token_id) {
            return Ok(dir.to_path_buf());
        }
    } else {
        // Named from the model_type as transformers names its classes (gemma3_text:
        // Gemma3TextForSequenceClassification, whatever the causal class is called).
        let model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !arch.is_empty() && !arch.ends_with("ForCausalLM") {
            return Err(Error::config(
                &source,
                "architectures",
                format!("'{arch}' is neither a causal LM (...ForCausalLM) nor a sequence classifier: a reward model starts from one of them"),
            ));
        }
        let base = match model_type {
            "" => arch.trim_end_matches("ForCausalLM").to_string(),
            t => class_prefix(t),
        };
        if base.is_empty() {
            return Err(Error::config(
                &source,
                "model_type",
                "missing: the classifier's class is named from it",
            ));
        }
        if super::composite::text_config(&config).is_some() {
            return Err(Error::config(&source, "text_config", "a vision-language checkpoint cannot start a reward model here: start from its language model"));
        }
        let m = config.as_object_mut().expect("an object");
        m.insert(
            "architectures".into(),
            vec![format!("{base}ForSequenceClassification")].into(),
        );
        m.insert("id2label".into(), serde_json::json!({"0": "LABEL_0"}));
        m.insert("label2id".into(), serde_json::json!({"LABEL_0": 0}));
    }
    let m = config.as_object_mut().expect("an object");
    m.insert("pad_token_id".into(), pad_token_id.into());
    let abs = dir
        .canonicalize()
        .map_err(|e| Error::io(format!("cannot resolve {}", dir.display()), e))?;
    let io = |what: &str, e: std::io::Error| {
        Error::io(
            format!(
                "{what} (making the reward model's start under {})",
                under.display()
            ),
            e,
        )
    };
    // The weight files: the source index's, or its single file.
    let (files, listed) = match std::fs::read_to_string(abs.join(super::params::INDEX_FILE)) {
        Ok(text) => {
            let json: Value = serde_json::from_str(&text).map_err(|e| {
                Error::config(
                    &source,
                    super::params::INDEX_FILE,
                    format!("not valid JSON: {e}"),
                )
            })?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            let mut files: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            let names = map
                .into_iter()
                .filter_map(|(k, v)| Some((k, v.as_str()?.to_string())))
                .collect();
            (files, Some(names))
        }
        Err(_) => (
            vec![super::params::SINGLE_FILE.to_string()],
            None::<TensorFiles>,
        ),
    };
    // What it is made from: a re-saved model at the same path makes another.
    let mut stamp = format!("{}|{seed}|{pad_token_id}|{text}", abs.display());
    for f in &files {
        let meta =
            std::fs::metadata(abs.join(f)).map_err(|e| io("cannot read a weight file", e))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        stamp.push_str(&format!("|{f}:{}:{mtime:?}", meta.len()));
    }
    let hash = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        stamp.hash(&mut h);
        h.finish()
    };
    // One directory per source: never replaced, so ranks racing to make it cannot remove
    // one another's (the first rename wins, the others use it).
    let out = under.join(format!("reward-model-start-{hash:016x}"));
    if out.join(START_SOURCE).exists() {
        return Ok(out);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = under.join(format!(
        ".reward-model-start.tmp-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&tmp).map_err(|e| io("cannot create its directory", e))?;
    let made =
        make_start(&abs, &tmp, (&files, listed), &config, (is_classifier, seed)).and_then(|()| {
            std::fs::write(tmp.join(START_SOURCE), &stamp).map_err(|e| io("cannot write a file", e))
        });
    if let Err(e) = made {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if std::fs::rename(&tmp, &out).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    match out.join(START_SOURCE).exists() {
        true => Ok(out),
        false => Err(Error::config(
            under.display().to_string(),
            "output_dir",
            "the reward model's start directory could not be made here",
        )),
    }
}

/// (tensor name, its weight file) as a sharded index lists them.
type TensorFiles = Vec<(String, String)>;

/// Fills `tmp` with the start of a classifier over `abs`'s weight `files` (and the tensor
/// names its index `listed`): links to them and to the tokenizer's files, an index without
/// the LM head, `config`, and for a causal LM a fresh `score`.
fn make_start(
    abs: &Path,
    tmp: &Path,
    (files, listed): (&[String], Option<TensorFiles>),
    config: &Value,
    (is_classifier, seed): (bool, u64),
) -> Result<()> {
    let io = |what: &str, e: std::io::Error| Error::io(format!("{what} ({})", tmp.display()), e);
    // transformers reads a model.safetensors before any index: the link is named as a shard,
    // so that the index (and the score in it) is what it reads.
    let link_name = |f: &str| match f {
        super::params::SINGLE_FILE => "model-00001-of-00001.safetensors".to_string(),
        f => f.to_string(),
    };
    let mut weight_map = serde_json::Map::new();
    for f in files {
        let names = match &listed {
            Some(l) => l
                .iter()
                .filter(|(_, file)| file == f)
                .map(|(n, _)| n.clone())
                .collect(),
            None => safetensors_names(&abs.join(f))?,
        };
        for n in names.into_iter().filter(|n| !n.starts_with("lm_head.")) {
            weight_map.insert(n, link_name(f).into());
        }
        link(&abs.join(f), &tmp.join(link_name(f)))
            .map_err(|e| io("cannot link a weight file", e))?;
    }
    // The tokenizer and the rest, but no other weights (an optimizer's state) and nothing
    // this directory writes itself.
    let own = [
        "config.json",
        super::params::INDEX_FILE,
        START_SOURCE,
        SCORE_FILE,
    ];
    for entry in std::fs::read_dir(abs).map_err(|e| io("cannot list the model directory", e))? {
        let entry = entry.map_err(|e| io("cannot list the model directory", e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if own.contains(&name.as_str()) || name.ends_with(".safetensors") || entry.path().is_dir() {
            continue;
        }
        link(&entry.path(), &tmp.join(&name)).map_err(|e| io("cannot link a file", e))?;
    }
    let source = abs.join("config.json").display().to_string();
    if !is_classifier {
        let std = config
            .get("initializer_range")
            .and_then(Value::as_f64)
            .unwrap_or(0.02);
        let hidden = config
            .get("hidden_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| {
                Error::config(&source, "hidden_size", "missing: the score head's width")
            })? as usize;
        let score = seeded_normal(seed, std, hidden)
            .map_err(|why| Error::config(&source, "initializer_range", why))?;
        candle_core::safetensors::save(
            &std::collections::HashMap::from([("score.weight".to_string(), score)]),
            tmp.join(SCORE_FILE),
        )?;
        weight_map.insert("score.weight".into(), SCORE_FILE.into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_default();
    std::fs::write(tmp.join(super::params::INDEX_FILE), pretty(&index))
        .map_err(|e| io("cannot write a file", e))?;
    std::fs::write(tmp.join("config.json"), pretty(config))
        .map_err(|e| io("cannot write a file", e))
}

/// transformers' class-name prefix of `model_type` (`qwen3_moe`: `Qwen3Moe`).
fn class_prefix(model_type: &str) -> String {
    match model_type {
        "smollm3" => "SmolLM3".into(),
        t => t
            .split('_')
            .map(|w| {
                let mut c = w.chars();
                c.next()
                    .map_or(String::new(), |f| f.to_uppercase().chain(c).collect())
            })
            .collect(),
    }
}

/// A symbolic link at `to` to `from` (a copy where links are not supported).
fn link(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(from, to)
    }
    #[cfg(not(unix))]
    {
        std::fs::copy(from, to).map(drop)
    }
}

/// The tensor names of one safetensors file (its header alone).
fn safetensors_names(path: &Path) -> Result<Vec<String>> {
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }?;
    Ok(st.tensors().into_iter().map(|(n, _)| n).collect())
}

/// A [1, hidden] f32 row of normal(0, std) values drawn from `seed`.
fn seeded_normal(seed: u64, std: f64, hidden: usize) -> std::result::Result<Tensor, String> {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = rand_distr::Normal::new(0f32, std as f32)
        .map_err(|e| format!("{std}: not a standard deviation ({e})"))?;
    let values: Vec<f32> = (0..hidden).map(|_| normal.sample(&mut rng)).collect();
    Tensor::from_vec(values, (1, hidden), &Device::Cpu).map_err(|e| e.to_string())
}

impl AutoModelForSequenceClassification {
    /// Checks that model directory `dir` holds a sequence classifier of a built-in model type,
    /// reading config.json alone.
    pub fn check_dir(dir: &Path) -> Result<()> {
        let (text, source) = read_config(dir)?;
        RewardModel::parse_config(&text, &source).map(drop)
    }

    /// The classifier of the transformers checkpoint in `dir` (config.json naming a
    /// `...ForSequenceClassification`, and its weights) in `dtype` on `device`: every tensor
    /// present with its shape, nothing unexpected.
    pub fn from_pretrained(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let (text, source) = read_config(dir)?;
        let config = RewardModel::parse_config(&text, &source)?;
        let files = Arc::new(WeightFiles::open(dir)?);
        let net = RewardModel::new(&config, FilesBackend::var_builder(&files, dtype, device))?;
        let (shapes, aliases) = shapes_and_aliases(&net);
        files.check(&shapes, &aliases)?;
        Ok(AutoModelForSequenceClassification {
            net,
            pad_token_id: config.pad_token_id,
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
        self.net.score.weight.dims()[0]
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
        let read_at: Vec<u32> = match self.pad_token_id {
            Some(pad) => ids.iter().map(|row| read_position(row, pad) as u32).collect(),
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
            super::generate::hidden_states(&self.net.body, (input_ids, &positions), None, false)?;
        let h = hidden.dim(2)?;
        // Row r's state at read_at[r]: row r * s + read_at[r] of the flattened states.
        let flat: Vec<u32> = (0..b).map(|r| r as u32 * s as u32 + read_at[r]).collect();
        let at = Tensor::new(flat, hidden.device())?;
        let pooled = hidden.reshape((b * s, h))?.index_select(&at, 0)?;
        Ok(self.net.score.forward(&pooled)?.to_dtype(DType::F32)?)
    }
}
