//! A parameter a model uses as a tensor rather than through a layer (gpt-oss's attention
//! sinks, its experts' fused 3-D weights): named as in the checkpoint (no `.weight` suffix),
//! held as any weight is (whole, or a ZeRO-3 / FSDP slot), and split along one chosen
//! dimension under `#[parallel(tp = "column")]`.

use super::module::{ColumnParallel, RowParallel, Split, TpContext, TpLayer, TpStyle};
use super::sharded;
use super::Weight;
use crate::error::{Error, Result as TrlResult};
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct Param {
    pub weight: Weight,
    /// The dimension tensor parallelism splits (`column` or `row` style alike: the model
    /// says which of its dimensions follow the split heads or features).
    pub split_dim: Option<usize>,
}

impl Param {
    /// `name` from `vb`, of `shape`.
    pub fn new(
        vb: &candle_nn::VarBuilder,
        shape: impl Into<candle_core::Shape>,
        name: &str,
    ) -> Result<Self> {
        Ok(Param {
            weight: Weight::Local(vb.get(shape, name)?),
            split_dim: None,
        })
    }

    /// The same parameter split along `dim` under tensor parallelism.
    pub fn split_on(mut self, dim: usize) -> Self {
        self.split_dim = Some(dim);
        self
    }

    /// Its whole value as a tensor of the graph (a sharded one gathered, its gradient going
    /// back to the unit).
    pub fn value(&self) -> Result<Tensor> {
        match &self.weight {
            Weight::Local(t) => Ok(t.clone()),
            Weight::Sharded(w) => sharded::whole(w),
        }
    }
}

impl TpLayer for Param {
    fn shard(&mut self, name: &str, style: TpStyle, tp: &TpContext) -> TrlResult<()> {
        let (Weight::Local(t), Some(dim)) = (&self.weight, self.split_dim) else {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: format!(
                    "cannot be split {} (no split dimension, or already sharded)",
                    style.name()
                ),
            });
        };
        self.weight = Weight::Local(tp.shard(name, t, dim)?);
        Ok(())
    }

    fn visit_split(&self, name: &str, style: TpStyle, f: &mut dyn FnMut(&str, &Tensor, Split)) {
        if let Weight::Local(t) = &self.weight {
            let dim = self.split_dim;
            f(name, t, Split { style, dim })
        }
    }
}

impl ColumnParallel for Param {}
impl RowParallel for Param {}

// Whole on every tensor-parallel rank unless a field splits it.
super::module::whole_layer!(Param: "" => weight);
