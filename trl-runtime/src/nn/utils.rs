//! Drop-ins for the helpers `candle_transformers::utils` gives its models' cached (inference)
//! forwards, so that a ported model file keeps its generation path as written: `repeat_kv`
//! and `build_additive_causal_mask`. (The training path attends through
//! `LayerInputs::attention`, which needs neither.)

use candle_core::{DType, Device, Result, Tensor};

/// Each of the `n_kv_head` key/value heads of `xs` [batch, n_kv_head, seq, head_dim]
/// repeated `n_rep` times in place (grouped-query attention).
pub fn repeat_kv(xs: Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(xs);
    }
    let (b, n_kv_head, seq, head_dim) = xs.dims4()?;
    Tensor::cat(&vec![&xs; n_rep], 2)?.reshape((b, n_kv_head * n_rep, seq, head_dim))
}

/// An additive causal mask [1, 1, tgt, tgt + offset]: 0 where query i (at position
/// i + offset) may see key j (j <= i + offset, and within `sw` positions when a sliding
/// window is given), -inf elsewhere.
pub fn build_additive_causal_mask(
    tgt: usize,
    offset: usize,
    sw: Option<usize>,
    device: &Device,
    dtype: DType,
) -> Result<Tensor> {
    let keys = tgt + offset;
    let mask: Vec<f32> = (0..tgt)
        .flat_map(|i| {
            (0..keys).map(move |j| {
                let seen = j <= i + offset && sw.is_none_or(|w| j + w >= i + offset);
                if seen {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (1, 1, tgt, keys), device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_and_repeats() {
        let m = build_additive_causal_mask(2, 1, None, &Device::Cpu, DType::F32).unwrap();
        let v: Vec<f32> = m.flatten_all().unwrap().to_vec1().unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(v, [0.0, 0.0, inf, 0.0, 0.0, 0.0]);
        let w = build_additive_causal_mask(3, 0, Some(1), &Device::Cpu, DType::F32).unwrap();
        let v: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v, [0.0, inf, inf, 0.0, 0.0, inf, inf, 0.0, 0.0]);
        let x = Tensor::arange(0f32, 4., &Device::Cpu)
            .unwrap()
            .reshape((1, 2, 1, 2))
            .unwrap();
        let r: Vec<f32> = repeat_kv(x, 2)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(r, [0., 1., 0., 1., 2., 3., 2., 3.]);
    }
}
