//! `accelerate launch`'s strategy flags, by their names: `--use_deepspeed --zero_stage 3`,
//! `--use_fsdp --fsdp_sharding_strategy FULL_SHARD`, `--multi_gpu`, ... Each is the Accelerate
//! variable it sets in `accelerate launch` by another name, so they are applied over the config
//! through the same reader the workers use (`LaunchPlan::overlay`), with the same checks.

use std::collections::HashMap;
use trl_runtime::config::launch::DistributedType;
use trl_runtime::config::{LaunchConfig, LaunchPlan};

#[derive(Debug, Clone, Default, clap::Args)]
#[command(rename_all = "snake_case")]
pub struct AccelerateFlags {
    /// Data parallelism over GPUs (distributed_type MULTI_GPU).
    #[arg(long)]
    pub multi_gpu: bool,
    /// DeepSpeed ZeRO (distributed_type DEEPSPEED).
    #[arg(long)]
    pub use_deepspeed: bool,
    /// FSDP (distributed_type FSDP).
    #[arg(long)]
    pub use_fsdp: bool,
    #[arg(long)]
    pub zero_stage: Option<String>,
    #[arg(long)]
    pub offload_optimizer_device: Option<String>,
    #[arg(long)]
    pub offload_param_device: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub zero3_init_flag: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub zero3_save_16bit_model: Option<String>,
    #[arg(long)]
    pub deepspeed_config_file: Option<String>,
    #[arg(long)]
    pub gradient_accumulation_steps: Option<String>,
    #[arg(long)]
    pub gradient_clipping: Option<String>,
    #[arg(long)]
    pub fsdp_version: Option<String>,
    #[arg(long)]
    pub fsdp_sharding_strategy: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_reshard_after_forward: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_offload_params: Option<String>,
    #[arg(long)]
    pub fsdp_auto_wrap_policy: Option<String>,
    #[arg(long)]
    pub fsdp_transformer_layer_cls_to_wrap: Option<String>,
    #[arg(long)]
    pub fsdp_min_num_params: Option<String>,
    #[arg(long)]
    pub fsdp_backward_prefetch: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_forward_prefetch: Option<String>,
    #[arg(long)]
    pub fsdp_state_dict_type: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_cpu_ram_efficient_loading: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_sync_module_states: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_activation_checkpointing: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_activation_checkpointing_offload: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fsdp_use_orig_params: Option<String>,
    /// Compute threads per process (OMP_NUM_THREADS, RAYON_NUM_THREADS).
    #[arg(long)]
    pub num_cpu_threads_per_process: Option<usize>,
    /// Accepted for Accelerate's command lines: there is no torch.compile here.
    #[arg(long)]
    pub dynamo_backend: Option<String>,
}

impl AccelerateFlags {
    /// (flag, the Accelerate variable it stands for, its value) for every flag given.
    fn given(&self) -> Vec<(&'static str, &'static str, String)> {
        let on = |b: bool| b.then(|| "true".to_string());
        [
            (
                "--use_deepspeed",
                "ACCELERATE_USE_DEEPSPEED",
                on(self.use_deepspeed),
            ),
            ("--use_fsdp", "ACCELERATE_USE_FSDP", on(self.use_fsdp)),
            (
                "--zero_stage",
                "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                self.zero_stage.clone(),
            ),
            (
                "--offload_optimizer_device",
                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                self.offload_optimizer_device.clone(),
            ),
            (
                "--offload_param_device",
                "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                self.offload_param_device.clone(),
            ),
            (
                "--zero3_init_flag",
                "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                self.zero3_init_flag.clone(),
            ),
            (
                "--zero3_save_16bit_model",
                "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                self.zero3_save_16bit_model.clone(),
            ),
            (
                "--deepspeed_config_file",
                "ACCELERATE_DEEPSPEED_CONFIG_FILE",
                self.deepspeed_config_file.clone(),
            ),
            (
                "--gradient_accumulation_steps",
                "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                self.gradient_accumulation_steps.clone(),
            ),
            (
                "--gradient_clipping",
                "ACCELERATE_GRADIENT_CLIPPING",
                self.gradient_clipping.clone(),
            ),
            ("--fsdp_version", "FSDP_VERSION", self.fsdp_version.clone()),
            (
                "--fsdp_sharding_strategy",
                "FSDP_SHARDING_STRATEGY",
                self.fsdp_sharding_strategy.clone(),
            ),
            (
                "--fsdp_reshard_after_forward",
                "FSDP_RESHARD_AFTER_FORWARD",
                self.fsdp_reshard_after_forward.clone(),
            ),
            (
                "--fsdp_offload_params",
                "FSDP_OFFLOAD_PARAMS",
                self.fsdp_offload_params.clone(),
            ),
            (
                "--fsdp_auto_wrap_policy",
                "FSDP_AUTO_WRAP_POLICY",
                self.fsdp_auto_wrap_policy.clone(),
            ),
            (
                "--fsdp_transformer_layer_cls_to_wrap",
                "FSDP_TRANSFORMER_CLS_TO_WRAP",
                self.fsdp_transformer_layer_cls_to_wrap.clone(),
            ),
            (
                "--fsdp_min_num_params",
                "FSDP_MIN_NUM_PARAMS",
                self.fsdp_min_num_params.clone(),
            ),
            (
                "--fsdp_backward_prefetch",
                "FSDP_BACKWARD_PREFETCH",
                self.fsdp_backward_prefetch.clone(),
            ),
            (
                "--fsdp_forward_prefetch",
                "FSDP_FORWARD_PREFETCH",
                self.fsdp_forward_prefetch.clone(),
            ),
            (
                "--fsdp_state_dict_type",
                "FSDP_STATE_DICT_TYPE",
                self.fsdp_state_dict_type.clone(),
            ),
            (
                "--fsdp_cpu_ram_efficient_loading",
                "FSDP_CPU_RAM_EFFICIENT_LOADING",
                self.fsdp_cpu_ram_efficient_loading.clone(),
            ),
            (
                "--fsdp_sync_module_states",
                "FSDP_SYNC_MODULE_STATES",
                self.fsdp_sync_module_states.clone(),
            ),
            (
                "--fsdp_activation_checkpointing",
                "FSDP_ACTIVATION_CHECKPOINTING",
                self.fsdp_activation_checkpointing.clone(),
            ),
            (
                "--fsdp_activation_checkpointing_offload",
                "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
                self.fsdp_activation_checkpointing_offload.clone(),
            ),
            (
                "--fsdp_use_orig_params",
                "FSDP_USE_ORIG_PARAMS",
                self.fsdp_use_orig_params.clone(),
            ),
        ]
        .into_iter()
        .filter_map(|(flag, var, v)| v.map(|v| (flag, var, v)))
        .collect()
    }

    /// Writes the given flags over `cfg`; errors name the flag.
    pub fn apply(&self, cfg: &mut LaunchConfig) -> Result<(), String> {
        if [self.multi_gpu, self.use_deepspeed, self.use_fsdp]
            .iter()
            .filter(|b| **b)
            .count()
            > 1
        {
            return Err(
                "--multi_gpu, --use_deepspeed and --use_fsdp choose one distributed type: pass one of them"
                    .into(),
            );
        }
        if self.multi_gpu {
            cfg.distributed_type = DistributedType::MultiGpu;
        }
        let given = self.given();
        let vars: HashMap<String, String> = given
            .iter()
            .map(|(_, var, v)| (var.to_string(), v.clone()))
            .collect();
        LaunchPlan::overlay(cfg, &vars).map_err(|e| {
            let mut msg = e.to_string();
            for (flag, var, _) in &given {
                msg = msg.replace(&format!("environment variable {var}"), flag);
            }
            msg
        })?;
        // A DeepSpeed or FSDP setting given while the config runs neither does nothing.
        let kind = cfg.distributed_type;
        for (flag, var, _) in &given {
            let deepspeed =
                var.starts_with("ACCELERATE_DEEPSPEED") || var.starts_with("ACCELERATE_GRADIENT");
            if (deepspeed && kind != DistributedType::DeepSpeed)
                || (var.starts_with("FSDP_") && kind != DistributedType::Fsdp)
            {
                return Err(format!(
                    "{flag} applies to {} but this launch's distributed type is {}: add {}",
                    if deepspeed { "DeepSpeed" } else { "FSDP" },
                    kind.as_str(),
                    if deepspeed {
                        "--use_deepspeed"
                    } else {
                        "--use_fsdp"
                    }
                ));
            }
        }
        if let Some(b) = self
            .dynamo_backend
            .as_deref()
            .filter(|b| !b.eq_ignore_ascii_case("no"))
        {
            eprintln!("warning: --dynamo_backend {b}: ignored: there is no torch.compile here (Candle runs its kernels directly)");
        }
        Ok(())
    }
}

/// Accelerate and HfArgumentParser accept `--num-processes` for `--num_processes`: the launcher's
/// own flags (before the program's `--`) are turned into the underscore spelling.
pub fn underscore_flags(args: &mut [String]) {
    for a in args.iter_mut().take_while(|a| a.as_str() != "--") {
        if let Some(name) = a.strip_prefix("--") {
            let (name, value) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (name, None),
            };
            if name.contains('-') {
                let fixed = name.replace('-', "_");
                *a = match value {
                    Some(v) => format!("--{fixed}={v}"),
                    None => format!("--{fixed}"),
                };
            }
        }
    }
}
