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

/// Shapes and dtypes, not values (as candle_nn's layers print).
impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Weight::Local(t) => write!(f, "Weight({:?}, {:?})", t.dims(), t.dtype()),
            Weight::Sharded(s) => write!(f, "Weight(sharded, {:?}, {:?})", s.dims(), s.dtype()),
        }
    }
}

impl From<Tensor> for Weight {
    fn from(t: Tensor) -> Self {
        Weight::Local(t)
    }
}
