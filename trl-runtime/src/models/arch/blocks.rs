//! Blocks the built-in models share, each a plain `#[derive(Parallelize)]` struct with its tp
//! plan: self-attention (grouped-query heads, optional q/k norms, rotary, an optional sliding
//! window), the gated MLP (SwiGLU, or GeGLU with tanh GELU), and the [`Decoder`] body
//! (embedding, layers, final norm, LM head) that makes a model file's [`Layer`] a model.

use crate::comm::autograd::{copy_to_group, reduce_from_group};
use crate::error::{Error, Result};
use crate::kernels::fused::{rotary as apply_rotary, swap_heads};
use crate::models::causal::{CausalModel, LayerInputs};
use crate::nn::chain::{Chain, SplitHeads};
use crate::nn::tiled_mlp::tiled_swiglu;
use crate::nn::{embedding, linear, linear_no_bias, rms_norm};
use crate::nn::{Embedding, Linear, Param, RmsNorm, RotaryEmbedding, Weight, Window};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use std::sync::Arc;

/// A linear layer from `vb`, with or without a bias.
pub fn lin(vb: VarBuilder, (i, o): (usize, usize), bias: bool) -> candle_core::Result<Linear> {
    match bias {
        true => linear(i, o, vb),
        false => linear_no_bias(i, o, vb),
    }
}

/// Self-attention as transformers' Llama family writes it (`self_attn.{q,k,v,o}_proj`): q/k/v
/// column-parallel, o row-parallel, head counts divided by the tp size.
#[derive(Debug, Clone, Parallelize)]
pub struct SelfAttention {
    #[parallel(tp = "column")]
    pub q_proj: Linear,
    #[parallel(tp = "column")]
    pub k_proj: Linear,
    #[parallel(tp = "column")]
    pub v_proj: Linear,
    #[parallel(tp = "row")]
    pub o_proj: Linear,
    // Per-head norms (Qwen3, Gemma 3): they act on the heads this rank holds, so under tp
    // their gradients are partial sums (found at the first step; this struct's unannotated
    // parameters are `auto`).
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    /// q/k norms over the whole projection (OLMo 2) instead of each head: under tp the
    /// projection is gathered for the norm (all-gather forward, reduce-scatter backward).
    #[parallel(skip)]
    pub norm_whole_projection: bool,
    /// Query and key/value heads on this rank.
    #[parallel(tp = "divide")]
    pub num_heads: usize,
    #[parallel(tp = "divide")]
    pub num_kv_heads: usize,
    #[parallel(skip)]
    pub head_dim: usize,
    /// Queries are scaled by this times 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar);
    /// None: 1/sqrt(head_dim) alone.
    #[parallel(skip)]
    pub query_scale: Option<f64>,
    /// Scores soft-capped at this (Gemma 2's attn_logit_softcapping); None: not capped.
    #[parallel(skip)]
    pub softcap: Option<f64>,
    /// Attention sinks, one logit per query head (gpt-oss's `self_attn.sinks`), split with
    /// the heads under tp (as q_proj's output).
    pub sinks: Option<Param>,
    /// Rotary on the first this many features of each head (partial rotary: GLM-4); None:
    /// all of them.
    #[parallel(skip)]
    pub rotary_dim: Option<usize>,
}

/// How a model's RMSNorms scale: by the weight, or Gemma's (1 + weight).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormKind {
    pub eps: f64,
    pub gemma: bool,
}

impl NormKind {
    /// A norm of `size` features from `vb`.
    pub fn build(self, size: usize, vb: VarBuilder) -> candle_core::Result<RmsNorm> {
        let norm = rms_norm(size, self.eps, vb)?;
        Ok(match self.gemma {
            true => RmsNorm::gemma(norm.weight, self.eps),
            false => norm,
        })
    }
}

/// The shapes of a [`SelfAttention`].
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: QkNorm,
    /// See [`SelfAttention::query_scale`].
    pub query_scale: Option<f64>,
    /// See [`SelfAttention::softcap`].
    pub softcap: Option<f64>,
    /// Whether it has [`SelfAttention::sinks`].
    pub sinks: bool,
    /// See [`SelfAttention::rotary_dim`].
    pub rotary_dim: Option<usize>,
}

/// The q/k RMSNorms of a [`SelfAttention`], applied before rotary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QkNorm {
    None,
    /// Over each head's features (Qwen3, Gemma 3).
    PerHead(NormKind),
    /// Over the whole q and k projections (OLMo 2).
    WholeProjection(NormKind),
}

impl SelfAttention {
    /// From `vb` (the `self_attn` prefix).
    pub fn new(s: AttentionShape, vb: VarBuilder) -> candle_core::Result<Self> {
        let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let (kind, sizes) = match s.qk_norm {
            QkNorm::None => (None, (0, 0)),
            QkNorm::PerHead(n) => (Some(n), (s.head_dim, s.head_dim)),
            QkNorm::WholeProjection(n) => (Some(n), (q, kv)),
        };
        let norm = |name: &str, size: usize| kind.map(|n| n.build(size, vb.pp(name))).transpose();
        Ok(SelfAttention {
            q_proj: lin(vb.pp("q_proj"), (s.hidden, q), s.qkv_bias)?,
            k_proj: lin(vb.pp("k_proj"), (s.hidden, kv), s.qkv_bias)?,
            v_proj: lin(vb.pp("v_proj"), (s.hidden, kv), s.qkv_bias)?,
            o_proj: lin(vb.pp("o_proj"), (q, s.hidden), s.o_bias)?,
            q_norm: norm("q_norm", sizes.0)?,
            k_norm: norm("k_norm", sizes.1)?,
            norm_whole_projection: matches!(s.qk_norm, QkNorm::WholeProjection(_)),
            num_heads: s.heads,
            num_kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            query_scale: s.query_scale.filter(|x| (x - 1.0).abs() > 1e-12),
            softcap: s.softcap,
            sinks: match s.sinks {
                true => Some(Param::new(&vb, s.heads, "sinks")?.split_column(0)),
                false => None,
            },
            rotary_dim: s.rotary_dim,
        })
    }

    /// Attention over `h` [batch, seq, hidden] with `rope` (None: no rotary, SmolLM3's NoPE
    /// layers) within `window` (None: every earlier key of the document).
    pub fn forward(
        &self,
        h: &Tensor,
        cx: &LayerInputs,
        rope: Option<&RotaryEmbedding>,
        window: Option<Window>,
    ) -> Result<Tensor> {
        self.forward_add(h, None, cx, rope, window)
    }

    /// `residual + attention(h)`: the residual is added inside the output projection's op,
    /// so the graph keeps neither the projection's input merged from the heads nor its
    /// output ([`Chain`]).
    pub fn forward_add(
        &self,
        h: &Tensor,
        residual: Option<&Tensor>,
        cx: &LayerInputs,
        rope: Option<&RotaryEmbedding>,
        window: Option<Window>,
    ) -> Result<Tensor> {
        let heads = self.heads();
        let projections = (&self.q_proj, &self.k_proj, &self.v_proj);
        let (q, k, v) = heads.project(projections, h, cx, rope)?;
        let a = heads.attend_heads(&q, &k, &v, cx, window)?;
        let out = Chain::merge_and_add(true, residual);
        Ok(self.o_proj.forward_chain(&a, &out)?)
    }

    /// What happens between its projections.
    pub fn heads(&self) -> Heads<'_> {
        Heads {
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            q_norm: self.q_norm.as_ref(),
            k_norm: self.k_norm.as_ref(),
            norm_whole_projection: self.norm_whole_projection,
            query_scale: self.query_scale,
            softcap: self.softcap,
            sinks: self.sinks.as_ref(),
            rotary_dim: self.rotary_dim,
        }
    }
}

/// Attention between the projections: heads split, q/k norms, rotary (on the first
/// `rotary_dim` features of each head when given: partial rotary), the query scale, and
/// attention within an optional window.
#[derive(Debug, Clone, Copy)]
pub struct Heads<'a> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub q_norm: Option<&'a RmsNorm>,
    pub k_norm: Option<&'a RmsNorm>,
    pub norm_whole_projection: bool,
    pub query_scale: Option<f64>,
    pub softcap: Option<f64>,
    pub sinks: Option<&'a Param>,
    pub rotary_dim: Option<usize>,
}

impl Heads<'_> {
    /// Projections q [b, s, heads * d] and k, v [b, s, kv_heads * d] (this rank's heads) to
    /// attention's output [b, s, heads * d], before the output projection.
    pub fn attend(
        &self,
        (q, k, v): (Tensor, Tensor, Tensor),
        cx: &LayerInputs,
        rope: Option<&RotaryEmbedding>,
        window: Option<Window>,
    ) -> Result<Tensor> {
        let (b, s, _) = q.dims3()?;
        let cos_sin = rope.map(|r| cx.cos_sin(r)).transpose()?;
        let [pq, pk, pv] = self.parts(cos_sin.as_ref());
        let q = self.heads_of(q, pq, cx)?;
        let k = self.heads_of(k, pk, cx)?;
        let v = self.heads_of(v, pv, cx)?;
        let a = self.attend_heads(&q, &k, &v, cx, window)?;
        Ok(swap_heads(&a)?.reshape((b, s, self.heads * self.head_dim))?)
    }

    /// q [b, heads, s, d] and k, v [b, kv_heads, s, d] from `h` [b, s, hidden] through the
    /// three projections, each with the ops after it in its op where nothing between needs
    /// its input kept (a per-head norm does: it comes after the head split).
    pub fn project(
        &self,
        (q, k, v): (&Linear, &Linear, &Linear),
        h: &Tensor,
        cx: &LayerInputs,
        rope: Option<&RotaryEmbedding>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let cos_sin = rope.map(|r| cx.cos_sin(r)).transpose()?;
        let [pq, pk, pv] = self.parts(cos_sin.as_ref());
        Ok((
            self.project_one(q, h, pq, cx)?,
            self.project_one(k, h, pk, cx)?,
            self.project_one(v, h, pv, cx)?,
        ))
    }

    /// What follows the q, k and v projections.
    fn parts<'t>(&'t self, cos_sin: Option<&'t (Tensor, Tensor)>) -> [Part<'t>; 3] {
        let part = |heads, norm, rotary, scale| Part {
            heads,
            norm,
            cos_sin: cos_sin.filter(|_| rotary),
            scale,
        };
        [
            part(self.heads, self.q_norm, true, self.query_scale),
            part(self.kv_heads, self.k_norm, true, None),
            part(self.kv_heads, None, false, None),
        ]
    }

    fn project_one(&self, proj: &Linear, h: &Tensor, p: Part, cx: &LayerInputs) -> Result<Tensor> {
        if p.norm.is_some() && self.norm_whole_projection {
            return self.heads_of(proj.forward(h)?, p, cx);
        }
        let (b, s, _) = h.dims3()?;
        let fold = p.norm.is_none() && self.partial_rotary().is_none();
        let split = SplitHeads {
            batch: b,
            seq: s,
            heads: p.heads,
            head_dim: self.head_dim,
            rotary: p.cos_sin.filter(|_| fold).cloned(),
            scale: p.scale.filter(|_| fold),
        };
        let y = proj.forward_chain(h, &Chain::split(split))?;
        if fold {
            return Ok(y);
        }
        let y = match p.norm {
            Some(n) => n.forward(&y)?,
            None => y,
        };
        self.rotate_and_scale(y, p.cos_sin, p.scale)
    }

    /// A projection's output [b, s, n * d] as heads [b, n, s, d]: q/k norm (over the whole
    /// projection before the split, or per head after it), rotary, the query scale.
    fn heads_of(&self, y: Tensor, p: Part, cx: &LayerInputs) -> Result<Tensor> {
        let (b, s, _) = y.dims3()?;
        let (whole, norm, scale) = (self.norm_whole_projection, p.norm, p.scale);
        let y = match norm {
            Some(norm) if whole => norm_whole(&y, norm, cx)?,
            _ => y,
        };
        let y = swap_heads(&y.reshape((b, s, p.heads, self.head_dim))?)?;
        let y = match norm {
            Some(norm) if !whole => norm.forward(&y)?,
            _ => y,
        };
        self.rotate_and_scale(y, p.cos_sin, scale)
    }

    /// Rotary on the first `rotary_dim` features of each head when it is shorter (partial).
    fn partial_rotary(&self) -> Option<usize> {
        self.rotary_dim.filter(|&r| r < self.head_dim)
    }

    fn rotate_and_scale(
        &self,
        t: Tensor,
        cos_sin: Option<&(Tensor, Tensor)>,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        let d = self.head_dim;
        let t = match (cos_sin, self.partial_rotary()) {
            (None, _) => t,
            (Some((cos, sin)), None) => apply_rotary(&t, cos, sin)?,
            (Some((cos, sin)), Some(r)) => Tensor::cat(
                &[
                    apply_rotary(&t.narrow(3, 0, r)?.contiguous()?, cos, sin)?,
                    t.narrow(3, r, d - r)?,
                ],
                3,
            )?,
        };
        Ok(match scale {
            Some(scale) => (t * scale)?,
            None => t,
        })
    }

    /// Attention of heads q [b, heads, s, d] over k, v [b, kv_heads, s, d]: [b, heads, s, d].
    pub fn attend_heads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cx: &LayerInputs,
        window: Option<Window>,
    ) -> Result<Tensor> {
        let sinks = self.sinks.map(Param::value).transpose()?;
        Ok(cx.attention_with(q, k, v, window, self.softcap, sinks.as_ref())?)
    }
}

/// What follows one of the q, k, v projections: its heads on this rank, its norm, rotary
/// (None: not rotated) and scale.
#[derive(Clone, Copy)]
struct Part<'a> {
    heads: usize,
    norm: Option<&'a RmsNorm>,
    cos_sin: Option<&'a (Tensor, Tensor)>,
    scale: Option<f64>,
}

/// `norm` over the last dimension of `t`, a projection split over tp when layers are: the
/// ranks' parts are gathered, normed whole, and this rank's part kept. The all-gather's
/// backward sums the ranks' partial gradients of the whole projection.
fn norm_whole(t: &Tensor, norm: &RmsNorm, cx: &LayerInputs) -> Result<Tensor> {
    let Some(tp) = cx.tp().filter(|tp| tp.size() > 1) else {
        return Ok(norm.forward(t)?);
    };
    let last = t.rank() - 1;
    let local = t.dim(last)?;
    let whole = crate::comm::autograd::all_gather(t, tp, last)?;
    Ok(norm
        .forward(&whole)?
        .narrow(last, tp.rank() * local, local)?)
}

/// Features of each head [b, heads, s, d] reordered: the even ones, then the odd ones (the
/// first and second of each rotary pair).
pub fn deinterleave(t: &Tensor) -> candle_core::Result<Tensor> {
    let d = t.dim(3)?;
    let order: Vec<u32> = (0..d as u32)
        .step_by(2)
        .chain((1..d as u32).step_by(2))
        .collect();
    let order = Tensor::new(order.as_slice(), t.device())?;
    t.contiguous()?.index_select(&order, 3)
}

/// A query scale by position: 1 + beta x log(1 + floor((p + offset) / divisor)) at
/// `positions` [b, s], as [b, 1, s, 1] in f32. Llama 4's NoPE temperature (offset 1,
/// `floor_scale`, `attn_scale`) and Mistral 4's `llama_4_scaling_beta` (offset 0,
/// `original_max_position_embeddings`).
pub fn log_position_scale(
    positions: &Tensor,
    (offset, divisor): (f64, f64),
    beta: f64,
) -> candle_core::Result<Tensor> {
    let p = positions.to_dtype(candle_core::DType::F64)?;
    let t = (((p + offset)? / divisor)?.floor()? + 1.0)?.log()?;
    let t = ((t * beta)? + 1.0)?.to_dtype(candle_core::DType::F32)?;
    t.unsqueeze(1)?.unsqueeze(3)
}

/// The gate's activation of a [`GatedMlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): Llama, Qwen, Mistral.
    Silu,
    /// GELU, tanh approximation (GeGLU: Gemma's gelu_pytorch_tanh).
    GeluTanh,
}

impl Activation {
    /// `act(gate) * up`, the gated MLP's product.
    pub fn gate(self, gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Activation::Silu => crate::kernels::fused::swiglu(gate, up),
            Activation::GeluTanh => gate.gelu()? * up,
        }
    }

    /// transformers' `hidden_act` / `hidden_activation` name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Activation::GeluTanh),
            _ => None,
        }
    }
}

/// `down(act(gate(x)) * up(x))` (`mlp.{gate,up,down}_proj`): gate and up column-parallel,
/// down row-parallel.
#[derive(Debug, Clone, Parallelize)]
pub struct GatedMlp {
    #[parallel(tp = "column")]
    pub gate_proj: Linear,
    #[parallel(tp = "column")]
    pub up_proj: Linear,
    #[parallel(tp = "row")]
    pub down_proj: Linear,
    #[parallel(skip)]
    pub act: Activation,
}

impl GatedMlp {
    /// The MLP with its projections within peft's reach or not ([`Linear::seen_by_peft`]).
    pub fn seen_by_peft(self, seen: bool) -> Self {
        GatedMlp {
            gate_proj: self.gate_proj.seen_by_peft(seen),
            up_proj: self.up_proj.seen_by_peft(seen),
            down_proj: self.down_proj.seen_by_peft(seen),
            ..self
        }
    }

    pub fn new(
        (hidden, inter): (usize, usize),
        bias: bool,
        act: Activation,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        Ok(GatedMlp {
            gate_proj: lin(vb.pp("gate_proj"), (hidden, inter), bias)?,
            up_proj: lin(vb.pp("up_proj"), (hidden, inter), bias)?,
            down_proj: lin(vb.pp("down_proj"), (inter, hidden), bias)?,
            act,
        })
    }

    /// The MLP of `h` [batch, seq, hidden] ([`gated_mlp`]).
    pub fn forward(&self, cx: &LayerInputs, h: &Tensor) -> Result<Tensor> {
        let projections = (&self.gate_proj, &self.up_proj, &self.down_proj);
        gated_mlp(projections, self.act, cx, h, None)
    }

    /// `residual + mlp(h)`, the residual added inside the down projection's op.
    pub fn forward_add(&self, cx: &LayerInputs, h: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let projections = (&self.gate_proj, &self.up_proj, &self.down_proj);
        gated_mlp(projections, self.act, cx, h, Some(residual))
    }
}

/// `down(act(gate(h)) * up(h))` for `h` [batch, seq, hidden], plus `residual` if given. SwiGLU
/// with the weights held whole on this rank and no biases runs as `nn::gated`'s two ops, or
/// with `tiled_mlp` in sequence tiles that keep no [tokens x intermediate] activations;
/// otherwise each projection is a chain.
pub fn gated_mlp(
    (gate, up, down): (&Linear, &Linear, &Linear),
    act: Activation,
    cx: &LayerInputs,
    h: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    // The tiled kernel reads the weights alone: not for biases or LoRA adapters.
    let no_bias = [gate, up, down]
        .iter()
        .all(|l| l.bias.is_none() && l.lora.is_none());
    let whole = match (&gate.weight, &up.weight, &down.weight) {
        (Weight::Local(g), Weight::Local(u), Weight::Local(d)) => Some((g, u, d)),
        _ => None,
    };
    // Generation's few rows: each projection on its own (the fused ops concatenate the gate
    // and up weights, for training's sake).
    let plain = no_bias && act == Activation::Silu && !cx.generating();
    let Some((g, u, d)) = whole.filter(|_| plain) else {
        let mlp = act.gate(&gate.forward(h)?, &up.forward(h)?)?;
        return Ok(down.forward_chain(&mlp, &Chain::merge_and_add(false, residual))?);
    };
    // Untiled, one rank: the two ops of `nn::gated` (one (gate | up) tensor kept for
    // backward), the residual added inside.
    if !cx.tiled_mlp && cx.tp().is_none() {
        return Ok(crate::nn::gated::gated_mlp(h, (g, u, d), residual)?);
    }
    let hidden = h.dim(h.rank() - 1)?;
    let x = h.reshape((h.elem_count() / hidden, hidden))?;
    // Under tp: Megatron's f before the column-split gate/up and g after the row-split down,
    // the residual added after the sum.
    let x = match cx.tp() {
        Some(tp) => copy_to_group(&x, tp)?,
        None => x,
    };
    let y = match cx.tiled_mlp {
        true => tiled_swiglu(&x, &Tensor::cat(&[g, u], 0)?, d)?,
        false => crate::nn::gated::gated_mlp(&x, (g, u, d), None)?,
    };
    let y = match cx.tp() {
        Some(tp) => reduce_from_group(&y, tp)?,
        None => y,
    };
    let y = y.reshape(h.shape())?;
    Ok(match residual {
        Some(r) => (r + y)?,
        None => y,
    })
}

/// The attention half of Llama's layer order, which the mixtures of experts share:
/// `x + attention(input_layernorm(x))`, then `post_attention_layernorm` of that for the MLP.
/// A layer holds it under `#[parallel(name = "")]`, so its parameters keep transformers'
/// names (`input_layernorm.weight`, `self_attn.q_proj.weight`, ...).
#[derive(Debug, Clone, Parallelize)]
pub struct PreNormAttention {
    input_layernorm: RmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    /// The rotary table (shared by the layers), None on SmolLM3's NoPE layers.
    #[parallel(skip)]
    rope: Option<Arc<RotaryEmbedding>>,
    /// The attention window, sliding or chunked (None: full attention).
    #[parallel(skip)]
    window: Option<Window>,
}

impl PreNormAttention {
    /// From a layer's `vb`, with its rotary table and window.
    pub fn new(
        (norm, shape): (NormKind, AttentionShape),
        (rope, window): (Option<Arc<RotaryEmbedding>>, Option<Window>),
        vb: &VarBuilder,
    ) -> candle_core::Result<Self> {
        Ok(PreNormAttention {
            input_layernorm: norm.build(shape.hidden, vb.pp("input_layernorm"))?,
            self_attn: SelfAttention::new(shape, vb.pp("self_attn"))?,
            post_attention_layernorm: norm
                .build(shape.hidden, vb.pp("post_attention_layernorm"))?,
            rope,
            window,
        })
    }

    /// `(h, x)` for the MLP: `x = x + attention(input_layernorm(x))` and
    /// `h = post_attention_layernorm(x)`; the layer returns `x + mlp(h)`.
    pub fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<(Tensor, Tensor)> {
        let h = self.input_layernorm.forward(x)?;
        let rope = self.rope.as_deref();
        let x = self
            .self_attn
            .forward_add(&h, Some(x), cx, rope, self.window)?;
        Ok((self.post_attention_layernorm.forward(&x)?, x))
    }

    /// Its query and key/value heads on this rank.
    pub fn heads(&self) -> (usize, usize) {
        (self.self_attn.num_heads, self.self_attn.num_kv_heads)
    }
}

/// A decoder layer as a model file writes it (its struct, with what it needs per layer:
/// window, rotary table), turned into a whole model by [`Decoder`].
pub trait Layer: Parallelize + Send + Sync + Sized + 'static {
    /// The model's config.json, as this file reads it.
    type Config: Send + Sync;
    /// Reads config.json, refusing `model_type`s this file does not read and values it does
    /// not implement (errors name `source` and the key).
    fn parse_config(text: &str, source: &str) -> Result<Self::Config>;
    /// The model: usually [`Decoder::from_layers`] over this file's layers.
    fn build(config: &Self::Config, vb: VarBuilder) -> candle_core::Result<Decoder<Self>>;
    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor>;
    /// Its query and key/value heads on this rank (for sequence parallelism's checks).
    fn attention_heads(&self) -> (usize, usize);
    /// Whether its MLP runs in sequence tiles under `tiled_mlp` (no by default: a mixture
    /// of experts routes whole sequences).
    fn tiles_mlp(&self) -> bool {
        false
    }
    /// Whether the parameter `name` may get no gradient in a step (routed experts).
    fn may_skip_grad(name: &str) -> bool {
        let _ = name;
        false
    }
}

/// transformers' body around a model's layers: `model.embed_tokens`, `model.layers`,
/// `model.norm` and `lm_head` (tied to the embedding or its own), vocab-parallel under tp.
#[derive(Parallelize)]
pub struct Decoder<L: Layer> {
    /// Embeddings are multiplied by this (Gemma: sqrt(hidden), in the weights' dtype).
    #[parallel(skip)]
    pub embed_scale: Option<f64>,
    /// Final-logit soft-capping.
    #[parallel(skip)]
    pub logit_softcap: Option<f64>,
    #[parallel(tp = "vocab", name = "model.embed_tokens")]
    pub embed_tokens: Embedding,
    /// Gemma 4's per-layer input embeddings, when the model has them.
    #[parallel(name = "model")]
    pub per_layer_inputs: Option<PerLayerInputs>,
    /// The layers pass on more than the hidden state (Gemma 4: the per-layer inputs of the
    /// layers still to come, keys and values shared with later layers), its first this many
    /// features; None: the hidden state alone.
    #[parallel(skip)]
    pub carried_hidden: Option<usize>,
    #[parallel(name = "model.layers")]
    pub layers: Vec<L>,
    #[parallel(name = "model.norm")]
    pub norm: RmsNorm,
    #[parallel(tp = "vocab")]
    pub lm_head: Linear,
}

/// `x` times `scale` cast to its dtype, as transformers multiplies an embedding by its scale.
fn scaled(x: Tensor, scale: Option<f64>) -> candle_core::Result<Tensor> {
    match scale {
        Some(s) => x.broadcast_mul(&Tensor::new(&[s as f32], x.device())?.to_dtype(x.dtype())?),
        None => Ok(x),
    }
}

/// Gemma 4's per-layer input embeddings (`model.embed_tokens_per_layer`,
/// `model.per_layer_model_projection`, `model.per_layer_projection_norm`): for each layer a
/// small vector per token, (own + projected) x 2^-1/2, `own` the token's row of a table of
/// `layers x width` per token (scaled by sqrt(width)), `projected` the normed projection of
/// its embedding (scaled by hidden^-1/2). The table splits by vocabulary under tp, as the
/// embedding; the projection stays whole.
#[derive(Debug, Clone, Parallelize)]
pub struct PerLayerInputs {
    #[parallel(tp = "vocab")]
    pub embed_tokens_per_layer: Embedding,
    #[parallel(tp = "replicate")]
    pub per_layer_model_projection: Linear,
    pub per_layer_projection_norm: RmsNorm,
    #[parallel(skip)]
    pub layers: usize,
    #[parallel(skip)]
    pub width: usize,
}

impl PerLayerInputs {
    /// From the model's `vb` (`model`): `vocab` rows of `layers x width`, over `hidden`.
    pub fn new(
        (vocab, hidden, layers, width): (usize, usize, usize, usize),
        norm: NormKind,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        Ok(PerLayerInputs {
            embed_tokens_per_layer: embedding(
                vocab,
                layers * width,
                vb.pp("embed_tokens_per_layer"),
            )?,
            per_layer_model_projection: linear_no_bias(
                hidden,
                layers * width,
                vb.pp("per_layer_model_projection"),
            )?,
            per_layer_projection_norm: norm.build(width, vb.pp("per_layer_projection_norm"))?,
            layers,
            width,
        })
    }

    /// Every layer's input [b, s, layers x width] for `ids` whose (scaled) embeddings are `x`.
    pub fn forward(&self, ids: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, hidden) = x.dims3()?;
        let (l, w) = (self.layers, self.width);
        let own = scaled(
            self.embed_tokens_per_layer.forward(ids)?,
            Some((w as f64).sqrt()),
        )?;
        let projected = (self.per_layer_model_projection.forward(x)? * (hidden as f64).powf(-0.5))?;
        let projected = self
            .per_layer_projection_norm
            .forward(&projected.reshape((b, s, l, w))?)?;
        ((projected + own.reshape((b, s, l, w))?)? * 0.5f64.sqrt())?.reshape((b, s, l * w))
    }
}

/// The sizes of a [`Decoder`]'s body.
#[derive(Debug, Clone, Copy)]
pub struct BodyShape {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub tied: bool,
    pub norm: NormKind,
}

impl<L: Layer> Decoder<L> {
    /// The body of `shape` from `vb` with `layer(l, vb)` building layer `l` from its prefix
    /// (`model.layers.l`).
    pub fn from_layers(
        shape: BodyShape,
        vb: VarBuilder,
        layer: impl Fn(usize, VarBuilder) -> candle_core::Result<L>,
    ) -> candle_core::Result<Self> {
        let m = vb.pp("model");
        let layers = (0..shape.layers)
            .map(|l| layer(l, m.pp("layers").pp(l)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let embed_tokens = embedding(shape.vocab, shape.hidden, m.pp("embed_tokens"))?;
        let lm_head = match shape.tied {
            true => Linear::from_weights(embed_tokens.weight.clone(), None),
            false => linear_no_bias(shape.hidden, shape.vocab, vb.pp("lm_head"))?,
        };
        Ok(Decoder {
            embed_scale: None,
            logit_softcap: None,
            embed_tokens,
            per_layer_inputs: None,
            carried_hidden: None,
            layers,
            norm: shape.norm.build(shape.hidden, m.pp("norm"))?,
            lm_head,
        })
    }
}

impl<L: Layer> CausalModel for Decoder<L> {
    type Config = L::Config;

    fn parse_config(text: &str, source: &str) -> Result<L::Config> {
        L::parse_config(text, source)
    }

    fn new(config: &L::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        L::build(config, vb)
    }

    fn embed(&self, input_ids: &Tensor, _: &LayerInputs) -> candle_core::Result<Tensor> {
        let x = scaled(self.embed_tokens.forward(input_ids)?, self.embed_scale)?;
        match &self.per_layer_inputs {
            // Each layer's input rides with the hidden state (the first layer's first).
            Some(p) => Tensor::cat(&[&x, &p.forward(input_ids, &x)?], 2),
            None => Ok(x),
        }
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer(&self, l: usize, x: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor> {
        self.layers[l].forward(x, cx).map_err(Error::into_candle)
    }

    fn final_norm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.carried_hidden {
            Some(h) if x.dim(2)? > h => self.norm.forward(&x.narrow(2, 0, h)?),
            _ => self.norm.forward(x),
        }
    }

    fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    fn logit_softcap(&self) -> Option<f64> {
        self.logit_softcap
    }

    fn heads(&self) -> Option<(usize, usize)> {
        Some(self.layers.first()?.attention_heads())
    }

    fn supports_tiled_mlp(&self) -> bool {
        self.layers.first().is_some_and(|l| l.tiles_mlp())
    }

    fn may_skip_grad(&self, name: &str) -> bool {
        L::may_skip_grad(name)
    }
}
