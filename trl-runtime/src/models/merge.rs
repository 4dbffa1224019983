//! An adapter merged into its base, as peft's `merge_and_unload()` then `save_pretrained()`
//! write it: every adapted weight becomes `W + scale * B A` (with DoRA, each row of that
//! rescaled to its magnitude; computed in f32, stored in the base's dtype), modules trained whole replace the base's, everything else is copied. The
//! result is a plain transformers checkpoint (`cargo trl merge`).
//!
//! It works on the checkpoint files, not on a built model, so any architecture merges (user
//! models included), and it streams: the base's tensors are read, merged and written a shard
//! at a time (at most `max_shard_bytes` of them in memory besides the adapters). The output
//! is written into a sibling temporary directory and renamed into place when complete.

use super::params::{write_atomic, write_safetensors, WeightFiles, CONFIG_FILE, INDEX_FILE};
use super::peft;
use crate::error::{Error, Result};
use candle_core::{DType, Device};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Files of a model directory that travel with its weights (tokenizer, generation settings).
const COMPANIONS: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

const HEAD: &str = "lm_head.weight";
const EMBEDDING: &str = "model.embed_tokens.weight";

/// What a merge did.
#[derive(Debug, Clone)]
pub struct MergeReport {
    /// The base model directory the adapter was merged into.
    pub base: PathBuf,
    /// Weights that took an adapter's `scale * B A`.
    pub merged: usize,
    /// Weights replaced by a module trained whole (`modules_to_save`).
    pub replaced: usize,
    /// Weights copied unchanged.
    pub copied: usize,
    /// Files the output's weights were written to.
    pub files: usize,
}

/// The base of `adapter_dir`: `base` when given, else its adapter_config.json's
/// `base_model_name_or_path` (which must be a local directory: nothing is downloaded).
fn base_dir(adapter_dir: &Path, base: Option<&Path>) -> Result<PathBuf> {
    if let Some(b) = base {
        return Ok(b.to_path_buf());
    }
    let path = adapter_dir.join(peft::ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(path.display().to_string(), "<document>", e.to_string()))?;
    let named = json["base_model_name_or_path"].as_str().unwrap_or("");
    let dir = PathBuf::from(named);
    if named.is_empty() || !dir.join(CONFIG_FILE).is_file() {
        return Err(Error::config(
            path.display().to_string(),
            "base_model_name_or_path",
            format!(
                "'{named}' is not a local model directory: name the base with \
                 --model_name_or_path DIR"
            ),
        ));
    }
    Ok(dir)
}

/// Merges the adapter in `adapter_dir` into its base (`base`, or the one its config names)
/// and writes the merged checkpoint to `out`, which must not exist yet. Weights are split
/// into files of at most `max_shard_bytes` (one file when they fit), as `save_pretrained`'s
/// max_shard_size does.
pub fn merge_adapter(
    adapter_dir: &Path,
    base: Option<&Path>,
    out: &Path,
    max_shard_bytes: usize,
) -> Result<MergeReport> {
    let base = base_dir(adapter_dir, base)?;
    if out.exists() {
        return Err(Error::config(
            out.display().to_string(),
            "--output_dir",
            "already exists: name a new directory (nothing is overwritten)",
        ));
    }
    let (config, mut adapters) = peft::read(adapter_dir, DType::F32, &Device::Cpu)?;
    let scale = config.scale();
    let files = WeightFiles::open(&base)?;
    // (name, the base tensor it starts from, bytes), in name order.
    let mut plan: Vec<(String, String, usize)> = files
        .tensor_infos()
        .into_iter()
        .map(|(name, _, bytes)| (name.clone(), name, bytes))
        .collect();
    // A head tied to the embedding (no lm_head tensor) parts from it when either is trained
    // whole: the head is written (the trained one, or the embedding it was before) and the
    // config unties them.
    let untie = !plan.iter().any(|p| p.0 == HEAD)
        && (adapters.contains_key(HEAD) || adapters.contains_key(EMBEDDING))
        && plan.iter().any(|p| p.0 == EMBEDDING);
    if untie {
        let bytes = plan.iter().find(|p| p.0 == EMBEDDING).expect("checked").2;
        plan.push((HEAD.into(), EMBEDDING.into(), bytes));
        plan.sort();
    }

    // Shards of whole tensors in name order, by their stored size.
    let mut shards: Vec<Vec<&(String, String, usize)>> = vec![Vec::new()];
    let mut filled = 0usize;
    for entry in &plan {
        if filled > 0 && filled + entry.2 > max_shard_bytes {
            shards.push(Vec::new());
            filled = 0;
        }
        filled += entry.2;
        shards.last_mut().expect("one shard").push(entry);
    }

    let tmp = out.with_file_name(format!(
        ".{}.merging",
        out.file_name()
            .map_or("merged".into(), |n| n.to_string_lossy())
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::io(format!("cannot create {}", tmp.display()), e))?;
    let mut report = MergeReport {
        base: base.clone(),
        merged: 0,
        replaced: 0,
        copied: 0,
        files: shards.len(),
    };
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, shard) in shards.iter().enumerate() {
        let file = match shards.len() {
            1 => super::params::SINGLE_FILE.to_string(),
            n => format!("model-{:05}-of-{:05}.safetensors", i + 1, n),
        };
        let mut tensors = Vec::with_capacity(shard.len());
        for (name, source, bytes) in shard.iter().map(|e| (&e.0, &e.1, e.2)) {
            let w = files.load_stored(source)?;
            let stem = name.strip_suffix(".weight").unwrap_or(name);
            let (a, b) = (
                adapters.remove(&format!("{stem}.lora_A.weight")),
                adapters.remove(&format!("{stem}.lora_B.weight")),
            );
            let merged = match (a, b, adapters.remove(name.as_str())) {
                (Some(a), Some(b), None) => {
                    report.merged += 1;
                    let magnitude = adapters.remove(&format!("{stem}.lora_magnitude_vector"));
                    let delta = (b.matmul(&a)? * scale)?;
                    let shape = w.dims().to_vec();
                    let delta = delta.reshape(shape.as_slice()).map_err(|_| {
                        Error::config(
                            adapter_dir.display().to_string(),
                            format!("{stem}.lora_B.weight"),
                            format!(
                                "B A has shape {:?} but the base's {name} has {shape:?}: the \
                                 adapter was trained on another model",
                                delta.dims()
                            ),
                        )
                    })?;
                    let adapted = (w.to_dtype(DType::F32)? + delta)?;
                    // DoRA: each row rescaled to its trained magnitude.
                    let adapted = match magnitude {
                        Some(m) => {
                            let norm = adapted.sqr()?.sum_keepdim(1)?.sqrt()?;
                            let m = m.reshape((m.elem_count(), 1))?;
                            adapted.broadcast_mul(&m.broadcast_div(&norm)?)?
                        }
                        None => adapted,
                    };
                    adapted.to_dtype(w.dtype())?
                }
                (None, None, Some(whole)) => {
                    report.replaced += 1;
                    whole.to_dtype(w.dtype())?
                }
                (None, None, None) => {
                    report.copied += 1;
                    w
                }
                _ => {
                    return Err(Error::config(
                        adapter_dir.display().to_string(),
                        stem,
                        "holds only one of lora_A / lora_B, or an adapter and a whole module \
                         for the same layer: not a complete adapter",
                    ))
                }
            };
            weight_map.insert(name.clone(), serde_json::Value::String(file.clone()));
            total += bytes;
            tensors.push((name.clone(), merged));
        }
        write_safetensors(&tmp.join(&file), &tensors, &metadata)?;
    }
    // Every adapter tensor must have found its base weight.
    if let Some(name) = adapters.keys().next() {
        return Err(Error::config(
            adapter_dir
                .join(peft::ADAPTER_WEIGHTS)
                .display()
                .to_string(),
            name,
            format!(
                "has no weight to merge into in {} ({} such tensors): the adapter belongs to \
                 another model",
                base.display(),
                adapters.len()
            ),
        ));
    }
    if shards.len() > 1 {
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_atomic(
            &tmp.join(INDEX_FILE),
            serde_json::to_string_pretty(&index)
                .expect("json")
                .as_bytes(),
        )?;
    }
    let config_path = base.join(CONFIG_FILE);
    let mut config_json: serde_json::Value = std::fs::read_to_string(&config_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| {
            Error::config(
                config_path.display().to_string(),
                "<document>",
                "unreadable",
            )
        })?;
    if untie {
        config_json["tie_word_embeddings"] = false.into();
    }
    write_atomic(
        &tmp.join(CONFIG_FILE),
        serde_json::to_string_pretty(&config_json)
            .expect("json")
            .as_bytes(),
    )?;
    // The tokenizer saved beside the adapter (a trainer checkpoint's), else the base's.
    for name in COMPANIONS {
        let from = [adapter_dir.join(name), base.join(name)]
            .into_iter()
            .find(|p| p.is_file());
        if let Some(from) = from {
            copy_file(&from, &tmp.join(name))?;
        }
    }
    std::fs::rename(&tmp, out).map_err(|e| {
        Error::io(
            format!("cannot move {} to {}", tmp.display(), out.display()),
            e,
        )
    })?;
    Ok(report)
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| Error::io(format!("cannot copy {}", from.display()), e))
}
