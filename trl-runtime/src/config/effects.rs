//! What each accepted launch-config key does here: every key either has its effect, is
//! refused ([`refused`]), or is named at launch with the reason it has none ([`ignored`]).
//! docs/launch-config.md lists them all.

use super::launch::{
    ComputeEnvironment, DistributedType, LaunchConfig, MixedPrecision, OffloadDevice,
};
use crate::error::{Error, Result};

/// Settings that would change what runs in a way this project cannot honour: an error
/// naming the key and what to use instead.
pub fn refused(cfg: &LaunchConfig) -> Result<()> {
    let err = |key: &str, message: &str| {
        Err(Error::Config {
            file: cfg.source.clone(),
            key: key.into(),
            message: message.into(),
        })
    };
    if cfg.compute_environment == ComputeEnvironment::AmazonSagemaker {
        return err(
            "compute_environment",
            "AMAZON_SAGEMAKER launches are not supported: use LOCAL_MACHINE (one launcher per machine, or `cargo trl slurm`)",
        );
    }
    match cfg.mixed_precision {
        MixedPrecision::Fp16 => return err(
            "mixed_precision",
            "fp16 needs dynamic loss scaling, which is not implemented: use bf16 (no scaling needed) or no",
        ),
        MixedPrecision::Fp8 => {
            return err("mixed_precision", "fp8 training is not implemented: use bf16 or no")
        }
        _ => {}
    }
    if let Some(ds) = cfg
        .deepspeed
        .as_ref()
        .filter(|_| cfg.distributed_type == DistributedType::DeepSpeed)
    {
        for (key, d) in [
            (
                "deepspeed_config.offload_optimizer_device",
                ds.offload_optimizer_device,
            ),
            (
                "deepspeed_config.offload_param_device",
                ds.offload_param_device,
            ),
        ] {
            if d == OffloadDevice::Nvme {
                return err(
                    key,
                    "NVMe offload is not implemented: use cpu (host memory) or none",
                );
            }
        }
        if ds.mixed_precision == Some(MixedPrecision::Fp16) {
            return err(
                "deepspeed_config.deepspeed_config_file",
                "the DeepSpeed JSON enables fp16, which needs loss scaling (not implemented): enable bf16 instead",
            );
        }
    }
    Ok(())
}

/// `key: why` for every setting of `cfg` that has no effect here (printed at launch).
pub fn ignored(cfg: &LaunchConfig) -> Vec<String> {
    let mut out = Vec::new();
    let mut note = |key: &str, why: &str| out.push(format!("{key}: {why}"));
    if !cfg.same_network {
        note(
            "same_network",
            "workers always connect to main_process_ip:main_process_port directly",
        );
    }
    if cfg.rdzv_backend != "static" {
        note(
            "rdzv_backend",
            "rendezvous is static (rank 0 serves the store at main_process_ip); elastic c10d/etcd rendezvous is not implemented, --max_restarts restarts the whole group",
        );
    }
    if cfg.debug {
        note(
            "debug",
            "Accelerate's debug mode (collective shape checks) is not implemented",
        );
    }
    if cfg.enable_cpu_affinity {
        note(
            "enable_cpu_affinity",
            "processes are not pinned to cores; each gets cores / processes compute threads",
        );
    }
    if cfg.downcast_bf16 {
        note("downcast_bf16", "a TPU setting");
    }
    if cfg.main_training_function != "main" {
        note(
            "main_training_function",
            "a Python setting: the target program's own main runs",
        );
    }
    if let Some(f) = cfg
        .fsdp
        .as_ref()
        .filter(|_| cfg.distributed_type == DistributedType::Fsdp)
    {
        if !f.sync_module_states {
            note(
                "fsdp_config.fsdp_sync_module_states",
                "rank 0's weights are always broadcast before sharding (false cannot be honoured)",
            );
        }
        if !f.use_orig_params {
            note(
                "fsdp_config.fsdp_use_orig_params",
                "the optimizer always keeps per-parameter state, as with true",
            );
        }
        if f.cpu_ram_efficient_loading && !f.sharding_strategy.reshards() {
            note(
                "fsdp_config.fsdp_cpu_ram_efficient_loading",
                "parameters stay whole on every rank under this sharding strategy, so each rank reads the whole model",
            );
        }
        if let Some(cls) = &f.transformer_layer_cls_to_wrap {
            if !cls.split(',').all(|c| c.trim().ends_with("DecoderLayer")) {
                note(
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                    "wrap units are the model's decoder layers (#[parallel(fsdp_unit)]), whatever class is named",
                );
            }
        }
    }
    if let Some(ds) = cfg
        .deepspeed
        .as_ref()
        .filter(|_| cfg.distributed_type == DistributedType::DeepSpeed)
    {
        if ds.zero3_init_flag && ds.zero_stage != 3 {
            note(
                "deepspeed_config.zero3_init_flag",
                "only ZeRO stage 3 shards parameters; below it every rank reads the whole model",
            );
        }
        if ds.zero_stage == 3 && !ds.zero3_save_16bit_model {
            note(
                "deepspeed_config.zero3_save_16bit_model",
                "the final checkpoint is always written whole in HF format (what true asks for), never left to zero_to_fp32.py",
            );
        }
        if let Some(l) = ds
            .multinode_launcher
            .as_deref()
            .filter(|l| *l != "standard")
        {
            out.push(format!(
                "deepspeed_config.deepspeed_multinode_launcher: {l} is not used: start `cargo trl launch` on every machine (or use `cargo trl slurm`)"
            ));
        }
        if let Some(path) = &ds.config_file {
            if let Ok(json) = super::deepspeed_json::DeepSpeedJson::from_file(path) {
                for i in json.ignored {
                    out.push(format!("{}: {i}", path.display()));
                }
            }
        }
    }
    let p = &cfg.parallelism;
    if p.cp_comm_strategy != "allgather" {
        out.push(format!(
            "parallelism_config.parallelism_config_cp_comm_strategy: {}: ring attention passes key/value blocks around the ring whatever the strategy (the results are the same)",
            p.cp_comm_strategy
        ));
    }
    if p.sp_seq_length.is_some() || !p.sp_seq_length_is_variable {
        out.push(
            "parallelism_config.parallelism_config_sp_seq_length(_is_variable): sequence lengths are taken from each batch (shapes are dynamic here)".into(),
        );
    }
    if p.sp_attn_implementation.is_some() {
        out.push(
            "parallelism_config.parallelism_config_sp_attn_implementation: attention under sp follows the training argument attn_implementation".into(),
        );
    }
    out
}
