//! RMSNorm as in Llama/Qwen2: x / sqrt(mean(x^2) + eps) * weight, computed in f32 (f64 inputs
//! stay f64). A drop-in for `candle_nn::RmsNorm`; replicated under tensor parallelism.

use super::module::{child_name, Parallelize, Split};
use super::sharded;
use super::Weight;
use crate::error::Result as TrlResult;
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Weight,
    pub eps: f64,
}

impl RmsNorm {
    pub fn new(weight: impl Into<Weight>, eps: f64) -> Self {
        RmsNorm {
            weight: weight.into(),
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.weight {
            // One fused pass forward and backward (see kernels::fused).
            Weight::Local(w) => crate::kernels::fused::rms_norm(x, w, self.eps),
            Weight::Sharded(w) => {
                sharded::scale(&crate::kernels::fused::rms_normalize(x, self.eps)?, w)
            }
        }
    }
}

impl candle_core::Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        RmsNorm::forward(self, x)
    }
}

/// A norm's weight scales every feature, so it stays whole on every tensor-parallel rank.
impl Parallelize for RmsNorm {
    fn visit_params(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor, Split)) {
        if let Weight::Local(w) = &self.weight {
            f(&child_name(name, "weight"), w, Split::REPLICATED)
        }
    }
    fn visit_weights_mut(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&str, &mut Weight) -> TrlResult<()>,
    ) -> TrlResult<()> {
        f(&child_name(name, "weight"), &mut self.weight)
    }
}

/// As `candle_nn::rms_norm`: a weight of `size` ones from `vb`.
pub fn rms_norm(size: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<RmsNorm> {
    let w = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
    Ok(RmsNorm::new(w, eps))
}
