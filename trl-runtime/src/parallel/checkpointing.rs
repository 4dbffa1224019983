//! Activation checkpointing (FSDP's `fsdp_activation_checkpointing`, TRL's
//! `gradient_checkpointing`): the decoder layers run in forward without keeping their
//! intermediate activations, only each layer's input; backward recomputes one layer at a time
//! from its input and backpropagates through it. Optionally the kept inputs live in host
//! memory between forward and backward (ALST's activation offload).
//!
//! Candle has no checkpointing, so the whole layer stack is one custom op over its input
//! (the embeddings): forward runs the layers on detached tensors (Candle's graph keeps none of
//! their intermediates), backward walks the layers last to first, recomputing each on a fresh
//! variable holding its saved input (the saved one is freed) and running a nested backward
//! seeded with the incoming gradient. The gradient of the layer's input continues down the stack; the gradients of
//! parameters held as variables are collected in [`Checkpointing`] and merged into the outer
//! gradient store by [`Checkpointing::merge_into`]. Parameters sharded by ZeRO-3 / FSDP
//! deposit their gradients in their unit as they always do ([`crate::nn::sharded::recomputing`]
//! keeps the recomputed ops from being counted twice).
//!
//! Every collective inside a layer (tensor-parallel sums, Ulysses all-to-alls, ring hops,
//! FSDP gathers) runs again in the recompute, in the same order on every rank.

use crate::nn::{lora, sharded};
use crate::precomputed::Precomputed;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Result, Shape, Tensor, TensorId, Var};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A stack of layers that can be run again in backward.
pub trait Layers: Send + Sync {
    fn count(&self) -> usize;

    /// Layer `l` applied to `x`; `recompute` is true when called again during backward.
    fn forward(&self, l: usize, x: &Tensor, recompute: bool) -> Result<Tensor>;

    /// The parameters of layer `l` held as variables on this rank (empty when sharded).
    fn params(&self, l: usize) -> Vec<Tensor>;
}

/// The setting and the parameter gradients of the recomputed layers until merged.
#[derive(Default)]
pub struct Checkpointing {
    /// Keep each layer's input in host memory between forward and backward.
    pub offload: bool,
    grads: Mutex<HashMap<TensorId, (Tensor, Tensor)>>,
    /// Layers recomputed so far (what a run with checkpointing on can be checked by).
    recomputed: AtomicUsize,
}

impl std::fmt::Debug for Checkpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpointing {{ offload: {} }}", self.offload)
    }
}

impl Checkpointing {
    pub fn new(offload: bool) -> Arc<Self> {
        Arc::new(Checkpointing {
            offload,
            grads: Mutex::default(),
            recomputed: AtomicUsize::new(0),
        })
    }

    /// Layers recomputed in backward so far.
    pub fn recomputed(&self) -> usize {
        self.recomputed.load(Ordering::Relaxed)
    }

    fn deposit(&self, param: &Tensor, grad: Tensor) -> Result<()> {
        let mut grads = self.grads.lock().unwrap_or_else(|e| e.into_inner());
        let grad = match grads.remove(&param.id()) {
            Some((_, prev)) => (prev + grad)?,
            None => grad,
        };
        grads.insert(param.id(), (param.clone(), grad));
        Ok(())
    }

    /// Adds the recomputed layers' parameter gradients to `store` (call after each backward).
    pub fn merge_into(&self, store: &mut GradStore) -> Result<()> {
        let grads = std::mem::take(&mut *self.grads.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, (param, grad)) in grads {
            let total = match store.remove(&param) {
                Some(prev) => (prev + grad)?,
                None => grad,
            };
            store.insert(&param, total);
        }
        Ok(())
    }

    /// Runs `layers` over `x` keeping only each layer's input (see the module docs).
    pub fn run(self: &Arc<Self>, x: &Tensor, layers: Arc<dyn Layers>) -> Result<Tensor> {
        let device = x.device().clone();
        let keep = |t: &Tensor| -> Result<Tensor> {
            match self.offload && !device.is_cpu() {
                true => t.to_device(&Device::Cpu),
                false => Ok(t.clone()),
            }
        };
        let mut inputs = Vec::with_capacity(layers.count());
        let mut dropout = Vec::with_capacity(layers.count());
        let mut h = x.detach();
        for l in 0..layers.count() {
            inputs.push(keep(&h)?);
            dropout.push(lora::dropout_state());
            h = layers.forward(l, &h, false)?.detach();
        }
        let stack = Stack {
            layers,
            inputs: Mutex::new(inputs.into_iter().map(Some).collect()),
            dropout,
            device,
            owner: self.clone(),
            out: Precomputed::new(h),
            input_tracked: x.track_op(),
        };
        if stack.input_tracked {
            return x.apply_op1(stack);
        }
        // An input without gradient (a LoRA run's frozen embedding) would leave the op out of
        // Candle's backward: it hangs off a variable of its own instead (transformers'
        // enable_input_require_grads, for the same reason).
        let anchor = Var::zeros(1, x.dtype(), x.device())?;
        anchor.as_tensor().apply_op1(stack)
    }
}

struct Stack {
    layers: Arc<dyn Layers>,
    /// Each layer's input (in host memory when offloaded), taken by its layer's backward:
    /// the inputs of the layers still to come and the gradients of those done then share the
    /// memory, as in torch, where each checkpoint frees its input once its backward ran.
    inputs: Mutex<Vec<Option<Tensor>>>,
    /// Where each layer's LoRA dropout masks start: the recompute draws the same ones.
    dropout: Vec<lora::DropoutState>,
    device: Device,
    owner: Arc<Checkpointing>,
    out: Precomputed,
    /// Whether the layers' input takes a gradient (else the op hangs off an anchor).
    input_tracked: bool,
}

/// Layer inputs from this size up (8 MiB: 8,192 tokens at hidden 256 in f32) have host memory
/// handed back to the OS after each recomputed layer.
const HAND_BACK_MIN_BYTES: usize = 8 << 20;

impl Stack {
    /// On the CPU, with long inputs, returns the freed heap to the OS once a layer's backward
    /// is done, before the next layer is recomputed. The process keeps freed memory for speed
    /// (`alloc::keep_freed_memory`), but the blocks the forward and the last layer freed do
    /// not all fit the next layer's sizes, so its recompute would raise the peak past what it
    /// holds: -69 MiB at 23k tokens on the reference model (~1 GiB). The next layer's buffers
    /// then come from fresh pages (~0.5 ms per MiB), which long layers amortize (no change
    /// beyond noise at 23k tokens); short ones would not (the tiny main job ran 2.2x slower
    /// when every layer did it).
    fn hand_back_freed(&self, input_bytes: usize) {
        if self.device.is_cpu() && input_bytes >= HAND_BACK_MIN_BYTES {
            crate::alloc::release_freed_memory();
        }
    }
}

impl CustomOp1 for Stack {
    fn name(&self) -> &'static str {
        "checkpointed-layers"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.out.take("the checkpointed layers")
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.take_cuda("the checkpointed layers")
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = grad.detach();
        for l in (0..self.layers.count()).rev() {
            let kept = self.inputs.lock().unwrap_or_else(|e| e.into_inner())[l].take();
            let Some(kept) = kept else {
                candle_core::bail!("the checkpointed layers ran their backward twice")
            };
            let bytes = kept.elem_count() * kept.dtype().size_in_bytes();
            // A variable of its own (a copy): the kept input is freed here.
            let input = Var::from_tensor(&kept.to_device(&self.device)?)?;
            drop(kept);
            self.owner.recomputed.fetch_add(1, Ordering::Relaxed);
            let store = sharded::recomputing(|| -> Result<GradStore> {
                let y = lora::recompute_dropout(self.dropout[l], || {
                    self.layers.forward(l, input.as_tensor(), true)
                })?;
                y.apply_op1(Seed { grad: g.clone() })?.backward()
            })?;
            for p in self.layers.params(l) {
                if let Some(gp) = store.get(&p) {
                    self.owner.deposit(&p, gp.clone())?;
                }
            }
            g = match store.get(input.as_tensor()) {
                Some(dx) => dx.clone(),
                None => g.zeros_like()?,
            };
            drop(store);
            self.hand_back_freed(bytes);
        }
        match self.input_tracked {
            true => Ok(Some(g)),
            false => Ok(Some(arg.zeros_like()?)),
        }
    }
}

/// A scalar whose backward hands `grad` to its input: `y.apply_op1(Seed { grad })`'s backward
/// backpropagates `grad` from `y` (a vector-Jacobian product). `(y * grad).sum()` would do the
/// same with two more tensors of y's size alive (the product, and a gradient for `grad`):
/// ~8% of what a checkpointed step holds per token on the reference model.
struct Seed {
    grad: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "checkpoint-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let zero = s
            .device()
            .zeros_impl(&Shape::from(()), candle_core::DType::F32)?;
        Ok((zero, Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        if self.grad.shape() != arg.shape() {
            candle_core::bail!(
                "checkpointing: gradient {:?} for a layer output {:?}",
                self.grad.dims(),
                arg.dims()
            );
        }
        Ok(Some(self.grad.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::max_abs_diff;

    /// tanh(x * w_l) per layer, counting the recomputations.
    struct Toy {
        weights: Vec<Var>,
        recomputed: AtomicUsize,
    }

    impl Layers for Toy {
        fn count(&self) -> usize {
            self.weights.len()
        }

        fn forward(&self, l: usize, x: &Tensor, recompute: bool) -> Result<Tensor> {
            if recompute {
                self.recomputed.fetch_add(1, Ordering::Relaxed);
            }
            x.broadcast_mul(self.weights[l].as_tensor())?.tanh()
        }

        fn params(&self, l: usize) -> Vec<Tensor> {
            vec![self.weights[l].as_tensor().clone()]
        }
    }

    #[test]
    fn backward_recomputes_each_layer_and_matches_the_plain_gradients() {
        let dev = Device::Cpu;
        let toy = Arc::new(Toy {
            weights: (0..3)
                .map(|_| Var::randn(0f32, 1.0, 5, &dev).unwrap())
                .collect(),
            recomputed: AtomicUsize::new(0),
        });
        let x = Var::randn(0f32, 1.0, (4, 5), &dev).unwrap();
        let target = Tensor::randn(0f32, 1.0, (4, 5), &dev).unwrap();
        let loss = |y: &Tensor| (y * &target).unwrap().sum_all().unwrap();
        let mut plain = x.as_tensor().clone();
        for l in 0..3 {
            plain = toy.forward(l, &plain, false).unwrap();
        }
        let want = loss(&plain).backward().unwrap();
        let ckpt = Checkpointing::new(false);
        let y = ckpt.run(x.as_tensor(), toy.clone()).unwrap();
        assert_eq!(max_abs_diff(&y, &plain), 0.0);
        let mut got = loss(&y).backward().unwrap();
        assert_eq!(
            toy.recomputed.load(Ordering::Relaxed),
            3,
            "one recompute per layer"
        );
        assert_eq!(ckpt.recomputed(), 3);
        // Before the merge the layer weights have no gradient: the graph never saw them.
        assert!(got.get(toy.weights[0].as_tensor()).is_none());
        ckpt.merge_into(&mut got).unwrap();
        let grad = |s: &GradStore, t: &Tensor| s.get(t).unwrap().clone();
        assert!(max_abs_diff(&grad(&got, x.as_tensor()), &grad(&want, x.as_tensor())) < 1e-6);
        for w in &toy.weights {
            let d = max_abs_diff(&grad(&got, w.as_tensor()), &grad(&want, w.as_tensor()));
            assert!(d < 1e-6, "weight gradient differs by {d}");
        }
    }
}
