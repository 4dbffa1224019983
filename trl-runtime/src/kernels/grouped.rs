//! Grouped matmuls of a mixture of experts: rows sorted by expert, `counts[e]` rows for
//! expert `e`, one GEMM per expert over its rows (no per-token loop), with the weights of
//! every expert in one [experts, in, out] tensor as gpt-oss keeps them. Plain tensor math,
//! no graph: `nn::grouped` gives it autograd, `nn::sharded` a ZeRO-3 / FSDP unit's.

use candle_core::{Result, Tensor};

/// How a fused expert tensor holds each expert's matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertLayout {
    /// [experts, in, out] (gpt-oss, Llama 4): `x w[e]`.
    #[default]
    InOut,
    /// [experts, out, in], each expert a linear layer's weight (Mistral 4): `x w[e]^T`.
    OutIn,
}

impl ExpertLayout {
    /// Expert `e`'s matrix as [in, out] (a transposed view for `OutIn`).
    fn in_out(self, w: &Tensor, e: usize) -> Result<Tensor> {
        match self {
            ExpertLayout::InOut => w.get(e),
            ExpertLayout::OutIn => w.get(e)?.t(),
        }
    }

    /// (in, out) of `w`'s experts.
    pub fn dims(self, w: &Tensor) -> Result<(usize, usize)> {
        let (_, a, b) = w.dims3()?;
        Ok(match self {
            ExpertLayout::InOut => (a, b),
            ExpertLayout::OutIn => (b, a),
        })
    }
}

/// Each expert's rows of `x` [rows, in] times its weight `w[e]` (held as `layout` says), plus
/// `b[e]` [out] when given: [rows, out].
pub fn forward(
    x: &Tensor,
    (w, layout): (&Tensor, ExpertLayout),
    b: Option<&Tensor>,
    counts: &[usize],
) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(counts.len());
    for (e, rows) in segments(counts) {
        let y = x
            .narrow(0, rows.start, rows.len())?
            .matmul(&layout.in_out(w, e)?)?;
        outs.push(match b {
            Some(b) => super::fused::add_bias(&y, &b.get(e)?)?,
            None => y,
        });
    }
    match outs.is_empty() {
        true => Tensor::zeros((0, layout.dims(w)?.1), x.dtype(), x.device()),
        false => Tensor::cat(&outs, 0),
    }
}

/// The gradients of [`forward`]'s `x` and, when asked (`grads`: the weight's, the bias's),
/// of `w` (in its layout) and `b`, for the output gradient `dy` [rows, out]; an expert
/// without rows gets zeros. A frozen weight (a LoRA base) asks for neither: `x`'s gradient
/// alone.
pub fn backward(
    x: &Tensor,
    (w, layout): (&Tensor, ExpertLayout),
    dy: &Tensor,
    counts: &[usize],
    (weight, bias): (bool, bool),
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let (experts, a, b) = w.dims3()?;
    let out = layout.dims(w)?.1;
    let (mut dx, mut dw, mut db) = (Vec::new(), Vec::new(), Vec::new());
    let zeros = |shape: &[usize]| Tensor::zeros(shape, w.dtype(), w.device());
    let mut rows_of = segments(counts).peekable();
    for e in 0..experts {
        match rows_of.next_if(|(i, _)| *i == e) {
            Some((_, rows)) => {
                let xe = x.narrow(0, rows.start, rows.len())?;
                let ge = dy.narrow(0, rows.start, rows.len())?;
                dx.push(ge.matmul(&layout.in_out(w, e)?.t()?)?);
                if weight {
                    dw.push(match layout {
                        ExpertLayout::InOut => xe.t()?.matmul(&ge)?,
                        ExpertLayout::OutIn => ge.t()?.matmul(&xe)?,
                    });
                }
                if bias {
                    db.push(super::fused::sum_rows(&ge)?);
                }
            }
            None => {
                if weight {
                    dw.push(zeros(&[a, b])?);
                }
                if bias {
                    db.push(zeros(&[out])?);
                }
            }
        }
    }
    let dx = match dx.is_empty() {
        true => x.zeros_like()?,
        false => Tensor::cat(&dx, 0)?,
    };
    let stack = |ts: Vec<Tensor>, on: bool| on.then(|| Tensor::stack(&ts, 0)).transpose();
    Ok((dx, stack(dw, weight)?, stack(db, bias)?))
}

/// The experts that have rows, with their row range.
fn segments(counts: &[usize]) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
    let mut start = 0;
    counts.iter().enumerate().filter_map(move |(e, &n)| {
        let rows = start..start + n;
        start += n;
        (n > 0).then_some((e, rows))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::max_abs_diff;
    use candle_core::{Device, Var};

    /// Against per-expert linear layers with autograd, an expert without rows included.
    #[test]
    fn equals_a_linear_per_expert() {
        let dev = Device::Cpu;
        let counts = [3usize, 0, 4];
        let x = Var::randn(0f32, 1.0, (7, 5), &dev).unwrap();
        let w = Var::randn(0f32, 1.0, (3, 5, 6), &dev).unwrap();
        let b = Var::randn(0f32, 1.0, (3, 6), &dev).unwrap();
        let dy = Tensor::randn(0f32, 1.0, (7, 6), &dev).unwrap();
        let y = forward(&x, (&w, ExpertLayout::InOut), Some(&b), &counts).unwrap();
        let parts = [(0usize, 0usize, 3usize), (2, 3, 4)].map(|(e, start, n)| {
            let xe = x.narrow(0, start, n).unwrap();
            let we = w.as_tensor().get(e).unwrap();
            xe.matmul(&we)
                .unwrap()
                .broadcast_add(&b.as_tensor().get(e).unwrap())
                .unwrap()
        });
        let want = Tensor::cat(&parts, 0).unwrap();
        assert!(max_abs_diff(&y, &want) < 1e-6);
        let grads = (&want * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (dx, dw, db) =
            backward(&x, (&w, ExpertLayout::InOut), &dy, &counts, (true, true)).unwrap();
        let dw = dw.unwrap();
        for (got, var) in [(dx, &x), (dw.clone(), &w), (db.unwrap(), &b)] {
            let expect = grads.get(var.as_tensor()).unwrap();
            assert!(max_abs_diff(&got, expect) < 1e-5);
        }
        // The same experts held [experts, out, in]: the same output, dx, and dW transposed.
        let w_t = w.as_tensor().transpose(1, 2).unwrap().contiguous().unwrap();
        let y_t = forward(&x, (&w_t, ExpertLayout::OutIn), Some(&b), &counts).unwrap();
        assert!(max_abs_diff(&y_t, &y) < 1e-6);
        let layout = (&w_t, ExpertLayout::OutIn);
        let (dx_t, dw_t, _) = backward(&x, layout, &dy, &counts, (true, false)).unwrap();
        let dx = grads.get(x.as_tensor()).unwrap();
        assert!(max_abs_diff(&dx_t, dx) < 1e-5);
        let dw_t = dw_t.unwrap().transpose(1, 2).unwrap();
        assert!(max_abs_diff(&dw_t, &dw) < 1e-5);
    }
}
