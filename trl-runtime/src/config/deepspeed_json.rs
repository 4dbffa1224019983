//! A DeepSpeed JSON config (`deepspeed_config_file` in an Accelerate YAML, `--deepspeed` in
//! transformers), read as Accelerate reads it: the ZeRO stage, offload devices, 16-bit save,
//! gradient accumulation and clipping, micro-batch size and bf16/fp16, ZeRO-1/2's reduce
//! buckets and overlap. `"auto"` leaves a value to the training arguments. Keys that tune only
//! DeepSpeed's own engine are listed as ignored with the reason, never silently dropped.

use super::sections::{DeepSpeedConfig, MixedPrecision, OffloadDevice};
use crate::error::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// What a DeepSpeed JSON says, for the parts that mean something here.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeepSpeedJson {
    pub file: String,
    pub zero_stage: Option<u8>,
    pub offload_optimizer_device: Option<OffloadDevice>,
    pub offload_param_device: Option<OffloadDevice>,
    pub zero3_save_16bit_model: Option<bool>,
    pub gradient_accumulation_steps: Option<u64>,
    pub gradient_clipping: Option<f64>,
    pub train_micro_batch_size_per_gpu: Option<u64>,
    pub mixed_precision: Option<MixedPrecision>,
    /// `zero_optimization.reduce_bucket_size`: Some(None) for "auto".
    pub reduce_bucket_size: Option<Option<u64>>,
    pub overlap_comm: Option<bool>,
    /// `key: why` for every key that has no effect here.
    pub ignored: Vec<String>,
}

/// Tuning knobs of DeepSpeed's engine: they change its speed or memory, not the results.
const ENGINE_TUNING: &[&str] = &[
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_bucket_size",
    "allgather_partitions",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
    "round_robin_gradients",
    "memory_efficient_linear",
    "pin_memory",
    "buffer_count",
    "fast_init",
];

impl DeepSpeedJson {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read the DeepSpeed config {file}"), e))?;
        Self::from_str(&text, &file)
    }

    pub fn from_str(text: &str, file: &str) -> Result<Self> {
        let err = |key: &str, message: String| Error::Config {
            file: file.into(),
            key: key.into(),
            message,
        };
        let root: Value = serde_json::from_str(text)
            .map_err(|e| err("<document>", format!("not valid JSON: {e}")))?;
        let Value::Object(root) = root else {
            return Err(err("<document>", "expected a JSON object".into()));
        };
        let mut out = DeepSpeedJson {
            file: file.into(),
            ..Default::default()
        };
        // A number, or None for "auto" (filled from the training arguments).
        let number = |key: &str, v: &Value| -> Result<Option<f64>> {
            match v {
                Value::String(s) if s == "auto" => Ok(None),
                Value::Number(n) => Ok(n.as_f64()),
                other => Err(err(
                    key,
                    format!("expected a number or \"auto\", found {other}"),
                )),
            }
        };
        let flag = |key: &str, v: &Value| -> Result<Option<bool>> {
            match v {
                Value::String(s) if s == "auto" => Ok(None),
                Value::Bool(b) => Ok(Some(*b)),
                other => Err(err(
                    key,
                    format!("expected true, false or \"auto\", found {other}"),
                )),
            }
        };
        let device = |key: &str, v: &Value| -> Result<OffloadDevice> {
            match v.get("device").and_then(Value::as_str).unwrap_or("none") {
                "none" => Ok(OffloadDevice::None),
                "cpu" => Ok(OffloadDevice::Cpu),
                "nvme" => Ok(OffloadDevice::Nvme),
                other => Err(err(
                    &format!("{key}.device"),
                    format!("'{other}' is not accepted: use none, cpu or nvme"),
                )),
            }
        };
        for (key, v) in &root {
            match key.as_str() {
                "zero_optimization" => {
                    let Value::Object(zero) = v else {
                        return Err(err(key, "expected an object".into()));
                    };
                    for (k, z) in zero {
                        let path = format!("zero_optimization.{k}");
                        match k.as_str() {
                            "stage" => match z.as_u64() {
                                Some(s) if s <= 3 => out.zero_stage = Some(s as u8),
                                _ => return Err(err(&path, format!("{z} is not a ZeRO stage: use 0, 1, 2 or 3"))),
                            },
                            "offload_optimizer" => out.offload_optimizer_device = Some(device(&path, z)?),
                            "offload_param" => out.offload_param_device = Some(device(&path, z)?),
                            "reduce_bucket_size" => {
                                out.reduce_bucket_size = Some(number(&path, z)?.map(|n| n as u64))
                            }
                            // "auto": DeepSpeed's default for the stage.
                            "overlap_comm" => out.overlap_comm = flag(&path, z)?,
                            "stage3_gather_16bit_weights_on_model_save"
                            | "gather_16bit_weights_on_model_save" => {
                                out.zero3_save_16bit_model = flag(&path, z)?
                            }
                            k if ENGINE_TUNING.contains(&k) => out.ignored.push(format!(
                                "{path} (tunes DeepSpeed's engine; collectives here are bucketed and overlapped by the runtime)"
                            )),
                            _ => out.ignored.push(format!("{path} (not a setting cargo-trl knows)")),
                        }
                    }
                }
                "gradient_accumulation_steps" => {
                    out.gradient_accumulation_steps = number(key, v)?.map(|n| n as u64)
                }
                "gradient_clipping" => out.gradient_clipping = number(key, v)?,
                "train_micro_batch_size_per_gpu" => {
                    out.train_micro_batch_size_per_gpu = number(key, v)?.map(|n| n as u64)
                }
                "bf16" | "fp16" => {
                    let enabled = match v.get("enabled") {
                        Some(e) => flag(&format!("{key}.enabled"), e)?,
                        None => Some(true),
                    };
                    if enabled == Some(true) {
                        out.mixed_precision = Some(match key.as_str() {
                            "bf16" => MixedPrecision::Bf16,
                            _ => MixedPrecision::Fp16,
                        });
                    }
                }
                "train_batch_size" => {
                    if number(key, v)?.is_some() {
                        out.ignored.push("train_batch_size (the global batch follows from per_device_train_batch_size x data-parallel ranks x gradient_accumulation_steps)".into());
                    }
                }
                "optimizer" | "scheduler" => out.ignored.push(format!(
                    "{key} (the trainer's own AdamW and learning-rate schedule from the training arguments are used)"
                )),
                "steps_per_print" | "wall_clock_breakdown" | "zero_allow_untested_optimizer"
                | "communication_data_type" | "prescale_gradients" | "flops_profiler"
                | "tensorboard" | "wandb" | "csv_monitor" | "comms_logger" => out
                    .ignored
                    .push(format!("{key} (DeepSpeed engine logging or tuning; no effect here)")),
                _ => out.ignored.push(format!("{key} (not a setting cargo-trl knows)")),
            }
        }
        if out.zero_stage == Some(3) && out.reduce_bucket_size.is_some() {
            out.ignored.push(
                "zero_optimization.reduce_bucket_size (ZeRO-3 reduce-scatters each layer's gradients as its backward ends)"
                    .into(),
            );
        }
        Ok(out)
    }

    /// Writes what the file sets over `c`.
    pub fn apply(&self, c: &mut DeepSpeedConfig) {
        if let Some(s) = self.zero_stage {
            c.zero_stage = s;
        }
        if let Some(d) = self.offload_optimizer_device {
            c.offload_optimizer_device = d;
        }
        if let Some(d) = self.offload_param_device {
            c.offload_param_device = d;
        }
        if let Some(b) = self.zero3_save_16bit_model {
            c.zero3_save_16bit_model = b;
        }
        if self.gradient_accumulation_steps.is_some() {
            c.gradient_accumulation_steps = self.gradient_accumulation_steps;
        }
        if self.gradient_clipping.is_some() {
            c.gradient_clipping = self.gradient_clipping;
        }
        if self.train_micro_batch_size_per_gpu.is_some() {
            c.train_micro_batch_size_per_gpu = self.train_micro_batch_size_per_gpu;
        }
        if self.mixed_precision.is_some() {
            c.mixed_precision = self.mixed_precision;
        }
        if let Some(b) = self.reduce_bucket_size {
            c.reduce_bucket_size = b;
        }
        if self.overlap_comm.is_some() {
            c.overlap_comm = self.overlap_comm;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_accelerate_reads() {
        let j = DeepSpeedJson::from_str(
            r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                 "overlap_comm": true, "stage3_gather_16bit_weights_on_model_save": true},
                "bf16": {"enabled": true}, "gradient_accumulation_steps": "auto",
                "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "AdamW"}}"#,
            "ds.json",
        )
        .unwrap();
        assert_eq!(j.zero_stage, Some(3));
        assert_eq!(j.offload_optimizer_device, Some(OffloadDevice::Cpu));
        assert_eq!(j.zero3_save_16bit_model, Some(true));
        assert_eq!(j.gradient_accumulation_steps, None);
        assert_eq!(j.gradient_clipping, Some(1.0));
        assert_eq!(j.train_micro_batch_size_per_gpu, Some(4));
        assert_eq!(j.mixed_precision, Some(MixedPrecision::Bf16));
        assert_eq!(j.overlap_comm, Some(true));
        assert_eq!(j.ignored.len(), 1, "{:?}", j.ignored);
        let bad = DeepSpeedJson::from_str(r#"{"zero_optimization": {"stage": 5}}"#, "ds.json")
            .unwrap_err()
            .to_string();
        assert!(
            bad.contains("ds.json") && bad.contains("zero_optimization.stage"),
            "{bad}"
        );
    }
}
