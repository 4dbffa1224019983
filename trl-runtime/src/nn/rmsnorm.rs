//! RMSNorm as in Llama/Qwen2: x / sqrt(mean(x^2) + eps) * weight, computed in f32 (f64 inputs
//! stay f64).

use candle_core::{DType, Result, Tensor, D};

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm { weight, eps }
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
        normed.to_dtype(dtype)?.broadcast_mul(&self.weight)
    }
}
