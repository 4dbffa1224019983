//! Generation from the model being trained, under its strategy, in the training process (what
//! an online trainer runs between steps):
//! - replicated (DDP, ZeRO-1/2): each rank decodes its rows alone;
//! - tensor parallel: each rank decodes its heads, the LM head's vocabulary parts gathered
//!   for the next token (the same on every rank of the group);
//! - ZeRO-3 / FSDP: the whole model gathered once for the round ([`GatherMode::Whole`]), or
//!   each unit gathered for each forward as in training ([`GatherMode::PerUnit`]);
//! - context / sequence parallel: each rank generates its own rows, whole (no split);
//! - expert parallel: each rank decodes its rows, every mixture exchanging the tokens with
//!   the ep group.
//!
//! Wherever forwards are collective (sharded parameters, tp, ep), the ranks step together: a rank
//! whose rows all stopped keeps stepping (on pads) until every rank has, so rows of different
//! lengths never hang a collective.

use super::Model;
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::generation::{CachedForward, GenerationConfig};
use crate::models::CausalModel;
use crate::nn::{KvCache, Weight};
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex};

/// How ZeRO-3 / FSDP's sharded parameters are gathered for a generation round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherMode {
    /// Whole when the gathered model fits in half of the memory available now, else per unit.
    Auto,
    /// Every unit gathered once, kept for the round: no collective per token.
    Whole,
    /// Each unit gathered for each forward and freed after it (one unit's weights at a time).
    PerUnit,
}

impl<N: CausalModel> CachedForward for Model<N> {
    fn last_logits(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        cache: Option<&Arc<Mutex<KvCache>>>,
    ) -> Result<Tensor> {
        crate::kernels::skinny::generation_forward(input_ids.device(), || {
            let hidden = self.hidden_states_over(input_ids, position_ids, false, cache)?;
            let s = hidden.dim(1)?;
            let logits = self.head_logits(&hidden.narrow(1, s - 1, 1)?)?.detach();
            let logits = match self.tp() {
                Some(tp) => tp.all_gather(&logits, 2)?,
                None => logits,
            };
            Ok(logits.squeeze(1)?.to_dtype(DType::F32)?)
        })
    }

    fn input_device(&self) -> Device {
        match &self.net().lm_head().weight {
            Weight::Local(w) => w.device().clone(),
            Weight::Sharded(s) => s.device(),
        }
    }

    fn all_done(&self, mine: bool) -> Result<bool> {
        let groups = self.lockstep_groups();
        if groups.is_empty() {
            return Ok(mine);
        }
        // Each group's max of "not done": after every group, 0 only when all ranks are done.
        let mut flag = Tensor::new(&[f32::from(u8::from(!mine))], &Device::Cpu)?;
        for g in groups {
            flag = g.all_reduce(&flag, ReduceOp::Max)?;
        }
        Ok(flag.to_vec1::<f32>()?[0] == 0.0)
    }
}

impl<N: CausalModel> Model<N> {
    /// The groups whose forwards are collective: the sharded units', tp's and ep's (whose
    /// mixtures exchange tokens).
    fn lockstep_groups(&self) -> Vec<Arc<dyn Communicator>> {
        let shard = self.sharding.as_ref().map(|s| s.root().comm().clone());
        let groups = shard.into_iter().chain(self.tp().cloned());
        groups.chain(self.ep().cloned()).collect()
    }

    /// transformers' `generate` on this rank's rows, under the model's strategy (see the
    /// module docs): tokens [batch, prompt + new] (u32). Every rank of a collective group
    /// calls it the same number of times.
    pub fn generate(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        cfg: &GenerationConfig,
        gather: GatherMode,
    ) -> Result<Tensor> {
        self.in_round(gather, || {
            crate::generation::generate(self, input_ids, attention_mask, cfg)
        })
    }

    /// [`Model::generate`] on rows of ids (left-padded `prompts`, their `mask`), each row
    /// drawing with its own seed: what a row samples does not depend on which rank or batch
    /// it is in. Each row's prompt and what follows it.
    pub fn generate_seeded(
        &self,
        prompts: &[Vec<u32>],
        mask: &[Vec<u32>],
        cfg: &GenerationConfig,
        gather: GatherMode,
        seeds: &[u64],
    ) -> Result<Vec<Vec<u32>>> {
        cfg.check("GenerationConfig")?;
        self.in_round(gather, || {
            crate::generation::generate_rows_seeded(self, prompts, mask, cfg, seeds)
        })
    }

    /// Runs `f` as a generation round: the sharded model gathered whole for it when `gather`
    /// says so, how this rank generates said once.
    fn in_round<T>(&self, gather: GatherMode, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let whole = self.gathers_whole(gather)?;
        let _held = match (&self.sharding, whole) {
            (Some(s), true) => Some(s.hold_gathered()?),
            _ => None,
        };
        if !self
            .said_how
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::info!("generation: {}", self.how_it_generates(whole));
        }
        f()
    }

    /// How this rank generates, said once per run.
    fn how_it_generates(&self, whole: bool) -> String {
        let mut parts = Vec::new();
        let gathered = self.sharding.as_ref().filter(|s| !s.holding().resident);
        match (gathered, whole) {
            (Some(s), true) => parts.push(format!(
                "the sharded model gathered whole once per round ({:.1} MiB per rank)",
                s.gathered_bytes() as f64 / (1u64 << 20) as f64
            )),
            (Some(_), false) => {
                parts.push("each unit gathered for each forward, ranks in lockstep".into())
            }
            (None, _) => parts.push("the model as held".into()),
        }
        if let Some(tp) = self.tp() {
            parts.push(format!("each of {} tp ranks decoding its heads", tp.size()));
        }
        if self.split().is_some() {
            parts.push("rows whole on each rank (sequences are not split for generation)".into());
        }
        parts.join("; ")
    }

    /// Whether a round gathers the whole model: asked, or (Auto) it fits in half of the
    /// memory this rank has free now, on every rank of the shard group.
    fn gathers_whole(&self, gather: GatherMode) -> Result<bool> {
        // ZeRO-2's resident units hold their parameters gathered already.
        let Some(sharding) = self.sharding.as_ref().filter(|s| !s.holding().resident) else {
            return Ok(false);
        };
        let fits = match gather {
            GatherMode::Whole => true,
            GatherMode::PerUnit => false,
            GatherMode::Auto => {
                let free = available_bytes(&self.input_device()).unwrap_or(0);
                sharding.gathered_bytes() <= free / 2
            }
        };
        // Every rank takes the same path (its collectives differ).
        let flag = Tensor::new(&[f32::from(u8::from(!fits))], &Device::Cpu)?;
        let any_not = sharding.root().comm().all_reduce(&flag, ReduceOp::Max)?;
        Ok(any_not.to_vec1::<f32>()?[0] == 0.0)
    }
}

/// Memory available for new allocations on `device`: the GPU's free memory, or the host's
/// `MemAvailable` (Linux); None when unknown.
pub fn available_bytes(device: &Device) -> Option<usize> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cudarc::driver::result::mem_get_info()
            .ok()
            .map(|(free, _)| free),
        _ => {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        }
    }
}
