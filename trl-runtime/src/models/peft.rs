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
/// those of `config.modules_to_save` ([`freeze_base`]), and the linear layers `config`
/// targets get adapters (sliced as their tensor-parallel split requires). The LM head takes
/// none; a target matching no layer is an error listing the layers there are.
pub fn add_adapters(net: &mut impl Parallelize, config: &LoraConfig) -> Result<AdapterPlan> {
    freeze_base(net, config)?;
    let (linears, parameters) = lora_sites(net)?;
    let plan = adapter_plan(config, &linears, &parameters)?;
    let planned: HashMap<&str, &PlannedAdapter> =
        plan.layers.iter().map(|p| (p.name.as_str(), p)).collect();
    // An expert's up projection takes its gate's A (one A for the fused gate_up_proj).
    let mut a_of: HashMap<String, Tensor> = HashMap::new();
    net.visit_linears_mut("", &mut |name, linear| {
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
    Ok(plan)
}

/// Makes every weight of `net` a constant (a tied weight stays one tensor) but those of
/// `config.modules_to_save`, which become trainable copies of their own, as peft's
/// ModulesToSaveWrapper makes: a head tied to the frozen embedding shares its storage,
/// which its updates would write into.
pub fn freeze_base(net: &mut impl Parallelize, config: &LoraConfig) -> Result<()> {
    let mut frozen: HashMap<TensorId, Tensor> = HashMap::new();
    let mut saved: HashMap<TensorId, Tensor> = HashMap::new();
    net.visit_weights_mut("", &mut |name, w| {
        let Weight::Local(t) = w else {
            return Ok(());
        };
        if config.saves(name) {
            let copy = match saved.get(&t.id()) {
                Some(c) => c.clone(),
                None => {
                    let c = Var::from_tensor(&t.copy()?)?.as_tensor().clone();
                    saved.insert(t.id(), c.clone());
                    c
                }
            };
            *w = Weight::Local(copy);
        } else if t.is_variable() {
            let constant = frozen.entry(t.id()).or_insert_with(|| t.detach()).clone();
            *w = Weight::Local(constant);
        }
        Ok(())
    })
}

/// Sets the trainable tensors of `net` (adapters, modules trained whole) from `values`,
/// full-size by our names, each cut to what this rank holds by `part` (name, value). Every
/// trainable tensor must be given and every value must name one; errors name `source`.
pub fn set_trainable(
    net: &impl Parallelize,
    values: &BTreeMap<String, Tensor>,
    part: &dyn Fn(&str, &Tensor) -> Result<Tensor>,
    source: &str,
) -> Result<()> {
    let mut seen = HashSet::new();
    let mut trainable = Vec::new();
    net.visit_params("", &mut |name, t, _| {
        if t.is_variable() && seen.insert(t.id()) {
            trainable.push((name.to_string(), t.clone()));
        }
    });
    // Expert adapters read from peft's fused layout carry Qwen3-MoE's names.
    let ours: HashSet<&str> = trainable.iter().map(|(n, _)| n.as_str()).collect();
    let values: BTreeMap<String, &Tensor> = values
        .iter()
        .map(|(n, t)| (super::peft_experts::align(n, &ours), t))
        .collect();
    for (name, t) in &trainable {
        let value = values.get(name).copied().ok_or_else(|| {
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
    if let Some(extra) = values
        .keys()
        .find(|k| !trainable.iter().any(|(n, _)| n == *k))
    {
        return Err(Error::config(
            source,
            extra,
            "names no trainable tensor of this model: an adapter for another model or setup?",
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
        match target.is_parameter() {
            true => parameters.push(name.to_string()),
            false => linears.push(name.to_string()),
        }
        Ok(())
    })?;
    Ok((linears, parameters))
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
        .map(|(n, t)| (n.clone(), t.clone()))
        .partition(|(n, _)| on_parameter(n));
    // Experts and router as peft holds them on transformers 5 (fused parameters).
    let mut fused = super::peft_experts::fuse(&rest)?;
    fused
        .tensors
        .extend(super::peft_experts::nest(params, &adapted));
    // The linear layers adapted (parameters are listed in target_parameters).
    let targets: Vec<String> = rest
        .keys()
        .filter_map(|n| n.strip_suffix(".lora_A.weight"))
        .filter(|m| !fused.parameter_layers.contains(*m))
        .map(String::from)
        .collect();
    // A vision-language model's language model: peft names its modules by the PyTorch tree.
    let composite = super::composite::is_composite_dir(base);
    let peft_name = |n: &str| match composite {
        true => super::composite::module_name(n),
        false => n.to_string(),
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
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.display().to_string(),
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "target_parameters": (!parameters.is_empty()).then_some(&parameters),
        "modules_to_save": (!config.modules_to_save.is_empty()).then_some(&config.modules_to_save),
        "use_rslora": config.rslora,
        "use_dora": config.dora,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "rank_pattern": pattern((2 * config.r).into()),
        "alpha_pattern": pattern((2.0 * config.alpha).into()),
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
    candle_core::safetensors::save(&named, dir.join(ADAPTER_WEIGHTS))?;
    Ok(())
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
    if named.is_empty() || !base.join(super::params::CONFIG_FILE).is_file() {
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
    let composite = loaded.keys().any(|n| {
        n.strip_prefix(PREFIX)
            .is_some_and(super::composite::is_tree_module)
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
    // A model that holds parameters adapts the listed ones (gpt-oss); one whose experts are
    // linear layers reads peft's fused experts as its per-expert adapters (Qwen3-MoE, Mixtral).
    let held = !sites.is_empty();
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
        .filter_map(|t| match composite {
            true => super::composite::text_module_name(t),
            false => Some(t.clone()),
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
        let ours = match super::composite::text_module_name(ours) {
            Some(text) if composite => text,
            None if composite => {
                left_out += 1;
                continue;
            }
            _ => ours.to_string(),
        };
        // Older peft files can carry the adapter name.
        let ours = ours
            .replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B.")
            .replace(
                ".lora_magnitude_vector.default.weight",
                ".lora_magnitude_vector",
            )
            .replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector");
        tensors.insert(ours, t.to_dtype(dtype)?);
    }
    if left_out > 0 {
        tracing::warn!(
            "{}: {left_out} adapter tensors on the vision tower or projector left out (text \
             rows do not reach them)",
            file.display()
        );
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
