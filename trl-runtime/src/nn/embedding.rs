//! Token embedding: rows of a [vocab, hidden] table. A drop-in for `candle_nn::Embedding` that
//! can also be vocab-parallel (each rank holds a slice of the rows; see [`crate::tp`]).

use super::embedding_adapter::EmbeddingAdapter;
use super::lora::{Lora, LoraConfig};
use super::module::{
    child_name, Parallelize, Sections, Split, TpContext, TpLayer, TpStyle, VocabParallel,
};
use super::module::{LinearFn, LoraTarget, ParamFn, WeightFn};
use super::sharded;
use super::Weight;
use crate::comm::autograd::reduce_from_group;
use crate::comm::Communicator;
use crate::error::Result as TrlResult;
use crate::kernels::op::inplace_op;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, TensorId};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

thread_local! {
    /// NEFTune's (noise alpha, key) while a training forward runs on this thread.
    static NEFTUNE: std::cell::Cell<Option<(f64, u64)>> = const { std::cell::Cell::new(None) };
}

/// Keeps NEFTune's draws apart from LoRA dropout's under the same key.
const NEFTUNE_SALT: u64 = 0x4E45_4654_554E_4500;

/// Runs `f` (a training forward) with NEFTune (transformers' `neftune_noise_alpha`): every
/// embedding lookup's [batch, seq, hidden] output gets uniform noise in
/// ±alpha / sqrt(seq x hidden), drawn from `key` and the element's index, so that ranks holding
/// the same rows (tensor parallelism) add the same noise. `None`: no noise.
pub fn with_neftune<T>(noise: Option<(f64, u64)>, f: impl FnOnce() -> T) -> T {
    let before = NEFTUNE.with(|n| n.replace(noise));
    let out = f();
    NEFTUNE.with(|n| n.set(before));
    out
}

#[derive(Clone)]
pub struct Embedding {
    pub weight: Weight,
    /// A LoRA or trainable-tokens adapter on the (then frozen) table
    /// ([`super::embedding_adapter`]).
    pub adapter: Option<EmbeddingAdapter>,
    /// The group the rows are split over (vocab-parallel), once split.
    tp: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for Embedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedding")
            .field("weight", &self.weight)
            .field("adapter", &self.adapter)
            .field("vocab_parallel", &self.tp.as_ref().map(|c| c.size()))
            .finish()
    }
}

impl Embedding {
    /// As `candle_nn::Embedding::new`: a [vocab, hidden_size] table.
    pub fn new(embeddings: Tensor, hidden_size: usize) -> Self {
        debug_assert_eq!(embeddings.dims().last(), Some(&hidden_size));
        Self::from_weight(Weight::Local(embeddings))
    }

    pub fn from_weight(weight: Weight) -> Self {
        Embedding {
            weight,
            adapter: None,
            tp: None,
        }
    }

    /// The table, as `candle_nn::Embedding::embeddings` (to tie an LM head to it:
    /// `Linear::new(embed.embeddings().clone(), None)` builds the same with both crates).
    pub fn embeddings(&self) -> &Weight {
        &self.weight
    }

    /// `ids` [..] (any integer dtype) -> [.., hidden].
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let flat = ids.flatten_all()?.to_dtype(DType::U32)?;
        let hidden = self.weight.dims()[1];
        let rows = match &self.tp {
            None => self.lookup(&flat)?,
            Some(comm) => {
                // Ids outside this rank's rows look up row 0 and are zeroed; the sum over the
                // group then holds every id's row exactly once.
                let local = self.weight.dims()[0] as i64;
                let start = comm.rank() as i64 * local;
                let shifted = flat
                    .to_dtype(DType::I64)?
                    .broadcast_sub(&Tensor::new(start, flat.device())?)?;
                let here = (shifted.ge(0i64)? * shifted.lt(local)?)?;
                let index = here
                    .where_cond(&shifted, &shifted.zeros_like()?)?
                    .to_dtype(DType::U32)?;
                let rows = self.lookup(&index)?;
                let here = here.to_dtype(rows.dtype())?.unsqueeze(1)?;
                reduce_from_group(&rows.broadcast_mul(&here)?, comm).map_err(|e| e.into_candle())?
            }
        };
        let rows = match &self.adapter {
            Some(adapter) => adapter.rows(&flat, &rows)?,
            None => rows,
        };
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        let out = rows.reshape(dims)?;
        match NEFTUNE.with(|n| n.get()) {
            // transformers' NEFTune hook: uniform noise of alpha / sqrt(seq x hidden).
            Some((alpha, key)) if out.rank() == 3 => {
                let (_, seq, hidden) = out.dims3()?;
                let mag = alpha / ((seq * hidden) as f64).sqrt();
                crate::kernels::fused::add_uniform_noise(&out, key ^ NEFTUNE_SALT, mag)
            }
            _ => Ok(out),
        }
    }

    fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        match &self.weight {
            Weight::Local(w) => {
                // A vocab-parallel slice is not the (whole) head's table.
                let tied = self.tp.is_none().then(|| TiedGrad::claim(w)).flatten();
                if tied.is_none() && !gpu_lookup_applies(w) {
                    return w.index_select(ids, 0);
                }
                let tied = tied.unwrap_or_default();
                w.contiguous()?
                    .apply_op2(&ids.contiguous()?, Lookup { tied })
            }
            Weight::Sharded(w) => sharded::embedding(ids, w),
        }
    }
}

/// Whether the lookup runs as [`Lookup`] on a GPU: its backward is a scatter-add with atomics
/// (Candle's index_add walks the ids one after another per column: 9.5 ms for 16k tokens of
/// Qwen2's table on an H100).
#[cfg(feature = "cuda")]
fn gpu_lookup_applies(w: &Tensor) -> bool {
    w.device().is_cuda()
        && crate::kernels::cuda_fused::enabled()
        && matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && w.rank() == 2
}

#[cfg(not(feature = "cuda"))]
fn gpu_lookup_applies(_: &Tensor) -> bool {
    false
}

/// The gradient of a table that is also the LM head, which the fused loss computes during
/// forward: the lookup's backward adds its rows into it in place. Otherwise the lookup makes a
/// second [vocab, hidden] gradient and the autograd a third, their sum, at the end of the
/// backward, when every other gradient is held (2 x 272 MB of Qwen2's table in bf16, 3 x 544 MB
/// in f32 on the CPU).
///
/// [`crate::parallel::Model`] opens a [`TieScope`] around the forward; the first lookup of
/// that same table on this thread takes the slot. The loss's backward (run first) puts its
/// scaled gradient in, the lookup's backward takes it out; a gradient left in (a lookup whose
/// backward did not run) is added by the model after the backward.
#[derive(Clone, Default)]
pub(crate) struct TiedGrad(Arc<TiedInner>);

#[derive(Default)]
struct TiedInner {
    grad: Mutex<Option<Tensor>>,
    claimed: AtomicBool,
}

thread_local! {
    /// The open scope: the head's weight and the slot its lookup takes.
    static SCOPE: RefCell<Option<(TensorId, TiedGrad)>> = const { RefCell::new(None) };
}

/// Closes the scope when dropped.
pub(crate) struct TieScope(());

impl Drop for TieScope {
    fn drop(&mut self) {
        SCOPE.with(|s| s.borrow_mut().take());
    }
}

impl TiedGrad {
    /// Until the guard drops, the first lookup of `weight` on this thread takes this slot.
    pub(crate) fn scope(&self, weight: &Tensor) -> TieScope {
        SCOPE.with(|s| *s.borrow_mut() = Some((weight.id(), self.clone())));
        TieScope(())
    }

    /// Whether a lookup took the slot.
    pub(crate) fn claimed(&self) -> bool {
        self.0.claimed.load(Ordering::Acquire)
    }

    pub(crate) fn put(&self, grad: Tensor) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = Some(grad);
    }

    pub(crate) fn take(&self) -> Option<Tensor> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The open scope's slot, for a lookup of `w` (the scope's table) that will have a
    /// backward and whose gradient can be added in place (CPU; a GPU where the kernels run).
    fn claim(w: &Tensor) -> Option<TiedGrad> {
        let in_place = w.device().is_cpu() || gpu_lookup_applies(w);
        if !in_place || !w.track_op() || w.rank() != 2 {
            return None;
        }
        SCOPE.with(|s| {
            let scope = s.borrow();
            let (_, tied) = scope.as_ref().filter(|(id, _)| *id == w.id())?;
            let first = !tied.0.claimed.swap(true, Ordering::AcqRel);
            first.then(|| tied.clone())
        })
    }
}

/// Rows of the table at the ids; backward, the rows' gradients added in place into the tied
/// head's gradient, or into zeros when there is none (see [`TiedGrad`]). The lookup on GPUs,
/// and on the CPU for a tied table.
struct Lookup {
    tied: TiedGrad,
}

impl candle_core::CustomOp2 for Lookup {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        w: &CpuStorage,
        wl: &Layout,
        ids: &CpuStorage,
        il: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let hidden = wl.shape().dims2()?.1;
        let rows = w.index_select(ids, wl, il, 0)?;
        Ok((rows, Shape::from((il.shape().elem_count(), hidden))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        ids: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda_fused::embedding_fwd((w, wl), (ids, il))
    }

    fn bwd(
        &self,
        w: &Tensor,
        ids: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let acc = match self.tied.take() {
            Some(g) if g.dims() == w.dims() && g.dtype() == w.dtype() && g.is_contiguous() => g,
            Some(_) => candle_core::bail!("tied embedding: the head's gradient does not match"),
            None => w.zeros_like()?,
        };
        acc.inplace_op3(&grad.contiguous()?, &ids.contiguous()?, &AddRows)?;
        Ok((Some(acc), None))
    }
}

/// `acc[ids[t], :] += dy[t, :]` in place (repeated ids add up).
struct AddRows;

inplace_op!(AddRows: InplaceOp3 [this] {
    name: "embedding-add-rows",
    cpu(acc, al, dy, dl, ids, il) {
        let (vocab, hidden) = al.shape().dims2()?;
        let (Some((a0, a1)), Some((d0, d1)), Some((i0, i1))) = (
            al.contiguous_offsets(),
            dl.contiguous_offsets(),
            il.contiguous_offsets(),
        ) else {
            candle_core::bail!("embedding-add-rows: contiguous inputs expected")
        };
        let CpuStorage::U32(ids) = ids else {
            candle_core::bail!("embedding-add-rows: u32 ids expected")
        };
        let ids = &ids[i0..i1];
        if d1 - d0 != ids.len() * hidden || ids.iter().any(|&i| i as usize >= vocab) {
            candle_core::bail!(
                "embedding-add-rows: {} ids for [{}, {hidden}] rows",
                ids.len(),
                (d1 - d0) / hidden.max(1)
            )
        }
        fn add<T: Copy>(
            acc: &mut [T],
            dy: &[T],
            ids: &[u32],
            hidden: usize,
            f: impl Fn(T, T) -> T,
        ) {
            for (t, &i) in ids.iter().enumerate() {
                let row = &mut acc[i as usize * hidden..(i as usize + 1) * hidden];
                for (a, &d) in row.iter_mut().zip(&dy[t * hidden..(t + 1) * hidden]) {
                    *a = f(*a, d);
                }
            }
        }
        match (acc, dy) {
            (CpuStorage::F32(a), CpuStorage::F32(d)) => {
                add(&mut a[a0..a1], &d[d0..d1], ids, hidden, |a, d| a + d)
            }
            (CpuStorage::F64(a), CpuStorage::F64(d)) => {
                add(&mut a[a0..a1], &d[d0..d1], ids, hidden, |a, d| a + d)
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(d)) => {
                add(&mut a[a0..a1], &d[d0..d1], ids, hidden, |a, d| {
                    half::bf16::from_f32(a.to_f32() + d.to_f32())
                })
            }
            (CpuStorage::F16(a), CpuStorage::F16(d)) => {
                add(&mut a[a0..a1], &d[d0..d1], ids, hidden, |a, d| {
                    half::f16::from_f32(a.to_f32() + d.to_f32())
                })
            }
            (a, d) => candle_core::bail!(
                "embedding-add-rows: {:?} rows into a {:?} table",
                d.dtype(),
                a.dtype()
            ),
        }
        Ok(())
    }
    cuda(acc, al, dy, dl, ids, il) {
        crate::kernels::cuda_fused::embedding_add_rows((acc, al), (dy, dl), (ids, il))
    }
});

impl candle_core::Module for Embedding {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Embedding::forward(self, x)
    }
}

impl TpLayer for Embedding {
    fn shard(&mut self, name: &str, style: TpStyle, tp: &TpContext) -> TrlResult<()> {
        let weight_name = child_name(name, "weight");
        let Weight::Local(w) = &self.weight else {
            return Err(crate::Error::TensorParallel {
                name: weight_name,
                message: "already sharded by FSDP: split tensor-parallel layers before wrapping"
                    .into(),
            });
        };
        if style != TpStyle::Vocab {
            return Err(crate::Error::TensorParallel {
                name: weight_name,
                message: format!(
                    "an embedding can only be vocab-parallel, not {}",
                    style.name()
                ),
            });
        }
        self.weight = Weight::Local(tp.shard(&weight_name, w, 0, Sections::WHOLE)?);
        self.tp = Some(tp.comm().clone());
        Ok(())
    }

    fn visit_split(&self, name: &str, style: TpStyle, f: &mut ParamFn) {
        if let Weight::Local(w) = &self.weight {
            let dim = (style == TpStyle::Vocab).then_some(0);
            f(&child_name(name, "weight"), w, Split::on(style, dim));
        }
        // Adapters are refused on a vocab-parallel table: whole on every rank.
        if let Some(adapter) = &self.adapter {
            for (part, t) in adapter.tensors() {
                f(&child_name(name, part), t, Split::REPLICATED);
            }
        }
    }
}

impl VocabParallel for Embedding {}

impl Parallelize for Embedding {
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        self.visit_split(name, TpStyle::Replicate, f)
    }
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> TrlResult<()> {
        f(&child_name(name, "weight"), &mut self.weight)
    }
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> TrlResult<()> {
        f(name, self)
    }
}

/// An embedding takes LoRA as peft's `lora.Embedding` and trainable tokens; its table is
/// frozen then.
impl LoraTarget for Embedding {
    fn add_lora(&mut self, name: &str, config: &LoraConfig) -> TrlResult<()> {
        let table = self.whole_table(name)?;
        if config.dora {
            return Err(crate::Error::config(
                "training arguments",
                "use_dora",
                format!("{name} is an embedding: DoRA on embeddings is not implemented here (adapt it without use_dora, or leave it out of lora_target_modules)"),
            ));
        }
        let dims = table.dims2()?;
        self.adapter = Some(EmbeddingAdapter::lora(
            name,
            dims,
            config,
            (table.dtype(), table.device()),
        )?);
        self.weight = Weight::Local(table.detach());
        Ok(())
    }
    fn lora_mut(&mut self) -> Option<&mut Lora> {
        None
    }
    fn is_embedding(&self) -> bool {
        true
    }
    fn weight_id(&self) -> Option<TensorId> {
        match &self.weight {
            Weight::Local(w) => Some(w.id()),
            Weight::Sharded(_) => None,
        }
    }
    fn add_tokens(&mut self, name: &str, indices: &[u32]) -> TrlResult<()> {
        let table = self.whole_table(name)?;
        self.adapter = Some(EmbeddingAdapter::tokens(&table, indices)?);
        self.weight = Weight::Local(table.detach());
        Ok(())
    }
    fn table_adapter(&self) -> Option<&EmbeddingAdapter> {
        self.adapter.as_ref()
    }
}

impl Embedding {
    /// The whole table, for an adapter: refused once vocab-parallel or sharded.
    fn whole_table(&self, name: &str) -> TrlResult<Tensor> {
        match (&self.weight, &self.tp) {
            (Weight::Local(w), None) => Ok(w.clone()),
            (_, Some(_)) => Err(crate::Error::TensorParallel {
                name: name.into(),
                message: "adapters on a vocab-parallel embedding (LoRA, trainable tokens) are not implemented: train it without tensor parallelism, or leave the embedding out of lora_target_modules / trainable_token_indices".into(),
            }),
            _ => Err(crate::Error::Parallelism(format!(
                "{name}: add adapters before sharding the model for ZeRO-3 / FSDP"
            ))),
        }
    }
}

/// As `candle_nn::embedding`: a [vocab, hidden] table from `vb`.
pub fn embedding(vocab: usize, hidden: usize, vb: candle_nn::VarBuilder) -> Result<Embedding> {
    let e = candle_nn::embedding(vocab, hidden, vb)?;
    Ok(Embedding::new(e.embeddings().clone(), hidden))
}
