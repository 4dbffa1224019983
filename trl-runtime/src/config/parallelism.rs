//! The parallelism config: how the world is factored into data, context, sequence and tensor
//! parallel axes. Mirrors Accelerate's `ParallelismConfig` (same sizes, same env variables).

use super::sections::DistributedType;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpBackend {
    /// DeepSpeed's Ulysses all-to-all (the only backend Accelerate offers).
    DeepSpeed,
}

/// Sizes as written by the user. `dp_replicate`/`dp_shard` stay `None` when not given, so that
/// [`ParallelismConfig::resolve`] can fill data parallelism from the world size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelismConfig {
    pub dp_replicate: Option<usize>,
    pub dp_shard: Option<usize>,
    pub tp: usize,
    pub cp: usize,
    pub sp: usize,
    /// Expert parallelism: each mixture's experts split over groups of `ep` data-parallel
    /// ranks, which exchange the routed tokens (not an axis of its own: taken out of the
    /// data-parallel ranks, as torchtitan takes it).
    pub ep: usize,
    pub cp_backend: String,
    pub cp_comm_strategy: String,
    pub sp_backend: SpBackend,
    pub sp_seq_length: Option<usize>,
    pub sp_seq_length_is_variable: bool,
    pub sp_attn_implementation: Option<String>,
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        ParallelismConfig {
            dp_replicate: None,
            dp_shard: None,
            tp: 1,
            cp: 1,
            sp: 1,
            ep: 1,
            cp_backend: "torch".into(),
            cp_comm_strategy: "allgather".into(),
            sp_backend: SpBackend::DeepSpeed,
            sp_seq_length: None,
            sp_seq_length_is_variable: true,
            sp_attn_implementation: None,
        }
    }
}

/// Fully resolved sizes: every factor known, product equal to the world size, rules checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub cp: usize,
    pub sp: usize,
    pub tp: usize,
}

pub const ENV_PREFIX: &str = "PARALLELISM_CONFIG_";

impl ParallelismConfig {
    /// Reads `PARALLELISM_CONFIG_*` variables through `get` (the launcher exports them, as
    /// Accelerate does). Variables override the fields of `self`.
    pub fn with_env(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let size = |name: &str| -> Result<Option<usize>> {
            let var = format!("{ENV_PREFIX}{name}");
            match get(&var) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => match v.trim().parse::<usize>() {
                    Ok(n) if n >= 1 => Ok(Some(n)),
                    _ => Err(Error::Env {
                        var,
                        message: format!("'{v}' is not a size: use a positive integer"),
                    }),
                },
            }
        };
        if let Some(n) = size("DP_REPLICATE_SIZE")? {
            self.dp_replicate = Some(n);
        }
        if let Some(n) = size("DP_SHARD_SIZE")? {
            self.dp_shard = Some(n);
        }
        if let Some(n) = size("TP_SIZE")? {
            self.tp = n;
        }
        if let Some(n) = size("CP_SIZE")? {
            self.cp = n;
        }
        if let Some(n) = size("SP_SIZE")? {
            self.sp = n;
        }
        if let Some(n) = size("EP_SIZE")? {
            self.ep = n;
        }
        if let Some(n) = size("SP_SEQ_LENGTH")? {
            self.sp_seq_length = Some(n);
        }
        if let Some(v) = get(&format!("{ENV_PREFIX}SP_SEQ_LENGTH_IS_VARIABLE")) {
            self.sp_seq_length_is_variable =
                !matches!(v.trim().to_ascii_lowercase().as_str(), "false" | "0");
        }
        if let Some(v) = get(&format!("{ENV_PREFIX}SP_ATTN_IMPLEMENTATION")) {
            self.sp_attn_implementation = Some(v);
        }
        if let Some(v) = get(&format!("{ENV_PREFIX}CP_COMM_STRATEGY")) {
            self.cp_comm_strategy = v;
        }
        Ok(self)
    }

    /// The same, from the process environment.
    pub fn with_process_env(self) -> Result<Self> {
        self.with_env(|k| std::env::var(k).ok())
    }

    /// The variables a launcher exports so that workers see this config.
    pub fn to_env(&self) -> Vec<(String, String)> {
        let mut v = Vec::new();
        if let Some(n) = self.dp_replicate {
            v.push((format!("{ENV_PREFIX}DP_REPLICATE_SIZE"), n.to_string()));
        }
        if let Some(n) = self.dp_shard {
            v.push((format!("{ENV_PREFIX}DP_SHARD_SIZE"), n.to_string()));
        }
        v.push((format!("{ENV_PREFIX}TP_SIZE"), self.tp.to_string()));
        v.push((format!("{ENV_PREFIX}CP_SIZE"), self.cp.to_string()));
        v.push((format!("{ENV_PREFIX}SP_SIZE"), self.sp.to_string()));
        v.push((format!("{ENV_PREFIX}EP_SIZE"), self.ep.to_string()));
        v
    }

    /// Fills unspecified data-parallel sizes from the world size and checks every rule.
    ///
    /// When neither dp size is given, the data-parallel degree is world / (cp x sp x tp); it
    /// goes to `dp_shard` for ZeRO/FSDP (state is sharded) and to `dp_replicate` otherwise.
    pub fn resolve(
        &self,
        world_size: usize,
        distributed_type: DistributedType,
    ) -> Result<ParallelDims> {
        let inner = self.cp * self.sp * self.tp;
        let (dp_replicate, dp_shard) = match (self.dp_replicate, self.dp_shard) {
            (Some(r), Some(s)) => (r, s),
            (r, s) => {
                let known = r.unwrap_or(1) * s.unwrap_or(1) * inner;
                if known == 0 || !world_size.is_multiple_of(known) {
                    // Let validate() produce the full message.
                    (r.unwrap_or(1), s.unwrap_or(1))
                } else {
                    let fill = world_size / known;
                    match (r, s) {
                        (Some(r), None) => (r, fill),
                        (None, Some(s)) => (fill, s),
                        _ if distributed_type.shards_model_state() => (1, fill),
                        _ => (fill, 1),
                    }
                }
            }
        };
        let dims = ParallelDims {
            dp_replicate,
            dp_shard,
            cp: self.cp,
            sp: self.sp,
            tp: self.tp,
        };
        dims.validate(world_size)?;
        self.validate_ep(&dims)?;
        Ok(dims)
    }

    /// Expert parallelism's rule: its groups are made of data-parallel ranks (dp_replicate x
    /// dp_shard, dp_shard's first), so ep must divide their number; the message names the
    /// numbers. Whether the experts divide is checked when the model is split.
    pub fn validate_ep(&self, dims: &ParallelDims) -> Result<()> {
        let (ep, dp) = (self.ep, dims.dp_world());
        if ep == 0 || !dp.is_multiple_of(ep) {
            return Err(Error::Parallelism(format!(
                "parallelism_config_ep_size = {ep} with {} (= {dp} data-parallel ranks): \
                 expert parallelism groups data-parallel ranks, so ep must divide {dp}; \
                 choose an ep of {} or add processes",
                dims.factors(),
                divisors(dp)
            )));
        }
        Ok(())
    }
}

/// The divisors of `n`, as "1, 2 or 4" for a message.
fn divisors(n: usize) -> String {
    let all: Vec<String> = (1..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    match all.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => all.join(""),
    }
}

impl ParallelDims {
    pub fn single() -> Self {
        ParallelDims {
            dp_replicate: 1,
            dp_shard: 1,
            cp: 1,
            sp: 1,
            tp: 1,
        }
    }

    pub fn product(&self) -> usize {
        self.dp_replicate * self.dp_shard * self.cp * self.sp * self.tp
    }

    pub fn factors(&self) -> String {
        format!(
            "dp_replicate={} x dp_shard={} x cp={} x sp={} x tp={}",
            self.dp_replicate, self.dp_shard, self.cp, self.sp, self.tp
        )
    }

    /// The mesh rules (docs/architecture.md, docs/launch-config.md); every message names all
    /// factors and the world size.
    pub fn validate(&self, world_size: usize) -> Result<()> {
        let fail = |why: String| {
            Err(Error::Parallelism(format!(
                "{} (= {}) with world size {world_size}: {why}",
                self.factors(),
                self.product()
            )))
        };
        for (name, v) in [
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("sp", self.sp),
            ("tp", self.tp),
        ] {
            if v == 0 {
                return fail(format!("{name} is 0; every size must be at least 1"));
            }
        }
        if self.product() != world_size {
            return fail(
                "the product of the sizes must equal the world size (num_processes); change a size or the number of processes"
                    .to_string(),
            );
        }
        if self.cp > 1 && self.sp > 1 {
            return fail("context parallelism (cp) and sequence parallelism (sp) cannot be combined: set one of them to 1".into());
        }
        if (self.tp > 1 || self.cp > 1) && self.dp_replicate > 1 && self.dp_shard == 1 {
            return fail("tp or cp needs FSDP-style sharding for data parallelism, not pure DDP: use dp_shard > 1 (HSDP) instead of dp_replicate alone".into());
        }
        Ok(())
    }

    /// Ranks that see the same batch: tp, cp and sp ranks of a group share one data shard.
    pub fn dp_world(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// Ranks that share the tokens of one batch (the token-count divisor of the loss rule).
    pub fn token_sharing(&self) -> usize {
        self.tp * self.cp * self.sp
    }
}
