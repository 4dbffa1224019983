//! Mixed precision inside the layers: matmuls run in the activations' dtype (bf16 on tensor
//! cores), while softmax, norms, losses and every sum over blocks, tiles or ring hops run in a
//! wider one, as transformers and FlashAttention's kernels do.

use super::cpu_gemm::{mm_with, Mat};
use super::op::inplace_op;
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

/// Adds `a^T b` (`a` [k, m], `b` [k, n]) into the f32 running sum `slot` ([m, n]): one GEMM
/// accumulating into the sum, on the CPU (f32) and on a GPU (f32, bf16, f16; cuBLAS with
/// beta = 1), so no [m, n] product is allocated and no pass adds it. Elsewhere (or with
/// `TRL_FUSED_CUDA=0`) the product, then [`accumulate`].
pub(crate) fn accumulate_product(slot: &mut Option<Tensor>, a: &Tensor, b: &Tensor) -> Result<()> {
    let dtype = a.dtype();
    let dev = a.device();
    let in_place = b.dtype() == dtype
        && b.device().same_device(dev)
        && a.rank() == 2
        && b.rank() == 2
        && ((dev.is_cpu() && dtype == DType::F32)
            || (dev.is_cuda()
                && cuda_fused_on()
                && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)));
    if in_place {
        if slot.is_none() {
            *slot = Some(Tensor::zeros((a.dim(1)?, b.dim(1)?), DType::F32, dev)?);
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

/// `acc += a^T b` in place (see [`accumulate_product`]).
struct AddProductT;

inplace_op!(AddProductT: InplaceOp3 [this] {
    name: "add-product-t",
    cpu(acc, al, a, a_l, b, bl) {
        use candle_core::CpuStorage::F32;
        let (F32(acc), F32(a), F32(b)) = (acc, a, b) else {
            candle_core::bail!("add-product-t on the CPU takes f32")
        };
        let (Some((c0, c1)), Some((a0, a1)), Some((b0, b1))) = (
            al.contiguous_offsets(),
            a_l.contiguous_offsets(),
            bl.contiguous_offsets(),
        ) else {
            candle_core::bail!("add-product-t: contiguous inputs expected")
        };
        let (k, m) = a_l.shape().dims2()?;
        let (kb, n) = bl.shape().dims2()?;
        let (acc, a, b) = (&mut acc[c0..c1], &a[a0..a1], &b[b0..b1]);
        if kb != k || acc.len() != m * n {
            candle_core::bail!("add-product-t: [{m}, {n}] += [{k}, {m}]^T x [{kb}, {n}]");
        }
        let parallelism = match rayon::current_num_threads() {
            1 => gemm::Parallelism::None,
            t => gemm::Parallelism::Rayon(t),
        };
        // acc (row-major [m, n]) += a^T (a as stored, transposed) x b.
        let (a_t, b) = (Mat::transposed(a, m), Mat::rows(b, n));
        mm_with(parallelism, (m, n, k), (acc, n), (a_t, b), 1.0, true);
        Ok(())
    }
    cuda(acc, al, a, a_l, b, bl) {
        super::cuda_fused::add_product_t((acc, al), (a, a_l), (b, bl))
    }
});

/// `acc += x` in place on a GPU (acc f32; the running sums above, which only they hold).
#[cfg(feature = "cuda")]
struct AddInto;

#[cfg(feature = "cuda")]
inplace_op!(AddInto: InplaceOp2 [this] {
    name: "add-into",
    cpu(_, _, _, _) {
        candle_core::bail!("add-into runs on GPUs")
    }
    cuda(acc, al, x, xl) {
        super::cuda_fused::add_into((acc, al), (x, xl))
    }
});

/// Whether the fused CUDA kernels are built (feature `cuda`) and switched on.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_fused_on() -> bool {
    super::cuda_fused::enabled()
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda_fused_on() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Two products summed in place on the CPU equal the matmuls added in f32.
    #[test]
    fn products_add_into_the_sum_in_place() {
        let dev = Device::Cpu;
        let draw = |shape: (usize, usize)| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        let (a1, b1, a2, b2) = (draw((37, 5)), draw((37, 7)), draw((19, 5)), draw((19, 7)));
        let mut slot = None;
        accumulate_product(&mut slot, &a1, &b1).unwrap();
        let first = slot.as_ref().unwrap().clone();
        accumulate_product(&mut slot, &a2, &b2).unwrap();
        let sum = slot.unwrap();
        let want =
            (a1.t().unwrap().matmul(&b1).unwrap() + a2.t().unwrap().matmul(&b2).unwrap()).unwrap();
        let diff = (&sum - &want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-4);
        // The sum grew in place: the tensor taken after the first product sees the second.
        let diff = (&first - &sum).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    }
}
