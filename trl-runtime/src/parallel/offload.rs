//! CPU offload of the optimizer (DeepSpeed's `offload_optimizer_device: cpu` and
//! `offload_param_device: cpu`, FSDP's `fsdp_offload_params`): the fp32 master weights and
//! both Adam moments live in host memory and the update runs there; the accelerator keeps
//! only the compute weights and gradients. Gradients travel to the host for the update and the
//! new weights back, once per step.
//!
//! On a run that computes on the CPU there is nothing to offload to: the state already lives
//! in host memory, and [`decide`] says so instead of pretending to move it.

use crate::error::Result;
use crate::optim::AdamW;
use candle_core::Device;

/// Whether to offload on `device`, given that the launch asked for it (`requested`); logs
/// what happens.
pub fn decide(requested: bool, device: &Device, main: bool) -> bool {
    if !requested {
        return false;
    }
    if device.is_cpu() {
        if main {
            tracing::warn!(
                "CPU offload requested (offload_optimizer_device / offload_param_device / \
                 fsdp_offload_params), but this run computes on the CPU: optimizer state and \
                 parameters already live in host memory, so there is nothing to offload to"
            );
        }
        return false;
    }
    if main {
        tracing::info!(
            "CPU offload: fp32 master weights and Adam moments live in host memory and the \
             update runs there; the GPU keeps the compute weights and gradients"
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
