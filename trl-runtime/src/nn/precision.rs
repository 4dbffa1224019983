//! Mixed precision inside the layers: matmuls run in the activations' dtype (bf16 on tensor
//! cores), while softmax, norms, losses and every sum over blocks, tiles or ring hops run in a
//! wider one, as transformers and FlashAttention's kernels do.

use candle_core::{DType, Result, Tensor};

/// The dtype of softmax, statistics and sums for activations of `dtype`: f32, or f64 for f64.
pub(crate) fn wide(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Adds `t`, cast to `wide`, into the running sum `slot` (bf16 partial sums would drop the
/// small terms).
pub(crate) fn accumulate(slot: &mut Option<Tensor>, t: Tensor, wide: DType) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(prev) = slot.as_ref() {
        // On a GPU the f32 sum grows in place, reading `t` as it is: no cast, no new buffer.
        if wide == DType::F32
            && prev.dtype() == DType::F32
            && prev.device().is_cuda()
            && prev.is_contiguous()
            && super::cuda_fused::enabled()
            && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        {
            return prev.inplace_op2(&t.contiguous()?, &AddInto);
        }
    }
    // A sum that may later grow in place must own its buffer: `t` already in `wide` could
    // share the caller's.
    let fresh = t.device().is_cuda() && t.dtype() == wide && slot.is_none();
    let t = if fresh { t.copy()? } else { t.to_dtype(wide)? };
    *slot = Some(match slot.take() {
        Some(prev) => (prev + t)?,
        None => t,
    });
    Ok(())
}

/// Adds `a^T b` (`a` [k, m], `b` [k, n]) into the f32 running sum `slot` ([m, n]). On a GPU
/// one GEMM accumulating into the sum (`TRL_FUSED_CUDA=0`: the product, then [`accumulate`]).
pub(crate) fn accumulate_product(slot: &mut Option<Tensor>, a: &Tensor, b: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if a.device().is_cuda()
        && super::cuda_fused::enabled()
        && a.dtype() == b.dtype()
        && matches!(a.dtype(), DType::F32 | DType::BF16 | DType::F16)
    {
        let (m, n) = (a.dim(1)?, b.dim(1)?);
        if slot.is_none() {
            *slot = Some(Tensor::zeros((m, n), DType::F32, a.device())?);
        }
        if let Some(acc) = slot
            .as_ref()
            .filter(|t| t.dtype() == DType::F32 && t.is_contiguous())
        {
            return acc.inplace_op3(&a.contiguous()?, &b.contiguous()?, &AddProductT);
        }
    }
    accumulate(slot, a.t()?.matmul(b)?, DType::F32)
}

/// `acc += a^T b` in place on a GPU (see [`accumulate_product`]).
#[cfg(feature = "cuda")]
struct AddProductT;

#[cfg(feature = "cuda")]
impl candle_core::InplaceOp3 for AddProductT {
    fn name(&self) -> &'static str {
        "add-product-t"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<()> {
        candle_core::bail!("add-product-t runs on GPUs")
    }

    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        al: &candle_core::Layout,
        a: &candle_core::CudaStorage,
        a_l: &candle_core::Layout,
        b: &candle_core::CudaStorage,
        bl: &candle_core::Layout,
    ) -> Result<()> {
        super::cuda_fused::add_product_t((acc, al), (a, a_l), (b, bl))
    }
}

/// `acc += x` in place on a GPU (acc f32; the running sums above, which only they hold).
#[cfg(feature = "cuda")]
struct AddInto;

#[cfg(feature = "cuda")]
impl candle_core::InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<()> {
        candle_core::bail!("add-into runs on GPUs")
    }

    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        al: &candle_core::Layout,
        x: &candle_core::CudaStorage,
        xl: &candle_core::Layout,
    ) -> Result<()> {
        super::cuda_fused::add_into((acc, al), (x, xl))
    }
}
