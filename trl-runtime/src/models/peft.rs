//! LoRA adapters in peft's format: `adapter_config.json` (peft's LoraConfig) and
//! `adapter_model.safetensors`, whose tensors are named as `PeftModel.save_pretrained`
//! names them (`base_model.model.` + the layer's name + `.lora_A.weight`; a module trained
//! whole under its own name). `peft.PeftModel.from_pretrained(base, dir)` loads what
//! [`save`] writes, and [`read`] loads what peft writes.

use crate::error::{Error, Result};
use crate::nn::lora::{LoraConfig, Targets};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const PREFIX: &str = "base_model.model.";

/// Writes `tensors` (full-size, by our names) and the adapter config into `dir`. `base` is
/// the base model's directory (peft's base_model_name_or_path); `targets` the names of the
/// adapted layers.
pub fn save(
    dir: &Path,
    tensors: &BTreeMap<String, Tensor>,
    config: &LoraConfig,
    base: &Path,
) -> Result<()> {
    let mut targets: Vec<String> = tensors
        .keys()
        .filter_map(|n| n.strip_suffix(".lora_A.weight"))
        .map(String::from)
        .collect();
    targets.sort();
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.display().to_string(),
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "modules_to_save": (!config.modules_to_save.is_empty()).then_some(&config.modules_to_save),
        "use_rslora": config.rslora,
        "use_dora": false,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let text = serde_json::to_string_pretty(&json).expect("json");
    std::fs::write(dir.join(ADAPTER_CONFIG), text).map_err(|e| {
        Error::io(
            format!("cannot write {}", dir.join(ADAPTER_CONFIG).display()),
            e,
        )
    })?;
    let named: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| Ok((format!("{PREFIX}{n}"), t.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    candle_core::safetensors::save(&named, dir.join(ADAPTER_WEIGHTS))?;
    Ok(())
}

/// The LoRA setup of a peft adapter directory and its tensors by our names (full size).
pub fn read(
    dir: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(LoraConfig, BTreeMap<String, Tensor>)> {
    let path = dir.join(ADAPTER_CONFIG);
    let source = path.display().to_string();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io(format!("cannot read {source}"), e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(&source, "<document>", e.to_string()))?;
    let err = |key: &str, message: String| Error::config(&source, key, message);
    if json["peft_type"].as_str() != Some("LORA") {
        return Err(err(
            "peft_type",
            format!("{}: only LORA adapters are read", json["peft_type"]),
        ));
    }
    for key in ["use_dora", "fan_in_fan_out"] {
        if json[key].as_bool() == Some(true) {
            return Err(err(
                key,
                "not supported: DoRA and fan-in-fan-out layers are not implemented".into(),
            ));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if json[key].as_object().is_some_and(|m| !m.is_empty()) {
            return Err(err(
                key,
                "per-layer ranks and alphas are not supported".into(),
            ));
        }
    }
    if json["bias"].as_str().is_some_and(|b| b != "none") {
        return Err(err(
            "bias",
            "trained biases are not supported (use bias: none)".into(),
        ));
    }
    let r = json["r"]
        .as_u64()
        .ok_or_else(|| err("r", "missing".into()))? as usize;
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
    let target_list = names("target_modules");
    let targets = match target_list.as_slice() {
        [one] if one.eq_ignore_ascii_case("all-linear") => Targets::AllLinear,
        _ => Targets::Names(target_list),
    };
    let config = LoraConfig {
        r,
        alpha: json["lora_alpha"].as_f64().unwrap_or(8.0),
        dropout: json["lora_dropout"].as_f64().unwrap_or(0.0),
        targets,
        modules_to_save: names("modules_to_save"),
        rslora: json["use_rslora"].as_bool().unwrap_or(false),
        seed: 0,
    };
    let file = dir.join(ADAPTER_WEIGHTS);
    let loaded = candle_core::safetensors::load(&file, device)?;
    let mut tensors = BTreeMap::new();
    for (name, t) in loaded {
        let Some(ours) = name.strip_prefix(PREFIX) else {
            return Err(Error::config(
                file.display().to_string(),
                &name,
                format!("not a peft causal-LM adapter tensor (expected names starting {PREFIX})"),
            ));
        };
        // Older peft files can carry the adapter name.
        let ours = ours
            .replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B.");
        tensors.insert(ours, t.to_dtype(dtype)?);
    }
    Ok((config, tensors))
}
