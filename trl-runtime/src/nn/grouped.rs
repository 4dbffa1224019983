//! A mixture of experts' grouped linear layer with autograd (`kernels::grouped`): rows sorted
//! by expert, the experts' weights one [experts, in, out] parameter, held whole or in a
//! ZeRO-3 / FSDP unit.

use super::param::Param;
use super::sharded;
use super::Weight;
use crate::kernels::grouped;
use crate::kernels::grouped::ExpertLayout;
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::{Result, Tensor};

/// Expert `e`'s `counts[e]` rows of `x` [rows, in] (rows sorted by expert) times `w[e]`
/// [in, out], plus `b[e]` when given: [rows, out]. A LoRA adapter on `w` (peft's
/// `target_parameters`) adds each expert's `x A_e^T B_e^T * scale` through two more grouped
/// GEMMs of rank r, the adapted weight never built.
pub fn grouped_linear(
    x: &Tensor,
    w: &Param,
    b: Option<&Param>,
    counts: &[usize],
) -> Result<Tensor> {
    let y = base(x, w, b, counts)?;
    let Some(lora) = &w.lora else {
        return Ok(y);
    };
    // Per expert, A [r, in] and B [out, r] in peft's reading of the weight: through A then
    // B when the rows' features are its inputs; else (Llama 4's experts, which peft reads
    // [experts, out, in] and which compute [experts, in, out]) through B then A.
    let (a, bs) = lora.expert_stacks(counts.len())?;
    let (first, second) = match w.layout == w.adapter_layout {
        true => (a, bs),
        false => (
            bs.transpose(1, 2)?.contiguous()?,
            a.transpose(1, 2)?.contiguous()?,
        ),
    };
    let in_out = ExpertLayout::InOut;
    let h = local(x, (&first.to_dtype(x.dtype())?, in_out), None, counts)?;
    let delta = local(&h, (&second.to_dtype(x.dtype())?, in_out), None, counts)?;
    y + (delta * lora.scale)?
}

/// The base layer: `w` and `b` held whole or sharded.
fn base(x: &Tensor, w: &Param, b: Option<&Param>, counts: &[usize]) -> Result<Tensor> {
    let layout = w.layout;
    match (&w.weight, b.map(|b| &b.weight)) {
        (Weight::Local(w), None) => local(x, (w, layout), None, counts),
        (Weight::Local(w), Some(Weight::Local(b))) => local(x, (w, layout), Some(b), counts),
        (Weight::Sharded(w), None) => sharded::grouped_linear(x, (w, layout), None, counts),
        (Weight::Sharded(w), Some(Weight::Sharded(b))) => {
            sharded::grouped_linear(x, (w, layout), Some(b), counts)
        }
        _ => candle_core::bail!("an expert weight and its bias must be held alike"),
    }
}

/// [`grouped_linear`] on weights held whole, with autograd.
fn local(
    x: &Tensor,
    (w, layout): (&Tensor, ExpertLayout),
    b: Option<&Tensor>,
    counts: &[usize],
) -> Result<Tensor> {
    let y = grouped::forward(&x.detach(), (w, layout), b, counts)?;
    // Gradients for what trains: a frozen weight (a LoRA base) tracks no variable; an
    // adapter's stacks are computed from its variables.
    let backward = Grouped {
        counts: counts.to_vec(),
        grads: (w.track_op(), b.is_some_and(Tensor::track_op)),
        layout,
    };
    // Without a bias the op's third input is a constant, which takes no gradient.
    let b = match b {
        Some(b) => b.clone(),
        None => Tensor::zeros(1, w.dtype(), w.device())?,
    };
    with_backward3(x, w, &b, y, backward)
}

struct Grouped {
    counts: Vec<usize>,
    /// Whether the weight and the bias take gradients.
    grads: (bool, bool),
    layout: ExpertLayout,
}

impl Backward3 for Grouped {
    const NAME: &'static str = "grouped linear";

    fn backward(&self, saved: &Saved3) -> Result<[Option<Tensor>; 3]> {
        let [x, w, _] = &saved.inputs;
        let (dx, dw, db) =
            grouped::backward(x, (w, self.layout), &saved.dout, &self.counts, self.grads)?;
        Ok([Some(dx), dw, db])
    }
}
