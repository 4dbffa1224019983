//! AdamW with decoupled weight decay (PyTorch's algorithm), fp32 master weights and moments
//! kept per parameter in plain sight: ZeRO shards them and checkpoints save them.

use crate::alloc::StorageBytes;
use crate::error::{Error, Result};
use crate::kernels::fused::slice;
use crate::kernels::op::inplace_op;
use crate::models::tensor_file::{TensorFile, TensorSpec};
use crate::models::Params;
use candle_core::{DType, Layout, Tensor};
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
    /// Per-element decay (1 or 0, u8: a byte per element) for a flat shard that spans
    /// several parameters (ZeRO, FSDP).
    pub decay_mask: Option<Tensor>,
}

/// HF's rule: no weight decay for biases and normalisation weights; nor for the buffers a
/// checkpoint keeps beside its parameters (Gemma 4's `layer_scalar`), which get no gradient
/// and so stay as they are.
pub fn decays(name: &str) -> bool {
    !(name.contains("bias") || name.contains("norm") || name.ends_with("layer_scalar"))
}

#[derive(Debug, Clone)]
pub struct AdamW {
    pub config: AdamWConfig,
    /// Completed optimizer steps (the bias-correction exponent).
    pub step: u64,
    pub states: BTreeMap<String, ParamState>,
}

/// The file a checkpoint keeps the optimizer state in ([`AdamW::write_file`]).
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// The parts of a parameter's state, as checkpoints name them (`NAME::part`).
pub const STATE_PARTS: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// Opens an optimizer file for the parameters `shapes` (whole shapes, in the order their
/// states will be written with [`write_state`]) at optimizer step `step`. A sharded optimizer
/// streams its state into it one gathered unit at a time.
pub fn state_file(
    path: &std::path::Path,
    shapes: impl IntoIterator<Item = (String, Vec<usize>)>,
    step: u64,
) -> Result<TensorFile> {
    let specs = shapes
        .into_iter()
        .flat_map(|(name, shape)| {
            STATE_PARTS.map(|part| TensorSpec::new(format!("{name}::{part}"), DType::F32, &shape))
        })
        .collect();
    let meta = [("optimizer_step".to_string(), step.to_string())].into();
    TensorFile::create(path, specs, meta)
}

/// One parameter's state, next in a file from [`state_file`].
pub fn write_state(file: &mut TensorFile, name: &str, s: &ParamState) -> Result<()> {
    for (part, t) in STATE_PARTS
        .iter()
        .zip([&s.master, &s.exp_avg, &s.exp_avg_sq])
    {
        file.write(&format!("{name}::{part}"), t)?;
    }
    Ok(())
}

impl AdamW {
    /// Writes the master weights and moments by parameter name (`NAME::master`,
    /// `NAME::exp_avg`, `NAME::exp_avg_sq`) and the step count (metadata `optimizer_step`) to
    /// the safetensors file `path`.
    pub fn write_file(&self, path: &std::path::Path) -> Result<()> {
        let shapes = self
            .states
            .iter()
            .map(|(n, s)| (n.clone(), s.master.dims().to_vec()));
        let mut file = state_file(path, shapes, self.step)?;
        for (name, s) in &self.states {
            write_state(&mut file, name, s)?;
        }
        file.finish()
    }

    /// Reads every parameter's state from a file [`Self::write_file`] wrote (onto each
    /// state's device); returns the step count it holds, if any.
    pub fn read_file(&mut self, path: &std::path::Path) -> Result<Option<u64>> {
        let bad = |key: &str, message: String| Error::Config {
            file: path.display().to_string(),
            key: key.into(),
            message,
        };
        // One read: the tensors and, in the header's metadata, the step count.
        let bytes = std::fs::read(path)
            .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)
            .map_err(|e| {
                bad(
                    "<safetensors>",
                    format!("cannot read the optimizer state: {e}"),
                )
            })?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad("<metadata>", e.to_string()))?;
        let take = |key: String| {
            tensors.get(&key).cloned().ok_or_else(|| {
                bad(
                    &key,
                    "missing from the optimizer state: the checkpoint does not match this model"
                        .into(),
                )
            })
        };
        for (name, s) in self.states.iter_mut() {
            let device = s.master.device().clone();
            s.master = take(format!("{name}::master"))?.to_device(&device)?;
            s.exp_avg = take(format!("{name}::exp_avg"))?.to_device(&device)?;
            s.exp_avg_sq = take(format!("{name}::exp_avg_sq"))?.to_device(&device)?;
        }
        Ok(meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("optimizer_step"))
            .and_then(|v| v.parse().ok()))
    }

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
        self.update_scaled(grads, lr, 1.0)
    }

    /// `update` with every gradient multiplied by `grad_scale` (the clipping coefficient of
    /// [`clip_coef`]), folded into the update's own pass on the CPU and the GPU.
    pub fn update_scaled(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        self.update_writing(grads, lr, grad_scale, None).map(|_| ())
    }

    /// [`Self::update_scaled`]; with `params`, the GPU kernel also writes each new weight
    /// into its model parameter, and the returned names are those it wrote.
    fn update_writing(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        grad_scale: f64,
        params: Option<&Params>,
    ) -> Result<Vec<String>> {
        let mut written = Vec::new();
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
            let g = g.to_device(s.master.device())?;
            let hyper = Hyper {
                lr,
                decay: c.weight_decay,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                bc1,
                bc2,
            };
            // On a GPU: in place, the gradient read in its own dtype, the weight written too.
            let weight = params.and_then(|p| p.get(name)).map(|v| v.as_tensor());
            match cuda_update_in_place(s, &g, grad_scale, weight, hyper)? {
                InPlace::No => {}
                InPlace::Master => continue,
                InPlace::MasterAndWeight => {
                    written.push(name.clone());
                    continue;
                }
            }
            let g = g.to_dtype(DType::F32)?;
            if cpu_update_in_place(s, &g, grad_scale, hyper)? {
                continue;
            }
            let g = match grad_scale != 1.0 {
                true => (g * grad_scale)?,
                false => g,
            };
            (s.master, s.exp_avg, s.exp_avg_sq) = chain_update(s, &g, hyper)?;
        }
        Ok(written)
    }

    /// `update`, then copies the master weights into the model (cast to its dtype).
    pub fn step(
        &mut self,
        params: &Params,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
    ) -> Result<()> {
        self.step_scaled(params, grads, lr, 1.0)
    }

    /// `step` with the gradients multiplied by `grad_scale` (the clipping coefficient of
    /// [`grad_clip_coef`]), which on a GPU costs no pass of its own; there the new weights are
    /// written into the model by the update's kernel.
    pub fn step_scaled(
        &mut self,
        params: &Params,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let written = self.update_writing(grads, lr, grad_scale, Some(params))?;
        for (name, s) in &self.states {
            if written.contains(name) {
                continue;
            }
            if let Some(var) = params.get(name) {
                var.set(&s.master.to_dtype(var.dtype())?.to_device(var.device())?)?;
            }
        }
        Ok(())
    }

    /// Adds the storage the state holds (master weights, both moments and a flat slice's
    /// decay mask) to `held`.
    pub fn add_storage(&self, held: &mut StorageBytes) {
        for s in self.states.values() {
            for t in [&s.master, &s.exp_avg, &s.exp_avg_sq] {
                held.add(t);
            }
            if let Some(mask) = &s.decay_mask {
                held.add(mask);
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

/// One AdamW step's constants.
#[derive(Clone, Copy)]
struct Hyper {
    lr: f64,
    /// The weight decay (applied where the parameter, or the element of a flat shard, decays).
    decay: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    bc1: f64,
    bc2: f64,
}

/// AdamW in Candle ops (any device and dtype): the new (master, exp_avg, exp_avg_sq).
fn chain_update(s: &ParamState, g: &Tensor, h: Hyper) -> Result<(Tensor, Tensor, Tensor)> {
    let mut master = s.master.clone();
    if h.decay != 0.0 {
        match &s.decay_mask {
            Some(mask) => {
                let mask = mask.to_dtype(master.dtype())?;
                master = (&master - (&master * mask)?.affine(h.lr * h.decay, 0.0)?)?
            }
            None if s.decay => master = (&master * (1.0 - h.lr * h.decay))?,
            None => {}
        }
    }
    let m = ((&s.exp_avg * h.beta1)? + (g * (1.0 - h.beta1))?)?.detach();
    let v = ((&s.exp_avg_sq * h.beta2)? + (g.sqr()? * (1.0 - h.beta2))?)?.detach();
    let denom = ((v.sqrt()? / h.bc2.sqrt())? + h.eps)?;
    // Detached: state built from a parameter `Var` records the op, and each update would
    // otherwise chain onto the last, keeping every step's tensors alive.
    let master = (&master - (m.broadcast_div(&denom)? * (h.lr / h.bc1))?)?.detach();
    Ok((master, m, v))
}

/// The contiguous elements of a CPU storage viewed through `layout`.
fn cpu_slice<'a, T: candle_core::WithDType>(
    storage: &'a candle_core::Storage,
    layout: &Layout,
) -> Option<&'a [T]> {
    match (storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(s), Some((a, b))) => s.as_slice::<T>().ok().map(|v| &v[a..b]),
        _ => None,
    }
}

/// `f` of the contiguous f32 elements of a CPU tensor, read under its storage lock.
fn with_cpu_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    let (storage, layout) = t.storage_and_layout();
    cpu_slice(&storage, layout).map(f)
}

/// Whether a tensor is all of its CPU f32 storage (what an update in place may rewrite
/// without touching another tensor's view).
fn own_cpu_f32(t: &Tensor) -> bool {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => s
            .as_slice::<f32>()
            .is_ok_and(|v| layout.contiguous_offsets() == Some((0, v.len()))),
        _ => false,
    }
}

/// AdamW on CPU in place: the moments, then the master weights, are rewritten where they are
/// (three passes, split over the cores), from the gradient times `grad_scale`, so an update
/// holds no second copy of the state. A ZeRO-1/2 rank's state is one flat slice: a copy of it
/// was 12 bytes per element of the slice beside the state. False where it does not apply
/// (state not CPU f32); a state that is a view of a larger storage (a loaded checkpoint's) is
/// copied once into storage of its own first.
fn cpu_update_in_place(s: &mut ParamState, g: &Tensor, grad_scale: f64, h: Hyper) -> Result<bool> {
    let f32_cpu = |t: &Tensor| t.dtype() == DType::F32 && t.device().is_cpu();
    let mask_ok = s
        .decay_mask
        .as_ref()
        .is_none_or(|m| m.dtype() == DType::U8 && m.device().is_cpu());
    if ![&s.master, &s.exp_avg, &s.exp_avg_sq, g]
        .into_iter()
        .all(f32_cpu)
        || !mask_ok
    {
        return Ok(false);
    }
    for t in [&mut s.master, &mut s.exp_avg, &mut s.exp_avg_sq] {
        if !own_cpu_f32(t) {
            *t = t.force_contiguous()?.detach();
        }
    }
    let g = g.contiguous()?;
    let scale = grad_scale as f32;
    let (b1, b2) = (h.beta1 as f32, h.beta2 as f32);
    s.exp_avg.inplace_op2(
        &g,
        &Moment {
            beta: b1,
            scale,
            square: false,
        },
    )?;
    s.exp_avg_sq.inplace_op2(
        &g,
        &Moment {
            beta: b2,
            scale,
            square: true,
        },
    )?;
    let decay = match (&s.decay_mask, s.decay) {
        (None, false) => 0.0,
        _ => h.decay,
    };
    let mask = s.decay_mask.as_ref().map(|m| m.contiguous()).transpose()?;
    let step = MasterStep {
        mask,
        shrink: (h.lr * decay) as f32,
        step: (h.lr / h.bc1) as f32,
        inv_bc2: (1.0 / h.bc2.sqrt()) as f32,
        eps: h.eps as f32,
    };
    s.master.inplace_op3(&s.exp_avg, &s.exp_avg_sq, &step)?;
    Ok(true)
}

/// Elements per task of the in-place passes.
const CHUNK: usize = 1 << 16;

/// The contiguous f32 elements of a storage an in-place op rewrites (read-only inputs go
/// through `kernels::fused::slice`).
fn f32_slice_mut<'a>(
    s: &'a mut candle_core::CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (candle_core::CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("in-place AdamW: a contiguous f32 tensor was expected"),
    }
}

/// `m = beta m + (1 - beta) (scale g)` (squared with `square`), in place.
struct Moment {
    beta: f32,
    scale: f32,
    square: bool,
}

inplace_op!(Moment: InplaceOp2 [this] {
    name: "adamw-moment",
    cpu(m, ml, g, gl) {
        use rayon::prelude::*;
        let (m, g) = (f32_slice_mut(m, ml)?, slice::<f32>(g, gl)?);
        let (beta, scale, square) = (this.beta, this.scale, this.square);
        m.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .for_each(|(m, g)| {
                for (m, &g) in m.iter_mut().zip(g) {
                    let g = scale * g;
                    *m = beta * *m + (1.0 - beta) * if square { g * g } else { g };
                }
            });
        Ok(())
    }
});

/// `w = w (1 - shrink mask) - step m / (sqrt(v) / sqrt(bc2) + eps)`, in place.
struct MasterStep {
    mask: Option<Tensor>,
    shrink: f32,
    step: f32,
    inv_bc2: f32,
    eps: f32,
}

inplace_op!(MasterStep: InplaceOp3 [this] {
    name: "adamw-master",
    cpu(w, wl, m, ml, v, vl) {
        use rayon::prelude::*;
        let (w, m, v) = (
            f32_slice_mut(w, wl)?,
            slice::<f32>(m, ml)?,
            slice::<f32>(v, vl)?,
        );
        let mask_guard = this.mask.as_ref().map(|t| t.storage_and_layout());
        let mask = match &mask_guard {
            Some((storage, layout)) => match cpu_slice::<u8>(storage, layout) {
                Some(mask) => Some(mask),
                None => candle_core::bail!("in-place AdamW: the decay mask must be u8 on the CPU"),
            },
            None => None,
        };
        let (shrink, step, inv_bc2, eps) = (this.shrink, this.step, this.inv_bc2, this.eps);
        w.par_chunks_mut(CHUNK).enumerate().for_each(|(c, w)| {
            let at = c * CHUNK;
            for (i, w) in w.iter_mut().enumerate() {
                let j = at + i;
                let keep = 1.0 - shrink * mask.map_or(1.0, |mask| mask[j] as f32);
                *w = *w * keep - step * m[j] / (v[j].sqrt() * inv_bc2 + eps);
            }
        });
        Ok(())
    }
});

/// What [`cuda_update_in_place`] did.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum InPlace {
    /// Nothing: it does not apply here.
    No,
    /// Updated the master weights and moments.
    Master,
    /// And wrote the new weight into the model's parameter.
    MasterAndWeight,
}

/// AdamW on a GPU in one kernel pass, in place (`kernels::cuda_fused::adamw_in_place`, the same
/// arithmetic as [`cpu_update_in_place`]): the master weights and both moments are updated where they
/// are, from the gradient in its own dtype times `grad_scale`, and `weight` (the model's
/// parameter, when given and contiguous on the same GPU) receives the new value in the same
/// pass. `No` where it does not apply (state not f32 on a GPU, or the fused kernels turned
/// off); the caller then runs the CPU or op-chain update.
#[cfg(feature = "cuda")]
fn cuda_update_in_place(
    s: &mut ParamState,
    g: &Tensor,
    grad_scale: f64,
    weight: Option<&Tensor>,
    h: Hyper,
) -> Result<InPlace> {
    let state_f32 = [&s.master, &s.exp_avg, &s.exp_avg_sq]
        .into_iter()
        .all(|t| t.dtype() == DType::F32 && t.device().is_cuda())
        && s.decay_mask
            .as_ref()
            .is_none_or(|m| m.dtype() == DType::U8 && m.device().is_cuda());
    let float = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16);
    let grad_ok = g.device().is_cuda() && float(g);
    if !state_f32 || !grad_ok || !crate::kernels::cuda_fused::enabled() {
        return Ok(InPlace::No);
    }
    // In place needs storages of their own, contiguous: copies the first time if not (a
    // loaded checkpoint's views), after which they stay so.
    for t in [&mut s.master, &mut s.exp_avg, &mut s.exp_avg_sq] {
        if !t.is_contiguous() || t.layout().start_offset() != 0 {
            *t = t.force_contiguous()?;
        }
    }
    let weight = weight.filter(|w| {
        float(w)
            && w.is_contiguous()
            && w.device().same_device(s.master.device())
            && w.elem_count() == s.master.elem_count()
    });
    let decay = match (&s.decay_mask, s.decay) {
        (None, false) => 0.0,
        _ => h.decay,
    };
    let op = AdamWInPlace {
        moments: [&s.exp_avg, &s.exp_avg_sq],
        grad: g.contiguous()?,
        mask: s.decay_mask.as_ref().map(|m| m.contiguous()).transpose()?,
        weight,
        consts: crate::kernels::cuda_fused::AdamWConsts {
            grad_scale: grad_scale as f32,
            shrink: (h.lr * decay) as f32,
            beta1: h.beta1 as f32,
            beta2: h.beta2 as f32,
            step: (h.lr / h.bc1) as f32,
            inv_bc2: (1.0 / h.bc2.sqrt()) as f32,
            eps: h.eps as f32,
        },
    };
    s.master.inplace_op1(&op)?;
    Ok(match weight {
        Some(_) => InPlace::MasterAndWeight,
        None => InPlace::Master,
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_update_in_place(
    _: &mut ParamState,
    _: &Tensor,
    _: f64,
    _: Option<&Tensor>,
    _: Hyper,
) -> Result<InPlace> {
    Ok(InPlace::No)
}

/// The GPU AdamW as an in-place op on the master weights, with the moments (written in place
/// too), the gradient and the decay mask.
#[cfg(feature = "cuda")]
struct AdamWInPlace<'a> {
    moments: [&'a Tensor; 2],
    grad: Tensor,
    mask: Option<Tensor>,
    /// The model's parameter, written in the same pass (through its storage: the step owns
    /// the model between forward passes).
    weight: Option<&'a Tensor>,
    consts: crate::kernels::cuda_fused::AdamWConsts,
}

#[cfg(feature = "cuda")]
inplace_op!(AdamWInPlace<'_>: InplaceOp1 [this] {
    name: "adamw",
    cpu(_, _) {
        candle_core::bail!("the CUDA AdamW runs on GPUs (the CPU has its own pass)")
    }
    cuda(ws, wl) {
        let (m_guard, m_layout) = this.moments[0].storage_and_layout();
        let (v_guard, v_layout) = this.moments[1].storage_and_layout();
        let (g_guard, g_layout) = this.grad.storage_and_layout();
        let mask = this.mask.as_ref().map(|t| t.storage_and_layout());
        fn cuda(s: &candle_core::Storage) -> candle_core::Result<&candle_core::CudaStorage> {
            match s {
                candle_core::Storage::Cuda(c) => Ok(c),
                _ => candle_core::bail!("AdamW state must be on the GPU"),
            }
        }
        let mask = match &mask {
            Some((g, l)) => Some((cuda(g)?, *l)),
            None => None,
        };
        let weight = this.weight.map(|t| t.storage_and_layout());
        let weight = match &weight {
            Some((g, l)) => Some((cuda(g)?, *l)),
            None => None,
        };
        crate::kernels::cuda_fused::adamw_in_place(
            (ws, wl),
            [
                (cuda(&m_guard)?, m_layout),
                (cuda(&v_guard)?, v_layout),
                (cuda(&g_guard)?, g_layout),
            ],
            mask,
            weight,
            this.consts,
        )
    }
});

/// Sum of squares of all gradients (f64), so sharded callers can add theirs across ranks.
pub fn grad_norm_sq(grads: &BTreeMap<String, Tensor>) -> Result<f64> {
    Ok(sums_of_squares(grads.values())?.iter().sum())
}

/// The sum of the squares of each tensor's elements, computed in f32 where the tensors live
/// and added up in f64. The per-tensor sums are read back together: on a GPU that is one
/// synchronisation per step instead of one per parameter.
pub fn sums_of_squares<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<Vec<f64>> {
    let tensors: Vec<&Tensor> = tensors.into_iter().collect();
    // On CPU in f32: one pass per tensor, nothing allocated.
    let cpu: Option<Vec<f64>> = tensors
        .iter()
        .map(|t| with_cpu_f32(t, |v| v.iter().map(|x| (x * x) as f64).sum()))
        .collect();
    if let Some(sums) = cpu {
        return Ok(sums);
    }
    #[cfg(feature = "cuda")]
    if crate::kernels::cuda_fused::enabled()
        && tensors.iter().all(|t| {
            t.device().is_cuda()
                && t.device().same_device(tensors[0].device())
                && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        })
    {
        let sums = crate::kernels::cuda_fused::sums_of_squares(&tensors)?;
        return Ok(sums.into_iter().map(f64::from).collect());
    }
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
    let (norm, coef) = grad_clip_coef(grads, max_norm, norm_sq)?;
    if coef != 1.0 {
        for g in grads.values_mut() {
            *g = (&*g * coef)?;
        }
    }
    Ok(norm)
}

/// The gradient norm and the factor [`clip_grad_norm`] would scale the gradients by (1 when
/// no clipping applies), without scaling them: for [`AdamW::step_scaled`].
pub fn grad_clip_coef(
    grads: &BTreeMap<String, Tensor>,
    max_norm: f64,
    norm_sq: Option<f64>,
) -> Result<(f64, f64)> {
    let norm = match norm_sq {
        Some(sq) => sq.sqrt(),
        None => grad_norm_sq(grads)?.sqrt(),
    };
    Ok((norm, clip_coef(norm, max_norm)))
}

/// The factor PyTorch's clip_grad_norm_ scales gradients by at global norm `norm`:
/// max_norm / (norm + 1e-6) when that is below 1, else 1 (and 1 when `max_norm` is 0).
pub fn clip_coef(norm: f64, max_norm: f64) -> f64 {
    let coef = max_norm / (norm + 1e-6);
    match max_norm > 0.0 && coef < 1.0 {
        true => coef,
        false => 1.0,
    }
}

#[cfg(test)]
mod fused_tests {
    use super::*;
    use candle_core::Device;

    /// AdamW's constants at `step` (lr 1e-2, decay 0.1, betas 0.9 / 0.999).
    fn hyper(step: i32) -> Hyper {
        Hyper {
            lr: 1e-2,
            decay: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            bc1: 1.0 - 0.9f64.powi(step),
            bc2: 1.0 - 0.999f64.powi(step),
        }
    }

    /// The in-place CPU update equals the Candle-op chain (with decay, without, and with a
    /// flat shard's per-element mask) over several steps, and writes where the state is.
    #[test]
    fn cpu_update_in_place_equals_the_op_chain() {
        let dev = Device::Cpu;
        let n = 1000;
        let randn = |seed: f32| {
            (Tensor::arange(0f32, n as f32, &dev).unwrap() * (0.37 + seed as f64))
                .unwrap()
                .sin()
                .unwrap()
        };
        let mask = Tensor::from_vec(
            (0..n).map(|i| (i % 3 == 0) as u8).collect::<Vec<_>>(),
            n,
            &dev,
        )
        .unwrap();
        for (decay, decay_mask) in [(true, None), (false, None), (true, Some(mask))] {
            let mut s = ParamState {
                master: randn(0.0),
                exp_avg: randn(1.0).affine(0.01, 0.0).unwrap(),
                exp_avg_sq: randn(2.0).sqr().unwrap().affine(0.001, 0.0).unwrap(),
                decay,
                decay_mask,
            };
            // Copies: a clone would share the storages the in-place update rewrites.
            let mut reference = ParamState {
                master: s.master.copy().unwrap(),
                exp_avg: s.exp_avg.copy().unwrap(),
                exp_avg_sq: s.exp_avg_sq.copy().unwrap(),
                ..s.clone()
            };
            let master = s.master.clone();
            for step in 1..4 {
                let h = hyper(step);
                let g = randn(step as f32 + 3.0);
                // The clipping factor is folded into the in-place passes.
                let half = (&g * 2.0).unwrap();
                assert!(cpu_update_in_place(&mut s, &half, 0.5, h).unwrap());
                let (w, m, v) = chain_update(&reference, &g, h).unwrap();
                (reference.master, reference.exp_avg, reference.exp_avg_sq) = (w, m, v);
            }
            for (a, b) in [
                (&s.master, &reference.master),
                (&s.exp_avg, &reference.exp_avg),
                (&s.exp_avg_sq, &reference.exp_avg_sq),
            ] {
                let d = crate::kernels::testing::max_abs_diff(a, b);
                assert!(d < 1e-6, "decay {decay}: differs by {d}");
            }
            // Updated where it was: a tensor sharing the master's storage sees the new values.
            assert_eq!(
                crate::kernels::testing::max_abs_diff(&master, &s.master),
                0.0
            );
        }
    }

    /// A state that views part of a larger storage (as a loaded checkpoint's can) gets its own
    /// storage before the first update: what it viewed is left as it was.
    #[test]
    fn cpu_update_in_place_leaves_a_viewed_storage_alone() {
        let dev = Device::Cpu;
        let whole = Tensor::arange(0f32, 30.0, &dev)
            .unwrap()
            .affine(0.1, 0.0)
            .unwrap();
        let before = whole.copy().unwrap();
        let view = |i: usize| whole.narrow(0, 10 * i, 10).unwrap();
        let mut s = ParamState {
            master: view(0),
            exp_avg: view(1),
            exp_avg_sq: view(2),
            decay: true,
            decay_mask: None,
        };
        let h = hyper(1);
        let g = Tensor::ones(10, DType::F32, &dev).unwrap();
        let (w, m, v) = chain_update(&s, &g, h).unwrap();
        assert!(cpu_update_in_place(&mut s, &g, 1.0, h).unwrap());
        assert_eq!(crate::kernels::testing::max_abs_diff(&whole, &before), 0.0);
        for (a, b) in [(&s.master, &w), (&s.exp_avg, &m), (&s.exp_avg_sq, &v)] {
            assert!(crate::kernels::testing::max_abs_diff(a, b) < 1e-6);
        }
    }
}
