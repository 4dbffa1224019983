//! A mixture of experts' grouped linear layer with autograd (`kernels::grouped`): rows sorted
//! by expert, the experts' weights one [experts, in, out] parameter, held whole or in a
//! ZeRO-3 / FSDP unit.

use super::param::Param;
use super::sharded;
use super::Weight;
use crate::kernels::grouped;
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::{Result, Tensor};

/// Expert `e`'s `counts[e]` rows of `x` [rows, in] (rows sorted by expert) times `w[e]`
/// [in, out] plus `b[e]`: [rows, out].
pub fn grouped_linear(x: &Tensor, w: &Param, b: &Param, counts: &[usize]) -> Result<Tensor> {
    match (&w.weight, &b.weight) {
        (Weight::Local(w), Weight::Local(b)) => {
            let y = grouped::forward(&x.detach(), w, b, counts)?;
            let backward = Grouped {
                counts: counts.to_vec(),
            };
            with_backward3(x, w, b, y, backward)
        }
        (Weight::Sharded(w), Weight::Sharded(b)) => sharded::grouped_linear(x, w, b, counts),
        _ => candle_core::bail!("an expert weight and its bias must be held alike"),
    }
}

struct Grouped {
    counts: Vec<usize>,
}

impl Backward3 for Grouped {
    const NAME: &'static str = "grouped linear";

    fn backward(&self, saved: &Saved3) -> Result<[Tensor; 3]> {
        let [x, w, _] = &saved.inputs;
        let (dx, dw, db) = grouped::backward(x, w, &saved.dout, &self.counts)?;
        Ok([dx, dw, db])
    }
}
