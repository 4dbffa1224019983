//! A layer's parameter: a tensor this rank holds whole, or a slot in a ZeRO-3 / FSDP unit
//! whose full value exists only while the layer runs (see `parallel::fsdp`).

use super::sharded::ShardedWeight;
use candle_core::Tensor;

#[derive(Clone)]
pub enum Weight {
    Local(Tensor),
    Sharded(ShardedWeight),
}

impl Weight {
    pub fn dims(&self) -> &[usize] {
        match self {
            Weight::Local(t) => t.dims(),
            Weight::Sharded(s) => s.dims(),
        }
    }
}

impl From<Tensor> for Weight {
    fn from(t: Tensor) -> Self {
        Weight::Local(t)
    }
}
