//! y = x W^T + b with W stored [out_features, in_features], as in PyTorch and HF checkpoints.

use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias }
    }

    /// `x`: [..., in] -> [..., out]. Leading dims are flattened into one matmul.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let inner = dims[dims.len() - 1];
        let rows = x.elem_count() / inner;
        let y = x.reshape((rows, inner))?.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().unwrap() = self.weight.dim(0)?;
        y.reshape(out_dims)
    }
}
