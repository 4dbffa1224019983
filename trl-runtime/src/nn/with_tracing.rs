//! Drop-ins for `candle_transformers::models::with_tracing`, the layers candle-transformers'
//! language models are written with (`linear_b`, `linear_no_bias`, `Linear`,
//! `RmsNorm::new(size, eps, vb)`): a model file ported from there swaps that import for this
//! one. They are this crate's layers (tensor-parallel, FSDP-shardable, with a backward pass);
//! the tracing spans are left out.

use super::module::Parallelize;
use super::module::{ParamFn, WeightFn};
use crate::error::Result as TrlResult;
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

pub use super::Linear;

/// A linear layer with a bias (`d1` inputs, `d2` outputs).
pub fn linear(d1: usize, d2: usize, vb: VarBuilder) -> Result<Linear> {
    super::linear(d1, d2, vb)
}

/// A linear layer without a bias.
pub fn linear_no_bias(d1: usize, d2: usize, vb: VarBuilder) -> Result<Linear> {
    super::linear_no_bias(d1, d2, vb)
}

/// A linear layer with a bias when `b`.
pub fn linear_b(d1: usize, d2: usize, b: bool, vb: VarBuilder) -> Result<Linear> {
    match b {
        true => linear(d1, d2, vb),
        false => linear_no_bias(d1, d2, vb),
    }
}

/// RMSNorm built from its size (candle-transformers' signature); see [`super::RmsNorm`].
#[derive(Debug, Clone)]
pub struct RmsNorm {
    inner: super::RmsNorm,
}

impl RmsNorm {
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(RmsNorm {
            inner: super::rms_norm(size, eps, vb)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(x)
    }
}

impl candle_core::Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(x)
    }
}

impl Parallelize for RmsNorm {
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        self.inner.visit_params(name, f)
    }
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> TrlResult<()> {
        self.inner.visit_weights_mut(name, f)
    }
}
