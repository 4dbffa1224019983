//! AdamW with decoupled weight decay (PyTorch's algorithm), fp32 master weights and moments
//! kept per parameter in plain sight: ZeRO shards them and checkpoints save them.

use crate::alloc::StorageBytes;
use crate::error::{Error, Result};
use crate::models::Params;
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// The defaults of HF TrainingArguments.
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Optimizer state of one parameter, all fp32.
#[derive(Debug, Clone)]
pub struct ParamState {
    pub master: Tensor,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// Whether weight decay applies (HF exempts biases and norm weights).
    pub decay: bool,
    /// Per-element decay (1 or 0) for a flat shard that spans several parameters (ZeRO).
    pub decay_mask: Option<Tensor>,
}

/// HF's rule: no weight decay for biases and normalisation weights.
pub fn decays(name: &str) -> bool {
    !(name.contains("bias") || name.contains("norm"))
}

#[derive(Debug, Clone)]
pub struct AdamW {
    pub config: AdamWConfig,
    /// Completed optimizer steps (the bias-correction exponent).
    pub step: u64,
    pub states: BTreeMap<String, ParamState>,
}

impl AdamW {
    /// State for every parameter of `params` (or the subset a ZeRO rank owns: pass those).
    pub fn new<'a>(
        params: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
        config: AdamWConfig,
    ) -> Result<Self> {
        let mut states = BTreeMap::new();
        for (name, p) in params {
            let master = p.to_dtype(DType::F32)?.force_contiguous()?.detach();
            states.insert(
                name.clone(),
                ParamState {
                    exp_avg: master.zeros_like()?,
                    exp_avg_sq: master.zeros_like()?,
                    master,
                    decay: decays(name),
                    decay_mask: None,
                },
            );
        }
        Ok(AdamW {
            config,
            step: 0,
            states,
        })
    }

    /// State for all of a model's parameters.
    pub fn for_params(params: &Params, config: AdamWConfig) -> Result<Self> {
        let tensors: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        Self::new(tensors.iter().map(|(n, t)| (n, t)), config)
    }

    /// One update of the master weights from `grads` (by parameter name) at learning rate `lr`.
    /// Every parameter with state must have a gradient. Returns the new master weights.
    pub fn update(&mut self, grads: &BTreeMap<String, Tensor>, lr: f64) -> Result<()> {
        self.step += 1;
        let c = self.config;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        for (name, s) in self.states.iter_mut() {
            let g = grads.get(name).ok_or_else(|| {
                Error::Candle(candle_core::Error::Msg(format!(
                    "no gradient for parameter {name}"
                )))
            })?;
            // The state may live in host memory (CPU offload): the gradient goes there.
            let g = g.to_dtype(DType::F32)?.to_device(s.master.device())?;
            if c.weight_decay != 0.0 {
                match &s.decay_mask {
                    Some(mask) => {
                        s.master =
                            (&s.master - (&s.master * mask)?.affine(lr * c.weight_decay, 0.0)?)?
                    }
                    None if s.decay => s.master = (&s.master * (1.0 - lr * c.weight_decay))?,
                    None => {}
                }
            }
            s.exp_avg = ((&s.exp_avg * c.beta1)? + (&g * (1.0 - c.beta1))?)?.detach();
            s.exp_avg_sq = ((&s.exp_avg_sq * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?.detach();
            let denom = ((s.exp_avg_sq.sqrt()? / bc2.sqrt())? + c.eps)?;
            // Detached: state built from a parameter `Var` records the op, and each update
            // would otherwise chain onto the last, keeping every step's tensors alive.
            s.master = (&s.master - (s.exp_avg.broadcast_div(&denom)? * (lr / bc1))?)?.detach();
        }
        Ok(())
    }

    /// `update`, then copies the master weights into the model (cast to its dtype).
    pub fn step(
        &mut self,
        params: &Params,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
    ) -> Result<()> {
        self.update(grads, lr)?;
        for (name, s) in &self.states {
            if let Some(var) = params.get(name) {
                var.set(&s.master.to_dtype(var.dtype())?.to_device(var.device())?)?;
            }
        }
        Ok(())
    }

    /// Adds the storage the state holds (master weights and both moments) to `held`.
    pub fn add_storage(&self, held: &mut StorageBytes) {
        for s in self.states.values() {
            for t in [&s.master, &s.exp_avg, &s.exp_avg_sq] {
                held.add(t);
            }
        }
    }

    /// Bytes of optimizer state held, measured from the storages.
    pub fn state_bytes(&self) -> usize {
        let mut held = StorageBytes::default();
        self.add_storage(&mut held);
        held.total
    }
}

/// Sum of squares of all gradients (f64), so sharded callers can add theirs across ranks.
pub fn grad_norm_sq(grads: &BTreeMap<String, Tensor>) -> Result<f64> {
    Ok(sums_of_squares(grads.values())?.iter().sum())
}

/// The sum of the squares of each tensor's elements, computed in f32 where the tensors live
/// and added up in f64. The per-tensor sums are read back together: on a GPU that is one
/// synchronisation per step instead of one per parameter.
pub fn sums_of_squares<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<Vec<f64>> {
    let sums = tensors
        .into_iter()
        .map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    if sums.is_empty() {
        return Ok(Vec::new());
    }
    let sums = Tensor::stack(&sums, 0)?.to_vec1::<f32>()?;
    Ok(sums.into_iter().map(f64::from).collect())
}

/// Scales all gradients so that their global L2 norm is at most `max_norm` (PyTorch's
/// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), applied when below 1). Returns the
/// norm before clipping. `norm_sq` lets a sharded caller pass the global sum of squares.
pub fn clip_grad_norm(
    grads: &mut BTreeMap<String, Tensor>,
    max_norm: f64,
    norm_sq: Option<f64>,
) -> Result<f64> {
    let norm = match norm_sq {
        Some(sq) => sq.sqrt(),
        None => grad_norm_sq(grads)?.sqrt(),
    };
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        for g in grads.values_mut() {
            *g = (&*g * coef)?;
        }
    }
    Ok(norm)
}
