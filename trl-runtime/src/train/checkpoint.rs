//! Checkpoints in HF layout plus what exact resumption needs:
//! `output_dir/checkpoint-N/` holds config.json + model.safetensors + tokenizer files (opens in
//! transformers), optimizer.safetensors (fp32 master weights and moments by parameter name)
//! and trainer_state.json (step, data position, schedule, seed, log history).
//!
//! A checkpoint is written into a hidden temporary directory and renamed into place, so a
//! crash mid-save never leaves a half-written `checkpoint-N`; `latest` only sees complete ones.

use crate::error::{Error, Result};
use crate::models::params::Others;
use crate::models::Params;
use crate::nn::lora::LoraConfig;
use crate::optim::AdamW;
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::data::TextTokenizer;
pub use crate::optim::OPTIMIZER_FILE;
pub const STATE_FILE: &str = "trainer_state.json";

/// Where training stands: enough to continue exactly.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub global_step: usize,
    /// Epoch of the next step and its index within that epoch (the data position).
    pub epoch: usize,
    pub step_in_epoch: usize,
    pub total_steps: usize,
    /// The sampler's seed (its permutation is a function of seed and epoch: the RNG state).
    pub seed: u64,
    /// Logged metrics so far (one JSON object per logging step).
    pub log_history: Vec<serde_json::Value>,
    /// Input tokens trained on so far, all ranks' (padding not counted): logged as TRL's
    /// `num_tokens`.
    #[serde(default)]
    pub num_input_tokens_seen: u64,
    /// The best value of metric_for_best_model so far, the step it was measured at, and that
    /// step's checkpoint once written (transformers' names; null without the metric, and
    /// None when read from a state written before them).
    pub best_metric: Option<f64>,
    pub best_global_step: Option<usize>,
    pub best_model_checkpoint: Option<PathBuf>,
    /// Positions of the current epoch's order dealt before this layout's first round of it:
    /// a run resumed on another layout (world size, batch, accumulation) deals the rest of
    /// the epoch from there; 0 otherwise.
    #[serde(default)]
    pub epoch_start_row: usize,
    /// The rows one step trains over all ranks (the effective batch): with epoch_start_row
    /// and step_in_epoch, where in the epoch a resume on another layout goes on from. None in
    /// checkpoints written before it (read as the same layout).
    #[serde(default)]
    pub effective_batch: Option<usize>,
}

fn checkpoint_step(path: &Path) -> Option<usize> {
    path.file_name()?
        .to_str()?
        .strip_prefix("checkpoint-")?
        .parse()
        .ok()
}

/// Complete checkpoints in `output_dir`, oldest first.
pub fn list(output_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(output_dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.join(STATE_FILE).exists())
                .filter_map(|p| checkpoint_step(&p).map(|s| (s, p)))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// What wrote a checkpoint: adapters on a base (its directory), or a whole model (its
/// architecture's shape, from config.json), to tell another run's checkpoints from this one's.
#[derive(Debug, Clone, PartialEq)]
pub enum RunKind {
    Adapter { base: String },
    Full { shape: String },
}

impl RunKind {
    /// This run's: adapters on `model` when `adapter`, else the whole `model`.
    pub fn of_run(model: &Path, adapter: bool) -> RunKind {
        let resolved = crate::hub::resolve(crate::hub::RepoKind::Model, model);
        let model = resolved.as_deref().unwrap_or(model);
        match adapter {
            true => RunKind::Adapter {
                base: canonical(model),
            },
            false => RunKind::Full {
                shape: shape_of(model),
            },
        }
    }

    /// A checkpoint's (`None`: not one a trainer wrote).
    fn of_checkpoint(dir: &Path) -> Option<RunKind> {
        if dir.join(crate::models::peft::ADAPTER_CONFIG).is_file() {
            let text =
                std::fs::read_to_string(dir.join(crate::models::peft::ADAPTER_CONFIG)).ok()?;
            let json: serde_json::Value = serde_json::from_str(&text).ok()?;
            let base = Path::new(json["base_model_name_or_path"].as_str()?);
            let resolved = crate::hub::resolve(crate::hub::RepoKind::Model, base);
            return Some(RunKind::Adapter {
                base: canonical(resolved.as_deref().unwrap_or(base)),
            });
        }
        dir.join("config.json").is_file().then(|| RunKind::Full {
            shape: shape_of(dir),
        })
    }

    fn describe(&self) -> String {
        match self {
            RunKind::Adapter { base } => format!("LoRA adapters on {base}"),
            RunKind::Full { shape } => format!("a whole model ({shape})"),
        }
    }
}

fn canonical(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .display()
        .to_string()
}

/// A model's architecture as config.json gives it (what tells one model from another).
fn shape_of(dir: &Path) -> String {
    let json: serde_json::Value = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let text = |c: &serde_json::Value| {
        [
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
        ]
        .iter()
        .map(|k| format!("{k} {}", c[*k]))
        .collect::<Vec<_>>()
        .join(", ")
    };
    // A vision-language checkpoint's language model.
    match json.get("text_config") {
        Some(t) if json.get("hidden_size").is_none() => text(t),
        _ => text(&json),
    }
}

/// Refuses to start a run in an `output_dir` that holds checkpoints another kind of run
/// wrote (`this`: what this run writes), which it would mix with its own and rotate away
/// under save_total_limit, unless `overwrite` (transformers' overwrite_output_dir). A run's
/// own checkpoints (a rerun, a resume) are fine.
pub fn check_output_dir(output_dir: &Path, this: &RunKind, overwrite: bool) -> Result<()> {
    let other = list(output_dir)
        .into_iter()
        .filter_map(|(_, dir)| RunKind::of_checkpoint(&dir).map(|k| (dir, k)))
        .filter(|(_, kind)| kind != this)
        .collect::<Vec<_>>();
    let Some((dir, kind)) = other.first() else {
        return Ok(());
    };
    let message = format!(
        "holds {} of another run ({} checkpoint(s), e.g. {}: {}), and this run trains {}; \
         its checkpoints would be mixed with them and rotated away",
        match other.len() {
            1 => "a checkpoint".to_string(),
            n => format!("{n} checkpoints"),
        },
        other.len(),
        dir.file_name().unwrap_or_default().to_string_lossy(),
        kind.describe(),
        this.describe()
    );
    if overwrite {
        tracing::warn!("{}: {message} (overwrite_output_dir)", output_dir.display());
        return Ok(());
    }
    Err(Error::config(
        output_dir.display().to_string(),
        "output_dir",
        format!("{message}: pass another --output_dir, or --overwrite_output_dir true to write here anyway"),
    ))
}

/// Resolves `resume_from_checkpoint`: a path, or `latest` (the newest complete checkpoint).
pub fn resolve(output_dir: &Path, spec: &str) -> Result<PathBuf> {
    // A bare `--resume_from_checkpoint` (true, as transformers' Trainer takes it) means latest.
    if spec == "latest" || spec.eq_ignore_ascii_case("true") {
        return list(output_dir)
            .pop()
            .map(|(_, p)| p)
            .ok_or_else(|| Error::Config {
                file: output_dir.display().to_string(),
                key: "resume_from_checkpoint".into(),
                message: "`latest` found no complete checkpoint-N directory here".into(),
            });
    }
    let p = PathBuf::from(spec);
    if !p.join(STATE_FILE).exists() {
        return Err(Error::Config {
            file: p.display().to_string(),
            key: "resume_from_checkpoint".into(),
            message: format!("not a complete checkpoint (no {STATE_FILE}): pass a checkpoint-N directory or `latest`"),
        });
    }
    Ok(p)
}

/// What a checkpoint holds of the model.
pub enum Weights<'a> {
    /// The whole model in HF layout: config.json and safetensors (transformers opens it).
    Full {
        params: &'a Params,
        config_json: &'a str,
        /// A vision-language checkpoint's tensors besides its language model's.
        others: Option<Others>,
    },
    /// A LoRA run's adapters (full-size, by our names) in peft's format
    /// (adapter_config.json + adapter_model.safetensors); `base` is the base model's directory.
    Adapter {
        tensors: &'a BTreeMap<String, Tensor>,
        lora: &'a LoraConfig,
        base: &'a Path,
        /// Every parameter name in the model's order (see `peft::save`).
        order: &'a [String],
    },
}

/// Writes checkpoint `state.global_step` under `output_dir` atomically (the weights, the
/// tokenizer files, the optimizer state, the trainer state) and prunes old ones beyond `keep`
/// (the newest are kept). Returns the checkpoint's path. One writer (rank 0).
pub fn save(
    output_dir: &Path,
    weights: Weights<'_>,
    tokenizer: &TextTokenizer,
    optimizer: Option<&AdamW>,
    state: &TrainerState,
    keep: Option<usize>,
) -> Result<PathBuf> {
    let tmp = begin(output_dir, state.global_step)?;
    match weights {
        Weights::Full {
            params,
            config_json,
            others,
        } => write_model_files(&tmp, Some((params, others)), config_json, tokenizer)?,
        Weights::Adapter {
            tensors,
            lora,
            base,
            order,
        } => {
            crate::models::peft::save(&tmp, tensors, lora, base, order)?;
            tokenizer.copy_files(&tmp)?;
        }
    }
    if let Some(optimizer) = optimizer {
        write_optimizer(&tmp, optimizer)?;
    }
    finish(output_dir, &tmp, state, keep)
}

/// The hidden directory checkpoint `step` is written into before it is renamed into place.
/// The name is the same on every rank, so that several ranks can write into it.
pub fn staging_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!(".checkpoint-{step}.tmp"))
}

fn io(what: String, e: std::io::Error) -> Error {
    Error::io(what, e)
}

/// Deletes a checkpoint so that no half-deleted `checkpoint-N` can be seen: it is renamed out
/// of the checkpoint names first (atomic), then removed. A process killed in between leaves
/// only a `.retired-*` directory, which the next save clears.
fn retire(dir: &Path) -> std::io::Result<()> {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let trash = dir.with_file_name(format!(".retired-{name}"));
    if trash.exists() {
        std::fs::remove_dir_all(&trash)?;
    }
    std::fs::rename(dir, &trash)?;
    std::fs::remove_dir_all(&trash)
}

/// Creates (empty) the staging directory of checkpoint `step`; one rank calls it.
pub fn begin(output_dir: &Path, step: usize) -> Result<PathBuf> {
    let tmp = staging_dir(output_dir, step);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .map_err(|e| io(format!("cannot clear {}", tmp.display()), e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(format!("cannot create {}", tmp.display()), e))?;
    Ok(tmp)
}

/// config.json, the tokenizer files and, when given, the weights in HF layout (with a
/// vision-language checkpoint's other tensors).
pub fn write_model_files(
    tmp: &Path,
    params: Option<(&Params, Option<Others>)>,
    config_json: &str,
    tokenizer: &TextTokenizer,
) -> Result<()> {
    let config_json: &str = &tokenizer.model_config(config_json);
    match params {
        Some((p, others)) => p.save(tmp, config_json, None, others)?,
        None => std::fs::write(tmp.join(crate::models::params::CONFIG_FILE), config_json)
            .map_err(|e| io("cannot write config.json".into(), e))?,
    }
    tokenizer.copy_files(tmp)
}

/// optimizer.safetensors: master weights and moments by parameter name, and the step count.
pub fn write_optimizer(tmp: &Path, optimizer: &AdamW) -> Result<()> {
    optimizer.write_file(&tmp.join(OPTIMIZER_FILE))
}

/// Writes the trainer state (its presence marks the checkpoint complete), renames the staging
/// directory into place and prunes old checkpoints beyond `keep`. One rank calls it, after
/// every rank has written its part.
pub fn finish(
    output_dir: &Path,
    tmp: &Path,
    state: &TrainerState,
    keep: Option<usize>,
) -> Result<PathBuf> {
    let final_dir = output_dir.join(format!("checkpoint-{}", state.global_step));
    let json = serde_json::to_string_pretty(state).expect("state serialises");
    std::fs::write(tmp.join(STATE_FILE), json)
        .map_err(|e| io(format!("cannot write {STATE_FILE}"), e))?;
    // Every file on disk before the directory is renamed into place, and the rename itself
    // after: after a power loss a checkpoint-N is whole or absent, never empty files.
    sync_tree(tmp).map_err(|e| io(format!("cannot sync {}", tmp.display()), e))?;
    if final_dir.exists() {
        retire(&final_dir).map_err(|e| io(format!("cannot replace {}", final_dir.display()), e))?;
    }
    std::fs::rename(tmp, &final_dir)
        .map_err(|e| io(format!("cannot move {} into place", final_dir.display()), e))?;
    sync_dir(output_dir).map_err(|e| io(format!("cannot sync {}", output_dir.display()), e))?;
    if let Some(keep) = keep.filter(|k| *k > 0) {
        prune(output_dir, keep, state.best_model_checkpoint.as_deref());
    }
    Ok(final_dir)
}

/// fsync(2) of every file under `dir` (its sub-directories too), then of `dir`.
fn sync_tree(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        match path.is_dir() {
            true => sync_tree(&path)?,
            false => std::fs::File::open(&path)?.sync_all()?,
        }
    }
    sync_dir(dir)
}

/// fsync(2) of a directory: its entries (a rename into it) on disk.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Removes what an interrupted save left in `output_dir`: hidden staging directories
/// (`.checkpoint-N.tmp`, full size) and half-retired old checkpoints (`.retired-*`). Called
/// once at the start of a run, by one rank, before anything is saved.
pub fn clear_stale(output_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(output_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let staging = name.starts_with(".checkpoint-") && name.ends_with(".tmp");
        if (staging || name.starts_with(".retired-")) && entry.path().is_dir() {
            match std::fs::remove_dir_all(entry.path()) {
                Ok(()) => tracing::info!(
                    "removed {}, left by an interrupted save",
                    entry.path().display()
                ),
                Err(e) => tracing::warn!("cannot remove {}: {e}", entry.path().display()),
            }
        }
    }
}

/// Retires the oldest checkpoints beyond `keep`, never the newest (to resume from) nor `best`,
/// as transformers' rotate_checkpoints does.
pub fn prune(output_dir: &Path, keep: usize, best: Option<&Path>) {
    let all = list(output_dir);
    let is_best = |p: &Path| best.is_some_and(|b| b.file_name() == p.file_name());
    let newest = all.last().map(|(_, p)| p.clone());
    let protected = |p: &Path| Some(p) == newest.as_deref() || is_best(p);
    let keep = keep.max(all.iter().filter(|(_, p)| protected(p)).count());
    let mut remaining = all.len();
    for (_, old) in &all {
        if remaining <= keep {
            break;
        }
        if !protected(old) {
            let _ = retire(old);
            remaining -= 1;
        }
    }
}

/// Retires every checkpoint in `output_dir` but `dir` (load_best_model_at_end with
/// save_total_limit 1). One rank calls it.
pub fn keep_only(output_dir: &Path, dir: &Path) {
    for (_, other) in list(output_dir) {
        if other.file_name() != dir.file_name() {
            let _ = retire(&other);
        }
    }
}

/// The trainer state of a checkpoint (where training stands).
pub fn read_trainer_state(dir: &Path) -> Result<TrainerState> {
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path)
        .map_err(|e| Error::io(format!("cannot read {}", state_path.display()), e))?;
    serde_json::from_str(&text).map_err(|e| Error::Config {
        file: state_path.display().to_string(),
        key: "<document>".into(),
        message: format!("not a trainer state: {e}"),
    })
}

/// Loads a checkpoint's optimizer state into `optimizer` (same parameter names) and returns
/// the trainer state. The model weights are loaded separately (`CausalLm::from_pretrained`).
pub fn load_training_state(dir: &Path, optimizer: &mut AdamW) -> Result<TrainerState> {
    let state = read_trainer_state(dir)?;
    let step = optimizer.read_file(&dir.join(OPTIMIZER_FILE))?;
    optimizer.step = step.unwrap_or(state.global_step as u64);
    Ok(state)
}
