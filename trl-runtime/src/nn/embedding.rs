//! Token embedding: rows of a [vocab, hidden] table.

use super::Weight;
use crate::parallel::fsdp;
use candle_core::{DType, Result, Tensor};

#[derive(Clone)]
pub struct Embedding {
    pub weight: Weight,
}

impl Embedding {
    pub fn new(weight: impl Into<Weight>) -> Self {
        Embedding {
            weight: weight.into(),
        }
    }

    /// `ids` [..] (any integer dtype) -> [.., hidden].
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let flat = ids.flatten_all()?.to_dtype(DType::U32)?;
        let hidden = self.weight.dims()[1];
        let rows = match &self.weight {
            Weight::Local(w) => w.index_select(&flat, 0)?,
            Weight::Sharded(w) => fsdp::embedding(&flat, w)?,
        };
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        rows.reshape(dims)
    }
}
