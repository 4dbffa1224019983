//! A mixture of experts' router load-balancing loss, as transformers'
//! `load_balancing_loss_func` computes it (Switch Transformer's), over every sparse layer of
//! one forward:
//!
//! `aux = E * sum_e (C_e / T) * (S_e / T)`, with `C_e` the (token, slot) choices of expert `e`,
//! `S_e` the sum of its router probabilities, over the real tokens (not padding) of every
//! sparse layer, and `T` = real tokens x sparse layers.
//!
//! The choices have no gradient, so the loss's gradient on a probability is the same for
//! every token and layer: `E * C_e / T^2`. It is known once the forward has seen every
//! layer, so each layer's probabilities pass through an op that is the identity in forward
//! and adds that gradient in backward (read when the backward runs): no probabilities are
//! kept for the loss, and a layer recomputed by activation checkpointing adds it again
//! without counting twice. Under cp or sp the counts and sums are over the whole rows (summed
//! over the sequence group), so each rank adds the whole loss's gradient for its tokens.
//!
//! TRL 1.16 adds `router_aux_loss_coef x aux` to each micro-batch's loss, averaged over the
//! micro-batches of a step and the data-parallel ranks: `weight` is the coefficient over
//! both counts.

use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Tensor};
use std::cell::RefCell;
use std::sync::{Arc, Mutex};

/// Whether transformers' model of `model_type` (a text config's, or a vision-language
/// wrapper's) adds no router loss although it routes with a softmax over experts: Llama 4
/// (its config names `router_aux_loss_coef` all the same) and Gemma 4.
pub fn not_computed_for(model_type: &str) -> bool {
    super::llama4::MODEL_TYPES
        .iter()
        .chain(super::gemma4::MODEL_TYPES)
        .any(|t| *t == model_type)
}

/// The load-balancing loss of one forward.
pub struct RouterLoss {
    /// Which of this rank's tokens ([batch * seq], row-major) are real; None: all of them
    /// (padding-free rows, where TRL passes no attention mask either).
    mask: Option<Vec<bool>>,
    /// The loss's weight in this micro-batch's loss.
    weight: f64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Per expert: choices, and summed probabilities (of real tokens, every sparse layer).
    counts: Vec<f64>,
    sums: Vec<f64>,
    /// Real tokens x sparse layers.
    tokens: f64,
    /// Once the forward is over: the gradient per expert of `weight x aux`, and aux.
    sealed: Option<(Vec<f32>, f64)>,
    /// That gradient on every real token [tokens, experts], built by the first layer's
    /// backward and added by every layer's (they all see this rank's tokens).
    addend: Option<Tensor>,
}

impl RouterLoss {
    pub fn new(mask: Option<Vec<bool>>, weight: f64) -> Arc<Self> {
        Arc::new(RouterLoss {
            mask,
            weight,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One sparse layer's router: `probs` [tokens, experts] (f32, in the graph), the same on
    /// the host, and `chosen` [tokens * k] the experts each token was routed to. Returns
    /// `probs` as the identity whose backward adds the loss's gradient (`probs` itself when
    /// the weight is 0: an evaluation, no backward). A layer run again (recomputed in
    /// backward) is not counted again.
    pub fn record(
        self: &Arc<Self>,
        probs: &Tensor,
        host: &[f32],
        chosen: &[u32],
    ) -> Result<Tensor> {
        let (n, experts) = probs.dims2()?;
        let k = chosen.len() / n.max(1);
        if let Some(mask) = &self.mask {
            if mask.len() != n {
                return Err(Error::Candle(candle_core::Error::Msg(format!(
                    "router loss: a mask of {} tokens for a layer of {n}",
                    mask.len()
                ))));
            }
        }
        let mut s = self.state();
        if s.sealed.is_none() {
            if s.counts.is_empty() {
                s.counts = vec![0.0; experts];
                s.sums = vec![0.0; experts];
            }
            for t in 0..n {
                if self.mask.as_ref().is_some_and(|m| !m[t]) {
                    continue;
                }
                s.tokens += 1.0;
                for &e in &chosen[t * k..(t + 1) * k] {
                    s.counts[e as usize] += 1.0;
                }
                for (sum, &p) in s.sums.iter_mut().zip(&host[t * experts..(t + 1) * experts]) {
                    *sum += p as f64;
                }
            }
        }
        drop(s);
        if self.weight == 0.0 {
            return Ok(probs.clone());
        }
        Ok(probs.apply_op1(AddGrad(self.clone()))?)
    }

    /// Ends the forward: counts summed over `group` (the ranks that hold other parts of the
    /// same rows), then the gradient and the loss's value. Every rank of the group calls it.
    pub fn seal(&self, group: Option<&Arc<dyn Communicator>>) -> Result<()> {
        let mut s = self.state();
        if s.sealed.is_some() {
            return Ok(());
        }
        let experts = s.counts.len();
        if let Some(g) = group.filter(|g| g.size() > 1) {
            // Every rank of the group ran the same layers, so all have the same length here.
            let mut v: Vec<f64> = s.counts.iter().chain(&s.sums).copied().collect();
            v.push(s.tokens);
            let t = Tensor::new(v.as_slice(), &candle_core::Device::Cpu)?;
            let v = g.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?;
            s.counts = v[..experts].to_vec();
            s.sums = v[experts..2 * experts].to_vec();
            s.tokens = v[2 * experts];
        }
        let t = s.tokens.max(1.0);
        let e = experts as f64;
        let value = e * s
            .counts
            .iter()
            .zip(&s.sums)
            .map(|(c, p)| c * p)
            .sum::<f64>()
            / (t * t);
        let grad = s
            .counts
            .iter()
            .map(|c| (self.weight * e * c / (t * t)) as f32)
            .collect();
        s.sealed = Some((grad, value));
        Ok(())
    }

    /// The loss (unweighted), once the forward is over.
    pub fn value(&self) -> Option<f64> {
        self.state().sealed.as_ref().map(|(_, v)| *v)
    }
}

thread_local! {
    static ACTIVE: RefCell<Option<Arc<RouterLoss>>> = const { RefCell::new(None) };
}

/// Runs `f` (a training forward) with `loss` collecting the routers' load-balancing loss: the
/// model's forward hands it to its layers and seals it after the last one.
pub fn with_router_loss<R>(loss: &Arc<RouterLoss>, f: impl FnOnce() -> R) -> R {
    let previous = ACTIVE.with(|a| a.replace(Some(loss.clone())));
    let r = f();
    ACTIVE.with(|a| *a.borrow_mut() = previous);
    r
}

/// The loss of the forward running on this thread, if one is collected.
pub(crate) fn active() -> Option<Arc<RouterLoss>> {
    ACTIVE.with(|a| a.borrow().clone())
}

/// The identity on a layer's router probabilities whose backward adds the load-balancing
/// loss's gradient (per expert, on real tokens).
struct AddGrad(Arc<RouterLoss>);

impl candle_core::CustomOp1 for AddGrad {
    fn name(&self) -> &'static str {
        "router-loss"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::precomputed::copy_storage(s, l)
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        crate::precomputed::copy_storage(s, l)
    }

    fn bwd(&self, arg: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let mut s = self.0.state();
        let add = match &s.addend {
            Some(add) => add.clone(),
            None => {
                let (n, experts) = arg.dims2()?;
                let Some((per_expert, _)) = &s.sealed else {
                    candle_core::bail!("router loss: backward before the forward was sealed")
                };
                let mask: Vec<f32> = match &self.0.mask {
                    Some(m) => m.iter().map(|&r| r as u8 as f32).collect(),
                    None => vec![1.0; n],
                };
                let dev = arg.device();
                let add = Tensor::from_vec(mask, (n, 1), dev)?
                    .broadcast_mul(&Tensor::from_vec(per_expert.clone(), (1, experts), dev)?)?
                    .to_dtype(grad.dtype())?;
                s.addend = Some(add.clone());
                add
            }
        };
        drop(s);
        Ok(Some((grad + add)?))
    }
}
