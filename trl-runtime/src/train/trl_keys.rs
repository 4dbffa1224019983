//! Keys of TRL's and transformers' training arguments (SFTConfig, TrainingArguments, TRL's
//! ModelConfig and ScriptArguments, as of TRL 1.16 / transformers 5.23, and a few older names)
//! that SFTConfig has no field for. A recipe written for `trl sft` keeps working: each such key
//! is applied (an alias of one we have), refused when ignoring it would change what is trained
//! (LoRA, quantization, fp16, a different optimizer or loss), or named once with why it has no
//! effect here. A key in none of these lists is a typo: an error naming the file and the key.

use crate::error::{Error, Result};
use serde_yaml::Value;
use std::collections::BTreeMap;

const KNOWN: &[&str] = &[
    "accelerator_config",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "auto_find_batch_size",
    "average_tokens_across_devices",
    "batch_eval_metrics",
    "bf16_full_eval",
    "bnb_4bit_quant_storage",
    "bnb_4bit_quant_type",
    "chat_template_path",
    "dataloader_in_order",
    "dataloader_multiprocessing_context",
    "dataloader_num_workers",
    "dataloader_persistent_workers",
    "dataloader_pin_memory",
    "dataloader_prefetch_factor",
    "dataset_kwargs",
    "dataset_num_proc",
    "dataset_streaming",
    "dataset_text_field",
    "ddp_backend",
    "ddp_broadcast_buffers",
    "ddp_bucket_cap_mb",
    "ddp_static_graph",
    "ddp_timeout",
    "debug",
    "deepspeed",
    "dispatch_batches",
    "do_eval",
    "do_predict",
    "do_train",
    "dtype",
    "enable_jit_checkpoint",
    "eos_token",
    "eval_accumulation_steps",
    "eval_do_concat_batches",
    "eval_packing",
    "evaluation_strategy",
    "eval_use_gather_object",
    "fp16",
    "fp16_full_eval",
    "fp16_opt_level",
    "fsdp",
    "fsdp_config",
    "fsdp_min_num_params",
    "fsdp_transformer_layer_cls_to_wrap",
    "full_determinism",
    "gradient_checkpointing_kwargs",
    "half_precision_backend",
    "hub_always_push",
    "hub_model_id",
    "hub_private_repo",
    "hub_revision",
    "hub_strategy",
    "hub_token",
    "ignore_bias_buffers",
    "ignore_data_skip",
    "include_for_metrics",
    "include_inputs_for_metrics",
    "include_num_input_tokens_seen",
    "include_tokens_per_second",
    "jit_mode_eval",
    "label_names",
    "label_smoothing_factor",
    "length_column_name",
    "liger_kernel_config",
    "load_in_4bit",
    "load_in_8bit",
    "local_rank",
    "log_level",
    "log_level_replica",
    "log_on_each_node",
    "logging_dir",
    "max_completion_length",
    "max_prompt_length",
    "max_seq_length",
    "model_init_kwargs",
    "model_revision",
    "mp_parameters",
    "no_cuda",
    "optim",
    "optim_args",
    "optim_target_modules",
    "pad_token",
    "parallelism_config",
    "past_index",
    "prediction_loss_only",
    "project",
    "push_to_hub",
    "ray_scope",
    "reference_free",
    "remove_unused_columns",
    "report_to",
    "restore_callback_states_from_checkpoint",
    "rpo_alpha",
    "run_name",
    "save_on_each_node",
    "save_safetensors",
    "shuffle_dataset",
    "skip_memory_metrics",
    "split_batches",
    "streaming",
    "tf32",
    "torch_compile",
    "torch_compile_backend",
    "torch_compile_mode",
    "torch_dtype",
    "torch_empty_cache_steps",
    "torchdynamo",
    "tpu_num_cores",
    "trackio_bucket_id",
    "trackio_space_id",
    "trackio_static_space_id",
    "truncation_mode",
    "trust_remote_code",
    "use_bnb_nested_quant",
    "use_cache",
    "use_cpu",
    "use_ipex",
    "use_legacy_prediction_loop",
    "use_mps_device",
];

/// TRL's GRPOConfig keys without a field in [`crate::train::GRPOConfig`] (TRL 1.16): vLLM and
/// transformers' generation backends, completion logging, the entropy bonus;
/// and DistillationConfig's teacher loading options.
const GRPO_KNOWN: &[&str] = &[
    "cache_implementation",
    "cast_lm_head_to_fp32",
    "chat_template_kwargs",
    "ds3_gather_for_generation",
    "entropy_coef",
    "entropy_coef_delta",
    "entropy_coef_max",
    "entropy_coef_min",
    "entropy_target",
    "generation_kwargs",
    "log_completions",
    "log_completions_hub_repo",
    "log_multimodal",
    "log_unique_prompts",
    "max_tool_calling_iterations",
    "num_completions_to_print",
    "off_policy_mask_threshold",
    "teacher_model_init_kwargs",
    "teacher_model_revision",
    "transformers_continuous_batching_config",
    "use_adaptive_entropy",
    "use_transformers_continuous_batching",
    "use_transformers_paged",
    "vllm_enable_sleep_mode",
    "vllm_gpu_memory_utilization",
    "vllm_group_port",
    "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_max_model_length",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_structured_outputs_regex",
    "vllm_tensor_parallel_size",
];

/// A key TRL or transformers documents that has no field here.
fn known(key: &str) -> bool {
    KNOWN.contains(&key) || GRPO_KNOWN.contains(&key)
}

/// Why a key has no effect here, by what it is about.
fn why(key: &str) -> &'static str {
    let any = |prefixes: &[&str]| prefixes.iter().any(|p| key.starts_with(p));
    if any(&[
        "vllm_",
        "use_transformers_",
        "transformers_continuous",
        "cache_implementation",
        "ds3_gather_for_generation",
        "cast_lm_head_to_fp32",
        "generation_kwargs",
    ]) {
        "completions are generated in the training processes (KV cache, the policy sharded as it trains, the head in f32 accumulation): no vLLM or transformers generation backend"
    } else if any(&[
        "log_completions",
        "log_multimodal",
        "log_unique_prompts",
        "num_completions_to_print",
    ]) {
        "completions are not logged as tables: the reward and completion figures go to metrics.jsonl"
    } else if key.starts_with("teacher_model_") {
        "the teacher is read from teacher_model_name_or_path (a local checkpoint directory) in the run's compute dtype"
    } else if key == "max_tool_calling_iterations" {
        "tool calling is not built: completions come from generation or a rollout program (rollout_command)"
    } else if key == "chat_template_kwargs" {
        "prompts are rendered with the tokenizer's chat template as it is"
    } else if any(&[
        "entropy_",
        "use_adaptive_entropy",
        "off_policy_mask_threshold",
    ]) {
        "at its default: the entropy bonus and the off-policy mask are not built"
    } else if any(&["hub_", "push_to_hub"]) {
        "no model hub here: checkpoints are written to output_dir"
    } else if any(&[
        "report_to",
        "run_name",
        "project",
        "trackio_",
        "logging_",
        "log_",
        "include_tokens_per_second",
    ]) {
        "metrics go to output_dir/metrics.jsonl (and the log) as logging_strategy says"
    } else if key == "include_num_input_tokens_seen" {
        "the input tokens trained on (padding not counted) are logged as num_tokens, as TRL logs them"
    } else if any(&[
        "eval_",
        "do_",
        "prediction_loss_only",
        "batch_eval_metrics",
        "include_for_metrics",
        "include_inputs_for_metrics",
        "bf16_full_eval",
        "fp16_full_eval",
        "jit_mode_eval",
        "use_legacy_prediction_loop",
        "past_index",
    ]) {
        "evaluation runs on eval_dataset_name as eval_strategy says"
    } else if any(&[
        "save_",
        "restore_callback_states_from_checkpoint",
        "ignore_data_skip",
    ]) {
        "checkpoints (HF safetensors, written atomically) as save_strategy says, save_total_limit kept"
    } else if any(&[
        "ddp_",
        "fsdp",
        "deepspeed",
        "accelerator_config",
        "parallelism_config",
        "local_rank",
        "use_cpu",
        "no_cuda",
        "use_mps_device",
        "tpu_num_cores",
        "split_batches",
        "dispatch_batches",
        "mp_parameters",
        "ray_scope",
    ]) {
        "distribution comes from the launch (cargo trl launch's profile or Accelerate config)"
    } else if any(&[
        "dataloader_",
        "dataset_",
        "streaming",
        "remove_unused_columns",
        "label_names",
        "length_column_name",
        "shuffle_dataset",
    ]) {
        "the dataset is dataset_name (a .jsonl or .parquet file in one of TRL's formats, or a local dataset directory), read and shuffled in-process by seed"
    } else if any(&[
        "model_init_kwargs",
        "trust_remote_code",
        "model_revision",
        "dtype",
        "torch_dtype",
        "chat_template_path",
        "eos_token",
        "pad_token",
        "ignore_bias_buffers",
        "lora_",
        "bnb_",
    ]) {
        "the model, its dtype and tokenizer come from model_name_or_path (weights are trained in fp32, or bf16 with bf16 / mixed_precision)"
    } else {
        "a PyTorch / transformers runtime setting with no counterpart here"
    }
}

/// A YAML scalar as the text an environment variable holds (Python's `str(value)`).
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(if *b { "True" } else { "False" }.to_string()),
        _ => None,
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        Value::String(s) => !matches!(
            s.to_ascii_lowercase().as_str(),
            "" | "false" | "no" | "0" | "none"
        ),
        _ => true,
    }
}

/// Takes the `--KEY [VALUE]` / `--KEY=VALUE` flags whose KEY (either spelling) is one of the
/// known keys out of `args` (unless the trainer has a field of that name, `fields`: its own
/// and the shared ones); a flag without a value (or followed by another flag) is `true`, and
/// `--no_KEY` is KEY false. Values are read as YAML scalars (`512` a number, `true` a
/// boolean).
pub fn take_flags(
    args: impl IntoIterator<Item = String>,
    fields: &[&str],
) -> (Vec<String>, BTreeMap<String, Value>) {
    let mut rest = Vec::new();
    let mut taken = BTreeMap::new();
    let mut args = args.into_iter().peekable();
    while let Some(a) = args.next() {
        let Some(flag) = a.strip_prefix("--") else {
            rest.push(a);
            continue;
        };
        let (mut name, mut inline) = match flag.split_once('=') {
            Some((n, v)) => (n.replace('-', "_"), Some(v.to_string())),
            None => (flag.replace('-', "_"), None),
        };
        // HfArgumentParser's `--no_KEY` for a boolean that defaults to true (TRL's scripts
        // document `--no_remove_unused_columns`): KEY false.
        if let Some(key) = name.strip_prefix("no_") {
            let known = |k: &str| known(k) || fields.contains(&k);
            if inline.is_none() && !known(&name) && known(key) {
                (name, inline) = (key.to_string(), Some("false".into()));
            }
        }
        if !known(&name) || fields.contains(&name.as_str()) {
            // HfArgumentParser accepts `--per-device-train-batch-size` for every field, and
            // every flag clap knows here is snake_case.
            rest.push(match &inline {
                Some(v) => format!("--{name}={v}"),
                None => format!("--{name}"),
            });
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => match args.peek() {
                Some(next) if !next.starts_with("--") => args.next().expect("peeked"),
                _ => "true".to_string(),
            },
        };
        let value = serde_yaml::from_str(&value).unwrap_or(Value::String(value));
        taken.insert(name, value);
    }
    (rest, taken)
}

/// A key that sets a field under another name (transformers 5's and TRL's older names).
#[derive(Debug, Clone, PartialEq)]
pub enum Alias {
    GradientCheckpointing(bool),
    MaxLength(usize),
    /// transformers 4's name of eval_strategy.
    EvalStrategy(String),
    /// TRL's config files' `env:` mapping: environment variables the process sets before
    /// training (`trl sft --config` sets them the same way).
    Env(Vec<(String, String)>),
}

/// Sorts `other` (keys the training config has no field for; `fields` are the ones it has,
/// for suggestions) as the module docs say: the aliases to apply, and one `KEY: why` line per
/// key that has no effect. Errors name `source` and the key.
pub fn classify(
    other: BTreeMap<String, Value>,
    fields: &[&str],
    source: &str,
) -> Result<(Vec<Alias>, Vec<String>)> {
    let err = |key: &str, message: String| Error::Config {
        file: source.into(),
        key: key.into(),
        message,
    };
    let mut aliases = Vec::new();
    let mut ignored = Vec::new();
    for (key, value) in other {
        match key.as_str() {
            // transformers 5's name, and TRL's older one, for fields we have.
            "activation_checkpointing" => {
                aliases.push(Alias::GradientCheckpointing(truthy(&value)))
            }
            "env" => {
                let vars = value.as_mapping().and_then(|m| {
                    m.iter()
                        .map(|(k, v)| Some((scalar(k)?, scalar(v)?)))
                        .collect::<Option<Vec<_>>>()
                });
                match vars {
                    Some(vars) => aliases.push(Alias::Env(vars)),
                    None => return Err(err(&key, "expected a mapping of variable names to values (env: {CUDA_VISIBLE_DEVICES: 0})".into())),
                }
            }
            "evaluation_strategy" => match value.as_str() {
                Some(s) => aliases.push(Alias::EvalStrategy(s.to_string())),
                None => return Err(err(&key, format!("expected no, steps or epoch, found {value:?}"))),
            },
            "max_seq_length" => match value.as_u64() {
                Some(n) => aliases.push(Alias::MaxLength(n as usize)),
                None if value.is_null() => {}
                None => return Err(err(&key, format!("expected a token count, found {value:?}"))),
            },
            "load_in_8bit" | "load_in_4bit" if truthy(&value) => {
                return Err(err(&key, "quantized training is not implemented: the base would be trained in full precision instead; remove it (or set it to false)".into()))
            }
            "fp16" if truthy(&value) => {
                return Err(err(&key, "fp16 needs dynamic loss scaling, which is not implemented: use bf16: true".into()))
            }
            "average_tokens_across_devices" if value.as_bool() == Some(false) => {
                return Err(err(&key, "false normalizes each rank's loss by its own target tokens; here the loss is always normalized by the target tokens of all ranks (transformers' default, true): remove it".into()))
            }
            "label_smoothing_factor" if truthy(&value) => {
                return Err(err(&key, "changes the loss and is not implemented: remove it".into()))
            }
            "optim" if !value.is_null() && !value.as_str().is_some_and(|o| o.starts_with("adamw")) => {
                return Err(err(&key, format!("{value:?}: only AdamW (adamw_torch, adamw_torch_fused, ...) is implemented")))
            }
            "rpo_alpha" => {
                return Err(err(&key, "TRL 1.x replaced it: loss_type: [sigmoid, sft] with loss_weights: [1.0, RPO_ALPHA]".into()))
            }
            "reference_free" | "max_prompt_length" | "max_completion_length" => {
                return Err(err(&key, "a DPO key of TRL before 1.0, gone from TRL 1.16's DPOConfig: remove it (sequences are cut to max_length, prompt first)".into()))
            }
            "truncation_mode" if !value.is_null() && value.as_str() != Some("keep_start") => {
                return Err(err(&key, format!("{value:?}: rows longer than max_length keep their start (keep_start)")))
            }
            "dataset_text_field" if value.as_str().is_some_and(|f| f != "text") => {
                return Err(err(&key, format!("{value:?}: preference rows are prompt, chosen and rejected (TRL's DPOConfig has no dataset_text_field): remove it")))
            }
            // What is left of these (the arms above refuse the rest) says what training here
            // does anyway: not ignored.
            "fp16" | "average_tokens_across_devices" | "label_smoothing_factor" | "optim"
            | "truncation_mode" => {}
            // GRPO's keys that change what is trained when set away from TRL's default.
            "entropy_coef" if value.as_f64().is_some_and(|c| c != 0.0) => {
                return Err(err(&key, "an entropy bonus is not built: remove it (or set 0.0)".into()))
            }
            "use_adaptive_entropy" if truthy(&value) => {
                return Err(err(&key, "the adaptive entropy bonus is not built: remove it".into()))
            }
            "off_policy_mask_threshold" if !value.is_null() => {
                return Err(err(&key, "the off-policy sequence mask is not built: remove it".into()))
            }
            "generation_kwargs" if !value.is_null() && !value.as_mapping().is_some_and(|m| m.is_empty()) => {
                return Err(err(&key, "sampling is set by the config's own keys here (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length): use those".into()))
            }
            k if known(k) => ignored.push(format!("{k}: {}", why(k))),
            k => {
                let hint = KNOWN
                    .iter()
                    .chain(GRPO_KNOWN)
                    .copied()
                    .chain(fields.iter().copied())
                    .min_by_key(|c| strsim::levenshtein(c, k))
                    .filter(|c| strsim::levenshtein(c, k) <= 3)
                    .map(|c| format!(" (did you mean `{c}`?)"))
                    .unwrap_or_default();
                return Err(err(k, format!("not a training argument of TRL or transformers{hint}")));
            }
        }
    }
    Ok((aliases, ignored))
}
