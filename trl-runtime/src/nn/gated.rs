//! The gated MLP `down(silu(gate(x)) * up(x))` as two ops of the graph, so that it keeps one
//! [tokens, 2 x intermediate] tensor for backward where separate ops keep three widths (the
//! gate's and up's outputs for SwiGLU's backward, its product for down's):
//!
//! - `gate_up`: one GEMM of `x` against the gate and up weights concatenated, run by the op
//!   into its own output (no copy of this widest tensor; the concatenation is not kept),
//!   giving (gate | up) per row;
//! - `gated_down`: SwiGLU of those rows, the down projection and the residual. Its backward
//!   computes SwiGLU again for down's weight gradient, then writes SwiGLU's input gradient
//!   over (gate | up), which nothing reads after it: the MLP's backward holds 3 intermediate
//!   widths per token (that buffer, and SwiGLU's output or its gradient) where separate ops
//!   held 6.
//!
//! For layers whose weights this rank holds (whole, or split by tp), without biases or
//! adapters (the caller, `models::blocks::gated_mlp`, decides); everything else runs the
//! projections as chains.

use super::chain::as_rows;
use crate::kernels::fused::{self, swiglu_halves, swiglu_halves_grad};
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// `down(silu(x Wg^T) * (x Wu^T)) (+ residual)` for `x` [..., hidden], `gate` and `up`
/// [inter, hidden], `down` [hidden, inter]; the output has `x`'s shape.
pub fn gated_mlp(
    x: &Tensor,
    (gate, up, down): (&Tensor, &Tensor, &Tensor),
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let gu = gate_up(x, gate, up)?;
    gated_down(&gu, down, residual, x.dims())
}

/// x (gate | up)^T as one op whose forward runs the GEMM itself into the op's output (the
/// widest tensor of a layer: a result computed outside the op would be copied into it,
/// `precomputed`). `w`, the concatenated weight, is taken by the forward, so the graph does
/// not keep it (the backward concatenates again); a frozen weight gets no gradient.
struct GateUp {
    w: Mutex<Option<Tensor>>,
}

fn gate_up(x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let w = Tensor::cat(&[gate.detach(), up.detach()], 0)?;
    let op = GateUp {
        w: Mutex::new(Some(w)),
    };
    x.contiguous()?
        .apply_op3(&gate.contiguous()?, &up.contiguous()?, op)
}

impl GateUp {
    /// `x` [..., k] (contiguous, read as [m, k]) times the weight [n, k] read as its
    /// transpose; `pick` gives the weight's storage on `x`'s device.
    fn gemm<S: BackendStorage>(
        &self,
        x: &S,
        xl: &Layout,
        pick: impl Fn(&Storage) -> Option<&S>,
    ) -> Result<(S, Shape)> {
        let w = self.w.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(w) = w else {
            candle_core::bail!("the gated MLP's gate and up projections ran twice")
        };
        let (n, k) = w.dims2()?;
        let m = xl.shape().elem_count() / k;
        let xl = Layout::contiguous_with_offset((m, k), xl.start_offset());
        let wl = w.layout().transpose(0, 1)?;
        let (storage, _) = w.storage_and_layout();
        let Some(ws) = pick(&storage) else {
            candle_core::bail!("the gated MLP: weights on another device than their input")
        };
        Ok((x.matmul(ws, (1, m, n, k), &xl, &wl)?, Shape::from((m, n))))
    }
}

impl CustomOp3 for GateUp {
    fn name(&self) -> &'static str {
        "gated-mlp-gate-up"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.gemm(x, xl, |s| match s {
            Storage::Cpu(s) => Some(s),
            _ => None,
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.gemm(x, xl, |s| match s {
            Storage::Cuda(s) => Some(s),
            _ => None,
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        _: &Tensor,
        dgu: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (xd, dgu) = (x.detach(), dgu.detach());
        let w = Tensor::cat(&[gate.detach(), up.detach()], 0)?;
        let dx = match x.track_op() {
            true => Some(dgu.matmul(&w)?.reshape(x.shape())?),
            false => None,
        };
        drop(w);
        if !gate.track_op() && !up.track_op() {
            return Ok((dx, None, None));
        }
        // One GEMM for both weights; each gradient is its half (a contiguous view).
        let inter = gate.dim(0)?;
        let dw = dgu.t()?.matmul(&as_rows(&xd)?)?;
        let (dgate, dup) = (dw.narrow(0, 0, inter)?, dw.narrow(0, inter, inter)?);
        Ok((dx, Some(dgate), Some(dup)))
    }
}

struct GatedDown {
    residual: bool,
    /// Whether the down weight takes a gradient (not when frozen).
    down_tracked: bool,
    /// Set by the backward, which overwrites its input: a second one would read gradients.
    spent: AtomicBool,
}

fn gated_down(
    gu: &Tensor,
    down: &Tensor,
    residual: Option<&Tensor>,
    x_dims: &[usize],
) -> Result<Tensor> {
    let act = swiglu_halves(&gu.detach())?;
    let y = fused::linear(&act, &down.detach(), None)?;
    drop(act);
    let mut dims = x_dims.to_vec();
    *dims.last_mut().expect("an MLP's input has a feature dim") = down.dim(0)?;
    let y = y.reshape(dims)?;
    let y = match residual {
        Some(r) => (r.detach() + y)?,
        None => y,
    };
    let op = GatedDown {
        residual: residual.is_some(),
        down_tracked: down.track_op(),
        spent: AtomicBool::new(false),
    };
    // Candle's ops take one to three inputs: without a residual the third is `gu` again,
    // unused (the graph holds it already).
    with_backward3(gu, down, residual.unwrap_or(gu), y, op)
}

impl Backward3 for GatedDown {
    const NAME: &'static str = "the gated MLP's down projection";

    fn backward(&self, saved: &Saved3) -> Result<[Option<Tensor>; 3]> {
        if self.spent.swap(true, Ordering::Relaxed) {
            candle_core::bail!("the gated MLP ran its backward twice");
        }
        let ([gu, down, _], dy) = (&saved.inputs, &saved.dout);
        let dy_rows = as_rows(dy)?;
        // Down's weight gradient from SwiGLU computed again (not kept from forward).
        let ddown = match self.down_tracked {
            true => Some(dy_rows.t()?.matmul(&swiglu_halves(gu)?)?),
            false => None,
        };
        let dact = dy_rows.matmul(down)?;
        // Only this op reads `gu` (gate_up's backward takes its gradient, not its value).
        let dgu = swiglu_halves_grad(gu, &dact)?;
        drop(dact);
        let dresidual = self.residual.then(|| dy.clone());
        Ok([Some(dgu), ddown, dresidual])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Output and every gradient (x, the three weights, the residual) against Candle's ops,
    /// in f32 and bf16, with and without a residual.
    #[test]
    fn gated_mlp_equals_candle_ops() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16] {
            for with_residual in [true, false] {
                let var = |shape: &[usize], seed: f64| -> Result<Var> {
                    let n: usize = shape.iter().product();
                    let v: Vec<f32> = (0..n)
                        .map(|i| ((i as f64 * 0.7312 + seed).sin() * 0.5) as f32)
                        .collect();
                    Var::from_tensor(&Tensor::from_vec(v, shape, &dev)?.to_dtype(dtype)?)
                };
                let (h, inter) = (24, 40);
                let x = var(&[2, 5, h], 0.1)?;
                let (g, u, d) = (
                    var(&[inter, h], 0.2)?,
                    var(&[inter, h], 0.3)?,
                    var(&[h, inter], 0.4)?,
                );
                let r = var(&[2, 5, h], 0.5)?;
                let weights = var(&[2, 5, h], 0.6)?.as_tensor().detach();
                let residual = with_residual.then(|| r.as_tensor());
                let run = |fused_path: bool| -> Result<(Tensor, Vec<Tensor>)> {
                    let y = if fused_path {
                        gated_mlp(
                            x.as_tensor(),
                            (g.as_tensor(), u.as_tensor(), d.as_tensor()),
                            residual,
                        )?
                    } else {
                        let a = x.as_tensor().broadcast_matmul(&g.as_tensor().t()?)?;
                        let b = x.as_tensor().broadcast_matmul(&u.as_tensor().t()?)?;
                        let y = (a.silu()? * b)?.broadcast_matmul(&d.as_tensor().t()?)?;
                        match residual {
                            Some(r) => (r + y)?,
                            None => y,
                        }
                    };
                    let grads = (&y * &weights)?.sum_all()?.backward()?;
                    let mut all = vec![];
                    for v in [&x, &g, &u, &d] {
                        all.push(grads.get(v.as_tensor()).expect("a gradient").clone());
                    }
                    if with_residual {
                        all.push(grads.get(r.as_tensor()).expect("a gradient").clone());
                    }
                    Ok((y, all))
                };
                let (y, grads) = run(true)?;
                let (y_ref, grads_ref) = run(false)?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 3e-2 };
                let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
                    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
                    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
                    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
                };
                assert!(diff(&y, &y_ref)? < tol, "{dtype:?} output");
                for (i, (a, b)) in grads.iter().zip(&grads_ref).enumerate() {
                    let e = diff(a, b)?;
                    assert!(
                        e < tol,
                        "{dtype:?} residual {with_residual}: gradient {i} off by {e}"
                    );
                }
            }
        }
        Ok(())
    }
}
