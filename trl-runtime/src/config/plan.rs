//! The launch contract: what every worker of a launch runs (distributed type, mesh sizes,
//! strategy settings). `cargo trl launch` exports it in Accelerate's own variables
//! ([`LaunchPlan::to_env`]) and [`crate::dist::DistContext::from_env`] reads it back
//! ([`LaunchPlan::from_env`]), so a worker started by `accelerate launch` or torchrun with
//! Accelerate's variables chooses the same strategy as one started by us.
//!
//! As in Accelerate, the distributed type is not a variable of its own: ACCELERATE_USE_DEEPSPEED
//! or ACCELERATE_USE_FSDP choose the sharding strategies, ACCELERATE_USE_CPU the device, and
//! more than one process means data parallelism. Booleans follow Accelerate's `str_to_bool`
//! (y/yes/t/true/on/1, n/no/f/false/off/0, any case); a variable that is set to anything else
//! is an error naming it.

use super::deepspeed_json::DeepSpeedJson;
use super::launch::{
    DeepSpeedConfig, DistributedType, FsdpConfig, LaunchConfig, MixedPrecision, OffloadDevice,
};
use super::named::Named;
use super::parallelism::{ParallelDims, ParallelismConfig};
use crate::error::{Error, Result};
use std::path::PathBuf;

/// What every worker of one launch runs.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    pub distributed_type: DistributedType,
    pub mixed_precision: MixedPrecision,
    pub use_cpu: bool,
    /// Mesh sizes; after [`LaunchPlan::to_env`] every size is set (the resolved plan).
    pub parallelism: ParallelismConfig,
    /// Present when the distributed type is FSDP.
    pub fsdp: Option<FsdpConfig>,
    /// Present when the distributed type is DEEPSPEED.
    pub deepspeed: Option<DeepSpeedConfig>,
}

impl Default for LaunchPlan {
    fn default() -> Self {
        LaunchPlan {
            distributed_type: DistributedType::No,
            mixed_precision: MixedPrecision::No,
            use_cpu: false,
            parallelism: ParallelismConfig::default(),
            fsdp: None,
            deepspeed: None,
        }
    }
}

/// Accelerate's `str_to_bool`.
pub fn str_to_bool(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Some(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Some(false),
        _ => None,
    }
}

/// Reads variables through `get`, naming the variable in every error.
struct Vars<F: Fn(&str) -> Option<String>>(F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    fn get(&self, var: &str) -> Option<String> {
        (self.0)(var).filter(|v| !v.trim().is_empty())
    }

    fn bad(var: &str, message: String) -> Error {
        Error::Env {
            var: var.into(),
            message,
        }
    }

    fn flag(&self, var: &str) -> Result<Option<bool>> {
        self.get(var)
            .map(|v| {
                str_to_bool(&v).ok_or_else(|| {
                    Self::bad(
                        var,
                        format!(
                            "'{v}' is not a boolean: use true or false (or yes/no, 1/0, on/off)"
                        ),
                    )
                })
            })
            .transpose()
    }

    fn number<T: std::str::FromStr>(&self, var: &str, what: &str) -> Result<Option<T>> {
        self.get(var)
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|_| Self::bad(var, format!("'{v}' is not {what}")))
            })
            .transpose()
    }

    /// One of `names` (any case), or its 1-based position when `numbered` (Accelerate writes
    /// FSDP's enums either way).
    fn choice(
        &self,
        var: &str,
        names: &[&'static str],
        numbered: bool,
    ) -> Result<Option<&'static str>> {
        let Some(v) = self.get(var) else {
            return Ok(None);
        };
        let t = v.trim();
        if let (true, Ok(n)) = (numbered, t.parse::<usize>()) {
            if (1..=names.len()).contains(&n) {
                return Ok(Some(names[n - 1]));
            }
        }
        names
            .iter()
            .find(|n| n.eq_ignore_ascii_case(t))
            .copied()
            .map(Some)
            .ok_or_else(|| {
                Self::bad(
                    var,
                    format!("'{v}' is not accepted: use one of {}", names.join(", ")),
                )
            })
    }

    /// A [`Named`] value, as [`Self::choice`] reads its names.
    fn named<T: Named>(&self, var: &str, numbered: bool) -> Result<Option<T>> {
        Ok(self.choice(var, T::NAMES, numbered)?.and_then(T::from_name))
    }
}

impl LaunchPlan {
    /// The part of a launch config that workers run (the distributed type as the launcher
    /// decided it: several processes of type NO become MULTI_CPU or MULTI_GPU).
    pub fn from_config(cfg: &LaunchConfig) -> Self {
        LaunchPlan {
            distributed_type: cfg.distributed_type,
            mixed_precision: json_precision(cfg.mixed_precision, cfg.deepspeed.as_ref()),
            // MULTI_CPU runs on the CPU whatever use_cpu says.
            use_cpu: cfg.use_cpu || cfg.distributed_type == DistributedType::MultiCpu,
            parallelism: cfg.parallelism.clone(),
            fsdp: cfg
                .fsdp
                .clone()
                .filter(|_| cfg.distributed_type == DistributedType::Fsdp),
            // The multi-node launcher choice is the launcher's business, not the workers'.
            deepspeed: cfg
                .deepspeed
                .clone()
                .filter(|_| cfg.distributed_type == DistributedType::DeepSpeed)
                .map(|d| DeepSpeedConfig {
                    multinode_launcher: None,
                    ..d
                }),
        }
    }

    /// Every size resolved for `world` processes (the rules of [`ParallelismConfig::resolve`]).
    pub fn resolve(&self, world: usize) -> Result<ParallelDims> {
        self.parallelism.resolve(world, self.distributed_type)
    }

    /// Accelerate's variables for this plan, every mesh size resolved to `dims` (so that the
    /// workers run the mesh the launcher printed).
    pub fn to_env(&self, dims: &ParallelDims) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = Vec::new();
        let mut put = |k: &str, v: String| env.push((k.to_string(), v));
        put(
            "ACCELERATE_MIXED_PRECISION",
            self.mixed_precision.as_str().into(),
        );
        put("ACCELERATE_USE_CPU", self.use_cpu.to_string());
        if let Some(ds) = &self.deepspeed {
            put("ACCELERATE_USE_DEEPSPEED", "true".into());
            put("ACCELERATE_DEEPSPEED_ZERO_STAGE", ds.zero_stage.to_string());
            put(
                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                ds.offload_optimizer_device.as_str().into(),
            );
            put(
                "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                ds.offload_param_device.as_str().into(),
            );
            put(
                "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                ds.zero3_init_flag.to_string(),
            );
            put(
                "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                ds.zero3_save_16bit_model.to_string(),
            );
            if let Some(n) = ds.gradient_accumulation_steps {
                put("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", n.to_string());
            }
            if let Some(c) = ds.gradient_clipping {
                put("ACCELERATE_GRADIENT_CLIPPING", c.to_string());
            }
            if let Some(f) = &ds.config_file {
                put("ACCELERATE_DEEPSPEED_CONFIG_FILE", f.display().to_string());
            }
            if let Some(t) = &ds.seq_parallel_communication_data_type {
                put(SEQ_COMM_DTYPE_VAR, t.clone());
            }
        }
        if let Some(f) = &self.fsdp {
            put("ACCELERATE_USE_FSDP", "true".into());
            put("FSDP_VERSION", f.version.to_string());
            put(
                "FSDP_SHARDING_STRATEGY",
                f.sharding_strategy.as_str().into(),
            );
            put(
                "FSDP_RESHARD_AFTER_FORWARD",
                f.reshard_after_forward.to_string(),
            );
            put("FSDP_AUTO_WRAP_POLICY", f.auto_wrap_policy.as_str().into());
            if let Some(n) = f.min_num_params {
                put("FSDP_MIN_NUM_PARAMS", n.to_string());
            }
            if let Some(cls) = &f.transformer_layer_cls_to_wrap {
                put("FSDP_TRANSFORMER_CLS_TO_WRAP", cls.clone());
            }
            put(
                "FSDP_BACKWARD_PREFETCH",
                f.backward_prefetch.as_str().into(),
            );
            put("FSDP_STATE_DICT_TYPE", f.state_dict_type.as_str().into());
            // The accessors take `&mut`: read them from a copy.
            let mut copy = f.clone();
            for (key, field) in FsdpConfig::BOOLEANS {
                put(&key.to_ascii_uppercase(), field(&mut copy).to_string());
            }
        }
        put("ACCELERATE_USE_PARALLELISM_CONFIG", "true".into());
        let resolved = ParallelismConfig {
            dp_replicate: Some(dims.dp_replicate),
            dp_shard: Some(dims.dp_shard),
            tp: dims.tp,
            cp: dims.cp,
            sp: dims.sp,
            ..self.parallelism.clone()
        };
        env.extend(resolved.to_env());
        env
    }

    /// The plan of this process, from its environment (see the module docs).
    pub fn from_process_env(world_size: usize) -> Result<Self> {
        Self::from_env(|k| std::env::var(k).ok(), world_size)
    }

    /// The plan from variables read through `get`, for a job of `world_size` processes.
    pub fn from_env(get: impl Fn(&str) -> Option<String>, world_size: usize) -> Result<Self> {
        let vars = Vars(get);
        let use_deepspeed = vars.flag("ACCELERATE_USE_DEEPSPEED")?.unwrap_or(false);
        let use_fsdp = vars.flag("ACCELERATE_USE_FSDP")?.unwrap_or(false);
        if use_deepspeed && use_fsdp {
            return Err(Vars::<fn(&str) -> Option<String>>::bad(
                "ACCELERATE_USE_FSDP",
                "set together with ACCELERATE_USE_DEEPSPEED: a launch uses one of them".into(),
            ));
        }
        let use_cpu = vars.flag("ACCELERATE_USE_CPU")?.unwrap_or(false);
        let mixed_precision = match vars.get("ACCELERATE_MIXED_PRECISION") {
            None => MixedPrecision::No,
            Some(v) => MixedPrecision::parse(v.trim()).ok_or_else(|| {
                Vars::<fn(&str) -> Option<String>>::bad(
                    "ACCELERATE_MIXED_PRECISION",
                    format!("'{v}' is not accepted: use one of no, fp16, bf16, fp8"),
                )
            })?,
        };
        let deepspeed = match use_deepspeed {
            true => Some(deepspeed_from_env(&vars, DeepSpeedConfig::default())?),
            false => None,
        };
        let fsdp = match use_fsdp {
            true => Some(fsdp_from_env(&vars, FsdpConfig::default())?),
            false => None,
        };
        let mixed_precision = json_precision(mixed_precision, deepspeed.as_ref());
        let distributed_type = match (&deepspeed, &fsdp) {
            (Some(_), _) => DistributedType::DeepSpeed,
            (_, Some(_)) => DistributedType::Fsdp,
            _ if world_size <= 1 => DistributedType::No,
            _ if use_cpu => DistributedType::MultiCpu,
            _ => DistributedType::MultiGpu,
        };
        let parallelism = ParallelismConfig::default().with_env(|k| vars.get(k))?;
        Ok(LaunchPlan {
            distributed_type,
            mixed_precision,
            use_cpu,
            parallelism,
            fsdp,
            deepspeed,
        })
    }

    /// Writes Accelerate's variables given in `vars` over a launch config (how `launch` applies
    /// Accelerate's flags, which are those variables by another name): ACCELERATE_USE_DEEPSPEED
    /// / ACCELERATE_USE_FSDP switch the distributed type, and the DeepSpeed / FSDP settings
    /// apply over the config's own. An invalid value is an error naming the variable.
    pub fn overlay(
        cfg: &mut LaunchConfig,
        vars: &std::collections::HashMap<String, String>,
    ) -> Result<()> {
        let vars = Vars(|k: &str| vars.get(k).cloned());
        if vars.flag("ACCELERATE_USE_DEEPSPEED")?.unwrap_or(false) {
            cfg.distributed_type = DistributedType::DeepSpeed;
        }
        if vars.flag("ACCELERATE_USE_FSDP")?.unwrap_or(false) {
            cfg.distributed_type = DistributedType::Fsdp;
        }
        match cfg.distributed_type {
            DistributedType::DeepSpeed => {
                let base = cfg.deepspeed.clone().unwrap_or_default();
                cfg.deepspeed = Some(deepspeed_from_env(&vars, base)?);
            }
            DistributedType::Fsdp => {
                let base = cfg.fsdp.clone().unwrap_or_default();
                cfg.fsdp = Some(fsdp_from_env(&vars, base)?);
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether each decoder layer is recomputed in backward (FSDP's activation checkpointing).
    pub fn activation_checkpointing(&self) -> bool {
        self.fsdp
            .as_ref()
            .is_some_and(|f| f.activation_checkpointing)
    }

    /// Whether each checkpointed layer's input is kept in host memory (FSDP's
    /// activation_checkpointing_offload).
    pub fn activation_checkpointing_offload(&self) -> bool {
        self.fsdp
            .as_ref()
            .is_some_and(|f| f.activation_checkpointing_offload)
    }

    /// Whether each rank should read only the model slices it keeps (FSDP's
    /// cpu_ram_efficient_loading, DeepSpeed's zero3_init_flag).
    pub fn efficient_loading(&self) -> bool {
        self.fsdp
            .as_ref()
            .is_some_and(|f| f.cpu_ram_efficient_loading)
            || self.deepspeed.as_ref().is_some_and(|d| d.zero3_init_flag)
    }

    /// Whether optimizer state (and master weights) live in host memory (DeepSpeed's
    /// offload_optimizer_device / offload_param_device cpu, FSDP's offload_params).
    pub fn offload_optimizer(&self) -> bool {
        let ds = self.deepspeed.as_ref().is_some_and(|d| {
            d.offload_optimizer_device != OffloadDevice::None
                || d.offload_param_device != OffloadDevice::None
        });
        ds || self.fsdp.as_ref().is_some_and(|f| f.offload_params)
    }

    /// Whether parameter slices live in host memory between uses (DeepSpeed's
    /// offload_param_device cpu, FSDP's offload_params).
    pub fn offload_params(&self) -> bool {
        let ds = self
            .deepspeed
            .as_ref()
            .is_some_and(|d| d.offload_param_device != OffloadDevice::None);
        ds || self.fsdp.as_ref().is_some_and(|f| f.offload_params)
    }
}

/// A DeepSpeed JSON's bf16 section turns bf16 on when nothing else asked for a precision (as
/// Accelerate takes it from the JSON).
fn json_precision(asked: MixedPrecision, ds: Option<&DeepSpeedConfig>) -> MixedPrecision {
    match (asked, ds.and_then(|d| d.mixed_precision)) {
        (MixedPrecision::No, Some(json)) => json,
        _ => asked,
    }
}

/// Ulysses' all-to-all precision (DeepSpeed's `seq_parallel_communication_data_type`, which
/// Accelerate keeps in its plugin object and has no variable for).
pub const SEQ_COMM_DTYPE_VAR: &str = "TRL_SEQ_PARALLEL_COMMUNICATION_DATA_TYPE";

fn deepspeed_from_env<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    base: DeepSpeedConfig,
) -> Result<DeepSpeedConfig> {
    let mut c = base;
    if let Some(path) = vars.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") {
        // The JSON is the whole DeepSpeed config (Accelerate then ignores its own fields).
        let json = DeepSpeedJson::from_file(&path)?;
        json.apply(&mut c);
        c.config_file = Some(PathBuf::from(path));
    }
    if let Some(stage) = vars.number::<u8>("ACCELERATE_DEEPSPEED_ZERO_STAGE", "a ZeRO stage")? {
        if stage > 3 {
            return Err(Vars::<F>::bad(
                "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                format!("{stage} is not a ZeRO stage: use 0, 1, 2 or 3"),
            ));
        }
        c.zero_stage = stage;
    }
    for (var, slot) in [
        (
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            &mut c.offload_optimizer_device,
        ),
        (
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
            &mut c.offload_param_device,
        ),
    ] {
        if let Some(d) = vars.named(var, false)? {
            *slot = d;
        }
    }
    if let Some(b) = vars.flag("ACCELERATE_DEEPSPEED_ZERO3_INIT")? {
        c.zero3_init_flag = b;
    }
    if let Some(b) = vars.flag("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")? {
        c.zero3_save_16bit_model = b;
    }
    if let Some(n) = vars.number::<u64>("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "a step count")? {
        c.gradient_accumulation_steps = Some(n);
    }
    if let Some(x) = vars.number::<f64>("ACCELERATE_GRADIENT_CLIPPING", "a number")? {
        c.gradient_clipping = Some(x);
    }
    if let Some(t) = vars.choice(SEQ_COMM_DTYPE_VAR, &["fp32", "fp16", "bf16"], false)? {
        c.seq_parallel_communication_data_type = Some(t.to_string());
    }
    Ok(c)
}

fn fsdp_from_env<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    base: FsdpConfig,
) -> Result<FsdpConfig> {
    let mut c = base;
    if let Some(v) = vars.number::<u8>("FSDP_VERSION", "1 or 2")? {
        if v != 1 && v != 2 {
            return Err(Vars::<F>::bad(
                "FSDP_VERSION",
                format!("{v} is not accepted: use 1 or 2"),
            ));
        }
        c.version = v;
    }
    if let Some(s) = vars.named("FSDP_SHARDING_STRATEGY", true)? {
        c.set_sharding_strategy(s);
    }
    // FSDP2 says only whether to reshard after forward; FSDP1 may carry a strategy name here.
    if let Some(v) = vars.get("FSDP_RESHARD_AFTER_FORWARD") {
        match str_to_bool(&v) {
            Some(b) => c.set_reshard_after_forward(b),
            None if c.version == 1 => {
                if let Some(s) = vars.named("FSDP_RESHARD_AFTER_FORWARD", true)? {
                    c.set_sharding_strategy(s);
                }
            }
            None => {
                return Err(Vars::<F>::bad(
                    "FSDP_RESHARD_AFTER_FORWARD",
                    format!("'{v}' is not a boolean: FSDP version 2 expects true or false"),
                ))
            }
        }
    }
    if let Some(p) = vars.named("FSDP_AUTO_WRAP_POLICY", false)? {
        c.auto_wrap_policy = p;
    }
    c.min_num_params = vars.number::<u64>("FSDP_MIN_NUM_PARAMS", "a parameter count")?;
    c.transformer_layer_cls_to_wrap = vars.get("FSDP_TRANSFORMER_CLS_TO_WRAP");
    if let Some(p) = vars.named("FSDP_BACKWARD_PREFETCH", true)? {
        c.backward_prefetch = p;
    }
    if let Some(t) = vars.named("FSDP_STATE_DICT_TYPE", true)? {
        c.state_dict_type = t;
    }
    for (key, field) in FsdpConfig::BOOLEANS {
        if let Some(b) = vars.flag(&key.to_ascii_uppercase())? {
            *field(&mut c) = b;
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FsdpShardingStrategy, FsdpStateDictType};
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)], world: usize) -> Result<LaunchPlan> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchPlan::from_env(|k| map.get(k).cloned(), world)
    }

    #[test]
    fn every_profile_round_trips_through_the_environment() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../templates/profiles");
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let cfg = LaunchConfig::from_file(&path).unwrap();
            let world = cfg.num_processes.unwrap_or(1) as usize;
            let mut plan = LaunchPlan::from_config(&cfg);
            if plan.distributed_type == DistributedType::No && world > 1 {
                plan.distributed_type = DistributedType::MultiGpu;
            }
            let dims = plan.resolve(world).unwrap();
            let env: HashMap<String, String> = plan.to_env(&dims).into_iter().collect();
            let back = LaunchPlan::from_env(|k| env.get(k).cloned(), world).unwrap();
            assert_eq!(back.distributed_type, plan.distributed_type, "{path:?}");
            assert_eq!(back.fsdp, plan.fsdp, "{path:?}");
            assert_eq!(back.deepspeed, plan.deepspeed, "{path:?}");
            assert_eq!(back.mixed_precision, plan.mixed_precision, "{path:?}");
            assert_eq!(back.resolve(world).unwrap(), dims, "{path:?}");
        }
    }

    #[test]
    fn accelerate_spellings_and_booleans() {
        let p = read(
            &[
                ("ACCELERATE_USE_FSDP", "True"),
                ("FSDP_SHARDING_STRATEGY", "2"),
                ("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
                ("FSDP_ACTIVATION_CHECKPOINTING", "yes"),
                ("FSDP_OFFLOAD_PARAMS", "0"),
            ],
            2,
        )
        .unwrap();
        let f = p.fsdp.unwrap();
        assert_eq!(p.distributed_type, DistributedType::Fsdp);
        assert_eq!(f.sharding_strategy, FsdpShardingStrategy::ShardGradOp);
        assert_eq!(f.state_dict_type, FsdpStateDictType::ShardedStateDict);
        assert!(f.activation_checkpointing && !f.offload_params);
        let p = read(
            &[
                ("ACCELERATE_USE_DEEPSPEED", "1"),
                ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3"),
            ],
            4,
        )
        .unwrap();
        assert_eq!(p.deepspeed.unwrap().zero_stage, 3);
        assert_eq!(read(&[], 1).unwrap().distributed_type, DistributedType::No);
        assert_eq!(
            read(&[("ACCELERATE_USE_CPU", "true")], 2)
                .unwrap()
                .distributed_type,
            DistributedType::MultiCpu
        );
    }

    #[test]
    fn invalid_values_name_the_variable() {
        for (vars, var) in [
            (
                vec![("ACCELERATE_USE_FSDP", "maybe")],
                "ACCELERATE_USE_FSDP",
            ),
            (
                vec![
                    ("ACCELERATE_USE_FSDP", "true"),
                    ("FSDP_SHARDING_STRATEGY", "FullShard"),
                ],
                "FSDP_SHARDING_STRATEGY",
            ),
            (
                vec![
                    ("ACCELERATE_USE_DEEPSPEED", "true"),
                    ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "4"),
                ],
                "ACCELERATE_DEEPSPEED_ZERO_STAGE",
            ),
            (
                vec![("PARALLELISM_CONFIG_DP_SHARD_SIZE", "two")],
                "PARALLELISM_CONFIG_DP_SHARD_SIZE",
            ),
        ] {
            let err = read(&vars, 2).unwrap_err().to_string();
            assert!(err.contains(var), "{err}");
        }
    }
}
