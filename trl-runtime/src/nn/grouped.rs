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
/// [in, out], plus `b[e]` when given: [rows, out].
pub fn grouped_linear(
    x: &Tensor,
    w: &Param,
    b: Option<&Param>,
    counts: &[usize],
) -> Result<Tensor> {
    match (&w.weight, b.map(|b| &b.weight)) {
        (Weight::Local(w), b) => {
            let b = match b {
                Some(Weight::Local(b)) => Some(b),
                None => None,
                Some(Weight::Sharded(_)) => candle_core::bail!("{MIXED}"),
            };
            let y = grouped::forward(&x.detach(), w, b, counts)?;
            let backward = Grouped {
                counts: counts.to_vec(),
            };
            // Without a bias the op's third input is a constant whose gradient is dropped.
            let b = match b {
                Some(b) => b.clone(),
                None => Tensor::zeros(1, w.dtype(), w.device())?,
            };
            with_backward3(x, w, &b, y, backward)
        }
        (Weight::Sharded(w), None) => sharded::grouped_linear(x, w, None, counts),
        (Weight::Sharded(w), Some(Weight::Sharded(b))) => {
            sharded::grouped_linear(x, w, Some(b), counts)
        }
        (Weight::Sharded(_), Some(Weight::Local(_))) => candle_core::bail!("{MIXED}"),
    }
}

const MIXED: &str = "an expert weight and its bias must be held alike";

struct Grouped {
    counts: Vec<usize>,
}

impl Backward3 for Grouped {
    const NAME: &'static str = "grouped linear";

    fn backward(&self, saved: &Saved3) -> Result<[Tensor; 3]> {
        let [x, w, b] = &saved.inputs;
        let (dx, dw, db) = grouped::backward(x, w, &saved.dout, &self.counts)?;
        // A bias-less call's constant third input.
        let db = if b.dims() == db.dims() {
            db
        } else {
            b.zeros_like()?
        };
        Ok([dx, dw, db])
    }
}
