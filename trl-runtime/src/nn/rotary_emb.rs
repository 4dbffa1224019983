//! Drop-ins for `candle_nn::rotary_emb`'s `rope`, `rope_i` and `rope_thd`, with their
//! signatures and layouts, that have a backward pass. (candle_nn's run a kernel without one:
//! a model built on them computes the right logits, but backprop stops there and every
//! parameter before them silently stops training.)
//!
//! `cos` and `sin` are [seq, head_dim / 2] (the first `seq` rows of a table, as
//! candle-transformers' models narrow them at an offset) or [batch, seq, head_dim / 2] (a row
//! per position id: see `crate::models::LayerInputs::at_positions`, for packed rows whose
//! positions restart).

use candle_core::{bail, Result, Tensor, D};

/// cos or sin as [batch, seq, half] for `b` rows of `t` positions.
fn per_row(cs: &Tensor, b: usize, t: usize, half: usize) -> Result<Tensor> {
    let cs = match cs.rank() {
        2 => {
            let (rows, h) = cs.dims2()?;
            if rows < t || h != half {
                bail!(
                    "rope: cos/sin {:?} do not cover {t} positions of {half} angles",
                    cs.dims()
                );
            }
            cs.narrow(0, 0, t)?
                .unsqueeze(0)?
                .broadcast_as((b, t, half))?
        }
        3 => {
            if cs.dims() != [b, t, half] {
                bail!(
                    "rope: cos/sin {:?} should be [{b}, {t}, {half}] (batch, seq, head_dim / 2)",
                    cs.dims()
                );
            }
            cs.clone()
        }
        _ => bail!("rope: cos/sin have to be 2D or 3D, not {:?}", cs.dims()),
    };
    Ok(cs)
}

/// Rotary embeddings on the two halves of each head (Llama, Qwen, Mistral, ...): `xs`
/// [batch, heads, seq, head_dim].
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, _, t, d) = xs.dims4()?;
    let full = |cs: &Tensor| -> Result<Tensor> {
        let cs = per_row(cs, b, t, d / 2)?;
        Tensor::cat(&[&cs, &cs], D::Minus1)
    };
    crate::kernels::fused::rotary(xs, &full(cos)?, &full(sin)?)
}

/// Rotary embeddings on interleaved pairs (x0, x1), (x2, x3), ... of each head (GPT-J,
/// Phi-3's rope_i layout): `xs` [batch, heads, seq, head_dim].
pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = xs.dims4()?;
    let pair = |cs: &Tensor| -> Result<Tensor> {
        per_row(cs, b, t, d / 2)?
            .unsqueeze(1)?
            .unsqueeze(D::Minus1)?
            .broadcast_as((b, h, t, d / 2, 1))
    };
    let (cos, sin) = (pair(cos)?, pair(sin)?);
    let x = xs.reshape((b, h, t, d / 2, 2))?;
    let (x0, x1) = (x.narrow(D::Minus1, 0, 1)?, x.narrow(D::Minus1, 1, 1)?);
    let y0 = ((&x0 * &cos)? - (&x1 * &sin)?)?;
    let y1 = ((&x0 * &sin)? + (&x1 * &cos)?)?;
    Tensor::cat(&[y0, y1], D::Minus1)?.flatten_from(D::Minus2)
}

/// [`rope`] on `xs` [batch, seq, heads, head_dim].
pub fn rope_thd(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope(&xs.transpose(1, 2)?, cos, sin)?.transpose(1, 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::max_abs_diff as max_diff;
    use candle_core::{Device, Var};

    type Rope = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

    /// Same values as candle_nn's kernels, and gradients that flow (checked against the
    /// adjoint: the rotation by the opposite angle).
    #[test]
    fn rope_matches_candle_nn_and_has_a_gradient() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 5, 8);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (b, h, t, d), &dev).unwrap()).unwrap();
        let angles = Tensor::randn(0f32, 1., (7, d / 2), &dev).unwrap();
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let (cos_t, sin_t) = (
            cos.narrow(0, 0, t).unwrap().contiguous().unwrap(),
            sin.narrow(0, 0, t).unwrap().contiguous().unwrap(),
        );
        let cases: [(&str, Rope, Rope); 2] = [
            ("rope", rope, candle_nn::rotary_emb::rope),
            ("rope_i", rope_i, candle_nn::rotary_emb::rope_i),
        ];
        for (what, ours, theirs) in cases {
            let want = theirs(x.as_tensor(), &cos_t, &sin_t).unwrap();
            // A table longer than the sequence, and a row per batch element.
            let got = ours(x.as_tensor(), &cos, &sin).unwrap();
            let batched = |c: &Tensor| c.unsqueeze(0).unwrap().repeat((b, 1, 1)).unwrap();
            let got3 = ours(x.as_tensor(), &batched(&cos_t), &batched(&sin_t)).unwrap();
            assert!(max_diff(&got, &want) < 1e-6, "{what}");
            assert!(max_diff(&got3, &want) < 1e-6, "{what} with 3D cos/sin");
            // d/dx sum(w * rope(x)) = rope with -sin applied to w.
            let w = Tensor::randn(0f32, 1., (b, h, t, d), &dev).unwrap();
            let grads = (&got * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = grads.get(x.as_tensor()).expect("a gradient for x");
            let adjoint = theirs(&w, &cos_t, &sin_t.neg().unwrap()).unwrap();
            assert!(max_diff(dx, &adjoint) < 1e-5, "{what} gradient");
        }
        let thd = x.as_tensor().transpose(1, 2).unwrap().contiguous().unwrap();
        let got = rope_thd(&thd, &cos_t, &sin_t).unwrap();
        let want = candle_nn::rotary_emb::rope_thd(&thd, &cos_t, &sin_t).unwrap();
        assert!(max_diff(&got, &want) < 1e-6, "rope_thd");
    }
}
