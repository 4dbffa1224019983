//! The device a training process computes on, by Accelerate's rules: a GPU when one is there
//! (the process's LOCAL_RANK picks it among the visible ones; the launcher pins one per process
//! with CUDA_VISIBLE_DEVICES), the CPU when ACCELERATE_USE_CPU is true or no GPU is visible.
//! A GPU the launcher pinned but that cannot be opened is an error, not a silent CPU run.

use crate::config::cli_value::CliValue;
use crate::error::Result;
use candle_core::Device;

/// Accelerate's switch to the CPU (`--use_cpu`, `use_cpu: true`).
pub const USE_CPU_VAR: &str = "ACCELERATE_USE_CPU";

/// A boolean variable read the way HF's argument parser reads booleans (true/yes/1, ...).
fn env_true(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| <bool as CliValue>::parse_cli(v.trim()).unwrap_or(false))
}

/// The launcher (or the user) asked for GPUs: CUDA_VISIBLE_DEVICES names some.
fn gpus_requested() -> bool {
    std::env::var("CUDA_VISIBLE_DEVICES").is_ok_and(|v| {
        let v = v.trim();
        !v.is_empty() && v != "-1"
    })
}

/// The device for the process with this local rank.
pub fn select(local_rank: usize) -> Result<Device> {
    if env_true(USE_CPU_VAR) {
        return Ok(Device::Cpu);
    }
    select_gpu(local_rank)
}

#[cfg(not(feature = "cuda"))]
fn select_gpu(_local_rank: usize) -> Result<Device> {
    if gpus_requested() {
        tracing::warn!(
            "GPUs are visible (CUDA_VISIBLE_DEVICES) but this program was built without the `cuda` feature: training on CPU; build with `--features trl-runtime/cuda,trl-runtime/nccl` to use them"
        );
    }
    Ok(Device::Cpu)
}

#[cfg(feature = "cuda")]
fn select_gpu(local_rank: usize) -> Result<Device> {
    use crate::error::Error;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
    let count = match cudarc::driver::CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) if gpus_requested() => {
            return Err(Error::Env {
                var: "CUDA_VISIBLE_DEVICES".into(),
                message: format!(
                    "GPUs {visible} were requested but the CUDA driver cannot be used ({e}): check `nvidia-smi`, or train on CPU with --use_cpu"
                ),
            })
        }
        Err(e) => {
            tracing::info!("no usable CUDA driver ({e}): training on CPU");
            return Ok(Device::Cpu);
        }
    };
    if count == 0 {
        if gpus_requested() {
            return Err(Error::Env {
                var: "CUDA_VISIBLE_DEVICES".into(),
                message: format!("GPUs {visible} were requested but none is visible: check `nvidia-smi` and the ids, or train on CPU with --use_cpu"),
            });
        }
        return Ok(Device::Cpu);
    }
    // One visible GPU: the launcher pinned it to this process. Several: LOCAL_RANK picks one,
    // as torch.cuda.set_device(local_rank) does.
    let ordinal = if count == 1 { 0 } else { local_rank };
    if ordinal >= count {
        return Err(Error::Env {
            var: "LOCAL_RANK".into(),
            message: format!(
                "local rank {local_rank} has no GPU: {count} are visible (CUDA_VISIBLE_DEVICES={visible}); run at most {count} processes per machine"
            ),
        });
    }
    let device = Device::new_cuda(ordinal).map_err(|e| Error::Env {
        var: "CUDA_VISIBLE_DEVICES".into(),
        message: format!("GPU {ordinal} of {count} visible ({visible}) cannot be opened: {e}"),
    })?;
    if let Device::Cuda(dev) = &device {
        // Not fatal: without it freed memory goes back to the driver at each synchronization.
        if let Err(e) = crate::alloc::gpu::keep_freed_memory(dev) {
            tracing::warn!("GPU {ordinal}: freed memory is not kept for reuse ({e})");
        }
    }
    Ok(device)
}
