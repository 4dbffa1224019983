//! LayerNorm as in GPT-2 / Phi: (x - mean) / sqrt(var + eps) * weight + bias over the last
//! dimension, computed in f32 (f64 inputs stay f64). A drop-in for `candle_nn::LayerNorm`;
//! replicated under tensor parallelism, its weight and bias FSDP-shardable.

use super::sharded;
use super::Weight;
use candle_core::{DType, Result, Tensor, D};

#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub weight: Weight,
    pub bias: Option<Weight>,
    pub eps: f64,
}

impl LayerNorm {
    pub fn new(weight: impl Into<Weight>, bias: Option<Tensor>, eps: f64) -> Self {
        LayerNorm {
            weight: weight.into(),
            bias: bias.map(Weight::Local),
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let inner = match dtype {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        let x = x.to_dtype(inner)?;
        let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered
            .broadcast_div(&(var + self.eps)?.sqrt()?)?
            .to_dtype(dtype)?;
        let y = match &self.weight {
            Weight::Local(w) => normed.broadcast_mul(w)?,
            Weight::Sharded(w) => sharded::scale(&normed, w)?,
        };
        match &self.bias {
            None => Ok(y),
            Some(Weight::Local(b)) => crate::kernels::fused::add_bias(&y, b),
            Some(Weight::Sharded(b)) => sharded::add_bias(&y, b),
        }
    }
}

impl candle_core::Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        LayerNorm::forward(self, x)
    }
}

// A norm acts on every feature, so it stays whole on every tensor-parallel rank.
super::module::whole_layer!(LayerNorm: "weight" => weight, "bias" => bias);

/// As `candle_nn::layer_norm`: a weight of `size` ones and a bias of zeros from `vb`.
pub fn layer_norm(size: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<LayerNorm> {
    let w = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
    let b = vb.get_with_hints(size, "bias", candle_nn::Init::Const(0.0))?;
    Ok(LayerNorm::new(w, Some(b), eps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candle_nn() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (3, 5, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1., 8, &dev).unwrap();
        let b = Tensor::randn(0f32, 1., 8, &dev).unwrap();
        let ours = LayerNorm::new(w.clone(), Some(b.clone()), 1e-5)
            .forward(&x)
            .unwrap();
        let theirs = candle_nn::LayerNorm::new(w, b, 1e-5);
        let theirs = candle_core::Module::forward(&theirs, &x).unwrap();
        let diff = crate::kernels::testing::max_abs_diff(&ours, &theirs);
        assert!(diff < 1e-5, "{diff}");
    }
}
