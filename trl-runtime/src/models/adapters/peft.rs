//! LoRA adapters in peft's format: `adapter_config.json` (peft's LoraConfig) and
//! `adapter_model.safetensors`, whose tensors are named as `PeftModel.save_pretrained`
//! names them (`base_model.model.` + the layer's name + `.lora_A.weight`; a module trained
//! whole under its own name). `peft.PeftModel.from_pretrained(base, dir)` loads what
//! [`save`] writes, and [`read`] loads what peft writes.

use crate::error::{Error, Result};
use crate::nn::lora::{adapter_plan, AdapterPlan, LoraConfig, PlannedAdapter, Targets};
use crate::nn::{Parallelize, Weight};
use candle_core::{DType, Device, Tensor, TensorId, Var};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// Trains LoRA adapters on `net` instead of its weights: every weight becomes a constant but
/// those of `config.modules_to_save` ([`freeze_base`]), the linear layers `config` targets get
/// adapters (sliced as their tensor-parallel split requires), and so do the embeddings it
/// names (peft's `lora.Embedding`) and the rows of `trainable_token_indices`. The LM head
/// takes one only when named (all-linear leaves it out, as peft does). A head tied to an
/// adapted embedding computes with the adapted table where peft ties it (trainable tokens
/// always, LoRA with `ensure_weight_tying`, which also moves a head's LoRA onto the
/// embedding). A target matching no layer is an error listing the layers there are.
pub fn add_adapters(net: &mut impl Parallelize, config: &LoraConfig) -> Result<AdapterPlan> {
    freeze_base(net, config)?;
    let (linears, parameters) = lora_sites(net)?;
    let sites = table_sites(net)?;
    let site_names = sites
        .iter()
        .map(|s| s.name.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let err = |key: &str, message: String| Error::config("training arguments", key, message);
    // The embedding a tied head shares its table with.
    let tied_to = |head: &TableSite| {
        sites
            .iter()
            .find(|e| e.embedding && e.weight.is_some() && e.weight == head.weight)
    };
    let head = sites.iter().find(|h| !h.embedding);
    let tied_embedding = head.and_then(tied_to).map(|e| e.name.clone());
    let mut plan = adapter_plan(config, &linears, &parameters)?;
    // A module trained whole takes no adapter, as peft leaves it (its copy is trained).
    let adapted = |name: &str| {
        let whole = config.saves(&format!("{name}.weight"));
        if whole {
            tracing::warn!("{name} is in lora_modules_to_save and lora_target_modules: it trains whole, without LoRA (as peft does)");
        }
        !whole
    };
    plan.layers.retain(|p| p.parameter || adapted(&p.name));
    // peft's ensure_weight_tying puts a tied head's LoRA on the embedding.
    let mut lora_tables: Vec<String> = sites
        .iter()
        .filter(|e| e.embedding && matches!(&config.targets, Targets::Names(_)))
        .filter(|e| config.targets(&e.name, false))
        .map(|e| e.name.clone())
        .collect();
    if let (Some(head), Some(embedding)) = (head, &tied_embedding) {
        if config.ensure_weight_tying && plan.layers.iter().any(|p| p.name == head.name) {
            plan.layers.retain(|p| p.name != head.name);
            if !lora_tables.contains(embedding) {
                lora_tables.push(embedding.clone());
            }
        }
    }
    if plan.layers.is_empty() && lora_tables.is_empty() && config.trainable_token_indices.is_empty()
    {
        return Err(err(
            "lora_target_modules",
            format!("matches no layer of this model; its embeddings and head are {site_names}"),
        ));
    }
    // Trainable tokens by module name (peft's dict keys, or embed_tokens for a list).
    let mut tokens: Vec<(String, Vec<u32>)> = Vec::new();
    for (module, ids) in &config.trainable_token_indices {
        let site = sites
            .iter()
            .find(|s| s.name == *module || s.name.ends_with(&format!(".{module}")))
            .ok_or_else(|| {
                err(
                    "trainable_token_indices",
                    format!("'{module}' names no embedding or LM head of this model (it has {site_names})"),
                )
            })?;
        // peft refuses both (trainable tokens cannot wrap its lora.Embedding).
        if lora_tables.contains(&site.name) {
            return Err(err(
                "trainable_token_indices",
                format!(
                    "{} also takes LoRA: trainable tokens cannot be applied to an embedding \
                     with LoRA (peft refuses it too); use one of them",
                    site.name
                ),
            ));
        }
        if config.saves(&format!("{}.weight", site.name)) {
            return Err(err(
                "trainable_token_indices",
                format!("{} is also trained whole (lora_modules_to_save), which trains its every row: drop one of them", site.name),
            ));
        }
        tokens.push((site.name.clone(), ids.clone()));
    }
    // A head tied to an embedding with trainable tokens shares them when it names the same
    // rows or none (peft ties them then); other rows train apart, which peft refuses with
    // ensure_weight_tying.
    let tied_tokens = head.zip(tied_embedding.as_ref()).and_then(|(head, embedding)| {
        let of = |n: &str| tokens.iter().find(|(m, _)| m == n).map(|(_, ids)| ids.clone());
        let rows = of(embedding)?;
        match of(&head.name) {
            None => Some(Ok(())),
            Some(h) if h == rows => Some(Ok(())),
            Some(h) if config.ensure_weight_tying => Some(Err(err(
                "trainable_token_indices",
                format!("cannot ensure weight tying when different token indices are given for tied layers: {embedding}: {rows:?}, {}: {h:?} (peft refuses it too); give both the same rows or set ensure_weight_tying false", head.name),
            ))),
            Some(_) => None,
        }
    });
    if let Some(Err(e)) = tied_tokens {
        return Err(e);
    }
    if tied_tokens.is_some() {
        // The head computes with the embedding's adapter (below), not rows of its own.
        if let Some(head) = head {
            tokens.retain(|(m, _)| *m != head.name);
        }
    }
    lora_tables.retain(|name| adapted(name));
    let planned: HashMap<&str, &PlannedAdapter> =
        plan.layers.iter().map(|p| (p.name.as_str(), p)).collect();
    // An expert's up projection takes its gate's A (one A for the fused gate_up_proj).
    let mut a_of: HashMap<String, Tensor> = HashMap::new();
    let mut tables: HashMap<String, crate::nn::embedding_adapter::EmbeddingAdapter> =
        HashMap::new();
    net.visit_linears_mut("", &mut |name, linear| {
        if let Some((_, ids)) = tokens.iter().find(|(n, _)| n == name) {
            linear.add_tokens(name, ids)?;
        } else if lora_tables.iter().any(|n| n == name) {
            linear.add_lora(name, config)?;
        }
        if let Some(adapter) = linear.table_adapter() {
            tables.insert(name.to_string(), adapter.clone());
        }
        let Some(p) = planned.get(name) else {
            return Ok(());
        };
        linear.add_lora(name, &p.config)?;
        let Some(lora) = linear.lora_mut() else {
            return Ok(());
        };
        match &p.shares_a {
            Some(first) => {
                lora.a = a_of.get(first).cloned().ok_or_else(|| {
                    Error::config(
                        "training arguments",
                        "lora_target_modules",
                        format!("{name} shares the A of {first}, which comes after it"),
                    )
                })?
            }
            None => {
                a_of.insert(name.to_string(), lora.a.clone());
            }
        }
        Ok(())
    })?;
    // A head tied to an adapted embedding: the same trainable tokens always (peft ties
    // them), the same LoRA with ensure_weight_tying.
    let (Some(head), Some(embedding)) = (head, tied_embedding) else {
        return Ok(plan);
    };
    let Some(adapter) = tables.get(&embedding).cloned() else {
        return Ok(plan);
    };
    let shared = match &adapter {
        crate::nn::embedding_adapter::EmbeddingAdapter::Tokens { .. } => tied_tokens.is_some(),
        crate::nn::embedding_adapter::EmbeddingAdapter::Lora { .. } => config.ensure_weight_tying,
    };
    if shared {
        let head_name = head.name.clone();
        net.visit_linears_mut("", &mut |name, linear| match name == head_name {
            true => linear.share_table(name, adapter.clone()),
            false => Ok(()),
        })?;
    }
    Ok(plan)
}

/// An embedding table or the LM head (what table adapters apply to), with its weight's id.
struct TableSite {
    name: String,
    embedding: bool,
    weight: Option<TensorId>,
}

/// The embeddings and the output layer of `net`, in its order.
fn table_sites(net: &mut impl Parallelize) -> Result<Vec<TableSite>> {
    let mut sites = Vec::new();
    net.visit_linears_mut("", &mut |name, target| {
        let head = name == "lm_head" || name.ends_with(".lm_head");
        if target.is_embedding() || head {
            sites.push(TableSite {
                name: name.to_string(),
                embedding: target.is_embedding(),
                weight: target.weight_id(),
            });
        }
        Ok(())
    })?;
    Ok(sites)
}

/// Makes every weight of `net` a constant (a tied weight stays one tensor) but those of
/// `config.modules_to_save`, which become trainable copies, as peft's ModulesToSaveWrapper
/// makes them: each named module its own copy (a head tied to the embedding parts from it:
/// peft's default), or, with `ensure_weight_tying`, one copy for every name of a tied tensor
/// when any of them is named (peft ties the wrappers then).
pub fn freeze_base(net: &mut impl Parallelize, config: &LoraConfig) -> Result<()> {
    let mut tied_saved: HashSet<TensorId> = HashSet::new();
    if config.ensure_weight_tying {
        net.visit_weights_mut("", &mut |name, w| {
            if let Weight::Local(t) = w {
                if config.saves(name) {
                    tied_saved.insert(t.id());
                }
            }
            Ok(())
        })?;
    }
    let mut frozen: HashMap<TensorId, Tensor> = HashMap::new();
    let mut shared: HashMap<TensorId, Tensor> = HashMap::new();
    net.visit_weights_mut("", &mut |name, w| {
        let Weight::Local(t) = w else {
            return Ok(());
        };
        let copy = || -> Result<Tensor> { Ok(Var::from_tensor(&t.copy()?)?.as_tensor().clone()) };
        if tied_saved.contains(&t.id()) {
            let c = match shared.get(&t.id()) {
                Some(c) => c.clone(),
                None => {
                    let c = copy()?;
                    shared.insert(t.id(), c.clone());
                    c
                }
            };
            *w = Weight::Local(c);
        } else if config.saves(name) {
            *w = Weight::Local(copy()?);
        } else if t.is_variable() {
            let constant = frozen.entry(t.id()).or_insert_with(|| t.detach()).clone();
            *w = Weight::Local(constant);
        }
        Ok(())
    })
}

/// The other names of `net`'s trainable tensors that are held under more than one name (a
/// head tied to its embedding, trained as one with `ensure_weight_tying`): (alias, the name
/// the parameters go by, the first visited).
pub fn trainable_aliases(net: &impl Parallelize) -> Vec<(String, String)> {
    let mut first: HashMap<TensorId, String> = HashMap::new();
    let mut aliases = Vec::new();
    net.visit_params("", &mut |name, t, _| {
        if !t.is_variable() {
            return;
        }
        match first.get(&t.id()) {
            Some(canonical) => aliases.push((name.to_string(), canonical.clone())),
            None => {
                first.insert(t.id(), name.to_string());
            }
        }
    });
    aliases
}

/// `tensors` (trainable, by the names `net`'s parameters go by) with each tensor held under
/// a second name added under it too: a tied pair trained as one is saved under both names,
/// as peft saves it.
pub fn add_aliases(net: &impl Parallelize, tensors: &mut BTreeMap<String, Tensor>) {
    for (alias, name) in trainable_aliases(net) {
        if let Some(t) = tensors.get(&name).cloned() {
            tensors.insert(alias, t);
        }
    }
}

/// Sets the trainable tensors of `net` (adapters, modules trained whole) from `values`,
/// full-size by our names, each cut to what this rank holds by `part` (name, value). Every
/// trainable tensor must be given (a tensor held under two names, a tied pair trained as
/// one, by either) and every value must name one; errors name `source`.
pub fn set_trainable(
    net: &impl Parallelize,
    values: &BTreeMap<String, Tensor>,
    part: &dyn Fn(&str, &Tensor) -> Result<Tensor>,
    source: &str,
) -> Result<()> {
    // Each trainable tensor once, with every name it goes by (the first is its own).
    let mut index: HashMap<TensorId, usize> = HashMap::new();
    let mut trainable: Vec<(Vec<String>, Tensor)> = Vec::new();
    net.visit_params("", &mut |name, t, _| {
        if !t.is_variable() {
            return;
        }
        match index.get(&t.id()) {
            Some(&i) => trainable[i].0.push(name.to_string()),
            None => {
                index.insert(t.id(), trainable.len());
                trainable.push((vec![name.to_string()], t.clone()));
            }
        }
    });
    // Expert adapters read from peft's fused layout carry Qwen3-MoE's names.
    let ours: HashSet<&str> = trainable
        .iter()
        .flat_map(|(n, _)| n.iter().map(|s| s.as_str()))
        .collect();
    let values: BTreeMap<String, &Tensor> = values
        .iter()
        .map(|(n, t)| (super::peft_experts::align(n, &ours), t))
        .collect();
    for (names, t) in &trainable {
        let name = &names[0];
        let value = names
            .iter()
            .find_map(|n| values.get(n).copied())
            .ok_or_else(|| {
                Error::config(
                    source,
                    name,
                    "missing: the adapter does not match this model's LoRA setup \
                     (lora_target_modules, lora_modules_to_save)",
                )
            })?;
        let value = part(name, value)?;
        if value.dims() != t.dims() {
            return Err(Error::config(
                source,
                name,
                format!(
                    "shape {:?}, this model's is {:?} (a different lora_r or model?)",
                    value.dims(),
                    t.dims()
                ),
            ));
        }
        Var::from_tensor(t)?.set(&value.to_dtype(t.dtype())?.to_device(t.device())?)?;
    }
    if let Some(extra) = values.keys().find(|k| !ours.contains(k.as_str())) {
        let tied = [TIED_HEAD, TIED_EMBEDDING].contains(&extra.as_str());
        let hint = match tied {
            true => {
                " (a head tied to its embedding, trained apart: this run keeps them one, \
                     lora_ensure_weight_tying; or the other way round)"
            }
            false => "",
        };
        return Err(Error::config(
            source,
            extra,
            format!("names no trainable tensor of this model: an adapter for another model or setup?{hint}"),
        ));
    }
    Ok(())
}

/// peft's rank_pattern / alpha_pattern key for the fused experts' gate_up_proj.
const GATE_UP_PATTERN: &str = ".*\\.gate_up_proj";

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const PREFIX: &str = "base_model.model.";

/// What in `net` can take a LoRA adapter, in the model's order: its linear layers
/// (`target_modules`) and the parameters adapted directly (2-D and 3-D `nn::Param`s:
/// `target_parameters`).
pub fn lora_sites(net: &mut impl Parallelize) -> Result<(Vec<String>, Vec<String>)> {
    let (mut linears, mut parameters) = (Vec::new(), Vec::new());
    net.visit_linears_mut("", &mut |name, target| {
        match (target.is_parameter(), target.is_embedding()) {
            (true, _) => parameters.push(name.to_string()),
            (false, false) => linears.push(name.to_string()),
            // Embeddings take table adapters (add_adapters), not a linear layer's.
            (false, true) => {}
        }
        Ok(())
    })?;
    Ok((linears, parameters))
}

/// The parameters of `net` adapted directly ([`lora_sites`]' second list), each with how
/// peft reads it (`nn::Param::adapter_layout`): what merging an adapter into them needs.
pub fn parameter_sites(
    net: &mut impl Parallelize,
) -> Result<Vec<(String, crate::kernels::grouped::ExpertLayout)>> {
    let mut sites = Vec::new();
    net.visit_linears_mut("", &mut |name, target| {
        if target.is_parameter() {
            sites.push((name.to_string(), target.adapter_layout()));
        }
        Ok(())
    })?;
    Ok(sites)
}

/// Every parameter name of `net` in its order (what [`save`] nests adapters on parameters by).
pub fn parameter_order(net: &impl Parallelize) -> Vec<String> {
    let mut order = Vec::new();
    net.visit_params("", &mut |n, _, _| order.push(n.to_string()));
    order
}

/// Writes `tensors` (full-size, by our names) and the adapter config into `dir`. `base` is
/// the base model's directory (peft's base_model_name_or_path); `order` the model's parameter
/// names in its order ([`parameter_order`]: where adapters on parameters nest, see
/// [`super::peft_experts::wrapper_prefixes`]).
pub fn save(
    dir: &Path,
    tensors: &BTreeMap<String, Tensor>,
    config: &LoraConfig,
    base: &Path,
    order: &[String],
) -> Result<()> {
    // Adapters on parameters (target_parameters) under peft's wrapper names, in the order
    // the model visits them (a sharded base weight is not visited; its adapter is).
    let adapted: Vec<String> = order
        .iter()
        .filter_map(|n| n.strip_suffix(".lora_A.weight"))
        .filter(|p| config.targets_parameter(p))
        .map(String::from)
        .collect();
    let on_parameter = |n: &str| {
        adapted.iter().any(|p| {
            n.strip_prefix(p.as_str())
                .is_some_and(|r| r.starts_with(".lora_"))
        })
    };
    let (params, rest): (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>) = tensors
        .iter()
        .filter(|(n, _)| !head_view_of_embedding(n, tensors))
        .map(|(n, t)| (n.clone(), t.clone()))
        .partition(|(n, _)| on_parameter(n));
    // Experts and router as peft holds them on transformers 5 (fused parameters).
    let mut fused = super::peft_experts::fuse(&rest)?;
    fused
        .tensors
        .extend(super::peft_experts::nest(params, &adapted));
    // The linear layers and embeddings adapted (parameters are listed in target_parameters).
    let embedding_a = format!(".{}", crate::nn::embedding_adapter::LORA_A);
    let targets: Vec<String> = rest
        .keys()
        .filter_map(|n| {
            n.strip_suffix(".lora_A.weight")
                .or_else(|| n.strip_suffix(embedding_a.as_str()))
        })
        .filter(|m| !fused.parameter_layers.contains(*m))
        .map(String::from)
        .collect();
    // A head tied to the embedding's LoRA (ensure_weight_tying) is saved with it transposed
    // under its own names, as peft saves its tied lm_head adapter.
    let embedding = TIED_EMBEDDING.trim_end_matches(".weight");
    let head = TIED_HEAD.trim_end_matches(".weight");
    if let (true, Some(a), Some(b)) = (
        config.ensure_weight_tying && tied_pair(tensors),
        tensors.get(&format!(
            "{embedding}.{}",
            crate::nn::embedding_adapter::LORA_A
        )),
        tensors.get(&format!(
            "{embedding}.{}",
            crate::nn::embedding_adapter::LORA_B
        )),
    ) {
        fused
            .tensors
            .insert(format!("{head}.lora_A.weight"), b.t()?.contiguous()?);
        fused
            .tensors
            .insert(format!("{head}.lora_B.weight"), a.t()?.contiguous()?);
    }
    // A vision-language model's language model: peft names its modules by the PyTorch tree.
    let tree = crate::models::composite::tree_of_dir(base);
    let peft_name = |n: &str| match tree {
        Some(tree) => tree.module(n),
        None => n.to_string(),
    };
    let mut targets: Vec<String> = targets.iter().map(|t| peft_name(t)).collect();
    targets.sort();
    // The gate_up wrapper's rank and alpha are twice the others' (its A serves gate and up).
    let gate_up = fused
        .target_parameters
        .contains(&super::peft_experts::GATE_UP);
    let pattern = |v: serde_json::Value| match gate_up {
        true => serde_json::json!({ GATE_UP_PATTERN: v }),
        false => serde_json::json!({}),
    };
    // The fused experts' names (as peft maps target_modules onto them), and the user's.
    let mut parameters: Vec<String> = fused
        .target_parameters
        .iter()
        .map(|s| s.to_string())
        .collect();
    if !adapted.is_empty() {
        parameters.extend(config.target_parameters.iter().cloned());
    }
    let modules_to_save = saved_modules(tensors, config, &peft_name);
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": match config.sequence_classification {
            true => "SEQ_CLS",
            false => "CAUSAL_LM",
        },
        "base_model_name_or_path": base.display().to_string(),
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "target_parameters": (!parameters.is_empty()).then_some(&parameters),
        "modules_to_save": (!modules_to_save.is_empty()).then_some(&modules_to_save),
        "use_rslora": config.rslora,
        "use_dora": config.dora,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "rank_pattern": pattern((2 * config.r).into()),
        "alpha_pattern": pattern((2.0 * config.alpha).into()),
        "ensure_weight_tying": config.ensure_weight_tying,
        "trainable_token_indices": token_indices_json(&config.trainable_token_indices),
    });
    let text = serde_json::to_string_pretty(&json).expect("json");
    std::fs::write(dir.join(ADAPTER_CONFIG), text).map_err(|e| {
        Error::io(
            format!("cannot write {}", dir.join(ADAPTER_CONFIG).display()),
            e,
        )
    })?;
    let named: HashMap<String, Tensor> = fused
        .tensors
        .iter()
        .map(|(n, t)| {
            Ok((
                format!("{PREFIX}{}", peft_name(n)),
                t.to_device(&Device::Cpu)?,
            ))
        })
        .collect::<Result<_>>()?;
    let weights = dir.join(ADAPTER_WEIGHTS);
    candle_core::safetensors::save(&named, &weights)?;
    // safetensors writes through a private temporary file (mode 0600): the mode of the rest
    // of the checkpoint, as peft's files have.
    if let Ok(meta) = std::fs::metadata(dir.join(ADAPTER_CONFIG)) {
        let _ = std::fs::set_permissions(&weights, meta.permissions());
    }
    Ok(())
}

/// `modules_to_save` as peft writes it: with `ensure_weight_tying` and the head trained as one
/// tensor with its embedding (`tensors` holds the same tensor under both names), peft's
/// `_add_modules_to_save_to_tie` names the embedding's module and drops the head's.
fn saved_modules(
    tensors: &BTreeMap<String, Tensor>,
    config: &LoraConfig,
    peft_name: &dyn Fn(&str) -> String,
) -> Vec<String> {
    let mut modules = config.modules_to_save.clone();
    let tied = match (tensors.get(TIED_HEAD), tensors.get(TIED_EMBEDDING)) {
        (Some(h), Some(e)) => h.id() == e.id(),
        _ => false,
    };
    if modules.is_empty() || !(config.ensure_weight_tying && tied) {
        return modules;
    }
    let embedding = peft_name(TIED_EMBEDDING.trim_end_matches(".weight"));
    if !modules.contains(&embedding) {
        modules.push(embedding);
    }
    let head = peft_name(TIED_HEAD.trim_end_matches(".weight"));
    if let Some(i) = modules
        .iter()
        .position(|m| head == *m || head.ends_with(&format!(".{m}")))
    {
        modules.remove(i);
    }
    modules
}

/// The weights a tied head shares (transformers' names for every built-in model).
pub const TIED_HEAD: &str = "lm_head.weight";
pub const TIED_EMBEDDING: &str = "model.embed_tokens.weight";

/// `trainable_token_indices` as peft writes it: null, the embedding's list, or {module: list}.
fn token_indices_json(tokens: &[(String, Vec<u32>)]) -> serde_json::Value {
    match tokens {
        [] => serde_json::Value::Null,
        [(module, ids)] if module == "embed_tokens" => serde_json::json!(ids),
        _ => tokens
            .iter()
            .map(|(m, ids)| (m.clone(), serde_json::json!(ids)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
    }
}

/// Whether `tensors` (with [`add_aliases`]' names) hold a trained tied pair: the same tensor
/// under the head's and the embedding's names, or the embedding's table adapter seen from
/// the head too.
fn tied_pair(tensors: &BTreeMap<String, Tensor>) -> bool {
    let head = TIED_HEAD.trim_end_matches(".weight");
    let embedding = TIED_EMBEDDING.trim_end_matches(".weight");
    [
        ".weight".to_string(),
        format!(".{}", crate::nn::embedding_adapter::LORA_A),
        format!(".{}", crate::nn::embedding_adapter::TOKENS),
    ]
    .iter()
    .any(|suffix| {
        match (
            tensors.get(&format!("{head}{suffix}")),
            tensors.get(&format!("{embedding}{suffix}")),
        ) {
            (Some(h), Some(e)) => h.id() == e.id(),
            _ => false,
        }
    })
}

/// The names [`add_aliases`] gives a head's view of its embedding's table adapter, which
/// peft does not save (it re-ties them on load).
fn head_view_of_embedding(name: &str, tensors: &BTreeMap<String, Tensor>) -> bool {
    let head = TIED_HEAD.trim_end_matches(".weight");
    let embedding = TIED_EMBEDDING.trim_end_matches(".weight");
    let Some(rest) = name.strip_prefix(head) else {
        return false;
    };
    let table = [
        crate::nn::embedding_adapter::LORA_A,
        crate::nn::embedding_adapter::LORA_B,
        crate::nn::embedding_adapter::TOKENS,
    ];
    table.iter().any(|t| rest == format!(".{t}"))
        && tensors
            .get(&format!("{embedding}{rest}"))
            .zip(tensors.get(name))
            .is_some_and(|(e, h)| e.id() == h.id())
}

/// peft's `trainable_token_indices`: a list (the embedding's rows) or {module: list}.
fn token_indices(v: &serde_json::Value) -> std::result::Result<Vec<(String, Vec<u32>)>, String> {
    let ids = |v: &serde_json::Value| -> std::result::Result<Vec<u32>, String> {
        v.as_array()
            .ok_or_else(|| format!("{v}: expected a list of token ids"))?
            .iter()
            .map(|i| {
                i.as_u64()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| format!("{i}: not a token id"))
            })
            .collect()
    };
    match v {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::Array(_) => Ok(vec![("embed_tokens".into(), ids(v)?)]),
        serde_json::Value::Object(map) => map
            .iter()
            .map(|(module, list)| Ok((module.clone(), ids(list)?)))
            .collect(),
        other => Err(format!(
            "{other}: expected a list of token ids or {{module: ids}}"
        )),
    }
}

/// A peft adapter directory's adapter_config.json, and its path for errors.
fn config_json(dir: &Path) -> Result<(serde_json::Value, String)> {
    let path = dir.join(ADAPTER_CONFIG);
    let source = path.display().to_string();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io(format!("cannot read {source}"), e))?;
    let json = serde_json::from_str(&text)
        .map_err(|e| Error::config(&source, "<document>", e.to_string()))?;
    Ok((json, source))
}

/// The base model a peft adapter names (`base_model_name_or_path`) when it is a local model
/// directory or a hub name the Hugging Face cache holds; an error naming the key otherwise
/// (nothing is downloaded).
pub fn base_model(dir: &Path) -> Result<std::path::PathBuf> {
    let (json, source) = config_json(dir)?;
    let named = json["base_model_name_or_path"].as_str().unwrap_or("");
    let base = crate::hub::resolve(crate::hub::RepoKind::Model, Path::new(named))
        .unwrap_or_else(|_| Path::new(named).to_path_buf());
    if named.is_empty() || !base.join(crate::models::params::CONFIG_FILE).is_file() {
        return Err(Error::config(
            source,
            "base_model_name_or_path",
            format!("'{named}' is not a local model directory, nor a hub name the Hugging Face cache holds (`hf download {named}` fetches it): pass the base model's directory (--model_name_or_path)"),
        ));
    }
    Ok(base)
}

/// The LoRA setup of a peft adapter directory and its tensors by our names (full size), for
/// a model whose parameters that take adapters directly are `sites` (`lora_sites(..).1`).
pub fn read(
    dir: &Path,
    dtype: DType,
    device: &Device,
    sites: &[String],
) -> Result<(LoraConfig, BTreeMap<String, Tensor>)> {
    let (json, source) = config_json(dir)?;
    let err = |key: &str, message: String| Error::config(&source, key, message);
    let file = dir.join(ADAPTER_WEIGHTS);
    let loaded = candle_core::safetensors::load(&file, device)?;
    // A vision-language model's language model (models/composite.rs).
    let tree = loaded.keys().find_map(|n| {
        n.strip_prefix(PREFIX)
            .and_then(crate::models::composite::tree_of_module)
    });
    if json["peft_type"].as_str() != Some("LORA") {
        return Err(err(
            "peft_type",
            format!("{}: only LORA adapters are read", json["peft_type"]),
        ));
    }
    if json["fan_in_fan_out"].as_bool() == Some(true) {
        return Err(err(
            "fan_in_fan_out",
            "not supported: fan-in-fan-out (Conv1D) layers are not implemented".into(),
        ));
    }
    let r = json["r"]
        .as_u64()
        .ok_or_else(|| err("r", "missing".into()))? as usize;
    let alpha = json["lora_alpha"].as_f64().unwrap_or(8.0);
    let names = |key: &str| -> Vec<String> {
        match &json[key] {
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect(),
            _ => Vec::new(),
        }
    };
    // Experts adapted on transformers 5's fused parameters: the only per-layer rank and alpha
    // read are the fused gate_up's, twice the others' (see adapter_plan).
    let parameters = names("target_parameters");
    let gate_up = parameters.iter().any(|p| p == super::peft_experts::GATE_UP);
    for (key, want) in [
        ("rank_pattern", serde_json::json!(2 * r)),
        ("alpha_pattern", serde_json::json!(2.0 * alpha)),
    ] {
        let Some(map) = json[key].as_object().filter(|m| !m.is_empty()) else {
            continue;
        };
        let fused_only = gate_up
            && map.len() == 1
            && map
                .get(GATE_UP_PATTERN)
                .and_then(|v| v.as_f64())
                .is_some_and(|v| Some(v) == want.as_f64());
        if !fused_only {
            return Err(err(
                key,
                format!("{}: per-layer ranks and alphas are not supported (but the fused experts' gate_up_proj at 2 x r / 2 x lora_alpha, as peft sets it)", json[key]),
            ));
        }
    }
    // A model that holds its experts as parameters adapts the listed ones (gpt-oss); one
    // whose experts are linear layers reads peft's fused experts as its per-expert adapters
    // (Qwen3-MoE, Mixtral, Qwen3-Next, whose convolution weight is a parameter but no expert).
    let held = sites.iter().any(|s| crate::nn::lora::is_routed_expert(s));
    if let Some(p) = parameters.iter().filter(|_| !held).find(|p| {
        ![
            super::peft_experts::GATE_UP,
            super::peft_experts::DOWN,
            super::peft_experts::ROUTER,
        ]
        .contains(&p.as_str())
    }) {
        return Err(err(
            "target_parameters",
            format!("'{p}': only the experts' gate_up_proj and down_proj and the router's gate.weight are read"),
        ));
    }
    if json["bias"].as_str().is_some_and(|b| b != "none") {
        return Err(err(
            "bias",
            "trained biases are not supported (use bias: none)".into(),
        ));
    }
    let mut target_list: Vec<String> = names("target_modules")
        .iter()
        .filter_map(|t| match tree {
            Some(tree) => tree.text_module(t),
            None => Some(t.clone()),
        })
        .collect();
    // The fused parameters' layers here (transformers 4's names, Qwen3-MoE's and Mixtral's).
    use crate::nn::lora::{EXPERT_DOWN, EXPERT_GATE, EXPERT_UP};
    for p in parameters.iter().filter(|_| !held) {
        let layers = match p.as_str() {
            super::peft_experts::GATE_UP => [EXPERT_GATE, EXPERT_UP].concat(),
            super::peft_experts::DOWN => EXPERT_DOWN.to_vec(),
            _ => vec!["gate"],
        };
        target_list.extend(layers.iter().map(|s| s.to_string()));
    }
    let targets = match target_list.as_slice() {
        [one] if one.eq_ignore_ascii_case("all-linear") => Targets::AllLinear,
        _ => Targets::Names(target_list),
    };
    let config = LoraConfig {
        r,
        alpha,
        dropout: json["lora_dropout"].as_f64().unwrap_or(0.0),
        targets,
        modules_to_save: names("modules_to_save"),
        rslora: json["use_rslora"].as_bool().unwrap_or(false),
        seed: 0,
        dora: json["use_dora"].as_bool().unwrap_or(false),
        // Without parameters held as such, the fused experts' names became target_modules.
        target_parameters: match held {
            true => parameters.clone(),
            false => Vec::new(),
        },
        ensure_weight_tying: json["ensure_weight_tying"].as_bool().unwrap_or(false),
        trainable_token_indices: token_indices(&json["trainable_token_indices"])
            .map_err(|m| err("trainable_token_indices", m))?,
        sequence_classification: json["task_type"].as_str() == Some("SEQ_CLS"),
    };
    let mut tensors = BTreeMap::new();
    let mut left_out = 0;
    for (name, t) in loaded {
        let Some(ours) = name.strip_prefix(PREFIX) else {
            return Err(Error::config(
                file.display().to_string(),
                &name,
                format!("not a peft causal-LM adapter tensor (expected names starting {PREFIX})"),
            ));
        };
        // A vision-language model's: the language model's modules by our names; adapters on
        // the vision tower or the projector never act on text rows (TRL trains them to
        // nothing: no gradient reaches them) and are left out.
        let ours = match tree.map(|t| t.text_module(ours)) {
            Some(Some(text)) => text,
            Some(None) => {
                left_out += 1;
                continue;
            }
            None => ours.to_string(),
        };
        // Older peft files can carry the adapter name.
        let ours = ours
            .replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B.")
            .replace(
                ".lora_magnitude_vector.default.weight",
                ".lora_magnitude_vector",
            )
            .replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector")
            .replace(".lora_embedding_A.default", ".lora_embedding_A")
            .replace(".lora_embedding_B.default", ".lora_embedding_B")
            .replace(".trainable_tokens_delta.default", ".trainable_tokens_delta");
        // peft saves an adapted embedding's (and head's) base table beside its adapter
        // (save_embedding_layers "auto"): the base's own, read from the base here.
        if ours.ends_with(".base_layer.weight") {
            continue;
        }
        tensors.insert(ours, t.to_dtype(dtype)?);
    }
    if left_out > 0 {
        tracing::warn!(
            "{}: {left_out} adapter tensors on the vision tower or projector left out (text \
             rows do not reach them)",
            file.display()
        );
    }
    // A head tied to an adapted embedding (ensure_weight_tying) is saved with the embedding's
    // LoRA transposed under its own names: the embedding's is the one read.
    let embedding_lora =
        |m: &str| tensors.contains_key(&format!("{m}.{}", crate::nn::embedding_adapter::LORA_A));
    if config.ensure_weight_tying && embedding_lora(TIED_EMBEDDING.trim_end_matches(".weight")) {
        let head = TIED_HEAD.trim_end_matches(".weight");
        tensors.remove(&format!("{head}.lora_A.weight"));
        tensors.remove(&format!("{head}.lora_B.weight"));
    }
    let adapted: Vec<String> = sites
        .iter()
        .filter(|p| config.targets_parameter(p))
        .cloned()
        .collect();
    let tensors = match held {
        true => super::peft_experts::unnest(tensors, &adapted),
        false => super::peft_experts::unfuse(
            tensors,
            &parameters,
            (2 * r, r),
            &file.display().to_string(),
        )?,
    };
    Ok((config, tensors))
}
