//! Attention sinks (gpt-oss's `self_attn.sinks`): one learned logit per head that joins every
//! row's softmax as a key whose value is zero, so a row may give part of its weight to
//! nothing. transformers concatenates it to the scores and drops its column after the softmax.
//!
//! Every blockwise path (the fused CPU and CUDA kernels, the Candle blockwise path, the ring)
//! computes an output `O` and a log-sum-exp `lse` over the real keys. With the sink the
//! log-sum-exp becomes `lse' = log(exp(lse) + exp(sink))` and the output `O' = O exp(lse -
//! lse')` ([`fold`]): no kernel changes. Their backward, given `O'` and `lse'`, is then
//! already the sink's: the probabilities `exp(s - lse')` are the true ones and `rowsum(dO O')`
//! is the true correction. The sink's own gradient, `-sum over rows of exp(sink - lse')
//! rowsum(dO O')`, comes from [`with_sink_gradient`].

use candle_core::{Result, Tensor};

/// `(O', lse')` from a path's `out` [b, heads, n, d] and `lse` (b x heads x n values in any
/// [b, heads, ..., n, ...] layout, heads-major as every path keeps it) for `sinks` [heads]
/// (read detached). `lse'` keeps `lse`'s shape and dtype; `O'` keeps `out`'s.
pub fn fold(out: &Tensor, lse: &Tensor, sinks: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, h, n, _) = out.dims4()?;
    let wide = lse.dtype();
    let l = lse.reshape((b, h, n, 1))?;
    let s = sinks.detach().to_dtype(wide)?.reshape((1, h, 1, 1))?;
    let m = l.broadcast_maximum(&s)?;
    let total = ((l.broadcast_sub(&m))?.exp()? + s.broadcast_sub(&m)?.exp()?)?;
    let folded = (m + total.log()?)?;
    let scale = (l - &folded)?.exp()?;
    let out = out
        .to_dtype(wide)?
        .broadcast_mul(&scale)?
        .to_dtype(out.dtype())?;
    Ok((out, folded.reshape(lse.shape())?))
}

/// `out` (a path's attached `O'`) plus a term that is zero in value and whose gradient with
/// respect to `sinks` [heads] (the graph's parameter) is the sink's: d out / d sink =
/// -O' exp(sink - lse') for `lse'` from [`fold`].
pub fn with_sink_gradient(out: Tensor, lse: &Tensor, sinks: &Tensor) -> Result<Tensor> {
    let (b, h, n, _) = out.dims4()?;
    let wide = lse.dtype();
    let l = lse.detach().reshape((b, h, n, 1))?;
    let s = sinks.to_dtype(wide)?.reshape((1, h, 1, 1))?;
    // p - p.detach() is exactly 0, so the value is out's; its gradient is p's.
    let p = s.broadcast_sub(&l)?.exp()?;
    let zero = (&p - p.detach())?;
    let term = out.detach().to_dtype(wide)?.broadcast_mul(&zero)?;
    let io = out.dtype();
    out - term.to_dtype(io)?
}

/// [`fold`] then the path's backward attached by `attach(O', lse')`, then the sink's gradient:
/// how every blockwise path adds sinks.
pub fn attend_with(
    (out, lse): (Tensor, Tensor),
    sinks: Option<&Tensor>,
    attach: impl FnOnce(Tensor, Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    match sinks {
        None => attach(out, lse),
        Some(sinks) => {
            let (out, lse) = fold(&out, &lse, sinks)?;
            let attached = attach(out, lse.clone())?;
            with_sink_gradient(attached, &lse, sinks)
        }
    }
}
