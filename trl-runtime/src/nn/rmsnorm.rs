//! RMSNorm as in Llama/Qwen2: x / sqrt(mean(x^2) + eps) * weight, computed in f32 (f64 inputs
//! stay f64); Gemma's scales by (offset + weight) with offset 1. A drop-in for
//! `candle_nn::RmsNorm`; replicated under tensor parallelism.

use super::sharded;
use super::Weight;
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Weight,
    pub eps: f64,
    /// Added to the weight before scaling: 0, or Gemma's 1 (its weights are stored as
    /// `scale - 1`, so checkpoints round-trip unchanged).
    pub offset: f64,
}

impl RmsNorm {
    pub fn new(weight: impl Into<Weight>, eps: f64) -> Self {
        RmsNorm {
            weight: weight.into(),
            eps,
            offset: 0.0,
        }
    }

    /// Gemma's RMSNorm: scales by (1 + weight).
    pub fn gemma(weight: impl Into<Weight>, eps: f64) -> Self {
        RmsNorm {
            offset: 1.0,
            ..Self::new(weight, eps)
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let offset = self.offset != 0.0;
        match &self.weight {
            // One fused pass forward and backward (see kernels::fused).
            Weight::Local(w) if !offset => crate::kernels::fused::rms_norm(x, w, self.eps),
            Weight::Local(w) => crate::kernels::fused::rms_norm(x, &(w + self.offset)?, self.eps),
            Weight::Sharded(w) => {
                let n = crate::kernels::fused::rms_normalize(x, self.eps)?;
                match offset {
                    false => sharded::scale(&n, w),
                    // n * (offset + w) = offset * n + n * w
                    true => (&n * self.offset)? + sharded::scale(&n, w)?,
                }
            }
        }
    }
}

impl candle_core::Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        RmsNorm::forward(self, x)
    }
}

// A norm's weight scales every feature, so it stays whole on every tensor-parallel rank.
super::module::whole_layer!(RmsNorm: "weight" => weight);

/// As `candle_nn::rms_norm`: a weight of `size` ones from `vb`.
pub fn rms_norm(size: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<RmsNorm> {
    let w = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
    Ok(RmsNorm::new(w, eps))
}
