//! The LM head and its cross-entropy fused and computed in sequence tiles (what Liger's fused
//! linear cross-entropy and ALST's tiled loss do): the [tokens x vocab] logits never exist at
//! once, in forward or backward. Forward keeps nothing but the inputs; backward recomputes
//! each tile's logits, turns them into the gradient of the loss (softmax minus the one-hot
//! target), and accumulates the hidden states' and the head weight's gradients tile by tile.

use super::loss::{checked_targets, target_index_and_weight, LossSum};
use super::precomputed::Precomputed;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};

/// Rows per tile: as many as keep one tile's logits near this many bytes (at least 16 rows).
const TILE_BYTES: usize = 16 << 20;

/// Per-row targets of a tile: gather index (0 for ignored rows) and weight (0 or 1), [t, 1].
struct Targets {
    index: Tensor,
    weight: Tensor,
}

struct TiledLoss {
    tiles: Vec<(usize, usize, Targets)>,
    sum: Precomputed,
}

impl TiledLoss {
    /// One tile's logits (f32 or f64) from detached `hidden` and `weight`.
    fn logits(hidden: &Tensor, weight: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        hidden.narrow(0, start, len)?.matmul(&weight.t()?)
    }

    fn forward(&self, hidden: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let mut total = Tensor::zeros((), hidden.dtype(), hidden.device())?;
        for (start, len, t) in &self.tiles {
            let logits = Self::logits(hidden, weight, *start, *len)?;
            let max = logits.max_keepdim(D::Minus1)?;
            let shifted = logits.broadcast_sub(&max)?;
            let log_z = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
            let nll = (log_z - shifted.gather(&t.index, 1)?)?;
            total = (total + (nll * &t.weight)?.sum_all()?)?;
        }
        Ok(total)
    }
}

impl CustomOp2 for TiledLoss {
    fn name(&self) -> &'static str {
        "tiled-lm-loss"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.sum.take("the tiled loss")
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.sum.take_cuda("the tiled loss")
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Detached, so that the accumulated gradients do not record (and keep) every tile.
        let (hidden, weight, grad) = (hidden.detach(), weight.detach(), grad.detach());
        let mut dhidden = Vec::with_capacity(self.tiles.len());
        let mut dweight: Option<Tensor> = None;
        for (start, len, t) in &self.tiles {
            let logits = Self::logits(&hidden, &weight, *start, *len)?;
            let max = logits.max_keepdim(D::Minus1)?;
            let e = logits.broadcast_sub(&max)?.exp()?;
            let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
            // d(loss)/d(logits) = softmax - one_hot(target), for the rows that count.
            let dlogits = probs
                .scatter_add(&t.index, &t.weight.neg()?, 1)?
                .broadcast_mul(&t.weight)?
                .broadcast_mul(&grad)?;
            dhidden.push(dlogits.matmul(&weight)?);
            let dw = dlogits.t()?.matmul(&hidden.narrow(0, *start, *len)?)?;
            dweight = Some(match dweight {
                Some(prev) => (prev + dw)?,
                None => dw,
            });
        }
        Ok((Some(Tensor::cat(&dhidden, 0)?), dweight))
    }
}

/// Summed cross-entropy of the logits `hidden` [n, h] x `weight`^T ([vocab, h]) would give,
/// against `targets` [n] (i64, -100 ignored), without ever holding more than one tile of
/// logits. The same value and gradients as the LM head followed by [`super::cross_entropy_sum`].
pub fn tiled_linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
) -> Result<LossSum> {
    let (n, _) = hidden.dims2()?;
    let vocab = weight.dim(0)?;
    if !matches!(hidden.dtype(), DType::F32 | DType::F64) {
        candle_core::bail!(
            "the tiled loss runs in f32 or f64, not {:?}",
            hidden.dtype()
        );
    }
    let (targets, count) = checked_targets(targets, vocab)?;
    let rows = (TILE_BYTES / (4 * vocab)).max(16);
    let device = hidden.device();
    let mut tiles = Vec::new();
    for start in (0..n).step_by(rows) {
        let len = rows.min(n - start);
        let (index, weight) =
            target_index_and_weight(&targets[start..start + len], hidden.dtype(), device)?;
        tiles.push((
            start,
            len,
            Targets {
                index,
                weight: weight.unsqueeze(1)?,
            },
        ));
    }
    let (hidden, weight) = (hidden.contiguous()?, weight.contiguous()?);
    let mut op = TiledLoss {
        tiles,
        sum: Precomputed::default(),
    };
    op.sum = Precomputed::new(op.forward(&hidden.detach(), &weight.detach())?);
    Ok(LossSum {
        sum: hidden.apply_op2(&weight, op)?,
        count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::loss::{cross_entropy_sum, IGNORE_INDEX};
    use crate::nn::testing::rel_diff as rel;
    use candle_core::{Device, Var};

    #[test]
    fn equals_the_head_and_cross_entropy() {
        // 600 rows over a vocabulary of 20,000: tiles of 209 rows, the last one short.
        let dev = Device::Cpu;
        let (n, h, vocab) = (600, 16, 20_000);
        let hidden = Var::randn(0f32, 1.0, (n, h), &dev).unwrap();
        let weight = Var::randn(0f32, 0.2, (vocab, h), &dev).unwrap();
        let targets: Vec<i64> = (0..n as i64)
            .map(|i| {
                if i % 7 == 3 {
                    IGNORE_INDEX
                } else {
                    (i * 7919) % vocab as i64
                }
            })
            .collect();
        let targets = Tensor::new(targets.as_slice(), &dev).unwrap();
        let run = |tiled: bool| {
            let ls = if tiled {
                tiled_linear_cross_entropy(&hidden, &weight, &targets).unwrap()
            } else {
                let logits = hidden.matmul(&weight.t().unwrap()).unwrap();
                cross_entropy_sum(&logits, &targets).unwrap()
            };
            let grads = (&ls.sum * 0.5).unwrap().backward().unwrap();
            let value = ls.sum.to_scalar::<f32>().unwrap();
            let gh = grads.get(&hidden).unwrap().clone();
            let gw = grads.get(&weight).unwrap().clone();
            (value, ls.count, gh, gw)
        };
        let (want, want_count, want_gh, want_gw) = run(false);
        let (got, count, gh, gw) = run(true);
        assert_eq!(count, want_count);
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{got} vs {want}");
        assert!(
            rel(&gh, &want_gh) < 1e-5,
            "hidden gradient {}",
            rel(&gh, &want_gh)
        );
        assert!(
            rel(&gw, &want_gw) < 1e-5,
            "weight gradient {}",
            rel(&gw, &want_gw)
        );
    }
}
