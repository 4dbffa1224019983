//! A parameter a model uses as a tensor rather than through a layer (gpt-oss's attention
//! sinks, its experts' fused 3-D weights): named as in the checkpoint (no `.weight` suffix),
//! held as any weight is (whole, or a ZeRO-3 / FSDP slot), and split under tensor parallelism
//! as it says itself ([`Param::split_column`], [`Param::split_row`]): a tensor has no
//! layer whose kind would imply the dimension, so the model names it where it builds it.

use super::module::{Parallelize, Sections, Split, TpContext, TpStyle};
use super::sharded;
use super::Weight;
use crate::error::{Error, Result as TrlResult};
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct Param {
    pub weight: Weight,
    /// How tensor parallelism splits it: a style (column: it feeds split features; row: it
    /// reads them) and the dimension cut. None: whole on every rank.
    pub split: Option<(TpStyle, usize)>,
}

impl Param {
    /// `name` from `vb`, of `shape`, whole on every tensor-parallel rank.
    pub fn new(
        vb: &candle_nn::VarBuilder,
        shape: impl Into<candle_core::Shape>,
        name: &str,
    ) -> Result<Self> {
        Ok(Param {
            weight: Weight::Local(vb.get(shape, name)?),
            split: None,
        })
    }

    /// The same parameter split along `dim` as a column-parallel layer's output is.
    pub fn split_column(mut self, dim: usize) -> Self {
        let style = TpStyle::Column {
            gather_output: false,
        };
        self.split = Some((style, dim));
        self
    }

    /// The same parameter split along `dim` as a row-parallel layer's input is.
    pub fn split_row(mut self, dim: usize) -> Self {
        self.split = Some((TpStyle::Row, dim));
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

impl Parallelize for Param {
    fn parallelize(&mut self, name: &str, tp: &TpContext) -> TrlResult<()> {
        let Some((_, dim)) = self.split else {
            return Ok(());
        };
        let Weight::Local(t) = &self.weight else {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: "already sharded by FSDP: split tensor-parallel layers before wrapping"
                    .into(),
            });
        };
        self.weight = Weight::Local(tp.shard(name, t, dim, Sections::WHOLE)?);
        Ok(())
    }

    fn visit_params(&self, name: &str, f: &mut dyn FnMut(&str, &Tensor, Split)) {
        if let Weight::Local(t) = &self.weight {
            let split = match self.split {
                Some((style, dim)) => Split::on(style, Some(dim)),
                None => Split::REPLICATED,
            };
            f(name, t, split)
        }
    }

    fn visit_weights_mut(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&str, &mut Weight) -> TrlResult<()>,
    ) -> TrlResult<()> {
        f(name, &mut self.weight)
    }
}
