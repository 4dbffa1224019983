//! An adapter merged into its base, as peft's `merge_and_unload()` then `save_pretrained()`
//! write it: every adapted weight becomes `W + scale * B A` (with DoRA, each row of that
//! rescaled to its magnitude; computed in f32, stored in the base's dtype), modules trained
//! whole replace the base's, everything else is copied. The result is a plain transformers
//! checkpoint (`cargo trl merge`).
//!
//! It works on the checkpoint files, not on a built model, so any architecture merges (user
//! models included), and it streams: the base's tensors are read, merged and written a
//! tensor at a time ([`crate::models::tensor_file::write_weights`]). The output is written into a
//! sibling temporary directory and renamed into place when complete.

use super::peft;
use crate::data::tokenize::TOKENIZER_FILES;
use crate::error::{Error, Result};
use crate::models::params::{read_config, write_atomic, WeightFiles, CONFIG_FILE};
use crate::models::tensor_file::{write_weights, TensorSpec};
use crate::nn::lora::LoraConfig;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use super::peft::{TIED_EMBEDDING as EMBEDDING, TIED_HEAD as HEAD};
use crate::kernels::grouped::ExpertLayout;

/// The base's parameters adapted directly, each with how peft reads it.
type Sites = std::collections::HashMap<String, ExpertLayout>;

/// A base directory's [`Sites`], as `sites_of` gives them.
pub type SitesOf<'a> = &'a dyn Fn(&Path) -> Result<Vec<(String, ExpertLayout)>>;

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

/// The base weight an adapter tensor belongs to (`...q_proj.lora_A.weight` ->
/// `...q_proj.weight`; a parameter adapted directly, one of `sites`, is the stem itself; a
/// module trained whole is its own).
fn target_of(adapter_tensor: &str, sites: &Sites) -> String {
    [
        ".lora_A.weight",
        ".lora_B.weight",
        ".lora_magnitude_vector",
        ".lora_embedding_A",
        ".lora_embedding_B",
        ".token_adapter.trainable_tokens_delta",
    ]
    .iter()
    .find_map(|suffix| adapter_tensor.strip_suffix(suffix))
    .map_or_else(
        || adapter_tensor.to_string(),
        |stem| match sites.contains_key(stem) {
            true => stem.to_string(),
            false => format!("{stem}.weight"),
        },
    )
}

/// `w` with its adapter merged in: `W + scale B A`, each row rescaled to DoRA's magnitude
/// `m` when there is one; f32 math, `w`'s dtype.
fn merged_weight(
    w: &Tensor,
    (a, b, layout): (&Tensor, &Tensor, ExpertLayout),
    m: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let lora = crate::nn::lora::Lora {
        a: a.to_dtype(DType::F32)?,
        b: b.to_dtype(DType::F32)?,
        magnitude: None,
        scale,
        dropout: 0.0,
    };
    let delta = lora.weight_delta(w.dims(), layout)?;
    let adapted = (w.to_dtype(DType::F32)? + delta)?;
    let adapted = match m {
        Some(m) => {
            let norm = adapted.sqr()?.sum_keepdim(1)?.sqrt()?;
            let m = m.reshape((m.elem_count(), 1))?;
            adapted.broadcast_mul(&m.broadcast_div(&norm)?)?
        }
        None => adapted,
    };
    Ok(adapted.to_dtype(w.dtype())?)
}

/// Merges the adapter in `adapter_dir` into its base (`base`, or the local directory its
/// config names) and writes the merged checkpoint to `out`, which must not exist yet. Weights
/// are split into files of at most `max_shard_bytes` (one file when they fit), as
/// `save_pretrained`'s max_shard_size does. `sites_of` gives a base directory's parameters
/// that take adapters directly (`peft::lora_sites` of its model), each with how peft reads
/// it (a 3-D one's [experts, out, in] or [experts, in, out]: `nn::Param::adapter_layout`).
pub fn merge_adapter(
    adapter_dir: &Path,
    base: Option<&Path>,
    out: &Path,
    max_shard_bytes: usize,
    sites_of: SitesOf,
) -> Result<MergeReport> {
    let base = match base {
        Some(b) => b.to_path_buf(),
        None => peft::base_model(adapter_dir)?,
    };
    if out.exists() {
        return Err(Error::config(
            out.display().to_string(),
            "--output_dir",
            "already exists: name a new directory (nothing is overwritten)",
        ));
    }
    if crate::models::composite::is_composite_dir(&base) {
        return Err(Error::config(
            base.join("config.json").display().to_string(),
            "model_type",
            "a vision-language checkpoint (its language model under text_config): merging \
             adapters into it is not supported here; merge with peft's merge_and_unload",
        ));
    }
    let sites = sites_of(&base)?;
    let names: Vec<String> = sites.iter().map(|(n, _)| n.clone()).collect();
    let (config, mut adapters) = peft::read(adapter_dir, DType::F32, &Device::Cpu, &names)?;
    let sites: Sites = sites.into_iter().collect();
    let files = WeightFiles::open(&base)?;
    // What is written (the base's names, dtypes and shapes), and the base tensor each starts
    // from.
    let mut specs: Vec<TensorSpec> = files.tensor_infos()?;
    let mut source: BTreeMap<String, String> = specs
        .iter()
        .map(|s| (s.name.clone(), s.name.clone()))
        .collect();
    let tied = !source.contains_key(HEAD) && source.contains_key(EMBEDDING);
    // Trained as one (peft's ensure_weight_tying): the pair stays tied, as peft's
    // merge_and_unload keeps it; the head's copy in the adapter is the embedding's.
    if tied && config.ensure_weight_tying {
        if let (Some(head), Some(embedding)) = (adapters.get(HEAD), adapters.get(EMBEDDING)) {
            let apart = (head - embedding)?.abs()?.max_all()?.to_scalar::<f32>()?;
            if apart > 0.0 {
                return Err(Error::config(
                    adapter_dir.join(peft::ADAPTER_WEIGHTS).display().to_string(),
                    HEAD,
                    format!("differs from {EMBEDDING} by up to {apart}, though ensure_weight_tying says they are one tensor: not an adapter peft or this project wrote"),
                ));
            }
        }
        if let Some(head) = adapters.remove(HEAD) {
            adapters.entry(EMBEDDING.to_string()).or_insert(head);
        }
    }
    // Trainable tokens on a tied table change the head too (peft ties them): the tie holds.
    let touches = |weight: &str| adapters.keys().any(|n| target_of(n, &sites) == weight);
    let tokens_only = adapters
        .keys()
        .filter(|n| target_of(n, &sites) == EMBEDDING)
        .all(|n| n.ends_with(".trainable_tokens_delta"));
    let keeps_tie = config.ensure_weight_tying || (tokens_only && !touches(HEAD));
    // Otherwise a head tied to the embedding (no lm_head tensor) parts from it when either
    // changes: the head is written (its own change, or the base table it was before) and the
    // config unties them.
    let untie = tied && !keeps_tie && (touches(HEAD) || touches(EMBEDDING));
    if untie {
        let embedding = specs.iter().find(|s| s.name == EMBEDDING).expect("checked");
        specs.push(TensorSpec {
            name: HEAD.into(),
            ..embedding.clone()
        });
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        source.insert(HEAD.into(), EMBEDDING.into());
    }
    // Every adapter tensor must have its base weight, before anything is written.
    if let Some(name) = adapters
        .keys()
        .find(|n| !source.contains_key(&target_of(n, &sites)))
    {
        return Err(Error::config(
            adapter_dir
                .join(peft::ADAPTER_WEIGHTS)
                .display()
                .to_string(),
            name,
            format!(
                "has no weight {} to merge into in {}: the adapter belongs to another model",
                target_of(name, &sites),
                base.display()
            ),
        ));
    }
    let adapted: HashSet<String> = adapters.keys().map(|n| target_of(n, &sites)).collect();

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
        files: 0,
    };
    report.files = write_weights(&tmp, specs, max_shard_bytes, None, |name| {
        let w = files.load_stored(&source[name])?;
        if !adapted.contains(name) {
            report.copied += 1;
            return Ok(w);
        }
        let (merged, whole) = merge_one(name, &w, (&adapters, &sites, &config), adapter_dir)?;
        match whole {
            true => report.replaced += 1,
            false => report.merged += 1,
        }
        Ok(merged)
    })?;
    // As the base is built: a base with MXFP4 experts merges into dense weights.
    let (text, source) = read_config(&base)?;
    let mut config_json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(source, "<document>", format!("not valid JSON: {e}")))?;
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
    for name in TOKENIZER_FILES.iter().chain(&["generation_config.json"]) {
        let from = [adapter_dir.join(name), base.join(name)]
            .into_iter()
            .find(|p| p.is_file());
        if let Some(from) = from {
            std::fs::copy(&from, tmp.join(name))
                .map_err(|e| Error::io(format!("cannot copy {}", from.display()), e))?;
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

/// Base weight `name` (`w`) with its adapter applied, or the whole module the adapter trained
/// in its place (then `true`): from `adapters` (peft's names), the adapted `sites` and the
/// adapter's `config`, read from `adapter_dir` (named in errors).
fn merge_one(
    name: &str,
    w: &Tensor,
    (adapters, sites, config): (&BTreeMap<String, Tensor>, &Sites, &LoraConfig),
    adapter_dir: &Path,
) -> Result<(Tensor, bool)> {
    let stem = match sites.contains_key(name) {
        true => name,
        false => name.strip_suffix(".weight").unwrap_or(name),
    };
    let part = |p: &str| adapters.get(&format!("{stem}.{p}"));
    // An embedding's adapters, as the layer computes its table (embedding_adapter).
    use crate::nn::embedding_adapter::EmbeddingAdapter;
    let table = match (part("lora_embedding_A"), part("lora_embedding_B")) {
        (Some(a), Some(b)) => Some(EmbeddingAdapter::Lora {
            a: a.clone(),
            b: b.clone(),
            scale: config.scale(),
        }),
        _ => {
            match part("token_adapter.trainable_tokens_delta") {
                Some(rows) => {
                    let indices = config
                    .trainable_token_indices
                    .iter()
                    .find(|(m, _)| stem == m || stem.ends_with(&format!(".{m}")))
                    .map(|(_, ids)| ids.clone())
                    .ok_or_else(|| {
                        Error::config(
                            adapter_dir.join(peft::ADAPTER_CONFIG).display().to_string(),
                            "trainable_token_indices",
                            format!("names no rows for {stem}, whose trained rows the adapter holds"),
                        )
                    })?;
                    Some(EmbeddingAdapter::Tokens {
                        indices,
                        rows: rows.clone(),
                    })
                }
                None => None,
            }
        }
    };
    if let Some(table) = table {
        let merged = table.table(&w.to_dtype(DType::F32)?)?;
        return Ok((merged.to_dtype(w.dtype())?, false));
    }
    match (
        part("lora_A.weight"),
        part("lora_B.weight"),
        adapters.get(name),
    ) {
        (Some(a), Some(b), None) => {
            let m = part("lora_magnitude_vector");
            // How peft reads a parameter adapted directly (a linear layer's: [out, in]).
            let layout = sites.get(name).copied().unwrap_or(ExpertLayout::OutIn);
            let merged = merged_weight(w, (a, b, layout), m, config.scale()).map_err(|e| {
                Error::config(
                    adapter_dir.display().to_string(),
                    format!("{stem}.lora_B.weight"),
                    format!("cannot merge into the base's {name} {:?}: {e}", w.dims()),
                )
            })?;
            Ok((merged, false))
        }
        (None, None, Some(whole)) => Ok((whole.to_dtype(w.dtype())?, true)),
        _ => Err(Error::config(
            adapter_dir.display().to_string(),
            stem,
            "holds only one of lora_A / lora_B, or an adapter and a whole module for the \
             same layer: not a complete adapter",
        )),
    }
}
