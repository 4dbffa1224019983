//! Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 (`linear_attn`), as
//! transformers' Qwen3NextGatedDeltaNet and Qwen3_5GatedDeltaNet compute it:
//! - the projections ([`Projections`]): Qwen3-Next's `in_proj_qkvz` gives per key head its
//!   query and key (`linear_key_head_dim`), and the values and output gates z of the value
//!   heads it serves (`linear_num_value_heads` / `linear_num_key_heads` of
//!   `linear_value_head_dim`), `in_proj_ba` per key head the write strengths' and decays'
//!   logits of those value heads; Qwen3.5's keep them apart: `in_proj_qkv` (every query,
//!   then every key, then every value), `in_proj_z`, `in_proj_b`, `in_proj_a`;
//! - the queries, keys and values (all of one, then all of the next) through a short causal
//!   depthwise convolution (`conv1d.weight` [channels, 1, `linear_conv_kernel_dim`], no
//!   bias) and SiLU;
//! - the gated delta rule (nn::gated_delta) on L2-normalised queries and keys (queries also
//!   scaled by 1/sqrt(dk)), each key head's shared by its value heads, with strengths
//!   sigmoid(b) and log decays -exp(`A_log`) x softplus(a + `dt_bias`);
//! - per value head an RMSNorm of the output times SiLU(z) (`norm.weight`, the gated norm),
//!   and `out_proj`.
//!
//! Packed documents start from a zero state and a convolution that sees none of the
//! document before, as each document alone would (transformers' torch path has no such
//! reset: its packed rows run as one document).
//!
//! Generating, the layer keeps its convolution's last `kernel - 1` inputs and the rule's
//! state in its slot of the cache (`nn::KvCache::state`), as transformers' cache does: the
//! prompt runs in chunks, each new token one step of the rule.
//!
//! Under tensor parallelism the layer is whole on every rank (its inputs are, between
//! layers): the projections are replicated rather than split by heads. Where each rank holds
//! a part of every row:
//! - by heads where the key heads divide by the group (Ulysses always, as its attention does;
//!   context parallelism too): an all-to-all gives each rank the whole rows of its share of
//!   the key heads (ring attention's head-tail chunks put back in order), it runs the
//!   convolution and the rule over them as one process does, and a second all-to-all returns
//!   it its tokens of every head: 1/n of the rule per rank;
//! - by tokens under context parallelism where they do not divide (or `TRL_LINEAR_CP=scan`):
//!   each rank's chunks start from the state the row reaches before them, a scan of the
//!   chunks' maps over the cp group, and their convolution reads the tokens before them
//!   (`context_parallel::linear`): 2/n of the rule per rank, nothing on the wire that grows
//!   with the sequence. Measured on the CPU at Qwen3.5's head size (`bench model`'s
//!   `split_gated_deltanet`), the head split is the faster at cp = 2.

use super::blocks::lin;
use crate::comm::autograd::all_to_all;
use crate::context_parallel::{linear, SeqSplit};
use crate::error::Result;
use crate::models::causal::LayerInputs;
use crate::nn::gated_delta::{l2_normalize, rule, DeltaInputs};
use crate::nn::{Linear, Param};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The sizes of a Gated DeltaNet layer (config.json's `linear_*` keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeltaNetShape {
    pub hidden: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    pub eps: f64,
    /// Tokens per chunk of the rule (flash-linear-attention's 64).
    pub chunk: usize,
    pub projections: Projections,
}

/// How a checkpoint stores the layer's input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projections {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped by key head.
    Grouped,
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Apart,
}

/// `linear_attn`.
#[derive(Debug, Clone, Parallelize)]
pub struct GatedDeltaNet {
    #[parallel(tp = "replicate")]
    in_proj_qkvz: Option<Linear>,
    #[parallel(tp = "replicate")]
    in_proj_ba: Option<Linear>,
    #[parallel(tp = "replicate")]
    in_proj_qkv: Option<Linear>,
    #[parallel(tp = "replicate")]
    in_proj_z: Option<Linear>,
    #[parallel(tp = "replicate")]
    in_proj_b: Option<Linear>,
    #[parallel(tp = "replicate")]
    in_proj_a: Option<Linear>,
    #[parallel(tp = "replicate", name = "conv1d.weight")]
    conv1d: Param,
    #[parallel(tp = "replicate")]
    dt_bias: Param,
    #[parallel(tp = "replicate", name = "A_log")]
    a_log: Param,
    /// The gated norm's weight (`norm.weight`, ones at init: scales by w, not 1 + w).
    #[parallel(tp = "replicate", name = "norm.weight")]
    norm: Param,
    #[parallel(tp = "replicate")]
    out_proj: Linear,
    #[parallel(skip)]
    shape: DeltaNetShape,
}

impl GatedDeltaNet {
    /// From `vb` (the `linear_attn` prefix).
    pub fn new(s: DeltaNetShape, vb: VarBuilder) -> candle_core::Result<Self> {
        let (keys, values) = (s.key_heads * s.key_dim, s.value_heads * s.value_dim);
        let channels = 2 * keys + values;
        let proj = |name: &str, out: usize| lin(vb.pp(name), (s.hidden, out), false).map(Some);
        let grouped = s.projections == Projections::Grouped;
        let (qkvz, ba, qkv, z, b, a) = match grouped {
            true => (
                proj("in_proj_qkvz", 2 * keys + 2 * values)?,
                proj("in_proj_ba", 2 * s.value_heads)?,
                None,
                None,
                None,
                None,
            ),
            false => (
                None,
                None,
                proj("in_proj_qkv", channels)?,
                proj("in_proj_z", values)?,
                proj("in_proj_b", s.value_heads)?,
                proj("in_proj_a", s.value_heads)?,
            ),
        };
        Ok(GatedDeltaNet {
            in_proj_qkvz: qkvz,
            in_proj_ba: ba,
            in_proj_qkv: qkv,
            in_proj_z: z,
            in_proj_b: b,
            in_proj_a: a,
            conv1d: Param::new(&vb.pp("conv1d"), (channels, 1, s.conv_kernel), "weight")?,
            dt_bias: Param::new(&vb, s.value_heads, "dt_bias")?,
            a_log: Param::new(&vb, s.value_heads, "A_log")?,
            norm: Param::new(&vb.pp("norm"), s.value_dim, "weight")?,
            out_proj: lin(vb.pp("out_proj"), (values, s.hidden), false)?,
            shape: s,
        })
    }

    /// The layer's output for `h` [batch, seq, hidden].
    pub fn forward(&self, h: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let parts = self.project(h)?;
        let y = match cx.sequence_split() {
            None => self.mix(parts, 0, &cx.document_starts()?, Some(cx))?,
            // Generation keeps rows whole on each rank (parallel::generate).
            Some(_) if cx.generating() => {
                return Err(crate::Error::Parallelism(
                    "a Gated DeltaNet layer's generation state needs whole rows: generate \
                     without splitting them over cp / sp ranks"
                        .into(),
                ))
            }
            Some(split) if split.ring && linear::scans(self.shape.key_heads, split) => {
                self.mix_scan(parts, split, cx)?
            }
            Some(split) => self.mix_split(parts, split, cx)?,
        };
        Ok(self.out_proj.forward(&y)?)
    }

    /// Under context parallelism or Ulysses: an all-to-all gives each rank the whole rows of
    /// its share of the key heads (and the value heads they serve), which run the
    /// convolution and the rule over the whole sequence as one process does; a second
    /// all-to-all returns each rank its tokens of every head. Ring attention's head-tail
    /// chunks are put in sequence order in between. Returns [b, t, value heads x dv].
    fn mix_split(&self, p: Projected, split: &SeqSplit, cx: &LayerInputs) -> Result<Tensor> {
        let s = self.shape;
        let (b, t, _) = p.q.dims3()?;
        let (nk, nv, dk, dv) = (s.key_heads, s.value_heads, s.key_dim, s.value_dim);
        let per = nv / nk;
        let group = &split.group;
        let size = group.size();
        if !nk.is_multiple_of(size) {
            return Err(crate::Error::Parallelism(format!(
                "Gated DeltaNet (linear_attention) layers split their key heads over the \
                 sp ranks (Ulysses): {nk} linear_num_key_heads do not divide by sp = {size}; \
                 choose an sp size that divides them, or context parallelism (cp), which \
                 splits the rows instead"
            )));
        }
        let local = nk / size;
        let whole = t * size;
        // Where each gathered token sits in the row (ring attention's head-tail chunks are
        // not in order), and the inverse: which gathered token is the row's i-th.
        let gathered: Vec<u32> = split.row_order(t)?.into_iter().map(|i| i as u32).collect();
        let in_order = split.gathered_at(t)?;
        let dev = p.q.device();
        let (gathered, in_order) = (
            Tensor::new(gathered.as_slice(), dev)?,
            Tensor::new(in_order.as_slice(), dev)?,
        );
        let reorder = |x: Tensor, index: &Tensor| -> Result<Tensor> {
            match split.ring {
                true => Ok(x.index_select(index, 1)?),
                false => Ok(x),
            }
        };
        // In the configured dtype over the wire, as Ulysses' attention sends it.
        let exchange = |x: &Tensor, from: usize, to: usize| -> Result<Tensor> {
            let wire = match split.comm_dtype {
                Some(d) if d != x.dtype() => x.to_dtype(d)?,
                _ => x.clone(),
            };
            Ok(all_to_all(&wire, group, from, to)?.to_dtype(x.dtype())?)
        };
        // Per key head: [q | k | v | z | b | a] of the value heads it serves.
        let by_key = |x: &Tensor, w: usize| x.reshape((b, t, nk, w));
        let packed = Tensor::cat(
            &[
                by_key(&p.q, dk)?,
                by_key(&p.k, dk)?,
                by_key(&p.v, per * dv)?,
                by_key(&p.z, per * dv)?,
                by_key(&p.beta_logit, per)?,
                by_key(&p.a, per)?,
            ],
            3,
        )?;
        let mine = reorder(exchange(&packed, 2, 1)?, &in_order)?;
        let part = |from: usize, len: usize| mine.narrow(3, from, len);
        let z_at = 2 * dk + per * dv;
        let parts = Projected {
            q: part(0, dk)?.reshape((b, whole, local * dk))?,
            k: part(dk, dk)?.reshape((b, whole, local * dk))?,
            v: part(2 * dk, per * dv)?.reshape((b, whole, local * per * dv))?,
            z: part(z_at, per * dv)?.reshape((b, whole, local * per, dv))?,
            beta_logit: part(z_at + per * dv, per)?.reshape((b, whole, local * per))?,
            a: part(z_at + per * dv + per, per)?.reshape((b, whole, local * per))?,
        };
        // The whole rows' documents (every rank's positions, gathered once per forward).
        let y = self.mix(parts, group.rank() * local, &cx.document_starts()?, None)?;
        let y = reorder(y.reshape((b, whole, local, per * dv))?, &gathered)?;
        Ok(exchange(&y.contiguous()?, 1, 2)?.reshape((b, t, nv * dv))?)
    }

    /// The convolution, the rule and the gated norm of `p` (its key heads from `first` on,
    /// the value heads they serve) over whole rows with document `starts`; through the
    /// cache of `cx` when it generates. Returns [b, t, value heads x dv].
    fn mix(
        &self,
        p: Projected,
        first: usize,
        starts: &[Vec<bool>],
        cx: Option<&LayerInputs>,
    ) -> Result<Tensor> {
        let s = self.shape;
        let mixed = Tensor::cat(&[&p.q, &p.k, &p.v], 2)?;
        // Generating: this layer's slot of the cache holds the convolution's last inputs and
        // the rule's state after the tokens so far (None before the prompt).
        let held = cx.and_then(|cx| cx.kv_cache()).map(|mut cache| {
            let (slot, state) = cache.state();
            (slot, state, cache.starts().to_vec())
        });
        let conv = self.conv_weight(first, p.q.dim(2)? / s.key_dim)?;
        let (mixed, conv_state) = match &held {
            None => (conv_silu(&mixed, &conv, starts)?, None),
            Some((_, prev, rows)) => {
                let (out, kept) = conv_with_state(&mixed, &conv, starts, prev.as_ref(), rows)?;
                (out, Some(kept))
            }
        };
        let x = self.rule_inputs(&mixed, &p.beta_logit, &p.a, first)?;
        let initial = held
            .as_ref()
            .and_then(|(_, prev, _)| prev.as_ref().map(|p| &p.1));
        // A decoded token is one step of the rule, as transformers' cached decode.
        let (out, last) = rule(&x.with(starts), initial, s.chunk)?;
        if let (Some((slot, _, _)), Some(conv_state), Some(cx)) = (&held, conv_state, cx) {
            if let Some(mut cache) = cx.kv_cache() {
                cache.keep_state(*slot, (conv_state, last))?;
            }
        }
        self.gated_norm(&out, &p.z)
    }

    /// Under context parallelism (ring attention's split): each rank's two chunks of every row
    /// as rows of their own, the convolution led by the tokens before each chunk, and the rule
    /// from the state the row reaches before it (`context_parallel::linear`: a scan of the
    /// chunks' maps over the cp group). Returns [b, t, value heads x dv] for this rank's
    /// tokens.
    fn mix_scan(&self, p: Projected, split: &SeqSplit, cx: &LayerInputs) -> Result<Tensor> {
        let s = self.shape;
        let (b, t, _) = p.q.dims3()?;
        let m = t / 2;
        let whole = cx.document_starts()?;
        let mixed = Tensor::cat(&[&p.q, &p.k, &p.v], 2)?;
        let width = s.conv_kernel - 1;
        let (led, led_starts) = linear::with_halo(&mixed, split, width, &whole)?;
        let conv = self.conv_weight(0, s.key_heads)?;
        let mixed = conv_silu(&led, &conv, &led_starts)?.narrow(1, width, m)?;
        // [b, 2m, ...] -> [2b, m, ...]: each chunk a row.
        let rows = |x: &Tensor| -> Result<Tensor> {
            let mut shape = x.dims().to_vec();
            shape[0] = 2 * b;
            shape[1] = m;
            Ok(x.reshape(shape.as_slice())?)
        };
        let x = self.rule_inputs(&mixed, &rows(&p.beta_logit)?, &rows(&p.a)?, 0)?;
        let starts = linear::chunk_starts(split, &whole, m)?;
        let out = linear::scan_rule(&x.with(&starts), split, s.chunk)?;
        let y = self.gated_norm(&out, &rows(&p.z)?)?;
        Ok(y.reshape((b, t, s.value_heads * s.value_dim))?)
    }

    /// The convolution's weight for `nk` key heads from `first` on: their queries' and keys'
    /// channels, and the values' of the value heads they serve.
    fn conv_weight(&self, first: usize, nk: usize) -> Result<Tensor> {
        let s = self.shape;
        let conv = self.conv1d.value()?;
        if nk == s.key_heads {
            return Ok(conv);
        }
        let (dk, dv) = (s.key_dim, s.value_dim);
        let per = s.value_heads / s.key_heads;
        let keys = s.key_heads * dk;
        Ok(Tensor::cat(
            &[
                conv.narrow(0, first * dk, nk * dk)?,
                conv.narrow(0, keys + first * dk, nk * dk)?,
                conv.narrow(0, 2 * keys + first * per * dv, nk * per * dv)?,
            ],
            0,
        )?)
    }

    /// The rule's inputs from the convolution's activated output `mixed` [b, t, channels of
    /// some key heads from `first` on] and the strengths' and decays' logits [b, t, value
    /// heads]: queries and keys L2-normalised (queries scaled by 1/sqrt(dk)), each key head's
    /// spread over the value heads it serves, all in f32 or wider, heads before tokens.
    fn rule_inputs(
        &self,
        mixed: &Tensor,
        beta_logit: &Tensor,
        a: &Tensor,
        first: usize,
    ) -> Result<RuleInputs> {
        let s = self.shape;
        let (b, t, _) = mixed.dims3()?;
        let (dk, dv) = (s.key_dim, s.value_dim);
        let per = s.value_heads / s.key_heads;
        let nv = beta_logit.dim(2)?;
        let nk = nv / per;
        let keys = nk * dk;
        // [b, t, heads, d] -> [b, heads, t, d]; each key head serves `per` value heads.
        let heads = |x: Tensor, n: usize, d: usize| -> Result<Tensor> {
            Ok(x.reshape((b, t, n, d))?.transpose(1, 2)?.contiguous()?)
        };
        let spread = |x: Tensor| -> Result<Tensor> {
            match per {
                1 => Ok(x),
                _ => {
                    // Key head i serves value heads i x per .. (i + 1) x per.
                    let x = x.unsqueeze(2)?.repeat((1, 1, per, 1, 1))?;
                    Ok(x.reshape((b, nv, t, dk))?)
                }
            }
        };
        let wide = crate::kernels::precision::wide(mixed.dtype());
        let q = heads(mixed.narrow(2, 0, keys)?, nk, dk)?.to_dtype(wide)?;
        let k = heads(mixed.narrow(2, keys, keys)?, nk, dk)?.to_dtype(wide)?;
        let v = heads(mixed.narrow(2, 2 * keys, nv * dv)?, nv, dv)?.to_dtype(wide)?;
        let q = spread((l2_normalize(&q, 1e-6)? / (dk as f64).sqrt())?)?;
        let k = spread(l2_normalize(&k, 1e-6)?)?;
        // Strengths and log decays in f32, as transformers computes them.
        let heads_of = |w: Tensor| w.narrow(0, first * per, nv);
        let beta = candle_nn::ops::sigmoid(&beta_logit.to_dtype(wide)?)?;
        let a = a.to_dtype(wide)?;
        let dt_bias = heads_of(self.dt_bias.value()?)?.to_dtype(wide)?;
        let rate = heads_of(self.a_log.value()?)?.to_dtype(wide)?.exp()?;
        let g = softplus(&a.broadcast_add(&dt_bias)?)?
            .broadcast_mul(&rate)?
            .neg()?;
        Ok(RuleInputs {
            q,
            k,
            v,
            g: g.transpose(1, 2)?.contiguous()?,
            beta: beta.transpose(1, 2)?.contiguous()?,
        })
    }

    /// Per value head an RMSNorm of the rule's output `out` [b, heads, t, dv], times SiLU of
    /// the gate `z` [b, t, heads, dv]: normalised in f32, scaled by its weight in the gate's
    /// dtype (two fused passes each way). Returns [b, t, heads x dv] in `z`'s dtype.
    fn gated_norm(&self, out: &Tensor, z: &Tensor) -> Result<Tensor> {
        let (b, t, nv, dv) = z.dims4()?;
        let (dtype, wide) = (z.dtype(), crate::kernels::precision::wide(z.dtype()));
        let out = out.transpose(1, 2)?.to_dtype(dtype)?;
        let normed = crate::kernels::fused::rms_norm(&out, &self.norm.value()?, self.shape.eps)?;
        let gated = crate::kernels::fused::swiglu(&z.to_dtype(wide)?, &normed.to_dtype(wide)?)?;
        Ok(gated.to_dtype(dtype)?.reshape((b, t, nv * dv))?)
    }
}

/// The rule's inputs of [`GatedDeltaNet::rule_inputs`], owned.
struct RuleInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

impl RuleInputs {
    fn with<'a>(&'a self, starts: &'a [Vec<bool>]) -> DeltaInputs<'a> {
        DeltaInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
            starts,
        }
    }
}

/// The input projections' parts, whatever their layout: q, k [b, t, key heads x dk], v
/// [b, t, value heads x dv], z [b, t, value heads, dv], the strengths' and decays' logits
/// [b, t, value heads].
struct Projected {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    z: Tensor,
    beta_logit: Tensor,
    a: Tensor,
}

impl GatedDeltaNet {
    fn project(&self, h: &Tensor) -> Result<Projected> {
        let s = self.shape;
        let (b, t, _) = h.dims3()?;
        let (nk, nv, dk, dv) = (s.key_heads, s.value_heads, s.key_dim, s.value_dim);
        let per = nv / nk;
        if let (Some(qkvz), Some(ba)) = (&self.in_proj_qkvz, &self.in_proj_ba) {
            // Per key head: [q (dk) | k (dk) | v (per x dv) | z (per x dv)], and
            // [b (per) | a (per)].
            let qkvz = qkvz
                .forward(h)?
                .reshape((b, t, nk, 2 * dk + 2 * per * dv))?;
            let ba = ba.forward(h)?.reshape((b, t, nk, 2 * per))?;
            let part = |x: &Tensor, from: usize, len: usize, heads: usize, d: usize| {
                x.narrow(3, from, len)?.reshape((b, t, heads * d))
            };
            return Ok(Projected {
                q: part(&qkvz, 0, dk, nk, dk)?,
                k: part(&qkvz, dk, dk, nk, dk)?,
                v: part(&qkvz, 2 * dk, per * dv, nv, dv)?,
                z: qkvz
                    .narrow(3, 2 * dk + per * dv, per * dv)?
                    .reshape((b, t, nv, dv))?,
                beta_logit: ba.narrow(3, 0, per)?.reshape((b, t, nv))?,
                a: ba.narrow(3, per, per)?.reshape((b, t, nv))?,
            });
        }
        fn get<'a>(p: &'a Option<Linear>, name: &str) -> candle_core::Result<&'a Linear> {
            p.as_ref()
                .ok_or_else(|| candle_core::Error::Msg(format!("Gated DeltaNet without {name}")))
        }
        let qkv = get(&self.in_proj_qkv, "in_proj_qkv")?.forward(h)?;
        let keys = nk * dk;
        Ok(Projected {
            q: qkv.narrow(2, 0, keys)?,
            k: qkv.narrow(2, keys, keys)?,
            v: qkv.narrow(2, 2 * keys, nv * dv)?,
            z: get(&self.in_proj_z, "in_proj_z")?
                .forward(h)?
                .reshape((b, t, nv, dv))?,
            beta_logit: get(&self.in_proj_b, "in_proj_b")?.forward(h)?,
            a: get(&self.in_proj_a, "in_proj_a")?.forward(h)?,
        })
    }
}

/// log(1 + e^x), stably: max(x, 0) + log(1 + e^-|x|).
fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// [`conv_silu`] in generation: `x` [b, t, channels] continues the rows whose last
/// `kernel - 1` inputs `prev` holds (None: `x` is the prompt, left-padded from `rows`'
/// starts). Returns the activated convolution of `x` and the last `kernel - 1` inputs to hold next, a
/// pad's zeroed (transformers zeroes pads before the layer, so none reaches a token).
fn conv_with_state(
    x: &Tensor,
    w: &Tensor,
    starts: &[Vec<bool>],
    prev: Option<&(Tensor, Tensor)>,
    rows: &[usize],
) -> candle_core::Result<(Tensor, Tensor)> {
    let (b, t, _) = x.dims3()?;
    let kept = w.dim(2)? - 1;
    match prev {
        Some((held, _)) => {
            // The held inputs, then the new ones, as one document.
            let seen = Tensor::cat(&[held, x], 1)?;
            let whole = vec![vec![false; kept + t]; b];
            let out = conv_silu(&seen, w, &whole)?.narrow(1, kept, t)?;
            Ok((out, seen.narrow(1, t, kept)?))
        }
        None => {
            let out = conv_silu(x, w, starts)?;
            let real: Vec<f32> = rows
                .iter()
                .flat_map(|&start| (0..t).map(move |i| f32::from(u8::from(i >= start))))
                .collect();
            let real = Tensor::from_vec(real, (b, t, 1), x.device())?.to_dtype(x.dtype())?;
            let padded = x.broadcast_mul(&real)?.pad_with_zeros(1, kept, 0)?;
            Ok((out, padded.narrow(1, t, kept)?))
        }
    }
}

/// SiLU of the causal convolution ([`causal_conv`]): one fused op on the CPU
/// (`kernels::gated_delta::conv_silu`), Candle's ops elsewhere.
fn conv_silu(x: &Tensor, w: &Tensor, starts: &[Vec<bool>]) -> candle_core::Result<Tensor> {
    use crate::kernels::gated_delta;
    match gated_delta::conv_here(x) {
        true => gated_delta::conv_silu(x, w, &reach(starts, x.dim(1)?)),
        false => causal_conv(x, w, starts)?.silu(),
    }
}

/// Each token's distance back to its document's start, per row of `t` tokens.
fn reach(starts: &[Vec<bool>], t: usize) -> Vec<Vec<usize>> {
    starts
        .iter()
        .map(|row| {
            let mut from = 0;
            (0..t)
                .map(|i| {
                    if row[i] {
                        from = i;
                    }
                    i - from
                })
                .collect()
        })
        .collect()
}

/// The causal depthwise convolution of `x` [b, t, channels] by `w` [channels, 1, kernel]:
/// y_t = sum_j w[., kernel - 1 - j] x_{t - j}, a document's first tokens seeing no earlier
/// document (`starts`).
fn causal_conv(x: &Tensor, w: &Tensor, starts: &[Vec<bool>]) -> candle_core::Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let kernel = w.dim(2)?;
    let reach = reach(starts, t);
    let mut y: Option<Tensor> = None;
    for j in 0..kernel.min(t) {
        // x_{t - j}, zero where that is before the document.
        let shifted = match j {
            0 => x.clone(),
            _ => x.narrow(1, 0, t - j)?.pad_with_zeros(1, j, 0)?,
        };
        let seen: Vec<f32> = reach
            .iter()
            .flat_map(|r| r.iter().map(move |&back| f32::from(u8::from(back >= j))))
            .collect();
        let seen = Tensor::from_vec(seen, (b, t, 1), x.device())?.to_dtype(x.dtype())?;
        let tap = w.narrow(2, kernel - 1 - j, 1)?.squeeze(2)?.squeeze(1)?;
        let term = shifted.broadcast_mul(&seen)?.broadcast_mul(&tap)?;
        y = Some(match y {
            Some(y) => (y + term)?,
            None => term,
        });
    }
    y.ok_or_else(|| candle_core::Error::Msg("an empty convolution kernel".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The convolution equals its definition, and a document's first tokens see nothing of
    /// the one before.
    #[test]
    fn the_convolution_is_causal_per_document() {
        let dev = Device::Cpu;
        let x = Tensor::arange(1f32, 7.0, &dev)
            .unwrap()
            .reshape((1, 6, 1))
            .unwrap();
        let w = Tensor::new(&[[[0.5f32, 2.0, 1.0]]], &dev).unwrap();
        // One document: y_t = x_t + 2 x_{t-1} + 0.5 x_{t-2}.
        let one = [vec![true, false, false, false, false, false]];
        let y: Vec<f32> = causal_conv(&x, &w, &one)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(y, vec![1.0, 4.0, 7.5, 11.0, 14.5, 18.0]);
        // A second document from token 3.
        let two = [vec![true, false, false, true, false, false]];
        let y: Vec<f32> = causal_conv(&x, &w, &two)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(y, vec![1.0, 4.0, 7.5, 4.0, 13.0, 18.0]);
    }

    /// The fused convolution and SiLU equal Candle's ops, values and the gradients of the
    /// input and the taps, on packed rows (documents shorter than the kernel too), in f64
    /// and in f32.
    #[test]
    fn the_fused_convolution_equals_candles_ops() {
        use crate::kernels::gated_delta;
        let dev = Device::Cpu;
        let (b, t, c, kernel) = (2, 70, 5, 4);
        let x = candle_core::Var::randn(0f64, 1.0, (b, t, c), &dev).unwrap();
        let w = candle_core::Var::randn(0f64, 0.5, (c, 1, kernel), &dev).unwrap();
        let mut starts = vec![vec![false; t]; b];
        for (row, at) in [(0, 0), (0, 2), (0, 3), (0, 40), (1, 17)] {
            starts[row][at] = true;
        }
        let weights = Tensor::randn(0f64, 1.0, (b, t, c), &dev).unwrap();
        let run = |y: Tensor| {
            let loss = (y.to_dtype(DType::F64).unwrap() * &weights)
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            let g = |v: &candle_core::Var| grads.get(v.as_tensor()).unwrap().clone();
            (y.to_dtype(DType::F64).unwrap(), g(&x), g(&w))
        };
        let want = run(causal_conv(x.as_tensor(), w.as_tensor(), &starts)
            .unwrap()
            .silu()
            .unwrap());
        let diff = |a: &Tensor, e: &Tensor| {
            (a - e)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let (xd, wd) = (
                x.as_tensor().to_dtype(dtype).unwrap(),
                w.as_tensor().to_dtype(dtype).unwrap(),
            );
            // The layer's `conv_silu` takes the fused op here.
            assert!(
                gated_delta::conv_here(&xd),
                "{dtype:?}: the CPU runs the fused op"
            );
            let got = run(gated_delta::conv_silu(&xd, &wd, &reach(&starts, t)).unwrap());
            assert!(diff(&got.0, &want.0) < tol, "{dtype:?}: values");
            assert!(diff(&got.1, &want.1) < tol, "{dtype:?}: dx");
            assert!(diff(&got.2, &want.2) < tol * 10.0, "{dtype:?}: dw");
        }
    }
}
