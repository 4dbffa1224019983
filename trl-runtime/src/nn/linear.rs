//! y = x W^T + b with W stored [out_features, in_features], as in PyTorch and HF checkpoints.

use super::Weight;
use crate::parallel::fsdp;
use candle_core::{Result, Tensor};

#[derive(Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Weight>,
}

impl Linear {
    pub fn new(weight: impl Into<Weight>, bias: Option<Weight>) -> Self {
        Linear {
            weight: weight.into(),
            bias,
        }
    }

    /// `x`: [..., in] -> [..., out]. Leading dims are flattened into one matmul.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match (&self.weight, &self.bias) {
            (Weight::Local(w), None) => local_linear(x, w, None),
            (Weight::Local(w), Some(Weight::Local(b))) => local_linear(x, w, Some(b)),
            (Weight::Sharded(w), None) => fsdp::linear(x, w, None),
            (Weight::Sharded(w), Some(Weight::Sharded(b))) => fsdp::linear(x, w, Some(b)),
            _ => candle_core::bail!("a linear layer's weight and bias must be held the same way"),
        }
    }
}

/// The plain computation (also what the sharded op runs once its weights are gathered).
pub fn local_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims();
    let inner = dims[dims.len() - 1];
    let rows = x.elem_count() / inner;
    let y = x.reshape((rows, inner))?.matmul(&weight.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().unwrap() = weight.dim(0)?;
    y.reshape(out_dims)
}
