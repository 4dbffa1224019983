//! RMSNorm as in Llama/Qwen2: x / sqrt(mean(x^2) + eps) * weight, computed in f32 (f64 inputs
//! stay f64).

use super::Weight;
use crate::parallel::fsdp;
use candle_core::{DType, Result, Tensor, D};

#[derive(Clone)]
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
        let dtype = x.dtype();
        let compute = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let x32 = x.to_dtype(compute)?;
        let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x32.broadcast_div(&(variance + self.eps)?.sqrt()?)?;
        // HF casts back to the input dtype before applying the weight.
        let normed = normed.to_dtype(dtype)?;
        match &self.weight {
            Weight::Local(w) => normed.broadcast_mul(w),
            Weight::Sharded(w) => fsdp::scale(&normed, w),
        }
    }
}
