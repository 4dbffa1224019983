//! The sections of Accelerate's launch config as values: the distributed type, mixed
//! precision, GPU ids, and the FSDP and DeepSpeed sections. `launch` reads them from YAML,
//! `deepspeed_json` from a DeepSpeed JSON, `parallelism` and `plan` use them.

use super::named::named;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeEnvironment {
    LocalMachine,
    AmazonSagemaker,
}

/// How the processes cooperate. Only the variants this project runs are accepted; the others
/// Accelerate knows (TPUs, NPUs, ...) are rejected with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DistributedType {
    No,
    MultiGpu,
    MultiCpu,
    DeepSpeed,
    Fsdp,
}

impl DistributedType {
    pub fn as_str(self) -> &'static str {
        match self {
            DistributedType::No => "NO",
            DistributedType::MultiGpu => "MULTI_GPU",
            DistributedType::MultiCpu => "MULTI_CPU",
            DistributedType::DeepSpeed => "DEEPSPEED",
            DistributedType::Fsdp => "FSDP",
        }
    }

    /// Whether data parallelism shards model state (ZeRO / FSDP) rather than replicating it.
    pub fn shards_model_state(self) -> bool {
        matches!(self, DistributedType::DeepSpeed | DistributedType::Fsdp)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixedPrecision {
    No,
    Fp16,
    Bf16,
    Fp8,
}

impl MixedPrecision {
    pub fn as_str(self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Fp16 => "fp16",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::Fp8 => "fp8",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "no" | "false" | "fp32" => Some(MixedPrecision::No),
            "fp16" => Some(MixedPrecision::Fp16),
            "bf16" => Some(MixedPrecision::Bf16),
            "fp8" => Some(MixedPrecision::Fp8),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuIds {
    All,
    List(Vec<u32>),
}

impl GpuIds {
    /// Parses Accelerate's `gpu_ids`: `all` or a comma-separated list such as `0,1,3`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("all") || s.is_empty() {
            return Ok(GpuIds::All);
        }
        s.split(',')
            .map(|p| {
                p.trim().parse::<u32>().map_err(|_| {
                    format!("'{p}' is not a GPU index: use `all` or a list like 0,1,3")
                })
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(GpuIds::List)
    }
}

// Accelerate's names for each value (the first the default).
named! {
    FsdpShardingStrategy {
        FullShard = "FULL_SHARD",
        ShardGradOp = "SHARD_GRAD_OP",
        NoShard = "NO_SHARD",
        HybridShard = "HYBRID_SHARD",
        HybridShardZero2 = "HYBRID_SHARD_ZERO2",
    }
    FsdpAutoWrapPolicy {
        TransformerBasedWrap = "TRANSFORMER_BASED_WRAP",
        SizeBasedWrap = "SIZE_BASED_WRAP",
        NoWrap = "NO_WRAP",
    }
    FsdpBackwardPrefetch {
        BackwardPre = "BACKWARD_PRE",
        BackwardPost = "BACKWARD_POST",
        NoPrefetch = "NO_PREFETCH",
    }
    FsdpStateDictType {
        FullStateDict = "FULL_STATE_DICT",
        ShardedStateDict = "SHARDED_STATE_DICT",
        LocalStateDict = "LOCAL_STATE_DICT",
    }
    OffloadDevice {
        None = "none",
        Cpu = "cpu",
        Nvme = "nvme",
    }
}

/// `fsdp_config.*`. Version 1 names a sharding strategy; version 2 only says whether to
/// reshard after forward (FULL_SHARD when true, SHARD_GRAD_OP when false).
#[derive(Debug, Clone, PartialEq)]
pub struct FsdpConfig {
    pub version: u8,
    pub sharding_strategy: FsdpShardingStrategy,
    pub reshard_after_forward: bool,
    pub auto_wrap_policy: FsdpAutoWrapPolicy,
    pub transformer_layer_cls_to_wrap: Option<String>,
    pub min_num_params: Option<u64>,
    pub backward_prefetch: FsdpBackwardPrefetch,
    pub forward_prefetch: bool,
    pub offload_params: bool,
    pub state_dict_type: FsdpStateDictType,
    pub cpu_ram_efficient_loading: bool,
    pub sync_module_states: bool,
    pub use_orig_params: bool,
    pub activation_checkpointing: bool,
    /// Each checkpointed layer's input kept in host memory (accelerate's
    /// fsdp_activation_checkpointing_offload; the training arguments' activation_offloading).
    pub activation_checkpointing_offload: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            version: 1,
            sharding_strategy: FsdpShardingStrategy::FullShard,
            reshard_after_forward: true,
            auto_wrap_policy: FsdpAutoWrapPolicy::TransformerBasedWrap,
            transformer_layer_cls_to_wrap: None,
            min_num_params: None,
            backward_prefetch: FsdpBackwardPrefetch::BackwardPre,
            forward_prefetch: false,
            offload_params: false,
            state_dict_type: FsdpStateDictType::FullStateDict,
            cpu_ram_efficient_loading: false,
            sync_module_states: true,
            use_orig_params: true,
            activation_checkpointing: false,
            activation_checkpointing_offload: false,
        }
    }
}

/// `deepspeed_config.*`.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSpeedConfig {
    pub zero_stage: u8,
    pub offload_optimizer_device: OffloadDevice,
    pub offload_param_device: OffloadDevice,
    pub zero3_init_flag: bool,
    pub zero3_save_16bit_model: bool,
    pub gradient_accumulation_steps: Option<u64>,
    pub gradient_clipping: Option<f64>,
    pub multinode_launcher: Option<String>,
    pub config_file: Option<PathBuf>,
    /// Ulysses all-to-all precision (`seq_parallel_communication_data_type`).
    pub seq_parallel_communication_data_type: Option<String>,
    /// From a DeepSpeed JSON: its micro-batch size (checked against the training arguments).
    pub train_micro_batch_size_per_gpu: Option<u64>,
    /// From a DeepSpeed JSON: its bf16 / fp16 section.
    pub mixed_precision: Option<MixedPrecision>,
    /// Gradient elements ZeRO-1/2 reduce per collective (`zero_optimization.reduce_bucket_size`;
    /// None: "auto", the model's hidden_size squared as transformers fills it).
    pub reduce_bucket_size: Option<u64>,
    /// Gradient reductions run while the backward goes on (`zero_optimization.overlap_comm`);
    /// None: DeepSpeed's default, off for stages 1-2 and on for stage 3.
    pub overlap_comm: Option<bool>,
}

impl Default for DeepSpeedConfig {
    fn default() -> Self {
        DeepSpeedConfig {
            zero_stage: 2,
            offload_optimizer_device: OffloadDevice::None,
            offload_param_device: OffloadDevice::None,
            zero3_init_flag: false,
            zero3_save_16bit_model: false,
            gradient_accumulation_steps: None,
            gradient_clipping: None,
            multinode_launcher: None,
            config_file: None,
            seq_parallel_communication_data_type: None,
            train_micro_batch_size_per_gpu: None,
            mixed_precision: None,
            reduce_bucket_size: Some(500_000_000),
            overlap_comm: None,
        }
    }
}

impl FsdpShardingStrategy {
    /// Whether parameters stay sharded between uses (FULL_SHARD, HYBRID_SHARD).
    pub fn reshards(self) -> bool {
        matches!(
            self,
            FsdpShardingStrategy::FullShard | FsdpShardingStrategy::HybridShard
        )
    }
}

/// The field an FSDP boolean key sets.
pub type FsdpField = fn(&mut FsdpConfig) -> &mut bool;

impl FsdpConfig {
    /// The boolean keys: the YAML's `fsdp_config` name (the launcher's variable is the same
    /// name upper-cased, as Accelerate sets it) and the field it sets.
    pub const BOOLEANS: [(&'static str, FsdpField); 7] = [
        ("fsdp_forward_prefetch", |c| &mut c.forward_prefetch),
        ("fsdp_offload_params", |c| &mut c.offload_params),
        ("fsdp_cpu_ram_efficient_loading", |c| {
            &mut c.cpu_ram_efficient_loading
        }),
        ("fsdp_sync_module_states", |c| &mut c.sync_module_states),
        ("fsdp_use_orig_params", |c| &mut c.use_orig_params),
        ("fsdp_activation_checkpointing", |c| {
            &mut c.activation_checkpointing
        }),
        ("fsdp_activation_checkpointing_offload", |c| {
            &mut c.activation_checkpointing_offload
        }),
    ];

    /// `fsdp_sharding_strategy` (FSDP_SHARDING_STRATEGY, or FSDP1's name in the reshard key):
    /// the strategy, and whether it reshards after forward.
    pub fn set_sharding_strategy(&mut self, s: FsdpShardingStrategy) {
        self.sharding_strategy = s;
        self.reshard_after_forward = s.reshards();
    }

    /// FSDP2's `fsdp_reshard_after_forward` boolean, which under version 2 also picks the
    /// strategy (FULL_SHARD when true, SHARD_GRAD_OP when false).
    pub fn set_reshard_after_forward(&mut self, reshard: bool) {
        self.reshard_after_forward = reshard;
        if self.version == 2 {
            self.sharding_strategy = match reshard {
                true => FsdpShardingStrategy::FullShard,
                false => FsdpShardingStrategy::ShardGradOp,
            };
        }
    }
}
