//! Accelerate's launch config (the YAML written by `accelerate config` and shipped by TRL),
//! read as is. Unknown keys are kept as warnings; a wrong type or value is an error naming the
//! file, the key and the accepted values.

use super::deepspeed_json::DeepSpeedJson;
use super::named::Named;
use super::parallelism::{ParallelismConfig, SpBackend};
use super::yaml::Section;
use crate::error::{Error, Result};
use serde_yaml::Value;
use std::path::{Path, PathBuf};

pub use super::sections::{
    ComputeEnvironment, DeepSpeedConfig, DistributedType, FsdpAutoWrapPolicy, FsdpBackwardPrefetch,
    FsdpConfig, FsdpShardingStrategy, FsdpStateDictType, GpuIds, MixedPrecision, OffloadDevice,
};

/// A whole Accelerate launch config.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    /// Where it was read from (for messages).
    pub source: String,
    pub compute_environment: ComputeEnvironment,
    pub distributed_type: DistributedType,
    /// Total processes across all machines (Accelerate's meaning). None: decided at launch.
    pub num_processes: Option<u32>,
    pub num_machines: u32,
    pub machine_rank: u32,
    pub main_process_ip: Option<String>,
    pub main_process_port: Option<u16>,
    pub mixed_precision: MixedPrecision,
    pub gpu_ids: GpuIds,
    pub use_cpu: bool,
    pub same_network: bool,
    pub rdzv_backend: String,
    pub debug: bool,
    pub downcast_bf16: bool,
    pub enable_cpu_affinity: bool,
    pub main_training_function: String,
    pub fsdp: Option<FsdpConfig>,
    pub deepspeed: Option<DeepSpeedConfig>,
    pub parallelism: ParallelismConfig,
    /// Keys that were not recognised, with their full paths: reported, never silently dropped.
    pub unknown_keys: Vec<String>,
}

const DISTRIBUTED_TYPES: &[&str] = &["NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP"];
const UNSUPPORTED_DISTRIBUTED_TYPES: &[&str] = &[
    "MULTI_NPU",
    "MULTI_XPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_HPU",
    "MULTI_NEURON",
    "XLA",
    "TPU",
    "MEGATRON_LM",
];
/// Keys Accelerate writes that have no effect here (TPU settings and similar): accepted silently.
const IGNORED_KEYS: &[&str] = &[
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_name",
    "tpu_zone",
    "commands",
    "command_file",
    "dynamo_config",
    "ipex_config",
    "mpirun_config",
    "use_parallelism_config",
];

impl LaunchConfig {
    /// Reads a config file. Errors name the file; unknown keys are logged as warnings.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read launch config {}", path.display()), e))?;
        let cfg = Self::from_yaml_str(&text, &path.display().to_string())?;
        for key in &cfg.unknown_keys {
            tracing::warn!(file = %cfg.source, "unknown key `{key}` in launch config: ignored (check its spelling)");
        }
        Ok(cfg)
    }

    /// Parses YAML text; `source` names it in messages.
    pub fn from_yaml_str(text: &str, source: &str) -> Result<Self> {
        let value: Value = serde_yaml::from_str(text).map_err(|e| Error::Config {
            file: source.to_string(),
            key: e
                .location()
                .map(|l| format!("<line {} column {}>", l.line(), l.column()))
                .unwrap_or_else(|| "<document>".into()),
            message: format!("not valid YAML: {e}"),
        })?;
        let empty = serde_yaml::Mapping::new();
        let map = match &value {
            Value::Mapping(m) => m,
            Value::Null => &empty,
            _ => {
                return Err(Error::Config {
                    file: source.into(),
                    key: "<document>".into(),
                    message: "expected a mapping of keys to values at the top level".into(),
                })
            }
        };
        let mut s = Section::new(source, "", map);
        for key in IGNORED_KEYS {
            s.raw(key);
        }

        let compute_environment = match s.choice(
            "compute_environment",
            &["LOCAL_MACHINE", "AMAZON_SAGEMAKER"],
        )? {
            Some("AMAZON_SAGEMAKER") => ComputeEnvironment::AmazonSagemaker,
            _ => ComputeEnvironment::LocalMachine,
        };
        let distributed_type = {
            let mut all = DISTRIBUTED_TYPES.to_vec();
            all.extend_from_slice(UNSUPPORTED_DISTRIBUTED_TYPES);
            match s.choice("distributed_type", &all)? {
                None | Some("NO") => DistributedType::No,
                Some("MULTI_GPU") => DistributedType::MultiGpu,
                Some("MULTI_CPU") => DistributedType::MultiCpu,
                Some("DEEPSPEED") => DistributedType::DeepSpeed,
                Some("FSDP") => DistributedType::Fsdp,
                Some(other) => {
                    return Err(s.error(
                        "distributed_type",
                        format!(
                        "{other} is an Accelerate backend cargo-trl does not run: use one of {}",
                        DISTRIBUTED_TYPES.join(", ")
                    ),
                    ))
                }
            }
        };
        let num_processes = s.uint_in("num_processes", 1, 1 << 20)?.map(|n| n as u32);
        let num_machines = s.uint_in("num_machines", 1, 1 << 16)?.unwrap_or(1) as u32;
        let machine_rank = s.uint("machine_rank")?.unwrap_or(0) as u32;
        if machine_rank >= num_machines {
            return Err(s.error(
                "machine_rank",
                format!("{machine_rank} must be below num_machines ({num_machines}): machine ranks count from 0"),
            ));
        }
        let main_process_ip = s.string("main_process_ip")?;
        let main_process_port = s.uint_in("main_process_port", 0, 65535)?.map(|p| p as u16);
        let mixed_precision = match s.raw("mixed_precision") {
            None => MixedPrecision::No,
            Some(Value::Bool(false)) => MixedPrecision::No,
            Some(Value::String(v)) => MixedPrecision::parse(v).ok_or_else(|| {
                s.error(
                    "mixed_precision",
                    format!("'{v}' is not accepted: use one of no, fp16, bf16, fp8"),
                )
            })?,
            Some(v) => {
                return Err(s.error(
                    "mixed_precision",
                    format!("expected one of no, fp16, bf16, fp8, found {v:?}"),
                ))
            }
        };
        let gpu_ids = match s.string("gpu_ids")? {
            None => GpuIds::All,
            Some(text) => GpuIds::parse(&text).map_err(|m| s.error("gpu_ids", m))?,
        };
        let use_cpu = s.bool("use_cpu")?.unwrap_or(false);
        let same_network = s.bool("same_network")?.unwrap_or(true);
        let rdzv_backend = s
            .choice("rdzv_backend", &["static", "c10d", "etcd", "etcd-v2"])?
            .unwrap_or("static")
            .to_string();
        let debug = s.bool("debug")?.unwrap_or(false);
        let downcast_bf16 = match s.raw("downcast_bf16") {
            None | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(Value::String(v)) if v == "no" || v == "false" => false,
            Some(Value::String(v)) if v == "yes" || v == "true" => true,
            Some(v) => {
                return Err(s.error(
                    "downcast_bf16",
                    format!("expected 'no' or 'yes', found {v:?}"),
                ))
            }
        };
        let enable_cpu_affinity = s.bool("enable_cpu_affinity")?.unwrap_or(false);
        let main_training_function = s
            .string("main_training_function")?
            .unwrap_or_else(|| "main".into());

        let mut unknown_keys = Vec::new();
        let fsdp =
            match s.mapping("fsdp_config")? {
                Some(m) if distributed_type == DistributedType::Fsdp || !m.is_empty() => Some(
                    section(source, "fsdp_config", m, &mut unknown_keys, parse_fsdp)?,
                ),
                _ if distributed_type == DistributedType::Fsdp => Some(FsdpConfig::default()),
                _ => None,
            };
        let deepspeed = match s.mapping("deepspeed_config")? {
            Some(m) if distributed_type == DistributedType::DeepSpeed || !m.is_empty() => {
                Some(section(
                    source,
                    "deepspeed_config",
                    m,
                    &mut unknown_keys,
                    parse_deepspeed,
                )?)
            }
            _ if distributed_type == DistributedType::DeepSpeed => Some(DeepSpeedConfig::default()),
            _ => None,
        };
        let parallelism = match s.mapping("parallelism_config")? {
            Some(m) => section(
                source,
                "parallelism_config",
                m,
                &mut unknown_keys,
                parse_parallelism,
            )?,
            None => ParallelismConfig::default(),
        };
        if distributed_type == DistributedType::No && num_processes.unwrap_or(1) > 1 {
            return Err(s.error(
                "num_processes",
                format!(
                    "distributed_type NO runs one process but num_processes is {}: set distributed_type to MULTI_GPU or MULTI_CPU, or num_processes to 1",
                    num_processes.unwrap_or(1)
                ),
            ));
        }
        let mut top_unknown = s.unknown_keys();
        top_unknown.append(&mut unknown_keys);
        Ok(LaunchConfig {
            source: source.to_string(),
            compute_environment,
            distributed_type,
            num_processes,
            num_machines,
            machine_rank,
            main_process_ip,
            main_process_port,
            mixed_precision,
            gpu_ids,
            use_cpu,
            same_network,
            rdzv_backend,
            debug,
            downcast_bf16,
            enable_cpu_affinity,
            main_training_function,
            fsdp,
            deepspeed,
            parallelism,
            unknown_keys: top_unknown,
        })
    }

    /// ZeRO stage implied by the config: DeepSpeed's zero_stage, FSDP's sharding strategy
    /// (FULL_SHARD = 3, SHARD_GRAD_OP = 2, NO_SHARD = 0), or 0 for plain DDP.
    pub fn zero_stage(&self) -> u8 {
        if let Some(ds) = &self.deepspeed {
            if self.distributed_type == DistributedType::DeepSpeed {
                return ds.zero_stage;
            }
        }
        match (&self.fsdp, self.distributed_type) {
            (Some(f), DistributedType::Fsdp) => match f.sharding_strategy {
                FsdpShardingStrategy::FullShard | FsdpShardingStrategy::HybridShard => 3,
                FsdpShardingStrategy::ShardGradOp | FsdpShardingStrategy::HybridShardZero2 => 2,
                FsdpShardingStrategy::NoShard => 0,
            },
            _ => 0,
        }
    }
}

/// Accelerate also accepts FSDP1 strategies by number (1 = FULL_SHARD ... 5 = HYBRID_SHARD_ZERO2).
fn sharding_from_value(s: &Section, key: &str, v: &Value) -> Result<FsdpShardingStrategy> {
    let text = match v {
        Value::Number(n) => n.to_string(),
        Value::String(t) => t.trim().to_ascii_uppercase(),
        _ => String::new(),
    };
    let all = FsdpShardingStrategy::ALL;
    if let Some(&s) = text
        .parse::<usize>()
        .ok()
        .and_then(|n| all.get(n.checked_sub(1)?))
    {
        return Ok(s);
    }
    if let Some(s) = FsdpShardingStrategy::from_name(&text) {
        return Ok(s);
    }
    Err(s.error(
        key,
        format!(
            "{v:?} is not a sharding strategy: use one of {} (or 1-5)",
            FsdpShardingStrategy::NAMES.join(", ")
        ),
    ))
}

/// `parse` of the section `key` of `source`, its keys that nothing read added to `unknown`.
fn section<T>(
    source: &str,
    key: &str,
    map: &serde_yaml::Mapping,
    unknown: &mut Vec<String>,
    parse: fn(&mut Section) -> Result<T>,
) -> Result<T> {
    let mut s = Section::new(source, key, map);
    let value = parse(&mut s)?;
    unknown.extend(s.unknown_keys());
    Ok(value)
}

fn parse_fsdp(s: &mut Section) -> Result<FsdpConfig> {
    let mut c = FsdpConfig::default();
    if let Some(v) = s.uint("fsdp_version")? {
        if v != 1 && v != 2 {
            return Err(s.error("fsdp_version", format!("{v} is not accepted: use 1 or 2")));
        }
        c.version = v as u8;
    }
    if let Some(v) = s.raw("fsdp_sharding_strategy") {
        c.set_sharding_strategy(sharding_from_value(s, "fsdp_sharding_strategy", v)?);
    }
    // FSDP1 profiles put the strategy name here; FSDP2 a boolean.
    if let Some(v) = s.raw("fsdp_reshard_after_forward") {
        match v {
            Value::Bool(b) => c.set_reshard_after_forward(*b),
            Value::String(t)
                if t.eq_ignore_ascii_case("true") || t.eq_ignore_ascii_case("false") =>
            {
                c.set_reshard_after_forward(t.eq_ignore_ascii_case("true"))
            }
            other if c.version == 1 => c.set_sharding_strategy(sharding_from_value(
                s,
                "fsdp_reshard_after_forward",
                other,
            )?),
            other => {
                return Err(s.error(
                    "fsdp_reshard_after_forward",
                    format!("fsdp_version 2 expects true or false, found {other:?}"),
                ))
            }
        }
    }
    if let Some(p) = s.named("fsdp_auto_wrap_policy")? {
        c.auto_wrap_policy = p;
    }
    c.transformer_layer_cls_to_wrap = s.string("fsdp_transformer_layer_cls_to_wrap")?;
    c.min_num_params = s.uint("fsdp_min_num_params")?;
    let prefetch_keys = ["fsdp_backward_prefetch", "fsdp_backward_prefetch_policy"];
    for key in prefetch_keys {
        if let Some(p) = s.named(key)? {
            c.backward_prefetch = p;
        }
    }
    if let Some(t) = s.named("fsdp_state_dict_type")? {
        c.state_dict_type = t;
    }
    for (key, field) in FsdpConfig::BOOLEANS {
        if let Some(b) = s.bool(key)? {
            *field(&mut c) = b;
        }
    }
    Ok(c)
}

fn offload(s: &mut Section, key: &str) -> Result<OffloadDevice> {
    Ok(s.named(key)?.unwrap_or(OffloadDevice::None))
}

fn parse_deepspeed(s: &mut Section) -> Result<DeepSpeedConfig> {
    let mut c = DeepSpeedConfig::default();
    if let Some(stage) = s.uint_in("zero_stage", 0, 3)? {
        c.zero_stage = stage as u8;
    }
    c.offload_optimizer_device = offload(s, "offload_optimizer_device")?;
    c.offload_param_device = offload(s, "offload_param_device")?;
    if c.offload_param_device != OffloadDevice::None && c.zero_stage != 3 {
        return Err(s.error(
            "offload_param_device",
            format!("parameter offload needs zero_stage 3 (found {}): set zero_stage: 3 or offload_param_device: none", c.zero_stage),
        ));
    }
    c.zero3_init_flag = s.bool("zero3_init_flag")?.unwrap_or(false);
    c.zero3_save_16bit_model = s.bool("zero3_save_16bit_model")?.unwrap_or(false);
    c.gradient_accumulation_steps = s.uint_in("gradient_accumulation_steps", 1, u32::MAX as u64)?;
    c.gradient_clipping = s.float("gradient_clipping")?;
    c.multinode_launcher = s
        .choice(
            "deepspeed_multinode_launcher",
            &[
                "standard", "pdsh", "openmpi", "mvapich", "mpich", "nossh", "slurm",
            ],
        )?
        .map(str::to_string);
    c.seq_parallel_communication_data_type = s
        .choice(
            "seq_parallel_communication_data_type",
            &["fp32", "fp16", "bf16"],
        )?
        .map(str::to_string);
    if let Some(path) = s.string("deepspeed_config_file")? {
        // As in Accelerate, the JSON is then the whole DeepSpeed config: fields that it
        // owns may not also be set here.
        let owned: Vec<&str> = [
            "zero_stage",
            "offload_optimizer_device",
            "offload_param_device",
            "zero3_save_16bit_model",
            "gradient_accumulation_steps",
            "gradient_clipping",
        ]
        .into_iter()
        .filter(|k| s.has(k))
        .collect();
        if !owned.is_empty() {
            return Err(s.error(
                "deepspeed_config_file",
                format!(
                    "is set together with {}: with a DeepSpeed JSON these belong in the JSON (Accelerate refuses both too); remove them here",
                    owned.join(", ")
                ),
            ));
        }
        let json = DeepSpeedJson::from_file(&path).map_err(|e| {
            s.error(
                "deepspeed_config_file",
                format!("{e} (a relative path is read from the directory you launch in)"),
            )
        })?;
        c = DeepSpeedConfig::default();
        json.apply(&mut c);
        c.config_file = Some(PathBuf::from(path));
    }
    Ok(c)
}

fn parse_parallelism(s: &mut Section) -> Result<ParallelismConfig> {
    let size = |s: &mut Section, key: &str| -> Result<Option<usize>> {
        Ok(s.uint_in(key, 1, 1 << 20)?.map(|n| n as usize))
    };
    let c = ParallelismConfig {
        dp_replicate: size(s, "parallelism_config_dp_replicate_size")?,
        dp_shard: size(s, "parallelism_config_dp_shard_size")?,
        tp: size(s, "parallelism_config_tp_size")?.unwrap_or(1),
        cp: size(s, "parallelism_config_cp_size")?.unwrap_or(1),
        sp: size(s, "parallelism_config_sp_size")?.unwrap_or(1),
        ep: size(s, "parallelism_config_ep_size")?.unwrap_or(1),
        cp_backend: s
            .choice("parallelism_config_cp_backend", &["torch"])?
            .unwrap_or("torch")
            .to_string(),
        cp_comm_strategy: s
            .choice(
                "parallelism_config_cp_comm_strategy",
                &["allgather", "alltoall"],
            )?
            .unwrap_or("allgather")
            .to_string(),
        sp_backend: {
            // DeepSpeed's Ulysses is the only backend; the choice still validates the value.
            s.choice("parallelism_config_sp_backend", &["deepspeed"])?;
            SpBackend::DeepSpeed
        },
        sp_seq_length: s
            .uint("parallelism_config_sp_seq_length")?
            .map(|n| n as usize),
        sp_seq_length_is_variable: s
            .bool("parallelism_config_sp_seq_length_is_variable")?
            .unwrap_or(true),
        sp_attn_implementation: s.string("parallelism_config_sp_attn_implementation")?,
    };
    Ok(c)
}
