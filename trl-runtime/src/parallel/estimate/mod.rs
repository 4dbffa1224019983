//! What one rank holds at its peak, and how fast a step runs, before anything is loaded:
//! the figures `cargo trl plan` and `--profile auto` choose a layout with.
//!
//! Model state is exact: each strategy's rule below is how its file allocates (DDP keeps
//! weights, gradients, an fp32 master and two moments whole; ZeRO-1/2 slice the flat vector
//! of all parameters, padded to the group size; ZeRO-3 / FSDP slice each wrap unit, padded the
//! same way), and trl-runtime/tests/memory_plan.rs checks it equals `Trainer::memory` for every strategy.
//! Activations are what the autograd graph keeps per token, in elements of the compute dtype,
//! measured from the layers with a counting allocator (trl-runtime/tests/memory_plan.rs re-measures them on
//! other shapes and fails when the code and these constants part by more than 10%).

mod hardware;
mod memory;
mod shapes;
mod speed;
#[cfg(test)]
mod tests;

pub use hardware::*;
pub use memory::*;
pub use shapes::*;
pub use speed::*;

use super::{Model, Strategy, WrapPolicy, ZeroStage};
use crate::config::parallelism::ParallelDims;
use crate::nn::lora::LoraConfig;
use candle_core::DType;

/// One layout to estimate: the strategy over a mesh, and the work each rank does.
#[derive(Debug, Clone)]
pub struct Setup {
    pub strategy: Strategy,
    pub dims: ParallelDims,
    /// Expert parallelism: each rank holds this share of every mixture's experts (1: all).
    pub ep: usize,
    /// The compute dtype (weights and activations); master weights, gradients and moments
    /// are fp32 whatever it is.
    pub dtype: DType,
    pub lora: Option<LoraConfig>,
    /// Rows per device per micro-batch and their length (before a cp/sp split).
    pub batch: usize,
    /// Micro-batches per optimizer step (gradient_accumulation_steps): ZeRO-3 / FSDP keep no
    /// gradient slices through the first one's loss backward (they are taken by the update).
    pub micro_batches: usize,
    pub seq: usize,
    pub checkpointing: bool,
    /// Optimizer state (fp32 master and moments) kept in host memory, and under ZeRO-2/3 the
    /// reduced gradient slices streamed there.
    pub offload_optimizer: bool,
    /// Parameter slices kept in host memory (fsdp_offload_params, offload_param).
    pub offload_params: bool,
    /// ZeRO-2's units (full fine-tuning): DeepSpeed's reduce buckets or FSDP's wrap units
    /// ([`super::zero2_units`]), and whether their reductions overlap the backward.
    pub reduce_units: (WrapPolicy, bool),
    /// A second copy of the weights this rank holds (TR-DPO's reference).
    pub reference_copy: bool,
    /// Parameters of other models held whole beside the trained one (GRPO's reward models).
    pub side_parameters: usize,
    /// Parameters of a frozen model held as the trained one is (distillation's teacher):
    /// split over tp, sharded over the ZeRO-3 / FSDP ranks, in the compute dtype.
    pub held_parameters: usize,
    /// On GPUs, where the fused loss's one-pass kernel takes every dtype (on the CPU, f32).
    pub gpu: bool,
    /// The router load-balancing loss is added (a mixture of experts with a non-zero
    /// `router_aux_loss_coef`, the default): each sparse layer keeps its probabilities once
    /// more, in f32, for the loss's backward.
    pub router_loss: bool,
    /// A CPU rank's compute threads (RAYON_NUM_THREADS, the training thread among them):
    /// each holds a GEMM packing buffer (`kernels::cpu_gemm::reserve_packing_buffers`).
    /// Unused on GPUs.
    pub threads: usize,
}

impl Setup {
    /// `strategy` over `dims` with `batch` rows of `seq` tokens, in the plainest form: fp32
    /// on the CPU, one thread, one micro-batch, no LoRA, checkpointing or offload.
    pub fn new(strategy: Strategy, dims: ParallelDims, batch: usize, seq: usize) -> Self {
        Setup {
            strategy,
            dims,
            ep: 1,
            dtype: DType::F32,
            lora: None,
            batch,
            micro_batches: 1,
            seq,
            checkpointing: false,
            offload_optimizer: false,
            offload_params: false,
            reduce_units: (WrapPolicy::Buckets(super::DEEPSPEED_REDUCE_BUCKET), false),
            reference_copy: false,
            side_parameters: 0,
            held_parameters: 0,
            gpu: false,
            router_loss: true,
            threads: 1,
        }
    }

    /// The setup of a trainer's `work` over it: its rows' sequences and its weight copies.
    pub fn apply(&mut self, work: &Workload) {
        self.batch *= work.sequences_per_row.max(1);
        self.reference_copy = work.weight_copies > 0;
        self.side_parameters = work.side_parameters;
        self.held_parameters = work.held_parameters;
    }
}

/// What a trainer's rows cost a rank, in fields every trainer fills (`crate::train::kinds`):
/// the planner reads these and has no branch per trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Workload {
    /// Sequences one dataset row becomes in a micro-batch (SFT 1; DPO 2: chosen and
    /// rejected).
    pub sequences_per_row: usize,
    /// Copies of the trained weights a rank holds beside them (TR-DPO's synced reference: 1).
    pub weight_copies: usize,
    /// Parameters of other models a rank holds whole, in the compute dtype (GRPO's reward
    /// models).
    #[serde(default)]
    pub side_parameters: usize,
    /// Parameters of a frozen model held as the trained one is (distillation's teacher).
    #[serde(default)]
    pub held_parameters: usize,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            sequences_per_row: 1,
            weight_copies: 0,
            side_parameters: 0,
            held_parameters: 0,
        }
    }
}

impl Workload {
    /// `n` rows per micro-batch in words, when they are more than n sequences or bring
    /// copies of the weights ("16 rows = 32 sequences per micro-batch, 1 copy of the
    /// weights"); None for a plain one.
    pub fn describe(&self, rows: usize) -> Option<String> {
        if *self == Workload::default() {
            return None;
        }
        let copies = match self.weight_copies {
            0 => String::new(),
            n => format!(", {n} copy of the weights"),
        };
        let side = match self.side_parameters {
            0 => String::new(),
            n => format!(", {n} parameters of reward models held whole"),
        };
        let held = match self.held_parameters {
            0 => String::new(),
            n => format!(", a frozen model of {n} parameters held as the trained one"),
        };
        Some(format!(
            "{rows} rows = {} sequences per micro-batch{copies}{side}{held}",
            rows * self.sequences_per_row
        ))
    }
}

/// Bytes one rank holds, by what holds them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Estimate {
    /// Weights in the compute dtype (a frozen LoRA base among them).
    pub parameters: usize,
    /// Gradients kept between backward and the update (a slice under ZeRO-2/3).
    pub gradients: usize,
    /// fp32 master weights and moments on the device (0 when offloaded).
    pub optimizer: usize,
    /// Optimizer state moved to host memory.
    pub host_optimizer: usize,
    /// Parameter slices in host memory (parameter offload).
    pub host_parameters: usize,
    /// Reduced gradient slices streamed to host memory (ZeRO-2/3 with optimizer offload).
    pub host_gradients: usize,
    /// What backward needs of the forward: per token, per layer, times the tokens of a rank.
    pub activations: usize,
    /// The runtime's own heap: tokenizer, data, host-collective buffers (measured).
    pub runtime: usize,
    /// Buffers a strategy keeps for its collectives between steps (ZeRO-2: the reduced
    /// gradient slice the host backend writes into).
    pub comm_buffers: usize,
    /// What the loss's logits add to `activations` at the backward's peak, when they exist
    /// whole (under tp, ZeRO-3/FSDP or soft-capping).
    pub logits: usize,
    /// Transient buffers of the step: the whole gradients while backward runs, the units
    /// gathered at once (ZeRO-3/FSDP), the flat buffers of the reductions.
    pub step_buffers: usize,
    /// Of `step_buffers`, the units whose all-gathers run ahead (ZeRO-3/FSDP prefetch) and
    /// the flat gradient reduce-scattered in the background: whether they are in memory at
    /// the peak depends on timing, so the peak is a bound.
    pub prefetch: usize,
    /// Transient buffers of the update, beyond the gradients (the flat copies ZeRO reduces
    /// and gathers; AdamW's temporaries). The step's transient is the larger of this and the
    /// backward's (activations, logits, step buffers).
    pub update_buffers: usize,
    /// A full checkpoint save over the training peak (streamed: one unit at a time).
    pub save: usize,
    /// Weights kept beside the trained ones: a copy of this rank's (TR-DPO's and GRPO's
    /// reference) and models held whole (GRPO's reward models).
    pub reference: usize,
    /// The formulas with their numbers, one line each (`cargo trl plan --explain`).
    pub explain: Vec<String>,
}

impl Estimate {
    /// Model state on the device (what `Trainer::memory` reports).
    pub fn model_state(&self) -> usize {
        self.parameters + self.gradients + self.optimizer
    }

    /// What offload keeps in host memory.
    pub fn host(&self) -> usize {
        self.host_optimizer + self.host_parameters + self.host_gradients
    }

    /// The step's peak on the device, without the process's own base (runtime, CUDA context).
    pub fn peak(&self) -> usize {
        self.runtime
            + self.comm_buffers
            + self.reference
            + self.parameters
            + self.optimizer
            + self.gradients
            + self.transient()
    }

    /// What exists only during the step: the larger of backward's (activations, logits,
    /// step buffers: the loss's graph stays alive while checkpointed layers are recomputed)
    /// and the update's.
    pub fn transient(&self) -> usize {
        (self.activations + self.logits + self.step_buffers).max(self.update_buffers)
    }
}
