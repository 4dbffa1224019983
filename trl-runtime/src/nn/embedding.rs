//! Token embedding: rows of a [vocab, hidden] table. A drop-in for `candle_nn::Embedding` that
//! can also be vocab-parallel (each rank holds a slice of the rows; see [`crate::tp`]).

use super::module::{child_name, Parallelize, Split, TpContext, TpLayer, TpStyle, VocabParallel};
use super::sharded;
use super::Weight;
use crate::comm::autograd::reduce_from_group;
use crate::comm::Communicator;
use crate::error::Result as TrlResult;
use candle_core::{DType, Result, Tensor};
use std::sync::Arc;

#[derive(Clone)]
pub struct Embedding {
    pub weight: Weight,
    /// The group the rows are split over (vocab-parallel), once split.
    tp: Option<Arc<dyn Communicator>>,
}

impl Embedding {
    /// As `candle_nn::Embedding::new`: a [vocab, hidden_size] table.
    pub fn new(embeddings: Tensor, hidden_size: usize) -> Self {
        debug_assert_eq!(embeddings.dims().last(), Some(&hidden_size));
        Self::from_weight(Weight::Local(embeddings))
    }

    pub fn from_weight(weight: Weight) -> Self {
        Embedding { weight, tp: None }
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
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        rows.reshape(dims)
    }

    fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        match &self.weight {
            #[cfg(feature = "cuda")]
            Weight::Local(w) if gpu_lookup_applies(w) => {
                w.contiguous()?.apply_op2(&ids.contiguous()?, GpuLookup)
            }
            Weight::Local(w) => w.index_select(ids, 0),
            Weight::Sharded(w) => sharded::embedding(ids, w),
        }
    }
}

/// On a GPU the lookup's backward is a scatter-add with atomics into an f32 table (Candle's
/// index_add walks the ids one after another per column: 9.5 ms for 16k tokens of Qwen2's
/// table on an H100).
#[cfg(feature = "cuda")]
fn gpu_lookup_applies(w: &Tensor) -> bool {
    w.device().is_cuda()
        && super::cuda_fused::enabled()
        && matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && w.rank() == 2
}

/// Rows of the table at the ids, with the scatter-add backward (see [`gpu_lookup_applies`]).
#[cfg(feature = "cuda")]
struct GpuLookup;

#[cfg(feature = "cuda")]
impl candle_core::CustomOp2 for GpuLookup {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("the GPU embedding lookup runs on GPUs")
    }

    fn cuda_fwd(
        &self,
        w: &candle_core::CudaStorage,
        wl: &candle_core::Layout,
        ids: &candle_core::CudaStorage,
        il: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        super::cuda_fused::embedding_fwd((w, wl), (ids, il))
    }

    fn bwd(
        &self,
        w: &Tensor,
        ids: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let vocab = w.dim(0)?;
        let dw = grad
            .contiguous()?
            .apply_op2_no_bwd(&ids.contiguous()?, &GpuLookupGrad { vocab })?;
        Ok((Some(dw), None))
    }
}

#[cfg(feature = "cuda")]
struct GpuLookupGrad {
    vocab: usize,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp2 for GpuLookupGrad {
    fn name(&self) -> &'static str {
        "embedding-grad"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("the GPU embedding gradient runs on GPUs")
    }

    fn cuda_fwd(
        &self,
        dy: &candle_core::CudaStorage,
        dl: &candle_core::Layout,
        ids: &candle_core::CudaStorage,
        il: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        super::cuda_fused::embedding_bwd((dy, dl), (ids, il), self.vocab)
    }
}

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
        self.weight = Weight::Local(tp.shard(&weight_name, w, 0)?);
        self.tp = Some(tp.comm().clone());
        Ok(())
    }

    fn visit_split(&self, name: &str, style: TpStyle, f: &mut dyn FnMut(&str, &Tensor, Split)) {
        if let Weight::Local(w) = &self.weight {
            let dim = (style == TpStyle::Vocab).then_some(0);
            f(&child_name(name, "weight"), w, Split { style, dim });
        }
    }
}

impl VocabParallel for Embedding {}

impl Parallelize for Embedding {
    fn visit_params(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor, Split)) {
        self.visit_split(name, TpStyle::Replicate, f)
    }
    fn visit_weights_mut(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&str, &mut Weight) -> TrlResult<()>,
    ) -> TrlResult<()> {
        f(&child_name(name, "weight"), &mut self.weight)
    }
}

/// As `candle_nn::embedding`: a [vocab, hidden] table from `vb`.
pub fn embedding(vocab: usize, hidden: usize, vb: candle_nn::VarBuilder) -> Result<Embedding> {
    let e = candle_nn::embedding(vocab, hidden, vb)?;
    Ok(Embedding::new(e.embeddings().clone(), hidden))
}
