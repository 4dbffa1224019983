//! What a rank holds: the model state it keeps under its strategy (measured from the
//! storages), what the planner predicts for it, the worker's report, and the process's
//! resident and device memory peaks.

use super::core::Core;
use crate::alloc::StorageBytes;
use crate::error::Result;
use crate::models::CausalModel;
use candle_core::{Device, Tensor};

/// Bytes of model state one rank holds (parameters, gradients after reduction, optimizer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    pub parameters: usize,
    pub gradients: usize,
    pub optimizer: usize,
    /// Kept in host memory under offload (not in the device figures above): optimizer
    /// state, gradient slices, and with parameter offload the parameter slices.
    pub host: usize,
}

impl MemoryReport {
    pub fn total(&self) -> usize {
        self.parameters + self.gradients + self.optimizer
    }
}

/// Restarts the peak-resident-memory count (Linux: `5` into /proc/self/clear_refs), so that
/// `peak_rss_bytes` measures from here. Returns false where the OS does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Peak resident memory of this process so far (VmHWM), when the OS reports it.
pub fn peak_rss_bytes() -> Option<usize> {
    status_bytes("VmHWM:")
}

/// Resident memory of this process now (VmRSS), when the OS reports it.
pub fn rss_bytes() -> Option<usize> {
    status_bytes("VmRSS:")
}

fn status_bytes(key: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The memory the plan predicts, measured where it lives: on a CPU this process's resident
/// peak, on a GPU the device pool's peak of live allocations (torch's
/// `max_memory_allocated`), each since [`reset_memory_peak`].
pub fn memory_peak_bytes(device: &Device) -> Option<usize> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => crate::alloc::gpu::peak_bytes(dev).ok().map(|b| b as usize),
        Device::Cpu => peak_rss_bytes(),
        _ => None,
    }
}

/// Starts [`memory_peak_bytes`] from what is live now.
pub fn reset_memory_peak(device: &Device) {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            // Not fatal: the logged peak then counts from the start.
            if let Err(e) = crate::alloc::gpu::reset_peak(dev) {
                tracing::warn!("GPU memory peak not reset: {e}");
            }
        }
        _ => {
            reset_peak_rss();
        }
    }
}

impl<'a, N: CausalModel> Core<'a, N> {
    /// Sets what the estimate predicts this rank holds for the task's `work` (DPO's two
    /// sequences per row, TR-DPO's copy of the weights).
    pub(super) fn estimate_with(&mut self, work: &crate::parallel::estimate::Workload) {
        self.predicted = self.estimate_memory(|setup| setup.apply(work));
    }

    /// Model state this rank holds under its strategy. Parameters and optimizer state are
    /// measured from the storages they keep allocated (shared storage counted once, a slice
    /// counting what it keeps alive); gradients, which exist only during a step, count what is
    /// kept after the reduction (ZeRO-2 / ZeRO-3: this rank's slice).
    pub fn memory(&self) -> MemoryReport {
        let (mut held, mut on_host) = (StorageBytes::default(), StorageBytes::default());
        if let Some(sharding) = &self.model.sharding {
            sharding.add_storage(&mut held, &mut on_host);
        }
        // What the layers hold whole: every weight unsharded (a LoRA base among them, frozen
        // in the compute dtype), else the adapters beside the units.
        crate::tp::named_tensors(self.model.net())
            .values()
            .for_each(|t| held.add(t));
        let parameters = held.total;
        // Offloaded fp32 slices are their own master weights: one storage, counted once.
        let offloaded = self.offloaded();
        let optimizer = match offloaded {
            true => {
                self.optimizer.state().add_storage(&mut on_host);
                0
            }
            false => {
                self.optimizer.state().add_storage(&mut held);
                held.total - parameters
            }
        };
        let mut host = on_host.total;
        // As `accumulate` keeps them over the step's micro-batches.
        let native = self.native_gradients(self.args.gradient_accumulation_steps);
        let grad_full: usize = self
            .model
            .params
            .iter()
            .map(|(_, v)| v.elem_count() * if native { v.dtype().size_in_bytes() } else { 4 })
            .sum();
        let gradients = self.optimizer.grad_bytes(grad_full);
        host += self.optimizer.fsdp().map_or(0, |f| f.host_grad_bytes());
        MemoryReport {
            parameters,
            gradients,
            optimizer,
            host,
        }
    }

    /// What `parallel::estimate` predicts this rank holds (from a skeleton of this run's
    /// model, built once at load; None for a config without the sizes it reads).
    pub fn memory_estimate(&self) -> Option<&crate::parallel::estimate::Estimate> {
        self.predicted.as_ref()
    }

    pub(super) fn estimate_memory(
        &self,
        task: impl Fn(&mut crate::parallel::estimate::Setup),
    ) -> Option<crate::parallel::estimate::Estimate> {
        let dir = &self.args.model_name_or_path;
        let shapes = crate::parallel::estimate::ModelShapes::of_model::<N>(
            self.model.config_json(),
            &dir.join("config.json").display().to_string(),
        )
        .ok()?;
        let mut setup = crate::parallel::estimate::Setup {
            strategy: self.strategy,
            dims: self.ctx.mesh.dims(),
            ep: self.model.ep().map_or(1, |ep| ep.size()),
            dtype: self.args.compute_dtype().ok()?,
            lora: self.args.lora(&shapes.dims.model_type),
            batch: self.args.per_device_train_batch_size,
            micro_batches: self.args.gradient_accumulation_steps,
            seq: self.args.max_length,
            checkpointing: self.model.checkpointing.is_some(),
            offload_optimizer: self.offloaded(),
            offload_params: (self.model.sharding.as_ref()).is_some_and(|s| s.holding().host_params),
            reduce_units: crate::parallel::zero2_units(
                self.ctx.plan(),
                crate::parallel::hidden_size(self.model.config_json()),
            ),
            reference_copy: false,
            side_parameters: 0,
            held_parameters: 0,
            gpu: self.ctx.device().is_cuda(),
            router_loss: self.router_loss_weight != 0.0,
            threads: crate::parallel::estimate::cpu_threads(),
        };
        task(&mut setup);
        Some(crate::parallel::estimate::estimate(&shapes, &setup))
    }

    /// What this job runs, as the workers see it (collective: every rank calls it): the
    /// distributed type, the mesh, the strategy and its settings, and the model-state bytes
    /// of every rank. `cargo trl launch --dry-run` prints the same plan before anything runs.
    pub fn report(&self) -> Result<serde_json::Value> {
        let world = self.ctx.world();
        let mine = Tensor::new(&[self.memory().total() as f64], &Device::Cpu)?;
        let bytes = world.all_gather(&mine, 0)?.to_vec1::<f64>()?;
        let d = self.ctx.mesh.dims();
        Ok(serde_json::json!({
            "distributed_type": self.ctx.plan().distributed_type.as_str(),
            "mesh": {
                "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard,
                "cp": d.cp, "sp": d.sp, "tp": d.tp,
                "ep": self.model.ep().map_or(1, |ep| ep.size()),
            },
            "strategy": self.strategy.name(),
            "activation_checkpointing": self.model.checkpointing.is_some(),
            "read_shards": self.read_shards,
            "offload_optimizer": self.offloaded(),
            "offload_params": self.model.sharding.as_ref().is_some_and(|s| s.holding().host_params),
            "host_state_bytes": self.memory().host,
            "model_state_bytes": bytes.iter().map(|b| *b as u64).collect::<Vec<_>>(),
            "predicted_model_state_bytes": self.memory_estimate().map(|e| e.model_state() as u64),
            "predicted_host_state_bytes": self.memory_estimate().map(|e| e.host() as u64),
        }))
    }

    /// Whether the optimizer state lives in host memory (on a CPU run, host and device
    /// memory are one: the offload paths run and the report counts what they hold apart).
    pub(super) fn offloaded(&self) -> bool {
        let on_host = |a: &crate::optim::AdamW| {
            a.states
                .values()
                .next()
                .is_some_and(|s| s.master.device().is_cpu())
        };
        self.ctx.plan().offload_optimizer() && on_host(self.optimizer.state())
    }

    /// Bytes moved between host and device memory by parameter and gradient offload since
    /// the last call.
    pub fn take_offload_traffic(&self) -> usize {
        self.model.sharding.as_ref().map_or(0, |s| s.take_moved())
    }
}

/// Says how many bytes offload moved over the run (parameter slices to the device, gradient
/// slices back): what shows the offload path ran, on a CPU run too. Nothing without offload.
pub(super) fn log_offload_traffic(moved: usize) {
    if moved > 0 {
        tracing::info!("offload: {moved} bytes moved between host and device memory");
    }
}
