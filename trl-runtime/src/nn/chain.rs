//! A linear layer together with the reshaping ops around it, as one op of the graph.
//!
//! Candle's graph keeps every op's inputs until the backward, whether or not the backward
//! reads them. A query projection followed by its bias, the head split and rotary kept four
//! [tokens, q] tensors (x W^T, + b, the split copy, the rotated one) where torch keeps the
//! last; an output projection kept its input merged from the heads and its output until the
//! residual add. Each op around the matmul here is linear in its input, so the backward needs
//! none of their results: the chain is computed outside the graph and handed to Candle as one
//! op on `x`, `W` and the bias or residual, whose backward is written below.

use crate::kernels::fused::{self, rotary_transposed, sum_rows, swap_heads};
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::{Result, Tensor};

/// What a projection's output goes through: [tokens, heads * d] to attention's layout
/// [batch, heads, seq, d], rotated by `rotary` (cos, sin [batch, seq, d]) and scaled.
#[derive(Clone)]
pub struct SplitHeads {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rotary: Option<(Tensor, Tensor)>,
    pub scale: Option<f64>,
}

/// The ops around one linear layer `x W^T (+ b)`.
#[derive(Clone, Default)]
pub struct Chain {
    /// The input is attention's output [batch, heads, seq, d], merged to [batch, seq, heads * d].
    pub merge_heads: bool,
    pub split_heads: Option<SplitHeads>,
    /// Added to the output (a residual stream of the output's shape).
    pub residual: Option<Tensor>,
}

impl Chain {
    pub fn split(heads: SplitHeads) -> Self {
        Chain {
            split_heads: Some(heads),
            ..Chain::default()
        }
    }

    /// `merge_heads` then `+ residual` (an output projection).
    pub fn merge_and_add(merge_heads: bool, residual: Option<&Tensor>) -> Self {
        Chain {
            merge_heads,
            residual: residual.cloned(),
            ..Chain::default()
        }
    }

    /// The input as the matmul takes it: [rows, in].
    pub(crate) fn rows_in(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.merge_heads {
            let (b, n, s, d) = x.dims4()?;
            swap_heads(x)?.reshape((b * s, n * d))?
        } else {
            x.clone()
        };
        let inner = x.dim(x.rank() - 1)?;
        x.reshape((x.elem_count() / inner, inner))
    }

    /// The output's shape, for an input `x` and `out` features.
    fn out_dims(&self, x: &Tensor, out: usize) -> Result<Vec<usize>> {
        Ok(match (&self.split_heads, self.merge_heads) {
            (Some(h), _) => vec![h.batch, h.heads, h.seq, h.head_dim],
            (None, true) => {
                let (b, _, s, _) = x.dims4()?;
                vec![b, s, out]
            }
            (None, false) => {
                let mut dims = x.dims().to_vec();
                *dims
                    .last_mut()
                    .expect("a linear layer's input has a feature dim") = out;
                dims
            }
        })
    }

    /// The ops after the matmul but the residual's, on `y` [rows, out] (recorded in the graph
    /// when `y` is: the path of layers the chain does not fuse).
    fn after(&self, y: Tensor, out_dims: &[usize]) -> Result<Tensor> {
        let y = match &self.split_heads {
            Some(h) => {
                let y = swap_heads(&y.reshape((h.batch, h.seq, h.heads, h.head_dim))?)?;
                let y = match &h.rotary {
                    Some((cos, sin)) => fused::rotary(&y, cos, sin)?,
                    None => y,
                };
                match h.scale {
                    Some(s) => (y * s)?,
                    None => y,
                }
            }
            None => y.reshape(out_dims)?,
        };
        Ok(y)
    }

    /// The gradient of `y` [rows, out] from the output's `dout` (the transposed ops of
    /// [`Chain::after`], without the residual's).
    fn before(&self, dout: &Tensor, rows: usize) -> Result<Tensor> {
        let g = match &self.split_heads {
            Some(h) => {
                let g = match h.scale {
                    Some(s) => (dout * s)?,
                    None => dout.clone(),
                };
                let g = match &h.rotary {
                    Some((cos, sin)) => rotary_transposed(&g, cos, sin)?,
                    None => g,
                };
                swap_heads(&g)?
            }
            None => dout.clone(),
        };
        g.reshape((rows, g.elem_count() / rows))
    }

    /// The whole chain on `x` around `linear`, through ordinary (recorded) ops: for layers
    /// whose matmul is not this rank's alone (a row split's all-reduce) or not plain (DoRA).
    pub fn around(
        &self,
        x: &Tensor,
        linear: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let rows = self.rows_in(x)?;
        let y = linear(&rows)?;
        let out = y.dim(1)?;
        let y = self.after(y, &self.out_dims(x, out)?)?;
        match &self.residual {
            Some(r) => r + y,
            None => Ok(y),
        }
    }

    /// The chain computed outside the graph: `x` through it with `w` [out, in], a bias and
    /// an adapter's output `added` (summed with `x W^T` before the ops after the matmul).
    pub(crate) fn compute(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        added: Option<&Tensor>,
    ) -> Result<Tensor> {
        let out_dims = self.out_dims(x, w.dim(0)?)?;
        let b = bias.map(Tensor::detach);
        let y = fused::linear(&self.rows_in(&x.detach())?, &w.detach(), b.as_ref())?;
        let y = match added {
            Some(a) => {
                let a = a.detach().reshape(y.shape())?;
                (y + a)?
            }
            None => y,
        };
        let out = self.after(y, &out_dims)?;
        match &self.residual {
            Some(r) => r.detach() + out,
            None => Ok(out),
        }
    }

    /// The chain on `x` with `w` [out, in] held on this rank and a bias (not with a
    /// residual: [`Chain::residual`] takes the third input), as one op of the graph.
    pub fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if bias.is_some() && self.residual.is_some() {
            candle_core::bail!("a chain takes a bias or a residual, not both");
        }
        let out = self.compute(x, w, bias, None)?;
        let mut inputs = vec![(Role::X, x), (Role::W, w)];
        inputs.extend(bias.map(|b| (Role::Bias, b)));
        inputs.extend(self.residual.as_ref().map(|r| (Role::Residual, r)));
        self.op(inputs, w, out)
    }

    /// The chain on a LoRA layer: its frozen `w` and bias, and the adapter's last matmul
    /// `h B^T` (`h` [..., r] scaled, from the adapter's own ops on [`Chain::rows_in`] of `x`;
    /// `up` its B [out, r]), as one op. The op takes `h` and `B` and runs the matmul itself,
    /// so the graph keeps the r-wide `h` rather than a [rows, out] product; with a residual
    /// (the op's third input) it takes the product instead, recorded in the graph.
    pub fn linear_with_adapter(
        &self,
        x: &Tensor,
        (w, bias): (&Tensor, Option<&Tensor>),
        (h, up): (&Tensor, &Tensor),
    ) -> Result<Tensor> {
        if let Some(r) = &self.residual {
            let added = adapter_product(h, up)?;
            let out = self.compute(x, w, bias, Some(&added))?;
            return self.op(
                vec![(Role::X, x), (Role::Added, &added), (Role::Residual, r)],
                w,
                out,
            );
        }
        // The product is freed before the op copies `out`.
        let added = adapter_product(&h.detach(), &up.detach())?;
        let out = self.compute(x, w, bias, Some(&added))?;
        drop(added);
        self.op(
            vec![(Role::X, x), (Role::Hidden, h), (Role::Up, up)],
            w,
            out,
        )
    }

    /// `out` as the result of one op on `inputs` (two or three), whose backward is
    /// [`Chain::grads`]'.
    fn op(&self, mut inputs: Vec<(Role, &Tensor)>, w: &Tensor, out: Tensor) -> Result<Tensor> {
        if !inputs.iter().any(|(_, t)| t.track_op()) {
            return Ok(out);
        }
        // Candle's ops take one, two or three inputs: two are three with `x` again, unused (the
        // graph holds it already).
        if let [(Role::X, x), _] = inputs[..] {
            inputs.push((Role::Unused, x));
        }
        let op = LinearChain {
            chain: self.clone(),
            w: w.detach(),
            roles: inputs
                .iter()
                .map(|(r, t)| (*r, *r != Role::Unused && t.track_op()))
                .collect(),
        };
        match inputs[..] {
            [(_, a), (_, b), (_, c)] => with_backward3(a, b, c, out, op),
            _ => candle_core::bail!("a linear chain takes two or three inputs"),
        }
    }

    /// The gradients of the chain's inputs (`roles`, each with whether it takes one: the
    /// input itself for `X`, its shape for `Added`) from the output's `dout`.
    pub(crate) fn grads(
        &self,
        w: &Tensor,
        inputs: &[(Role, &Tensor, bool)],
        dout: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let input = |role: Role| {
            inputs
                .iter()
                .find(|(r, ..)| *r == role)
                .map(|(_, t, _)| *t)
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!("a linear chain without its {role:?} input"))
                })
        };
        let x = input(Role::X)?;
        let rows = match self.merge_heads {
            true => x.dim(0)? * x.dim(2)?,
            false => x.elem_count() / x.dim(x.rank() - 1)?,
        };
        let g = self.before(dout, rows)?.to_dtype(w.dtype())?;
        let grad = |role: Role, t: &Tensor| -> Result<Tensor> {
            match role {
                Role::X => {
                    let d = g.matmul(w)?;
                    match self.merge_heads {
                        true => {
                            let (b, n, s, hd) = t.dims4()?;
                            swap_heads(&d.reshape((b, s, n, hd))?)
                        }
                        false => d.reshape(t.shape()),
                    }
                }
                Role::W => g.t()?.matmul(&self.rows_in(x)?),
                Role::Bias => sum_rows(&g),
                Role::Residual => Ok(dout.clone()),
                Role::Added => g.reshape(t.shape()),
                Role::Hidden => {
                    let up = input(Role::Up)?.to_dtype(g.dtype())?;
                    g.matmul(&up)?.to_dtype(t.dtype())?.reshape(t.shape())
                }
                Role::Up => {
                    let h = as_rows(input(Role::Hidden)?)?.to_dtype(g.dtype())?;
                    g.t()?.matmul(&h)?.to_dtype(t.dtype())
                }
                Role::Unused => candle_core::bail!("no gradient for an unused input"),
            }
        };
        inputs
            .iter()
            .map(|&(role, t, wanted)| wanted.then(|| grad(role, t)).transpose())
            .collect()
    }
}

/// An adapter's output `h B^T` [rows, out] for its scaled hidden `h` [..., r] and `B` [out, r].
pub(crate) fn adapter_product(h: &Tensor, up: &Tensor) -> Result<Tensor> {
    as_rows(h)?.matmul(&up.t()?)
}

/// `t` [..., n] as [rows, n].
pub(crate) fn as_rows(t: &Tensor) -> Result<Tensor> {
    let n = t.dim(t.rank() - 1)?;
    t.reshape((t.elem_count() / n, n))
}

/// What an input of a linear chain's op is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    X,
    W,
    Bias,
    Residual,
    /// An adapter's output, added to `x W^T`.
    Added,
    /// An adapter's scaled rank-r hidden `h` and its B: `h B^T` is added to `x W^T`.
    Hidden,
    Up,
    /// Fills an op's third input.
    Unused,
}

struct LinearChain {
    chain: Chain,
    /// The weight, detached (an input too unless it is a frozen LoRA base).
    w: Tensor,
    /// Each input's role and whether it takes a gradient.
    roles: Vec<(Role, bool)>,
}

impl LinearChain {
    fn backward(&self, inputs: &[Tensor], dout: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let with: Vec<_> = self
            .roles
            .iter()
            .zip(inputs)
            .map(|(&(r, wanted), t)| (r, t, wanted))
            .collect();
        self.chain.grads(&self.w, &with, dout)
    }
}

impl Backward3 for LinearChain {
    const NAME: &'static str = "linear-chain";
    fn backward(&self, s: &Saved3) -> Result<[Option<Tensor>; 3]> {
        let mut g = LinearChain::backward(self, &s.inputs, &s.dout)?.into_iter();
        Ok([g.next().flatten(), g.next().flatten(), g.next().flatten()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn var(dims: &[usize], dev: &Device) -> Var {
        Var::from_tensor(&Tensor::randn(0f32, 1.0, dims, dev).unwrap()).unwrap()
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let diff = (a - b).unwrap().sqr().unwrap().sum_all().unwrap();
        let norm = b.sqr().unwrap().sum_all().unwrap();
        (diff.to_scalar::<f32>().unwrap() / norm.to_scalar::<f32>().unwrap().max(1e-30)).sqrt()
    }

    /// Every chain (split + rotary + scale with a bias; merge + residual; LoRA's) against its
    /// math in plain Candle ops: the output and every input's gradient.
    #[test]
    fn a_chain_equals_its_math_in_plain_ops() {
        let dev = Device::Cpu;
        let (b, s, n, d, hidden) = (2, 5, 3, 4, 7);
        let cos_sin = || {
            let angles = Tensor::randn(0f32, 1.0, (b, s, d / 2), &dev).unwrap();
            let angles = Tensor::cat(&[&angles, &angles], 2).unwrap();
            (angles.cos().unwrap(), angles.sin().unwrap())
        };
        let split = Chain::split(SplitHeads {
            batch: b,
            seq: s,
            heads: n,
            head_dim: d,
            rotary: Some(cos_sin()),
            scale: Some(0.5),
        });
        let residual = var(&[b, s, hidden], &dev);
        let merge = Chain::merge_and_add(true, Some(residual.as_tensor()));
        let plain_split = Chain::split(SplitHeads {
            rotary: None,
            scale: None,
            ..split.split_heads.clone().unwrap()
        });
        let cases = [
            (split, vec![b, s, hidden], [n * d, hidden], true),
            (
                plain_split.clone(),
                vec![b, s, hidden],
                [n * d, hidden],
                false,
            ),
            (merge, vec![b, n, s, d], [hidden, n * d], false),
        ];
        for (chain, x_dims, w_dims, with_bias) in cases {
            let x = var(&x_dims, &dev);
            let w = var(&w_dims, &dev);
            let bias = var(&[w_dims[0]], &dev);
            let bias = with_bias.then_some(bias.as_tensor());
            let fused_out = chain.linear(&x, &w, bias).unwrap();
            let plain_out = reference(&chain, &x, &w, bias, None);
            let mut inputs = vec![x.as_tensor(), w.as_tensor()];
            inputs.extend(bias);
            inputs.extend(chain.residual.as_ref());
            same_output_and_grads(&fused_out, &plain_out, &inputs);
        }
        // A LoRA layer: a frozen weight and bias, the adapter's hidden (r 3) and B inputs of
        // the op (its product with a residual: merged rows, the layer merges in the graph
        // first).
        let residual = var(&[b * s, hidden], &dev);
        let adapted = [
            (plain_split.clone(), [b * s, hidden], [n * d, hidden]),
            (
                Chain::merge_and_add(false, Some(residual.as_tensor())),
                [b * s, n * d],
                [hidden, n * d],
            ),
        ];
        for (chain, x_dims, w_dims) in adapted {
            let x = var(&x_dims, &dev);
            let (w, bias) = (var(&w_dims, &dev), var(&[w_dims[0]], &dev));
            let frozen = (&w.as_tensor().detach(), Some(&bias.as_tensor().detach()));
            let (h, up) = (var(&[x_dims[0], 3], &dev), var(&[w_dims[0], 3], &dev));
            let fused_out = chain
                .linear_with_adapter(&x, frozen, (h.as_tensor(), up.as_tensor()))
                .unwrap();
            let added = h.as_tensor().matmul(&up.as_tensor().t().unwrap()).unwrap();
            let plain_out = reference(&chain, &x, frozen.0, frozen.1, Some(&added));
            let mut inputs = vec![x.as_tensor(), h.as_tensor(), up.as_tensor()];
            inputs.extend(chain.residual.as_ref());
            same_output_and_grads(&fused_out, &plain_out, &inputs);
        }
    }

    /// The chain's math in plain Candle ops, none of `Chain`'s own steps (so a wrong step
    /// there cannot agree with itself here): merge by transpose, matmul, bias, the adapter's
    /// output, split by transpose, rotary by `apply_rotary`'s Candle ops, scale, residual.
    fn reference(
        chain: &Chain,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        added: Option<&Tensor>,
    ) -> Tensor {
        let x = match chain.merge_heads {
            true => {
                let (b, n, s, d) = x.dims4().unwrap();
                x.transpose(1, 2).unwrap().reshape((b, s, n * d)).unwrap()
            }
            false => x.clone(),
        };
        let mut y = x.broadcast_matmul(&w.t().unwrap()).unwrap();
        if let Some(b) = bias {
            y = y.broadcast_add(b).unwrap();
        }
        if let Some(a) = added {
            y = (y + a
                .reshape(
                    x.dims()[..x.rank() - 1]
                        .iter()
                        .copied()
                        .chain([w.dim(0).unwrap()])
                        .collect::<Vec<_>>(),
                )
                .unwrap())
            .unwrap();
        }
        if let Some(h) = &chain.split_heads {
            y = y.reshape((h.batch, h.seq, h.heads, h.head_dim)).unwrap();
            y = y.transpose(1, 2).unwrap();
            if let Some((cos, sin)) = &h.rotary {
                y = fused::apply_rotary(&y, cos, sin).unwrap();
            }
            if let Some(scale) = h.scale {
                y = (y * scale).unwrap();
            }
        }
        match &chain.residual {
            Some(r) => (r + y).unwrap(),
            None => y,
        }
    }

    fn same_output_and_grads(fused_out: &Tensor, plain_out: &Tensor, inputs: &[&Tensor]) {
        assert!(rel(fused_out, plain_out) < 1e-6);
        let dout = Tensor::randn(0f32, 1.0, fused_out.shape(), fused_out.device()).unwrap();
        let grads = |o: &Tensor| (o * &dout).unwrap().sum_all().unwrap().backward().unwrap();
        let (gf, gp) = (grads(fused_out), grads(plain_out));
        for t in inputs {
            let (a, e) = (gf.get(t).unwrap(), gp.get(t).unwrap());
            assert!(rel(a, e) < 1e-6, "{:?}: {}", t.dims(), rel(a, e));
        }
    }
}
