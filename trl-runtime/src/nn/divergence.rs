//! The divergence between a student's and a teacher's next-token distributions that TRL's
//! DistillationTrainer trains on (its `ChunkedDivergenceFunction`): with `beta` 0 the forward
//! KL(teacher || student), with 1 the reverse KL(student || teacher), in between the
//! generalised Jensen-Shannon divergence beta KL(t || m) + (1 - beta) KL(s || m) with the
//! mixture m = (1 - beta) p_s + beta p_t. Both distributions are of the logits (soft-capped
//! where the model caps them) divided by the temperature; the gradient reaches the student only.
//!
//! Two ways, the same values: [`tiled_divergence`] over whole LM heads, tile by tile, the
//! gradients computed in forward and kept (the [tokens x vocab] logits of neither model ever
//! exist at once), and [`divergence_rows`] over logits a caller already holds, in Candle ops
//! (differentiable), reduced over vocabulary parts by the caller's collectives (tensor
//! parallelism's vocab-split heads).

use crate::kernels::divergence::{RowDivergence, RowFigures};
use crate::kernels::op::inplace_op;
use crate::kernels::precision;
use candle_core::{CpuStorage, DType, Result, Tensor, D};
use std::cell::RefCell;

/// Rows per tile: as many as keep one tile's logits near this many bytes (at least 16 rows).
const TILE_BYTES: usize = 16 << 20;

/// How per-row values over a vocabulary split in parts are combined: the identity for a whole
/// vocabulary; all-reduces over a tensor-parallel group for a vocab-split head.
pub struct VocabParts<'a> {
    /// Row maxima over every part (of detached values).
    pub max: &'a dyn Fn(Tensor) -> Result<Tensor>,
    /// Row sums over every part, for a value every part then uses alike (the loss): each
    /// part's gradient is its own (Megatron's reduce: backward is the identity).
    pub sum: &'a dyn Fn(Tensor) -> Result<Tensor>,
    /// Row sums over every part, for a value each part then uses in its own terms (the
    /// softmax's normaliser): backward sums the parts' gradients too.
    pub shared: &'a dyn Fn(Tensor) -> Result<Tensor>,
}

fn same(t: Tensor) -> Result<Tensor> {
    Ok(t)
}

/// The whole vocabulary in one part.
pub const WHOLE: VocabParts<'static> = VocabParts {
    max: &same,
    sum: &same,
    shared: &same,
};

/// Which divergence `beta` names.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Forward,
    Reverse,
    Jsd(f64),
}

fn kind(beta: f64) -> Kind {
    match beta {
        0.0 => Kind::Forward,
        1.0 => Kind::Reverse,
        b => Kind::Jsd(b),
    }
}

/// log(exp(a) + exp(b)) elementwise, differentiable through both.
fn log_add_exp(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let m = a.maximum(b)?.detach();
    let sum = (a.broadcast_sub(&m)?.exp()? + b.broadcast_sub(&m)?.exp()?)?;
    sum.log()? + m
}

/// Each row's log-softmax of `z` [n, v] over every part.
fn log_softmax(z: &Tensor, parts: &VocabParts<'_>) -> Result<Tensor> {
    let max = (parts.max)(z.detach().max_keepdim(D::Minus1)?)?;
    let shifted = z.broadcast_sub(&max)?;
    let sum = (parts.shared)(shifted.exp()?.sum_keepdim(D::Minus1)?)?;
    shifted.broadcast_sub(&sum.log()?)
}

/// The log-mixture log((1 - beta) p_s + beta p_t).
fn log_mixture(log_ps: &Tensor, log_pt: &Tensor, beta: f64) -> Result<Tensor> {
    log_add_exp(&(log_ps + (1.0 - beta).ln())?, &(log_pt + beta.ln())?)
}

/// Both distributions of a block of rows, computed once for the divergence, the entropy and
/// the divergence's gradient.
struct Rows {
    log_ps: Tensor,
    log_pt: Tensor,
    ps: Tensor,
    pt: Tensor,
    /// The JSD's log-mixture (neither KL has one).
    log_m: Option<Tensor>,
    kind: Kind,
}

impl Rows {
    /// The rows of `zs` (student, its graph kept) and `zt` (teacher, detached), in the wide
    /// dtype.
    fn of(zs: &Tensor, zt: &Tensor, beta: f64, parts: &VocabParts<'_>) -> Result<Self> {
        let wide = precision::wide(zs.dtype());
        let log_ps = log_softmax(&zs.to_dtype(wide)?, parts)?;
        let log_pt = log_softmax(&zt.detach().to_dtype(wide)?, parts)?.detach();
        let kind = kind(beta);
        let log_m = match kind {
            Kind::Jsd(b) => Some(log_mixture(&log_ps, &log_pt, b)?),
            _ => None,
        };
        Ok(Rows {
            ps: log_ps.exp()?,
            pt: log_pt.exp()?,
            log_ps,
            log_pt,
            log_m,
            kind,
        })
    }

    /// Each row's divergence [n], with the student's graph.
    fn divergence(&self, parts: &VocabParts<'_>) -> Result<Tensor> {
        let (ps, pt, log_ps, log_pt) = (&self.ps, &self.pt, &self.log_ps, &self.log_pt);
        let terms = match (self.kind, &self.log_m) {
            (Kind::Jsd(b), Some(log_m)) => {
                let t = ((pt * (log_pt - log_m)?)? * b)?;
                let s = ((ps * (log_ps - log_m)?)? * (1.0 - b))?;
                (t + s)?
            }
            (Kind::Reverse, _) => (ps * (log_ps - log_pt)?)?,
            _ => (pt * (log_pt - log_ps)?)?,
        };
        (parts.sum)(terms.sum_keepdim(D::Minus1)?)?.squeeze(1)
    }

    /// Each row's student entropy [n], detached.
    fn entropy(&self, parts: &VocabParts<'_>) -> Result<Tensor> {
        let (ps, log_ps) = (self.ps.detach(), self.log_ps.detach());
        (parts.sum)((ps * log_ps)?.sum_keepdim(D::Minus1)?.neg()?)?.squeeze(1)
    }

    /// d(divergence)/d(zs) per row, TRL's closed forms (`divergence` [n, 1]: each row's, a
    /// whole vocabulary's rows).
    fn grad(&self, divergence: &Tensor) -> Result<Tensor> {
        let (ps, log_ps, log_pt) = (&self.ps, &self.log_ps, &self.log_pt);
        match (self.kind, &self.log_m) {
            (Kind::Jsd(b), Some(log_m)) => {
                let gap = (log_ps - log_m)?;
                let kl_s = (ps * &gap)?.sum_keepdim(D::Minus1)?;
                (ps * gap.broadcast_sub(&kl_s)?)? * (1.0 - b)
            }
            (Kind::Reverse, _) => ps * (log_ps - log_pt)?.broadcast_sub(divergence)?,
            _ => ps - &self.pt,
        }
    }
}

/// Per row of the student's `zs` and the teacher's `zt` ([n, v] each: logits already divided
/// by the temperature, this part of the vocabulary), the divergence [n] (with `zs`'s graph)
/// and the student's entropy [n] (detached), in f32 (f64 for f64 logits).
pub fn divergence_rows(
    zs: &Tensor,
    zt: &Tensor,
    beta: f64,
    parts: &VocabParts<'_>,
) -> Result<(Tensor, Tensor)> {
    let rows = Rows::of(zs, zt, beta, parts)?;
    Ok((rows.divergence(parts)?, rows.entropy(parts)?))
}

/// A head's logits of `hidden` as the loss takes them: `hidden . weight^T`, soft-capped
/// (`cap * tanh(x / cap)`), divided by the temperature; and tanh's values when capped.
fn scaled_logits(
    hidden: &Tensor,
    weight: &Tensor,
    cap: Option<f64>,
    temperature: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    // In the wide dtype: bf16 logits would round before the softmax (TRL projects to fp32).
    let wide = precision::wide(hidden.dtype());
    let logits = hidden
        .to_dtype(wide)?
        .matmul(&weight.to_dtype(wide)?.t()?)?;
    Ok(match cap {
        Some(c) => {
            let th = (logits / c)?.tanh()?;
            (((&th * c)? / temperature)?, Some(th))
        }
        None => ((logits / temperature)?, None),
    })
}

/// The row pass over a tile of f32 logits on the CPU ([`RowDivergence::rows`]): the
/// student's logits (written with their gradient when `weights` are given), the teacher's read.
struct FusedRows {
    pass: RowDivergence,
    weights: Option<Vec<f64>>,
    figures: RefCell<Vec<RowFigures>>,
}

inplace_op!(FusedRows: InplaceOp2 [this] {
    name: "distillation-divergence-rows",
    cpu(s, sl, t, tl) {
        let (Some((s0, s1)), Some((t0, t1))) = (sl.contiguous_offsets(), tl.contiguous_offsets())
        else {
            candle_core::bail!("divergence rows: contiguous logits expected")
        };
        let (CpuStorage::F32(s), CpuStorage::F32(t)) = (s, t) else {
            candle_core::bail!("divergence rows: f32 logits expected")
        };
        let vocab = sl.dims()[1];
        let rows = this.pass.rows(&mut s[s0..s1], &t[t0..t1], vocab, this.weights.as_deref());
        *this.figures.borrow_mut() = rows;
        Ok(())
    }
});

/// One side of the loss: a model's final hidden states [n, h], its LM head [vocab, h] and
/// its soft-capping (Gemma's final_logit_softcapping).
pub struct HeadSide<'a> {
    pub hidden: &'a Tensor,
    pub weight: &'a Tensor,
    pub softcap: Option<f64>,
}

/// What [`tiled_divergence`] returns.
pub struct TiledDivergence {
    /// sum_i weights_i x divergence_i: a scalar in the wide dtype, whose backward gives the
    /// student's hidden states and head their gradients (computed in forward when `train`).
    pub loss: Tensor,
    /// Each row's divergence and student entropy, [n] each (detached, f64 on the host).
    pub divergence: Vec<f64>,
    pub entropy: Vec<f64>,
}

/// The divergence of `student` from `teacher` (the same rows; heads over the same vocabulary,
/// hidden sizes free) weighted per row by `weights` (f64 per row, 0 for rows that do not
/// count), tile by tile: each tile's logits of both heads, their row statistics, the
/// divergence and (with `train`) the gradient of the student's logits, turned into the
/// gradients of its hidden states and (unless it is frozen, no graph) its head at once.
pub fn tiled_divergence(
    student: HeadSide<'_>,
    teacher: HeadSide<'_>,
    weights: &[f64],
    (beta, temperature): (f64, f64),
    train: bool,
) -> Result<TiledDivergence> {
    let (n, _) = student.hidden.dims2()?;
    let vocab = student.weight.dim(0)?;
    if teacher.weight.dim(0)? != vocab {
        candle_core::bail!(
            "the teacher's head has {} rows, the student's {vocab}: distillation needs one vocabulary",
            teacher.weight.dim(0)?
        );
    }
    let io = student.hidden.dtype();
    let wide = precision::wide(io);
    let weight_grad = train && student.weight.track_op();
    let grads = train && (student.hidden.track_op() || weight_grad);
    let (hs, ws) = (
        student.hidden.detach().contiguous()?,
        student.weight.detach(),
    );
    let (ht, wt) = (
        teacher.hidden.detach().contiguous()?,
        teacher.weight.detach(),
    );
    let rows = (TILE_BYTES / (4 * vocab)).max(16);
    // The row pass on the CPU in f32; elsewhere (f64, GPUs) Candle ops.
    let fused = hs.device().is_cpu() && io == DType::F32 && wt.dtype() == DType::F32;
    // Elsewhere both heads in the wide dtype once (each tile's products run there).
    let (ws_wide, wt_wide) = match fused {
        true => (ws.clone(), wt.clone()),
        false => (ws.to_dtype(wide)?, wt.to_dtype(wide)?),
    };
    let mut loss = 0.0;
    let (mut divergence, mut entropy) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut dhidden = Vec::new();
    let mut dweight: Option<Tensor> = None;
    for start in (0..n).step_by(rows) {
        let len = rows.min(n - start);
        let h = hs.narrow(0, start, len)?;
        let w = &weights[start..start + len];
        if fused {
            // One pass per row over both tiles, the gradient written over the student's.
            let s = h.matmul(&ws.t()?)?.contiguous()?;
            let t = ht.narrow(0, start, len)?.matmul(&wt.t()?)?.contiguous()?;
            let op = FusedRows {
                pass: RowDivergence {
                    beta,
                    temperature,
                    student_cap: student.softcap,
                    teacher_cap: teacher.softcap,
                },
                weights: grads.then(|| w.to_vec()),
                figures: RefCell::new(Vec::new()),
            };
            s.inplace_op2(&t, &op)?;
            for f in op.figures.take() {
                divergence.push(f.divergence);
                entropy.push(f.entropy);
            }
            let tile = &divergence[start..];
            loss += tile.iter().zip(w).map(|(d, w)| d * w).sum::<f64>();
            if grads {
                dhidden.push(s.matmul(&ws)?);
                if weight_grad {
                    let dw = s.t()?.matmul(&h)?;
                    dweight = Some(match dweight {
                        Some(acc) => (acc + dw)?,
                        None => dw,
                    });
                }
            }
            continue;
        }
        let (zs, th) = scaled_logits(&h, &ws_wide, student.softcap, temperature)?;
        let (zt, _) = scaled_logits(
            &ht.narrow(0, start, len)?,
            &wt_wide,
            teacher.softcap,
            temperature,
        )?;
        // Detached: the gradient is the closed form's, applied below.
        let rows = Rows::of(&zs.detach(), &zt, beta, &WHOLE)?;
        let div_rows = rows.divergence(&WHOLE)?;
        let div: Vec<f64> = div_rows.to_dtype(DType::F64)?.to_vec1()?;
        loss += div.iter().zip(w).map(|(d, w)| d * w).sum::<f64>();
        divergence.extend_from_slice(&div);
        entropy.extend(
            rows.entropy(&WHOLE)?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?,
        );
        if !grads {
            continue;
        }
        let per_row = |v: Vec<f64>| Tensor::new(v, zs.device())?.to_dtype(wide)?.unsqueeze(1);
        let dz = rows.grad(&div_rows.unsqueeze(1)?)?;
        // Through the temperature and the cap, weighed by each row's weight.
        let mut dlogits = (dz / temperature)?;
        if let Some(th) = th {
            dlogits = (dlogits * (1.0 - th.sqr()?)?)?;
        }
        // The gradients' products in the wide dtype, accumulated there (TRL's fp32 addmm).
        let dlogits = dlogits.broadcast_mul(&per_row(w.to_vec())?)?;
        dhidden.push(dlogits.matmul(&ws_wide)?.to_dtype(io)?);
        if weight_grad {
            let dw = dlogits.t()?.matmul(&h.to_dtype(wide)?)?;
            dweight = Some(match dweight {
                Some(acc) => (acc + dw)?,
                None => dw,
            });
        }
    }
    let sum = Tensor::new(loss, student.hidden.device())?.to_dtype(wide)?;
    if !grads {
        return Ok(TiledDivergence {
            loss: sum,
            divergence,
            entropy,
        });
    }
    let dh = match dhidden.is_empty() {
        true => hs.zeros_like()?,
        false => Tensor::cat(&dhidden, 0)?,
    };
    let dw = match (weight_grad, dweight) {
        (false, _) => None,
        (true, Some(d)) => Some(d.to_dtype(io)?),
        (true, None) => Some(ws.zeros_like()?),
    };
    let loss = super::tiled_loss::with_kept_grads(student.hidden, student.weight, sum, dh, dw)?;
    Ok(TiledDivergence {
        loss,
        divergence,
        entropy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The tiled, closed-form gradients equal Candle's autograd through the logits, for the
    /// three kinds of divergence, a temperature and soft-capping.
    #[test]
    fn tiled_gradients_equal_autograd_through_the_logits() -> Result<()> {
        let dev = Device::Cpu;
        let (n, hs_dim, ht_dim, vocab) = (37, 8, 12, 29);
        let hs = Var::from_tensor(
            &(Tensor::randn(0f32, 1.0, (n, hs_dim), &dev)?.to_dtype(DType::F64)?),
        )?;
        let ws = Var::from_tensor(
            &(Tensor::randn(0f32, 1.0, (vocab, hs_dim), &dev)?.to_dtype(DType::F64)?),
        )?;
        let ht = Tensor::randn(0f32, 1.0, (n, ht_dim), &dev)?.to_dtype(DType::F64)?;
        let wt = Tensor::randn(0f32, 1.0, (vocab, ht_dim), &dev)?.to_dtype(DType::F64)?;
        let weights: Vec<f64> = (0..n).map(|i| (i % 3) as f64 * 0.25).collect();
        for (beta, temperature, cap) in [
            (0.0, 1.0, None),
            (1.0, 0.7, None),
            (0.5, 1.0, Some(3.0)),
            (0.1, 1.3, None),
        ] {
            let tiled = tiled_divergence(
                HeadSide {
                    hidden: hs.as_tensor(),
                    weight: ws.as_tensor(),
                    softcap: cap,
                },
                HeadSide {
                    hidden: &ht,
                    weight: &wt,
                    softcap: None,
                },
                &weights,
                (beta, temperature),
                true,
            )?;
            let g1 = tiled.loss.backward()?;
            // Through the logits, in Candle ops.
            let (zs, _) = scaled_logits(hs.as_tensor(), ws.as_tensor(), cap, temperature)?;
            let (zt, _) = scaled_logits(&ht, &wt, None, temperature)?;
            let (div, ent) = divergence_rows(&zs, &zt, beta, &WHOLE)?;
            let w = Tensor::new(weights.as_slice(), &dev)?;
            let loss = (div * &w)?.sum_all()?;
            let g2 = loss.backward()?;
            let close = |a: &Tensor, b: &Tensor| -> Result<f64> {
                (a - b)?.abs()?.max_all()?.to_scalar::<f64>()
            };
            let l1 = tiled.loss.to_scalar::<f64>()?;
            assert!((l1 - loss.to_scalar::<f64>()?).abs() < 1e-10, "beta {beta}");
            let e: Vec<f64> = ent.to_vec1()?;
            assert!(e
                .iter()
                .zip(&tiled.entropy)
                .all(|(a, b)| (a - b).abs() < 1e-10));
            for v in [&hs, &ws] {
                let d = close(g1.get(v).unwrap(), g2.get(v).unwrap())?;
                assert!(d < 1e-10, "beta {beta}: gradients differ by {d}");
            }
            // The CPU row pass in f32 gives the same values and gradients.
            let f32v = |t: &Tensor| -> Result<Var> { Var::from_tensor(&t.to_dtype(DType::F32)?) };
            let (hs32, ws32) = (f32v(hs.as_tensor())?, f32v(ws.as_tensor())?);
            let fused = tiled_divergence(
                HeadSide {
                    hidden: hs32.as_tensor(),
                    weight: ws32.as_tensor(),
                    softcap: cap,
                },
                HeadSide {
                    hidden: &ht.to_dtype(DType::F32)?,
                    weight: &wt.to_dtype(DType::F32)?,
                    softcap: None,
                },
                &weights,
                (beta, temperature),
                true,
            )?;
            let g3 = fused.loss.backward()?;
            let lf = fused.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            assert!(
                (lf - l1).abs() < 1e-5 * l1.abs().max(1.0),
                "beta {beta}: {lf} vs {l1}"
            );
            for (v32, v64) in [(&hs32, &hs), (&ws32, &ws)] {
                let a = g3.get(v32).unwrap().to_dtype(DType::F64)?;
                let b = g1.get(v64).unwrap();
                let scale = b.abs()?.max_all()?.to_scalar::<f64>()?;
                let d = close(&a, b)? / scale;
                assert!(
                    d < 1e-4,
                    "beta {beta}: f32 row pass gradients differ by {d} relative"
                );
            }
            // Forward KL of a distribution against itself is 0.
            if beta == 0.0 {
                assert!(l1 > 0.0);
            }
        }
        Ok(())
    }
}
