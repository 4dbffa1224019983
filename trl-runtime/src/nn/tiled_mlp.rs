//! The SwiGLU MLP computed in sequence tiles (ALST's TiledMLP): `down(silu(gate(x)) * up(x))`
//! without keeping the [tokens x intermediate] activations for backward. Forward runs tile by
//! tile and keeps only its inputs; backward recomputes each tile's activations and
//! accumulates the weight gradients. Gate and up weights enter as one [2 x intermediate,
//! hidden] tensor (Candle's custom ops take three inputs; the concatenation's own backward
//! splits the gradient).
//!
//! Precision: everything runs in the inputs' dtype, as the untiled MLP does, except the weight
//! gradients' sums over tiles, which are f32 (bf16 partial sums would drop small terms).

use crate::kernels::precision::{self, accumulate};
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::{Result, Tensor, D};

/// Rows per tile.
const TILE_ROWS: usize = 1024;

struct TiledMlp;

/// One tile's activations: gate pre-activation `a`, up `b`, silu(a) `s`.
fn activations(x: &Tensor, gate_up: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let inter = gate_up.dim(0)? / 2;
    let ab = x.matmul(&gate_up.t()?)?;
    let (a, b) = (ab.narrow(1, 0, inter)?, ab.narrow(1, inter, inter)?);
    let s = a.silu()?;
    Ok((a, b, s))
}

fn tiles(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(TILE_ROWS)
        .map(move |start| (start, TILE_ROWS.min(n - start)))
}

fn forward(x: &Tensor, gate_up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let mut out = Vec::new();
    for (start, len) in tiles(x.dim(0)?) {
        let (_, b, s) = activations(&x.narrow(0, start, len)?, gate_up)?;
        out.push((s * b)?.matmul(&down.t()?)?);
    }
    Tensor::cat(&out, 0)
}

impl Backward3 for TiledMlp {
    const NAME: &'static str = "the tiled MLP";

    fn backward(&self, saved: &Saved3) -> Result<[Option<Tensor>; 3]> {
        let ([x, gate_up, down], dy) = (&saved.inputs, &saved.dout);
        let (mut dx, mut dgu, mut ddown) = (Vec::new(), None::<Tensor>, None::<Tensor>);
        let (io, wide) = (x.dtype(), precision::wide(x.dtype()));
        for (start, len) in tiles(x.dim(0)?) {
            let xt = x.narrow(0, start, len)?;
            let dyt = dy.narrow(0, start, len)?;
            let (a, b, s) = activations(&xt, gate_up)?;
            let dh = dyt.matmul(down)?;
            let dd = dyt.t()?.matmul(&(&s * &b)?)?;
            let db = (&dh * &s)?;
            // d silu(a) / da = sigmoid(a) * (1 + a * (1 - sigmoid(a))).
            let sig = candle_nn::ops::sigmoid(&a)?;
            let dsilu = (&sig * ((&a * (1.0 - &sig)?)? + 1.0)?)?;
            let da = ((dh * b)? * dsilu)?;
            let dab = Tensor::cat(&[&da, &db], D::Minus1)?;
            dx.push(dab.matmul(gate_up)?);
            accumulate(&mut dgu, dab.t()?.matmul(&xt)?, wide)?;
            accumulate(&mut ddown, dd, wide)?;
        }
        let missing = || candle_core::Error::Msg("the tiled MLP had no rows".into());
        Ok([
            Some(Tensor::cat(&dx, 0)?),
            Some(dgu.ok_or_else(missing)?.to_dtype(io)?),
            Some(ddown.ok_or_else(missing)?.to_dtype(io)?),
        ])
    }
}

/// `down(silu(x gate^T) * (x up^T))` for `x` [n, hidden], `gate_up` [2 x inter, hidden]
/// (gate rows first), `down` [hidden, inter], holding one tile's activations at a time.
pub fn tiled_swiglu(x: &Tensor, gate_up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let (x, gate_up, down) = (x.contiguous()?, gate_up.contiguous()?, down.contiguous()?);
    let out = forward(&x.detach(), &gate_up.detach(), &down.detach())?;
    with_backward3(&x, &gate_up, &down, out, TiledMlp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{bf16_exact_randn as randn, rel_diff as rel};
    use candle_core::{DType, Var};

    /// In f32 and in bf16 (inputs bf16 holds exactly) the tiled MLP equals the plain one:
    /// output and gradients.
    #[test]
    fn equals_the_plain_mlp() {
        // 2500 rows: three tiles, the last one short.
        let var =
            |shape: (usize, usize), std, seed| Var::from_tensor(&randn(shape, std, seed)).unwrap();
        let x = var((2500, 16), 1.0, 1);
        let gate = var((24, 16), 0.3, 2);
        let up = var((24, 16), 0.3, 3);
        let down = var((16, 24), 0.3, 4);
        let w = randn((2500, 16), 1.0, 5);
        let run = |tiled: bool, dtype: DType| {
            let [xc, gc, uc, dc] = [&x, &gate, &up, &down].map(|t| t.to_dtype(dtype).unwrap());
            let y = if tiled {
                let gu = Tensor::cat(&[&gc, &uc], 0).unwrap();
                tiled_swiglu(&xc, &gu, &dc).unwrap()
            } else {
                let h = (xc.matmul(&gc.t().unwrap()).unwrap().silu().unwrap()
                    * xc.matmul(&uc.t().unwrap()).unwrap())
                .unwrap();
                h.matmul(&dc.t().unwrap()).unwrap()
            };
            assert_eq!(y.dtype(), dtype);
            let y = y.to_dtype(DType::F32).unwrap();
            let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            // Gradients reach the f32 variables through the casts.
            let grads: Vec<Tensor> = [&x, &gate, &up, &down]
                .iter()
                .map(|t| g.get(t).unwrap().clone())
                .collect();
            (y, grads)
        };
        for (dtype, bound) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let (want, want_grads) = run(false, dtype);
            let (got, grads) = run(true, dtype);
            let d = rel(&got, &want);
            eprintln!("{dtype:?}: output {d:e}");
            assert!(d < bound, "{dtype:?}: output {d:e}");
            for (name, (g, w)) in ["x", "gate", "up", "down"]
                .iter()
                .zip(grads.iter().zip(&want_grads))
            {
                let d = rel(g, w);
                eprintln!("{dtype:?}: gradient of {name} {d:e}");
                assert!(d < bound, "{dtype:?}: gradient of {name}: {d:e}");
            }
        }
    }
}
