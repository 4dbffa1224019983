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
    let t = t.to_dtype(wide)?;
    *slot = Some(match slot.take() {
        Some(prev) => (prev + t)?,
        None => t,
    });
    Ok(())
}
