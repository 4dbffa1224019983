//! Fused causal softmax for attention scores on CPU, with its backward.
//!
//! Row i of a sequence may attend to keys [start_i, i]: causal, and cut at the start of its
//! document. The fused op reads only that range (the masked half of the scores is never
//! exponentiated) and writes zeros elsewhere; backward is y * (g - <g, y>) over the same range.
//! It replaces an additive mask plus the max/sub/exp/sum/div chain and their backward passes.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// For every (batch, query row): the first key it may see. Keys up to the row itself (offset
/// by `key_offset` when queries are the tail of the keys) are visible.
#[derive(Debug, Clone)]
pub struct RowRanges {
    pub batch: usize,
    pub rows: usize,
    pub starts: Arc<Vec<u32>>,
}

struct CausalSoftmax {
    ranges: RowRanges,
}

struct CausalSoftmaxGrad {
    ranges: RowRanges,
}

/// (rows, cols, heads per batch) of a contiguous [batch, heads.., rows, cols] layout.
fn geometry(l: &Layout, r: &RowRanges) -> Result<Geometry> {
    let dims = l.dims();
    let n = dims.len();
    if n < 3 || dims[0] != r.batch || dims[n - 2] != r.rows {
        candle_core::bail!(
            "causal softmax: scores {dims:?} do not match {} rows of batch {}",
            r.rows,
            r.batch
        );
    }
    let heads = dims[1..n - 2].iter().product();
    Ok((dims[n - 2], dims[n - 1], heads))
}

fn slice<'a, T>(v: &'a [T], l: &Layout) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("causal softmax needs contiguous input"),
    }
}

/// The element types the fused softmax runs in (f32, f64).
trait Real: candle_core::WithDType + std::iter::Sum {
    const NEG_INFINITY: Self;
    fn exp(self) -> Self;
    fn max(self, other: Self) -> Self;
}

macro_rules! real {
    ($($t:ident),*) => {$(
        impl Real for $t {
            const NEG_INFINITY: Self = $t::NEG_INFINITY;
            fn exp(self) -> Self {
                $t::exp(self)
            }
            fn max(self, other: Self) -> Self {
                $t::max(self, other)
            }
        }
    )*};
}
real!(f32, f64);

/// (rows, cols, heads per batch), as [`geometry`] gives them.
type Geometry = (usize, usize, usize);

fn forward_rows<T: Real>(x: &[T], r: &RowRanges, (rows, cols, heads): Geometry) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    for (block, (xs, ys)) in x
        .chunks_exact(rows * cols)
        .zip(out.chunks_exact_mut(rows * cols))
        .enumerate()
    {
        let b = block / heads;
        for i in 0..rows {
            let start = r.starts[b * rows + i] as usize;
            let end = i + 1 + (cols - rows);
            let (x, y) = (
                &xs[i * cols + start..i * cols + end],
                &mut ys[i * cols + start..i * cols + end],
            );
            let max = x.iter().copied().fold(T::NEG_INFINITY, <T as Real>::max);
            let mut sum = T::zero();
            for (yv, xv) in y.iter_mut().zip(x) {
                *yv = (*xv - max).exp();
                sum += *yv;
            }
            let inv = T::one() / sum;
            y.iter_mut().for_each(|v| *v *= inv);
        }
    }
    out
}

fn backward_rows<T: Real>(
    y: &[T],
    g: &[T],
    r: &RowRanges,
    (rows, cols, heads): Geometry,
) -> Vec<T> {
    let mut out = vec![T::zero(); y.len()];
    let blocks = y
        .chunks_exact(rows * cols)
        .zip(g.chunks_exact(rows * cols))
        .zip(out.chunks_exact_mut(rows * cols));
    for (block, ((ys, gs), dx)) in blocks.enumerate() {
        let b = block / heads;
        for i in 0..rows {
            let start = r.starts[b * rows + i] as usize;
            let range = i * cols + start..i * cols + i + 1 + (cols - rows);
            let (y, g, d) = (&ys[range.clone()], &gs[range.clone()], &mut dx[range]);
            let dot: T = y.iter().zip(g).map(|(a, b)| *a * *b).sum();
            for ((dv, yv), gv) in d.iter_mut().zip(y).zip(g) {
                *dv = *yv * (*gv - dot);
            }
        }
    }
    out
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (r, geo) = (&self.ranges, geometry(l, &self.ranges)?);
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(forward_rows(slice(v, l)?, r, geo)),
            CpuStorage::F64(v) => CpuStorage::F64(forward_rows(slice(v, l)?, r, geo)),
            _ => candle_core::bail!("causal softmax: only f32 and f64 run fused"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = CausalSoftmaxGrad {
            ranges: self.ranges.clone(),
        };
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &op)?))
    }
}

impl CustomOp2 for CausalSoftmaxGrad {
    fn name(&self) -> &'static str {
        "causal-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        ys: &CpuStorage,
        yl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (r, geo) = (&self.ranges, geometry(yl, &self.ranges)?);
        let out = match (ys, gs) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => {
                CpuStorage::F32(backward_rows(slice(y, yl)?, slice(g, gl)?, r, geo))
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => {
                CpuStorage::F64(backward_rows(slice(y, yl)?, slice(g, gl)?, r, geo))
            }
            _ => candle_core::bail!("causal softmax backward: unsupported dtypes"),
        };
        Ok((out, yl.shape().clone()))
    }
}

/// Softmax of contiguous `scores` [batch, .., rows, cols] over each row's visible keys.
pub fn causal_softmax(scores: &Tensor, ranges: &RowRanges) -> Result<Tensor> {
    scores.contiguous()?.apply_op1(CausalSoftmax {
        ranges: ranges.clone(),
    })
}
