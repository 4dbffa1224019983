//! CPU offload (DeepSpeed's `offload_optimizer_device: cpu` and `offload_param_device: cpu`,
//! FSDP's `fsdp_offload_params`), as DeepSpeed and PyTorch define it:
//! - the optimizer: the fp32 master weights and both Adam moments live in host memory and the
//!   update runs there; under ZeRO-2/3 each reduced gradient slice streams to the host as it
//!   arrives (`nn::sharded::Holding::host_grads`), so no fp32 gradient slice stays on the device;
//! - the parameters (ZeRO-3 / FSDP, and FSDP's SHARD_GRAD_OP): each rank's parameter slices
//!   live in host memory too, and a unit moves to the device only to be gathered for its
//!   forward and backward (`Holding::host_params`).
//!
//! A run that computes on the CPU takes the same paths: host and device memory are one, so
//! each move is a no-op, and the memory report counts the offloaded state as host memory.

use crate::config::LaunchPlan;
use crate::error::Result;
use crate::optim::AdamW;
use candle_core::Device;

/// Whether this run offloads (the launch asked for it); logs what moves where on the main
/// process (`main`).
pub fn decide(plan: &LaunchPlan, device: &Device, main: bool) -> bool {
    if !plan.offload_optimizer() {
        return false;
    }
    if main {
        let params = match plan.offload_params() {
            true => " Parameter slices live there too and each unit moves to the device for its forward and backward.",
            false => "",
        };
        let cpu = match device.is_cpu() {
            true => " This run computes on the CPU: host and device memory are one, so the moves cost nothing.",
            false => "",
        };
        tracing::info!(
            "CPU offload: fp32 master weights and Adam moments live in host memory and the \
             update runs there; reduced gradient slices stream out as they arrive.{params}{cpu}"
        );
    }
    true
}

/// Moves the optimizer's state (master weights and moments) to host memory.
pub fn to_host(opt: &mut AdamW) -> Result<()> {
    for s in opt.states.values_mut() {
        s.master = s.master.to_device(&Device::Cpu)?;
        s.exp_avg = s.exp_avg.to_device(&Device::Cpu)?;
        s.exp_avg_sq = s.exp_avg_sq.to_device(&Device::Cpu)?;
        if let Some(m) = &s.decay_mask {
            s.decay_mask = Some(m.to_device(&Device::Cpu)?);
        }
    }
    Ok(())
}
