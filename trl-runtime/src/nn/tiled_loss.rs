//! The LM head and its cross-entropy fused and computed in sequence tiles (what Liger's fused
//! linear cross-entropy and ALST's tiled loss do): the [tokens x vocab] logits never exist at
//! once, in forward or backward. Where the in-place row pass exists (CPU f32, GPUs) the
//! gradients are computed in forward and kept (Liger); elsewhere forward keeps nothing but the
//! inputs and backward recomputes each tile's logits, turns them into the gradient of the loss
//! (softmax minus the one-hot target), and accumulates the gradients tile by tile.
//!
//! Precision: the head's matmuls run in the inputs' dtype (bf16 under mixed precision), the
//! log-softmax, the loss and the weight gradient's accumulation in f32 (f64 for f64 inputs),
//! as the untiled head followed by [`super::cross_entropy_sum`] computes.

use super::embedding::TiedGrad;
use super::loss::{checked_targets, target_index_and_weight, LossSum, RowLosses};
use crate::kernels::fused::RowStats;
use crate::kernels::op::inplace_op;
use crate::kernels::precision::{self, accumulate, accumulate_product};
use crate::precomputed::Precomputed;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use std::cell::{Cell, RefCell};
use std::sync::Mutex;

/// Rows per tile: as many as keep one tile's logits near this many bytes (at least 16 rows).
const TILE_BYTES: usize = 16 << 20;
/// Logits per tile of the fused loss on a GPU (a few tiles per step: 883 rows of Qwen2's
/// 151,936-token vocabulary in bf16).
const GPU_TILE_BYTES: usize = 256 << 20;

/// Per-row targets of a tile: gather index (0 for ignored rows) and weight (0 or 1), [t, 1].
struct Targets {
    index: Tensor,
    weight: Tensor,
}

type Tiles = Vec<(usize, usize, Targets)>;

/// One tile's logits from detached `hidden` and `weight`, in the wide dtype (f32, or f64).
fn tile_logits(hidden: &Tensor, weight: &Tensor, start: usize, len: usize) -> Result<Tensor> {
    hidden
        .narrow(0, start, len)?
        .matmul(&weight.t()?)?
        .to_dtype(precision::wide(hidden.dtype()))
}

/// log sum_v p_v^2 of each row's logits `hidden . weight^T`, [n] in the wide dtype,
/// detached, over the loss's tiles: the [n x vocab] logits never exist whole (WPO's weights).
pub fn tiled_log_sum_sq(hidden: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let (hidden, weight) = (hidden.detach(), weight.detach());
    let (n, _) = hidden.dims2()?;
    let rows = (TILE_BYTES / (4 * weight.dim(0)?)).max(16);
    let tiles = (0..n)
        .step_by(rows)
        .map(|start| {
            let logits = tile_logits(&hidden, &weight, start, rows.min(n - start))?;
            super::loss::log_sum_sq_probs(&logits)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&tiles, 0)
}

/// Each row's loss over the tiles, [n] (0 where ignored), and its token figures
/// ([`super::loss::token_stats_of`], [n, 2]), in Candle ops (the recomputing path's forward).
fn tiles_loss(
    tiles: &Tiles,
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
) -> Result<(Tensor, Tensor)> {
    let mut rows = Vec::with_capacity(tiles.len());
    let mut stats = Vec::with_capacity(tiles.len());
    for &(start, len, _) in tiles {
        let logits = tile_logits(hidden, weight, start, len)?;
        let tile_targets = &targets[start..start + len];
        let tile = RowLosses::new(&logits, tile_targets)?;
        stats.push(tile.stats(tile_targets)?);
        rows.push(tile.nll);
    }
    Ok((Tensor::cat(&rows, 0)?, Tensor::cat(&stats, 0)?))
}

/// The gradients of the tiles' loss, recomputing each tile's logits (its backward). `grad`
/// is the incoming gradient: a scalar for the summed loss, [n] for per-row losses (each row
/// weighed by its own).
fn tiles_grads(
    tiles: &Tiles,
    hidden: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    weight_grad: bool,
) -> Result<Kept> {
    let (io, wide) = (hidden.dtype(), precision::wide(hidden.dtype()));
    let mut dhidden = Vec::with_capacity(tiles.len());
    let mut dweight: Option<Tensor> = None;
    for (start, len, t) in tiles {
        let logits = tile_logits(hidden, weight, *start, *len)?;
        let max = logits.max_keepdim(D::Minus1)?;
        let e = logits.broadcast_sub(&max)?.exp()?;
        let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let g = match grad.rank() {
            0 => grad.to_dtype(wide)?,
            _ => grad.narrow(0, *start, *len)?.unsqueeze(1)?.to_dtype(wide)?,
        };
        // d(loss)/d(logits) = softmax - one_hot(target), for the rows that count.
        let dlogits = probs
            .scatter_add(&t.index, &t.weight.neg()?, 1)?
            .broadcast_mul(&t.weight)?
            .broadcast_mul(&g)?
            .to_dtype(io)?;
        dhidden.push(dlogits.matmul(weight)?);
        if weight_grad {
            let dw = dlogits.t()?.matmul(&hidden.narrow(0, *start, *len)?)?;
            accumulate(&mut dweight, dw, wide)?;
        }
    }
    let dweight = match (weight_grad, dweight) {
        (false, _) => None,
        (true, Some(d)) => Some(d.to_dtype(io)?),
        (true, None) => Some(weight.zeros_like()?),
    };
    Ok((Tensor::cat(&dhidden, 0)?, dweight))
}

/// The gradients of hidden and (unless the head is frozen) weight.
type Kept = (Tensor, Option<Tensor>);

/// How the loss op gets its inputs' gradients.
enum Backward {
    /// The tiled loss: each tile's logits recomputed in backward.
    Recompute(Tiles),
    /// Per-row losses by the one-pass kernel: each tile's logits recomputed in backward and
    /// turned into their gradient in place (the targets, checked).
    Rows(Vec<i64>),
    /// The fused loss: the gradients were computed in forward (for an incoming gradient of
    /// one) and are only scaled, in place. With a tied table, the weight's gradient goes to
    /// the embedding's lookup, which adds its rows into it.
    Kept(Mutex<Option<Kept>>, Option<TiedGrad>),
}

/// The loss of the LM head over (hidden, weight), computed outside the op.
struct LossOp {
    sum: Precomputed,
    backward: Backward,
}

impl CustomOp2 for LossOp {
    fn name(&self) -> &'static str {
        match self.backward {
            Backward::Recompute(_) => "tiled-lm-loss",
            Backward::Rows(_) => "tiled-lm-row-losses",
            Backward::Kept(..) => "fused-linear-cross-entropy",
        }
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.sum.take(self.name())
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.sum.take_cuda(self.name())
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // A frozen head (LoRA's) gets no gradient: its [vocab, hidden] product is skipped.
        let weight_grad = weight.track_op();
        // Detached, so that the accumulated gradients do not record (and keep) every tile.
        let (hidden, weight, grad) = (hidden.detach(), weight.detach(), grad.detach());
        let (dh, dw) = match &self.backward {
            Backward::Recompute(tiles) => tiles_grads(tiles, &hidden, &weight, &grad, weight_grad)?,
            Backward::Rows(targets) => one_pass_row_grads(
                &hidden.contiguous()?,
                &weight.contiguous()?,
                targets,
                &grad,
                weight_grad,
            )?,
            Backward::Kept(kept, tied) => {
                let kept = kept.lock().unwrap_or_else(|e| e.into_inner()).take();
                let Some((dh, dw)) = kept else {
                    candle_core::bail!("the fused loss ran its backward twice")
                };
                // Only this op holds them: scaled in place, no second [vocab, hidden] copy.
                let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                if g != 1.0 {
                    dh.inplace_op1(&Scale(g))?;
                    if let Some(dw) = &dw {
                        dw.inplace_op1(&Scale(g))?;
                    }
                }
                match (tied.as_ref().filter(|t| t.claimed()), dw) {
                    (Some(tied), Some(dw)) => {
                        tied.put(dw);
                        (dh, None)
                    }
                    (_, dw) => (dh, dw),
                }
            }
        };
        Ok((Some(dh), dw))
    }
}

/// `x *= s` in place.
struct Scale(f64);

inplace_op!(Scale: InplaceOp1 [this] {
    name: "scale",
    cpu(storage, layout) {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("scale: a contiguous tensor expected")
        };
        let s = this.0;
        match storage {
            CpuStorage::F32(v) => v[start..end].iter_mut().for_each(|x| *x *= s as f32),
            CpuStorage::F64(v) => v[start..end].iter_mut().for_each(|x| *x *= s),
            CpuStorage::BF16(v) => v[start..end]
                .iter_mut()
                .for_each(|x| *x = half::bf16::from_f64(x.to_f64() * s)),
            CpuStorage::F16(v) => v[start..end]
                .iter_mut()
                .for_each(|x| *x = half::f16::from_f64(x.to_f64() * s)),
            other => candle_core::bail!(
                "scale: {:?} is not a float dtype",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
        Ok(())
    }
    cuda(storage, layout) {
        crate::kernels::cuda_fused::scale_in_place((storage, layout), this.0 as f32)
    }
});

/// One tile of logits turned in place into the gradient of its summed loss (see
/// [`crate::kernels::fused::cross_entropy_rows`]). On CPU the loss is left in `loss` and each
/// row's figures in `rows`; on a GPU the rows' losses and figures go to `on_device`'s buffers
/// from row `first` on, and its targets are read there.
struct CrossEntropyRows<'a> {
    targets: &'a [i64],
    grads: bool,
    loss: Cell<f64>,
    rows: RefCell<Vec<RowStats>>,
    // Read by the CUDA pass only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    on_device: Option<&'a DeviceRows>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    first: usize,
}

/// The targets (i64), per-row losses (f32, [n]) and per-row entropy and top-1 flags (f32,
/// [n, 2]) of a fused loss on a GPU: written by the tiles' passes, summed once on the device.
struct DeviceRows {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    targets: Tensor,
    loss: Tensor,
    stats: Tensor,
}

inplace_op!(CrossEntropyRows<'_>: InplaceOp1 [this] {
    name: "cross-entropy-rows",
    cpu(storage, layout) {
        let (CpuStorage::F32(v), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("cross-entropy rows: contiguous f32 logits expected")
        };
        let vocab = layout.dims()[1];
        let mut rows = vec![RowStats::default(); this.targets.len()];
        let loss = crate::kernels::fused::cross_entropy_rows(
            &mut v[start..end],
            vocab,
            this.targets,
            this.grads,
            &mut rows,
        );
        this.loss.set(loss);
        *this.rows.borrow_mut() = rows;
        Ok(())
    }
    cuda(storage, layout) {
        use candle_core::Storage;
        let Some(rows) = this.on_device else {
            candle_core::bail!("cross-entropy rows: the GPU pass needs its device buffers")
        };
        let len = layout.dims()[0];
        let (t_guard, _) = rows.targets.storage_and_layout();
        let (l_guard, _) = rows.loss.storage_and_layout();
        let (s_guard, _) = rows.stats.storage_and_layout();
        let (Storage::Cuda(t), Storage::Cuda(l), Storage::Cuda(s)) = (&*t_guard, &*l_guard, &*s_guard)
        else {
            candle_core::bail!("cross-entropy rows: targets, losses and figures must be on the GPU")
        };
        let range = this.first..this.first + len;
        crate::kernels::cuda_fused::cross_entropy_rows(
            storage,
            layout,
            &t.as_cuda_slice::<i64>()?.slice(range.clone()),
            &l.as_cuda_slice::<f32>()?.slice(range.clone()),
            &s.as_cuda_slice::<f32>()?.slice(2 * range.start..2 * range.end),
            this.grads,
        )
    }
});

/// What one pass of [`fused_loss`] over the tiles gives.
struct Pass {
    /// The summed loss (f32, a scalar).
    sum: Tensor,
    /// Each row's loss, [n] f32, 0 where ignored.
    rows: Tensor,
    /// Each row's [`super::loss::token_stats_of`], [n, 2] f32.
    stats: Tensor,
    /// With `grads`: the gradients of hidden and (unless `weight_grad` was off) weight.
    grads: Option<Kept>,
}

/// Liger's fused linear cross-entropy (on CPU in f32; on a GPU in f32, bf16 or f16): per tile
/// of rows, the logits by one GEMM, then one in-place pass computing each row's loss (f32
/// math) and turning the logits into their gradient, then the gradient GEMMs, all during
/// forward. No broadcast op, and nothing [tokens x vocab] outlives its tile. Returns the loss
/// (summed and per row) and, with `grads`, the gradients of hidden and (with `weight_grad`; a
/// frozen head under LoRA has none to compute) weight (contiguous inputs). `row_scale` ([n, 1] f32): each row's
/// gradient weighed by its own factor (a loss built on per-row losses), applied to the
/// [rows, hidden] products in f32 (no other tile-sized buffer).
fn fused_loss(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    (grads, weight_grad): (bool, bool),
    (softcap, row_scale): (Option<f64>, Option<&Tensor>),
) -> Result<Pass> {
    let (n, _) = hidden.dims2()?;
    let vocab = weight.dim(0)?;
    let dev = hidden.device();
    // On a GPU, tiles of GPU_TILE_BYTES: each tile's weight gradient is a full [vocab, hidden]
    // product added to the sum, so few large tiles keep the GEMMs big and the passes few.
    let rows = if dev.is_cuda() {
        (GPU_TILE_BYTES / (hidden.dtype().size_in_bytes() * vocab)).max(64)
    } else {
        (TILE_BYTES / (4 * vocab)).max(16)
    };
    let mut total = 0f64;
    let mut cpu_rows = Vec::new();
    let on_device = if dev.is_cpu() {
        None
    } else {
        Some(DeviceRows {
            targets: Tensor::new(targets, dev)?,
            loss: Tensor::zeros(n, DType::F32, dev)?,
            stats: Tensor::zeros((n, 2), DType::F32, dev)?,
        })
    };
    let mut dhidden = Vec::new();
    let mut dweight: Option<Tensor> = None;
    for start in (0..n).step_by(rows) {
        let len = rows.min(n - start);
        let h = hidden.narrow(0, start, len)?;
        let logits = h.matmul(&weight.t()?)?;
        // Final-logit soft-capping (Gemma): the tile capped in f32, and the cap's slope for
        // the logits' gradient.
        let (logits, slope) = match softcap {
            Some(cap) => {
                let io = logits.dtype();
                let (capped, slope) =
                    super::mask::soft_cap(logits.to_dtype(DType::F32)?, Some(cap), grads)?;
                (
                    capped.to_dtype(io)?,
                    slope.map(|s| s.to_dtype(io)).transpose()?,
                )
            }
            None => (logits, None),
        };
        let pass = CrossEntropyRows {
            targets: &targets[start..start + len],
            grads,
            loss: Cell::new(0.0),
            rows: RefCell::default(),
            on_device: on_device.as_ref(),
            first: start,
        };
        logits.inplace_op1(&pass)?;
        total += pass.loss.get();
        cpu_rows.extend(pass.rows.take());
        if grads {
            // The capped logits' gradient through the cap.
            let logits = match slope {
                Some(slope) => (logits * slope)?,
                None => logits,
            };
            let scaled = |t: Tensor| match row_scale {
                Some(s) => {
                    let s = s.narrow(0, start, len)?;
                    t.to_dtype(DType::F32)?
                        .broadcast_mul(&s)?
                        .to_dtype(h.dtype())
                }
                None => Ok(t),
            };
            dhidden.push(scaled(logits.matmul(weight)?)?);
            if weight_grad {
                // dW += logits^T h (rows scaled), into the f32 sum by the GEMM itself.
                accumulate_product(&mut dweight, &logits, &scaled(h.clone())?)?;
            }
        }
    }
    let (sum, rows, stats) = match on_device {
        Some(rows) => (rows.loss.sum_all()?, rows.loss, rows.stats),
        None => {
            let losses = cpu_rows.iter().map(|r| r.loss as f32).collect();
            let stats = cpu_rows
                .iter()
                .flat_map(|r| [r.entropy as f32, r.top1 as u8 as f32])
                .collect();
            (
                Tensor::new(total as f32, dev)?,
                Tensor::from_vec(losses, n, dev)?,
                Tensor::from_vec(stats, (n, 2), dev)?,
            )
        }
    };
    let grads = match grads {
        // The weight's gradient summed in f32, handed back in its dtype.
        true => Some((
            Tensor::cat(&dhidden, 0)?,
            dweight.map(|dw| dw.to_dtype(weight.dtype())).transpose()?,
        )),
        false => None,
    };
    Ok(Pass {
        sum,
        rows,
        stats,
        grads,
    })
}

/// The gradients of the per-row losses of `hidden . weight^T` against `targets`, each row
/// weighed by its own incoming gradient `grad` ([n]): [`fused_loss`]'s pass run in backward,
/// recomputing each tile's logits. The weight's gradient only with `weight_grad`.
fn one_pass_row_grads(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    grad: &Tensor,
    weight_grad: bool,
) -> Result<Kept> {
    let scale = grad.to_dtype(DType::F32)?.reshape((hidden.dim(0)?, 1))?;
    let pass = fused_loss(
        hidden,
        weight,
        targets,
        (true, weight_grad),
        (None, Some(&scale)),
    )?;
    pass.grads
        .ok_or_else(|| candle_core::Error::Msg("the row losses' pass kept no gradient".into()))
}

/// Whether [`tiled_linear_cross_entropy`] runs fused in one pass per row: on CPU in f32, on
/// a GPU (feature `cuda`) in f32, bf16 or f16.
pub fn fused_applies(hidden: &Tensor, weight: &Tensor) -> bool {
    let dtype = hidden.dtype();
    let device = hidden.device();
    let here = device.is_cpu() || (device.is_cuda() && crate::kernels::precision::cuda_fused_on());
    weight.dtype() == dtype
        && weight.device().same_device(device)
        && here
        && one_pass_dtype(dtype, device.is_cuda())
}

/// Whether the fused loss's one-pass row kernel takes `dtype`: f32 on the CPU; f32, bf16 or
/// f16 on a GPU (the memory estimate asks the same).
pub fn one_pass_dtype(dtype: DType, gpu: bool) -> bool {
    match gpu {
        true => matches!(dtype, DType::F32 | DType::BF16 | DType::F16),
        false => dtype == DType::F32,
    }
}

/// Summed cross-entropy of the logits `hidden` [n, h] x `weight`^T ([vocab, h]) would give,
/// against `targets` [n] (i64, -100 ignored), without ever holding more than one tile of
/// logits. The same value and gradients as the LM head followed by [`super::cross_entropy_sum`].
/// Where [`fused_applies`] it is Liger's fused linear cross-entropy (gradients computed in
/// forward, when either input needs them); elsewhere the tiles are recomputed in backward.
pub fn tiled_linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
) -> Result<LossSum> {
    tied_linear_cross_entropy(hidden, weight, targets, None, None)
}

/// [`tiled_linear_cross_entropy`] whose weight is also an embedding table looked up in
/// `hidden`'s forward: on the fused path the weight's gradient goes to the lookup through
/// `tied` when a lookup claimed it (see [`TiedGrad`]). `softcap`: the logits are soft-capped
/// (`cap * tanh(logits / cap)`, Gemma's final_logit_softcapping), on the fused path only
/// (elsewhere an error: compute the loss from the logits).
pub(crate) fn tied_linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    tied: Option<TiedGrad>,
    softcap: Option<f64>,
) -> Result<LossSum> {
    let vocab = weight.dim(0)?;
    if fused_applies(hidden, weight) {
        let (targets, count) = checked_targets(targets, vocab)?;
        let grads = hidden.track_op() || weight.track_op();
        let (h, w) = (hidden.detach().contiguous()?, weight.detach().contiguous()?);
        let pass = fused_loss(
            &h,
            &w,
            &targets,
            (grads, weight.track_op()),
            (softcap, None),
        )?;
        let (sum, kept, stats) = (pass.sum, pass.grads, pass.stats.sum(0)?);
        if !grads {
            return Ok(LossSum { sum, count, stats });
        }
        let op = LossOp {
            sum: Precomputed::new(sum),
            backward: Backward::Kept(Mutex::new(kept), tied),
        };
        return Ok(LossSum {
            sum: hidden.apply_op2(weight, op)?,
            count,
            stats,
        });
    }
    if softcap.is_some() {
        candle_core::bail!("the tiled loss has no soft-capping: compute it from the logits");
    }
    let (nll, count, stats) = tiled_rows(hidden, weight, targets)?;
    LossSum::of_tokens((nll, count), &stats)
}

/// `sum` (a scalar computed outside the graph) attached to `hidden` and `weight` with their
/// gradients for an incoming gradient of one, `dh` and `dw` (None: the weight gets none),
/// scaled in place in backward: another loss over the head computed the fused way (the
/// distillation divergence).
pub(crate) fn with_kept_grads(
    hidden: &Tensor,
    weight: &Tensor,
    sum: Tensor,
    dh: Tensor,
    dw: Option<Tensor>,
) -> Result<Tensor> {
    let op = LossOp {
        sum: Precomputed::new(sum),
        backward: Backward::Kept(
            Mutex::new(Some((
                dh.contiguous()?,
                dw.map(|d| d.contiguous()).transpose()?,
            ))),
            None,
        ),
    };
    hidden.apply_op2(weight, op)
}

/// Each row's cross-entropy of the logits `hidden` [n, h] x `weight`^T would give against
/// `targets` [n] (i64, -100 ignored): [n] in f32 (f64 for f64 inputs), 0 where ignored, and
/// how many targets count. Tiled: forward keeps only the inputs, backward recomputes each
/// tile's logits and weighs each row by its own incoming gradient, so a loss built on
/// per-sequence sums (DPO) gets exact gradients without the logits ever existing whole.
pub fn tiled_token_nll(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, usize)> {
    let (nll, count, _) = tiled_rows(hidden, weight, targets)?;
    Ok((nll, count))
}

/// [`tiled_token_nll`] with each row's [`super::loss::token_stats_of`], [n, 2].
pub(crate) fn tiled_rows(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, usize, Tensor)> {
    if !matches!(hidden.dtype(), DType::F32 | DType::F64 | DType::BF16) {
        candle_core::bail!(
            "the tiled loss runs in f32, f64 or bf16, not {:?}",
            hidden.dtype()
        );
    }
    let (n, _) = hidden.dims2()?;
    let vocab = weight.dim(0)?;
    let (targets, count) = checked_targets(targets, vocab)?;
    let grads = hidden.track_op() || weight.track_op();
    if fused_applies(hidden, weight) {
        let (h, w) = (hidden.detach().contiguous()?, weight.detach().contiguous()?);
        let pass = fused_loss(&h, &w, &targets, (false, false), (None, None))?;
        if !grads {
            return Ok((pass.rows, count, pass.stats));
        }
        let op = LossOp {
            sum: Precomputed::new(pass.rows),
            backward: Backward::Rows(targets),
        };
        return Ok((hidden.apply_op2(weight, op)?, count, pass.stats));
    }
    let wide = precision::wide(hidden.dtype());
    let rows = (TILE_BYTES / (4 * vocab)).max(16);
    let device = hidden.device();
    let mut tiles = Vec::new();
    for start in (0..n).step_by(rows) {
        let len = rows.min(n - start);
        let (index, weight) = target_index_and_weight(&targets[start..start + len], wide, device)?;
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
    let (per_row, stats) = tiles_loss(&tiles, &hidden.detach(), &weight.detach(), &targets)?;
    if !grads {
        return Ok((per_row, count, stats));
    }
    let op = LossOp {
        sum: Precomputed::new(per_row),
        backward: Backward::Recompute(tiles),
    };
    Ok((hidden.apply_op2(&weight, op)?, count, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{bf16_exact_randn as randn, rel_diff as rel};

    /// WPO's log sum p^2 over tiles (40 rows in tiles of 16 at a 300k vocabulary) equals the
    /// whole logits' and its definition, log sum softmax^2.
    #[test]
    fn tiled_log_sum_sq_equals_the_whole_logits() {
        let dev = candle_core::Device::Cpu;
        let hidden = Tensor::randn(0f32, 1.0, (40, 4), &dev).unwrap();
        let weight = Tensor::randn(0f32, 1.0, (300_000, 4), &dev).unwrap();
        let tiled = tiled_log_sum_sq(&hidden, &weight).unwrap();
        let logits = hidden.matmul(&weight.t().unwrap()).unwrap();
        let p = candle_nn::ops::softmax_last_dim(&logits).unwrap();
        let want = p.sqr().unwrap().sum(1).unwrap().log().unwrap();
        let d = (tiled - want)
            .unwrap()
            .abs()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-4, "{d}");
    }
    use crate::nn::loss::{cross_entropy_sum, IGNORE_INDEX};
    use candle_core::{Device, Var};

    /// In f32 (the fused path: gradients computed in forward) and in bf16 (the recomputing
    /// path; inputs bf16 holds exactly, so both see the same values), the tiled loss equals the
    /// LM head followed by the cross-entropy: value and gradients; without gradients (eval) the
    /// fused path gives the same value.
    /// Soft-capped logits (Gemma's final_logit_softcapping) in the fused loss equal the capped
    /// head followed by the cross-entropy, loss and gradients, over several tiles; and the cap
    /// changes both.
    #[test]
    fn soft_capped_logits_equal_the_capped_head() {
        let (n, h, vocab, cap) = (300, 16, 20_000, 2.0);
        let (hidden, weight, targets) = head_inputs((n, h, vocab), 0.8, 3, (5, 2));
        let run = |f: &dyn Fn() -> LossSum| {
            let ls = f();
            let grads = (&ls.sum * 0.5).unwrap().backward().unwrap();
            let value = ls.sum.to_scalar::<f32>().unwrap();
            let gh = grads.get(&hidden).unwrap().clone();
            let gw = grads.get(&weight).unwrap().clone();
            (value, gh, gw)
        };
        let reference = |cap: Option<f64>| {
            let logits = hidden.matmul(&weight.t().unwrap()).unwrap();
            let logits = match cap {
                Some(c) => ((logits / c).unwrap().tanh().unwrap() * c).unwrap(),
                None => logits,
            };
            cross_entropy_sum(&logits, &targets).unwrap()
        };
        let (want, wh, ww) = run(&|| reference(Some(cap)));
        let (plain, ph, _) = run(&|| reference(None));
        assert!(
            (plain - want).abs() > 1e-2 && rel(&ph, &wh) > 1e-2,
            "the cap bites"
        );
        let fused =
            || tied_linear_cross_entropy(&hidden, &weight, &targets, None, Some(cap)).unwrap();
        let (got, gh, gw) = run(&fused);
        assert!(
            (got - want).abs() / want.abs() < 1e-5,
            "loss {got} vs {want}"
        );
        assert!(rel(&gh, &wh) < 1e-5, "hidden gradient {}", rel(&gh, &wh));
        assert!(rel(&gw, &ww) < 1e-5, "weight gradient {}", rel(&gw, &ww));
    }

    /// Hidden states [n, h] (std 1) and a head [vocab, h] (std `weight_std`) drawn from
    /// `seed`, and targets spread over the vocabulary, ignored at rows `i % every == at`.
    fn head_inputs(
        (n, h, vocab): (usize, usize, usize),
        weight_std: f32,
        seed: u64,
        (every, at): (i64, i64),
    ) -> (Var, Var, Tensor) {
        let hidden = Var::from_tensor(&randn((n, h), 1.0, seed)).unwrap();
        let weight = Var::from_tensor(&randn((vocab, h), weight_std, seed + 1)).unwrap();
        let targets: Vec<i64> = (0..n as i64)
            .map(|i| match i % every == at {
                true => IGNORE_INDEX,
                false => (i * 7919) % vocab as i64,
            })
            .collect();
        let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        (hidden, weight, targets)
    }

    /// `hidden` and `weight` in `dtype`, checking that the one-pass path takes f32 only (on
    /// the CPU; bf16 runs the recomputing path).
    fn one_pass_in_f32_only(hidden: &Var, weight: &Var, dtype: DType) -> (Tensor, Tensor) {
        let (x, w) = (
            hidden.to_dtype(dtype).unwrap(),
            weight.to_dtype(dtype).unwrap(),
        );
        let one_pass = fused_applies(&x, &w);
        assert_eq!(one_pass, dtype == DType::F32, "{dtype:?}: which path");
        (x, w)
    }

    #[test]
    fn equals_the_head_and_cross_entropy() {
        // 600 rows over a vocabulary of 20,000: tiles of 209 rows, the last one short.
        let (n, h, vocab) = (600, 16, 20_000);
        let (hidden, weight, targets) = head_inputs((n, h, vocab), 0.2, 1, (7, 3));
        let run = |tiled: bool, dtype: DType| {
            let (x, w) = (
                hidden.to_dtype(dtype).unwrap(),
                weight.to_dtype(dtype).unwrap(),
            );
            let ls = if tiled {
                tiled_linear_cross_entropy(&x, &w, &targets).unwrap()
            } else {
                let logits = x.matmul(&w.t().unwrap()).unwrap();
                cross_entropy_sum(&logits, &targets).unwrap()
            };
            assert_eq!(ls.sum.dtype(), DType::F32, "the loss is summed in f32");
            let grads = (&ls.sum * 0.5).unwrap().backward().unwrap();
            let value = ls.sum.to_scalar::<f32>().unwrap();
            let gh = grads.get(&hidden).unwrap().clone();
            let gw = grads.get(&weight).unwrap().clone();
            (value, ls.count, gh, gw)
        };
        for (dtype, value_bound, grad_bound) in
            [(DType::F32, 1e-5, 1e-5), (DType::BF16, 1e-4, 1e-2)]
        {
            let (x, w) = one_pass_in_f32_only(&hidden, &weight, dtype);
            let (want, want_count, want_gh, want_gw) = run(false, dtype);
            let (got, count, gh, gw) = run(true, dtype);
            let eval = tiled_linear_cross_entropy(&x.detach(), &w.detach(), &targets)
                .unwrap()
                .sum
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(eval, got, "{dtype:?}: the loss without gradients");
            let (dv, dh, dw) = (
                (got - want).abs() / want.abs(),
                rel(&gh, &want_gh),
                rel(&gw, &want_gw),
            );
            eprintln!("{dtype:?}: value {dv:e}, hidden gradient {dh:e}, weight gradient {dw:e}");
            assert_eq!(count, want_count);
            assert!(dv <= value_bound, "{dtype:?}: {got} vs {want}");
            assert!(dh < grad_bound, "{dtype:?}: hidden gradient {dh:e}");
            assert!(dw < grad_bound, "{dtype:?}: weight gradient {dw:e}");
        }
    }

    /// Each row's entropy and whether its target is the argmax, f64 from the logits: TRL's
    /// entropy (-sum p log p) and mean_token_accuracy (torch's argmax: the first maximum).
    fn direct_stats(logits: &Tensor, targets: &[i64]) -> Vec<[f64; 2]> {
        let rows = logits
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        rows.iter()
            .zip(targets)
            .map(|(z, &t)| {
                if t == IGNORE_INDEX {
                    return [0.0, 0.0];
                }
                let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = z.iter().map(|v| (v - max).exp()).sum();
                let entropy = -z
                    .iter()
                    .map(|v| {
                        let p = (v - max).exp() / sum;
                        p * (p.ln())
                    })
                    .sum::<f64>();
                let argmax = z.iter().position(|&v| v == max).unwrap();
                [entropy, (argmax == t as usize) as u8 as f64]
            })
            .collect()
    }

    /// TRL's entropy and mean_token_accuracy figures: the one-pass kernel (f32), the
    /// recomputing tiles (bf16) and the whole logits give the entropy summed over the targets
    /// and the count of targets that are their row's argmax, as computed directly in f64 (ties:
    /// tests/tp.rs).
    #[test]
    fn entropy_and_top1_equal_a_direct_count() {
        // Over tiles, with ignored rows, through the loss functions the trainer calls.
        let (n, h, vocab) = (600, 16, 20_000);
        let (hidden, weight, targets) = head_inputs((n, h, vocab), 0.2, 3, (7, 3));
        // Every third row's target is its argmax (in f32), so that there are hits to count.
        let whole = hidden.matmul(&weight.t().unwrap()).unwrap();
        let argmax: Vec<u32> = whole.argmax(1).unwrap().to_vec1().unwrap();
        let mut t: Vec<i64> = targets.to_vec1().unwrap();
        for (i, v) in t.iter_mut().enumerate() {
            if i % 3 == 0 && *v != IGNORE_INDEX {
                *v = argmax[i] as i64;
            }
        }
        let targets = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let (x, w) = one_pass_in_f32_only(&hidden, &weight, dtype);
            let logits = x.matmul(&w.t().unwrap()).unwrap();
            let direct = direct_stats(&logits, &t);
            let want = [
                direct.iter().map(|r| r[0]).sum::<f64>(),
                direct.iter().map(|r| r[1]).sum::<f64>(),
            ];
            assert!(
                want[1] > 50.0 && want[1] < 500.0,
                "some hits, not all: {want:?}"
            );
            for (path, ls) in [
                (
                    "tiled",
                    tiled_linear_cross_entropy(&x, &w, &targets).unwrap(),
                ),
                ("logits", cross_entropy_sum(&logits, &targets).unwrap()),
            ] {
                let got = ls.stats.to_vec1::<f32>().unwrap();
                let de = (got[0] as f64 - want[0]).abs() / want[0];
                assert!(de < 1e-5, "{dtype:?} {path}: entropy {got:?} vs {want:?}");
                assert_eq!(got[1] as f64, want[1], "{dtype:?} {path}: top-1 count");
            }
        }
    }

    /// Per-row losses (DPO's token log-probabilities), each row weighed by its own gradient:
    /// on the one-pass path (f32) and the recomputing one (bf16), equal to the whole logits'
    /// cross-entropy per row, over several tiles with ignored rows; a frozen head gets no
    /// gradient (there or from the summed loss) and leaves the hidden state's unchanged.
    #[test]
    fn per_row_losses_equal_the_whole_logits_and_a_frozen_head_gets_no_gradient() {
        let dev = Device::Cpu;
        let (n, h, vocab) = (600, 16, 20_000);
        let (hidden, weight, targets) = head_inputs((n, h, vocab), 0.2, 5, (9, 4));
        // A different weight per row, as DPO's per-sequence sums give.
        let row_weights: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) / 7.0).collect();
        let row_weights = Tensor::new(row_weights.as_slice(), &dev).unwrap();
        let run = |tiled: bool, dtype: DType, frozen: bool| {
            let x = hidden.to_dtype(dtype).unwrap();
            let w = match frozen {
                true => weight.as_tensor().detach().to_dtype(dtype).unwrap(),
                false => weight.to_dtype(dtype).unwrap(),
            };
            let rows = match tiled {
                true => tiled_token_nll(&x, &w, &targets).unwrap().0,
                false => {
                    let logits = x.matmul(&w.t().unwrap()).unwrap();
                    crate::nn::loss::cross_entropy_tokens(&logits, &targets)
                        .unwrap()
                        .0
                }
            };
            let rows = rows.to_dtype(DType::F32).unwrap();
            let loss = (&rows * &row_weights).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let gh = grads.get(&hidden).unwrap().clone();
            // A frozen head's gradient would be stored under the tensor the loss took.
            let head = if frozen { &w } else { weight.as_tensor() };
            (rows, gh, grads.get(head).cloned())
        };
        for (dtype, value_bound, grad_bound) in
            [(DType::F32, 1e-5, 1e-5), (DType::BF16, 1e-3, 1e-2)]
        {
            one_pass_in_f32_only(&hidden, &weight, dtype);
            let (want, want_gh, want_gw) = run(false, dtype, false);
            let (got, gh, gw) = run(true, dtype, false);
            let (dv, dh, dw) = (
                rel(&got, &want),
                rel(&gh, &want_gh),
                rel(&gw.unwrap(), &want_gw.unwrap()),
            );
            eprintln!("{dtype:?}: rows {dv:e}, hidden gradient {dh:e}, weight gradient {dw:e}");
            assert!(dv < value_bound, "{dtype:?}: row losses {dv:e}");
            assert!(dh < grad_bound, "{dtype:?}: hidden gradient {dh:e}");
            assert!(dw < grad_bound, "{dtype:?}: weight gradient {dw:e}");
            let (frozen, frozen_gh, frozen_gw) = run(true, dtype, true);
            assert!(
                frozen_gw.is_none(),
                "{dtype:?}: a frozen head has no gradient"
            );
            assert_eq!(rel(&frozen, &got), 0.0, "{dtype:?}: frozen rows");
            assert_eq!(
                rel(&frozen_gh, &gh),
                0.0,
                "{dtype:?}: frozen hidden gradient"
            );
            // SFT's summed loss (the fused path in f32, the recomputing one in bf16) too.
            let (x, w) = (
                hidden.to_dtype(dtype).unwrap(),
                weight.as_tensor().detach().to_dtype(dtype).unwrap(),
            );
            let ls = tiled_linear_cross_entropy(&x, &w, &targets).unwrap();
            let grads = ls.sum.backward().unwrap();
            assert!(grads.get(&hidden).is_some(), "{dtype:?}: summed loss");
            assert!(
                grads.get(&w).is_none(),
                "{dtype:?}: a frozen head has no gradient from the summed loss"
            );
        }
    }
}
