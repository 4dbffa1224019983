//! Gemma 4 (`model_type` gemma4_text; the hub's vision-language checkpoints `gemma4`,
//! Gemma4ForConditionalGeneration, trained on text), as transformers' Gemma4ForCausalLM:
//! embeddings scaled by sqrt(hidden), N x (norm -> attention -> norm -> residual, norm -> GeGLU
//! MLP [+ a mixture of experts beside it] -> norm -> residual [-> the per-layer input's
//! residual]) x `layer_scalar`, final norm, LM head tied to the embedding. What it changes
//! from Gemma 3:
//! - RMSNorms scale by w (not 1 + w); the values are RMS-normed per head without a weight;
//!   the scores are not scaled (transformers' `scaling` 1.0);
//! - sliding and full layers (`layer_types`, five sliding then one full by default, the last
//!   always full) with their own head width and key/value heads (`per_layer_config`, or
//!   `global_head_dim` / `num_global_key_value_heads`), the full layers' rotary
//!   "proportional" (`partial_rotary_factor` of the frequencies, the others zero); on full
//!   layers `attention_k_eq_v` uses the key projection's output as the values too;
//! - KV sharing: the last `num_kv_shared_layers` layers compute no keys or values and attend
//!   over those of the last earlier layer of their type (transformers' `kv_sharing_modes`:
//!   that one "stores", they "reuse"); `use_double_wide_mlp` doubles their MLP;
//! - per-layer inputs (`hidden_size_per_layer_input`, blocks.rs's [`PerLayerInputs`]): after
//!   the MLP each layer adds norm(proj(gelu(gate(x)) * its input));
//! - `enable_moe_block`: beside the dense MLP, a router (RMS-normed input without a weight, x
//!   `router.scale` x hidden^-1/2, softmax, top-k renormalised, x `router.per_expert_scale`)
//!   and fused experts (`experts.gate_up_proj` [experts, 2 x inter, hidden], GeGLU), each
//!   branch normed before the sum. No router loss, as in transformers.
//!
//! What crosses layers rides with the hidden state: the layers pass on [hidden | the
//! per-layer inputs of the layers still to come | the keys and values stored for sharing],
//! so activation checkpointing, ZeRO-3 / FSDP and sequence splits see one tensor per layer
//! and every gradient reaches the layer that made it. In generation a reusing layer reads its
//! storing layer's cache (`KvCache::attend_reused`).
//!
//! Strategies: tp splits attention and the MLP as Llama's (each layer's own head counts), the
//! experts as Mistral 4's; the router, the per-layer projections and `layer_scalar` (a
//! buffer: read, saved, never trained) whole. Each layer is one FSDP unit.

use super::blocks::{Activation, BodyShape, Decoder, GatedMlp, Layer, NormKind, PerLayerInputs};
use super::moe::{routed_scaled, FusedExperts};
use crate::error::{Error, Result};
use crate::kernels::fused::{rms_normalize, rotary as apply_rotary, swap_heads};
use crate::kernels::grouped::ExpertLayout;
use crate::models::causal::LayerInputs;
use crate::models::config::sliding_layers;
use crate::nn::{linear_no_bias, Linear, Param, RmsNorm, RopeScaling, RotaryEmbedding, Window};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["gemma4_text", "gemma4"];

/// The keys of a gemma4_text config.json this model reads, with transformers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Gemma4Config {
    pub model_type: String,
    #[serde(default = "vocab")]
    pub vocab_size: usize,
    #[serde(default = "hidden")]
    pub hidden_size: usize,
    #[serde(default = "inter")]
    pub intermediate_size: usize,
    #[serde(default = "layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "heads")]
    pub num_attention_heads: usize,
    #[serde(default = "kv_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "head_dim")]
    pub head_dim: usize,
    #[serde(default = "gelu")]
    pub hidden_activation: String,
    #[serde(default = "eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub attention_dropout: Option<f64>,
    #[serde(default = "window")]
    pub sliding_window: usize,
    pub layer_types: Option<Vec<serde_json::Value>>,
    pub final_logit_softcapping: Option<f64>,
    pub use_bidirectional_attention: Option<String>,
    #[serde(default = "vocab")]
    pub vocab_size_per_layer_input: usize,
    #[serde(default = "per_layer")]
    pub hidden_size_per_layer_input: Option<usize>,
    #[serde(default)]
    pub attention_k_eq_v: bool,
    #[serde(default)]
    pub num_kv_shared_layers: usize,
    #[serde(default)]
    pub enable_moe_block: bool,
    #[serde(default)]
    pub use_double_wide_mlp: bool,
    pub num_experts: Option<usize>,
    pub top_k_experts: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    /// transformers' saved form: overrides by layer index (`head_dim`,
    /// `num_key_value_heads`).
    pub per_layer_config: Option<BTreeMap<String, serde_json::Map<String, serde_json::Value>>>,
    /// The hub's form, when `per_layer_config` is absent: the full layers' head width and
    /// (with `attention_k_eq_v`) key/value heads.
    pub global_head_dim: Option<usize>,
    pub num_global_key_value_heads: Option<usize>,
}

fn vocab() -> usize {
    262_144
}
fn hidden() -> usize {
    2304
}
fn inter() -> usize {
    9216
}
fn layers() -> usize {
    30
}
fn heads() -> usize {
    8
}
fn kv_heads() -> usize {
    4
}
fn head_dim() -> usize {
    256
}
fn gelu() -> String {
    "gelu_pytorch_tanh".into()
}
fn eps() -> f64 {
    1e-6
}
fn max_pos() -> usize {
    131_072
}
fn yes() -> bool {
    true
}
fn window() -> usize {
    512
}
fn per_layer() -> Option<usize> {
    Some(256)
}

/// How a layer gets its keys and values (transformers' `kv_sharing_modes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSharing {
    /// Its own.
    Own,
    /// Its own, kept for the later layers of its type that reuse them.
    Store,
    /// Those of this earlier layer.
    Reuse(usize),
}

/// What config.json makes of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerPlan {
    pub sliding: bool,
    pub head_dim: usize,
    pub kv_heads: usize,
    pub kv: KvSharing,
    /// Values are the key projection's output (`attention_k_eq_v` on a full layer).
    pub k_eq_v: bool,
    /// The MLP's width.
    pub inter: usize,
}

impl Gemma4Config {
    fn parse(text: &str, source: &str) -> Result<Self> {
        let err = |key: &str, message: String| Error::config(source, key, message);
        let c: Gemma4Config = crate::models::config::text_config(text, source, MODEL_TYPES)?;
        c.check().map_err(|(k, m)| err(k, m))?;
        Ok(c)
    }

    fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        if Activation::parse(&self.hidden_activation) != Some(Activation::GeluTanh) {
            return Err((
                "hidden_activation",
                format!(
                    "'{}' is not supported: Gemma 4 uses gelu_pytorch_tanh",
                    self.hidden_activation
                ),
            ));
        }
        if self.use_bidirectional_attention.as_deref() == Some("all") {
            return Err((
                "use_bidirectional_attention",
                "'all' makes every token see the whole row; a causal language model is \
                 trained with null (or 'vision', which text tokens attend causally under)"
                    .into(),
            ));
        }
        if self.attention_dropout.is_some_and(|p| p != 0.0) {
            return Err((
                "attention_dropout",
                "attention dropout is not implemented: set it to 0.0".into(),
            ));
        }
        if let Some(cap) = self.final_logit_softcapping {
            if !(cap.is_finite() && cap > 0.0) {
                return Err((
                    "final_logit_softcapping",
                    format!("{cap}: a cap is a positive number or null"),
                ));
            }
        }
        if self.enable_moe_block {
            for (key, v) in [
                ("num_experts", self.num_experts),
                ("top_k_experts", self.top_k_experts),
                ("moe_intermediate_size", self.moe_intermediate_size),
            ] {
                if v.is_none_or(|v| v == 0) {
                    return Err((key, "enable_moe_block needs it: a positive number".into()));
                }
            }
            if self.top_k_experts > self.num_experts {
                return Err((
                    "top_k_experts",
                    format!(
                        "{:?} experts per token of {:?}",
                        self.top_k_experts, self.num_experts
                    ),
                ));
            }
        }
        let plans = self.layer_plans()?;
        for (l, p) in plans.iter().enumerate() {
            if p.kv_heads == 0 || !self.num_attention_heads.is_multiple_of(p.kv_heads) {
                return Err((
                    "num_key_value_heads",
                    format!(
                        "layer {l}: {} attention heads cannot be grouped over {} key/value heads",
                        self.num_attention_heads, p.kv_heads
                    ),
                ));
            }
        }
        self.ropes()?;
        Ok(())
    }

    /// Whether each layer is a sliding one, the last forced full as transformers forces it.
    fn sliding(&self) -> std::result::Result<Vec<bool>, (&'static str, String)> {
        let n = self.num_hidden_layers;
        let mut kinds = match &self.layer_types {
            Some(types) => sliding_layers(types, n)?,
            None => (0..n).map(|i| !(i + 1).is_multiple_of(6)).collect(),
        };
        if kinds.last() == Some(&true) {
            tracing::warn!(
                "config.json layer_types: the last layer must be full_attention; it is made \
                 so, as transformers does"
            );
            *kinds.last_mut().expect("checked") = false;
        }
        Ok(kinds)
    }

    /// Each layer's attention, as transformers derives it from the config.
    pub fn layer_plans(&self) -> std::result::Result<Vec<LayerPlan>, (&'static str, String)> {
        let sliding = self.sliding()?;
        let n = self.num_hidden_layers;
        let shared = self.num_kv_shared_layers;
        if shared >= n && n > 0 {
            return Err((
                "num_kv_shared_layers",
                format!(
                    "{shared} of {n} layers reuse keys and values: at least the first layer \
                     must compute its own"
                ),
            ));
        }
        let first_shared = n - shared;
        // The last layer of each type before the shared ones stores for them.
        let store_of = |kind: bool| (0..first_shared).rev().find(|&l| sliding[l] == kind);
        let mut plans = Vec::with_capacity(n);
        for (l, &is_sliding) in sliding.iter().enumerate() {
            let (mut head_dim, mut kv_heads) = (self.head_dim, self.num_key_value_heads);
            if !is_sliding && self.per_layer_config.is_none() {
                head_dim = self.global_head_dim.unwrap_or(512);
                if let Some(kv) = self
                    .num_global_key_value_heads
                    .filter(|_| self.attention_k_eq_v)
                {
                    kv_heads = kv;
                }
            }
            if let Some(o) = self
                .per_layer_config
                .as_ref()
                .and_then(|p| p.get(&l.to_string()))
            {
                for (key, value) in o {
                    let v = value.as_u64().map(|v| v as usize);
                    match (key.as_str(), v) {
                        ("head_dim", Some(v)) => head_dim = v,
                        ("num_key_value_heads", Some(v)) => kv_heads = v,
                        _ => {
                            return Err((
                                "per_layer_config",
                                format!(
                                    "layer {l}: {key} = {value} is not read by this model (it \
                                     reads head_dim and num_key_value_heads)"
                                ),
                            ))
                        }
                    }
                }
            }
            let kv = match l >= first_shared {
                true => match store_of(is_sliding) {
                    Some(s) => KvSharing::Reuse(s),
                    None => {
                        return Err((
                            "num_kv_shared_layers",
                            format!(
                                "layer {l} reuses the keys and values of an earlier {} layer, \
                                 and there is none before the shared layers",
                                if is_sliding { "sliding" } else { "full" }
                            ),
                        ))
                    }
                },
                false if Some(l) == store_of(is_sliding) && shared > 0 => KvSharing::Store,
                false => KvSharing::Own,
            };
            let reuses = matches!(kv, KvSharing::Reuse(_));
            plans.push(LayerPlan {
                sliding: is_sliding,
                head_dim,
                kv_heads,
                kv,
                k_eq_v: self.attention_k_eq_v && !is_sliding,
                inter: self.intermediate_size
                    * if self.use_double_wide_mlp && reuses {
                        2
                    } else {
                        1
                    },
            });
        }
        // A reusing layer attends over its storing layer's heads as its own.
        for (l, p) in plans.iter().enumerate() {
            if let KvSharing::Reuse(s) = p.kv {
                let s = &plans[s];
                if (s.head_dim, s.kv_heads) != (p.head_dim, p.kv_heads) {
                    return Err((
                        "per_layer_config",
                        format!(
                            "layer {l} reuses the keys and values of a layer with other head \
                             sizes ({} x {} against {} x {})",
                            s.kv_heads, s.head_dim, p.kv_heads, p.head_dim
                        ),
                    ));
                }
            }
        }
        Ok(plans)
    }

    /// The full and the sliding layers' rotary tables.
    fn ropes(
        &self,
    ) -> std::result::Result<(RotaryEmbedding, RotaryEmbedding), (&'static str, String)> {
        let plans = self.layer_plans()?;
        let width = |sliding: bool| {
            plans
                .iter()
                .find(|p| p.sliding == sliding)
                .map_or(self.head_dim, |p| p.head_dim)
        };
        let read = |kind: &str, default: &str| -> std::result::Result<RopeScaling, _> {
            let value = self
                .rope_parameters
                .as_ref()
                .and_then(|p| p.get(kind))
                .cloned()
                .unwrap_or_else(|| serde_json::from_str(default).expect("a valid default"));
            serde_json::from_value::<RopeScaling>(value)
                .map_err(|e| ("rope_parameters", format!("{kind}: {e}")))
        };
        let full = read(
            "full_attention",
            r#"{"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}"#,
        )?;
        let sliding = read(
            "sliding_attention",
            r#"{"rope_type": "default", "rope_theta": 10000.0}"#,
        )?;
        let make = |p: &RopeScaling, d: usize| {
            let theta = p.rope_theta.unwrap_or(10_000.0);
            let scaling = Some(p).filter(|p| p.rope_type != "default");
            RotaryEmbedding::new(d, theta, self.max_position_embeddings, scaling)
                .map_err(|m| ("rope_parameters", m))
        };
        Ok((make(&full, width(false))?, make(&sliding, width(true))?))
    }
}

/// Gemma4ForCausalLM.
pub type Gemma4 = Decoder<Gemma4Layer>;

/// Gemma 4's self-attention: q/k norms, values normed without a weight, unscaled scores;
/// no key or value projection on a layer that reuses another's, no value projection where
/// the keys serve as values.
#[derive(Debug, Clone, Parallelize)]
pub struct Gemma4Attention {
    #[parallel(tp = "column")]
    q_proj: Linear,
    #[parallel(tp = "column")]
    k_proj: Option<Linear>,
    #[parallel(tp = "column")]
    v_proj: Option<Linear>,
    #[parallel(tp = "row")]
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: Option<RmsNorm>,
    #[parallel(tp = "divide")]
    num_heads: usize,
    #[parallel(tp = "divide")]
    num_kv_heads: usize,
    #[parallel(skip)]
    head_dim: usize,
    #[parallel(skip)]
    eps: f64,
}

impl Gemma4Attention {
    fn new(
        c: &Gemma4Config,
        p: &LayerPlan,
        norm: NormKind,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let (h, d) = (c.hidden_size, p.head_dim);
        let lin = |name: &str, (i, o): (usize, usize)| -> candle_core::Result<Linear> {
            super::blocks::lin(vb.pp(name), (i, o), c.attention_bias)
        };
        let own = !matches!(p.kv, KvSharing::Reuse(_));
        let kv = p.kv_heads * d;
        Ok(Gemma4Attention {
            q_proj: lin("q_proj", (h, c.num_attention_heads * d))?,
            k_proj: own.then(|| lin("k_proj", (h, kv))).transpose()?,
            v_proj: (own && !p.k_eq_v)
                .then(|| lin("v_proj", (h, kv)))
                .transpose()?,
            o_proj: lin("o_proj", (c.num_attention_heads * d, h))?,
            q_norm: norm.build(d, vb.pp("q_norm"))?,
            k_norm: own.then(|| norm.build(d, vb.pp("k_norm"))).transpose()?,
            num_heads: c.num_attention_heads,
            num_kv_heads: p.kv_heads,
            head_dim: d,
            eps: c.rms_norm_eps,
        })
    }

    /// Attention of `h` [b, s, hidden] over its own keys and values, or over `reused`: the
    /// storing layer's [b, kv_heads, s, d] passed on with the hidden state, and its index
    /// (generation reads that layer's cache). With `store`, also its keys and values
    /// [b, s, 2 x kv_heads x d] (keys then values, this rank's heads) for the layers that
    /// reuse them.
    fn forward(
        &self,
        h: &Tensor,
        cx: &LayerInputs,
        (rope, window): (&RotaryEmbedding, Option<Window>),
        reused: Option<(Tensor, Tensor, usize)>,
        store: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (b, s, _) = h.dims3()?;
        let d = self.head_dim;
        let (cos, sin) = cx.cos_sin(rope)?;
        let q = self.heads(self.q_proj.forward(h)?, self.num_heads)?;
        let q = apply_rotary(&self.q_norm.forward(&q)?, &cos, &sin)?;
        // transformers' scaling is 1.0; the kernels divide the scores by sqrt(d).
        let q = (q * (d as f64).sqrt())?;
        let (a, stored) = match reused {
            Some((_, _, layer)) if cx.generating() => {
                let Some(mut cache) = cx.kv_cache() else {
                    return Err(candle_core::Error::Msg("generating without a cache".into()).into());
                };
                (cache.attend_reused(&q, layer, window, None)?, None)
            }
            Some((k, v, _)) => (cx.attention_with(&q, &k, &v, window, None, None)?, None),
            None => {
                let (k, v) = self.keys_values(h, (&cos, &sin))?;
                let a = cx.attention_with(&q, &k, &v, window, None, None)?;
                let merge = |t: &Tensor| swap_heads(t)?.reshape((b, s, self.num_kv_heads * d));
                let stored = match store {
                    true => Some(Tensor::cat(&[merge(&k)?, merge(&v)?], 2)?),
                    false => None,
                };
                (a, stored)
            }
        };
        let a = swap_heads(&a)?.reshape((b, s, self.num_heads * d))?;
        Ok((self.o_proj.forward(&a)?, stored))
    }

    /// A projection's output [b, s, n x d] as heads [b, n, s, d].
    fn heads(&self, y: Tensor, n: usize) -> candle_core::Result<Tensor> {
        let (b, s, _) = y.dims3()?;
        swap_heads(&y.reshape((b, s, n, self.head_dim))?)
    }

    /// This layer's own keys (normed, rotated) and values (normed without a weight; the key
    /// projection's output where it has no value projection), as heads.
    fn keys_values(&self, h: &Tensor, (cos, sin): (&Tensor, &Tensor)) -> Result<(Tensor, Tensor)> {
        let (Some(k_proj), Some(k_norm)) = (&self.k_proj, &self.k_norm) else {
            return Err(candle_core::Error::Msg(
                "a Gemma 4 layer that reuses keys and values was given none".into(),
            )
            .into());
        };
        let raw = k_proj.forward(h)?;
        let v = match &self.v_proj {
            Some(v_proj) => v_proj.forward(h)?,
            None => raw.clone(),
        };
        let k = k_norm.forward(&self.heads(raw, self.num_kv_heads)?)?;
        let k = apply_rotary(&k, cos, sin)?;
        let v = rms_normalize(&self.heads(v, self.num_kv_heads)?, self.eps)?;
        Ok((k, v))
    }
}

/// `router`: which experts each token goes to, and with what weight.
#[derive(Debug, Clone, Parallelize)]
pub struct Gemma4Router {
    proj: Linear,
    scale: Param,
    per_expert_scale: Param,
}

/// The mixture beside the dense MLP (`enable_moe_block`).
#[derive(Debug, Clone, Parallelize)]
pub struct Gemma4Experts {
    #[parallel(tp = "replicate")]
    router: Gemma4Router,
    experts: FusedExperts,
    post_feedforward_layernorm_1: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
    pre_feedforward_layernorm_2: RmsNorm,
    #[parallel(skip)]
    top_k: usize,
    #[parallel(skip)]
    eps: f64,
}

impl Gemma4Experts {
    /// norm_1(mlp) + norm_2(experts(pre_norm_2(x))), routed by `x` (the layer's residual
    /// after attention) [b, s, hidden].
    fn forward(&self, cx: &LayerInputs, x: &Tensor, mlp: &Tensor) -> Result<Tensor> {
        let (b, s, hidden) = x.dims3()?;
        let flat = x.reshape((b * s, hidden))?;
        let r = &self.router;
        let routed_by = (rms_normalize(&flat, self.eps)?.broadcast_mul(&r.scale.value()?)?
            * (hidden as f64).powf(-0.5))?;
        let logits = r.proj.forward(&routed_by)?;
        let inputs = self.pre_feedforward_layernorm_2.forward(&flat)?;
        let scale = r.per_expert_scale.value()?;
        let routing = (self.top_k, true);
        let experts = routed_scaled(
            cx,
            &inputs,
            &logits,
            routing,
            Some(&scale),
            |rows, index, counts| {
                let rows = rows.index_select(index, 0)?;
                self.experts.forward(cx, &rows, counts)
            },
        )?;
        let experts = self
            .post_feedforward_layernorm_2
            .forward(&experts.reshape((b, s, hidden))?)?;
        Ok((self.post_feedforward_layernorm_1.forward(mlp)? + experts)?)
    }
}

/// The per-layer input's residual branch.
#[derive(Debug, Clone, Parallelize)]
pub struct PerLayerInput {
    #[parallel(tp = "replicate")]
    per_layer_input_gate: Linear,
    #[parallel(tp = "replicate")]
    per_layer_projection: Linear,
    post_per_layer_input_norm: RmsNorm,
}

/// Where a layer finds what rides with its hidden state.
#[derive(Debug, Clone, PartialEq)]
struct Carried {
    hidden: usize,
    /// Each per-layer input's width (0: none).
    per_layer: usize,
    /// Per-layer inputs in this layer's input: its own and those of the layers after it.
    per_layer_slices: usize,
    /// The stored keys and values in this layer's input, in layer order: each storing layer
    /// and its width across all ranks (kv_heads x head_dim).
    stored: Vec<(usize, usize)>,
}

impl Carried {
    /// The storing layer `store`'s keys and values in `x` [b, s, width], each
    /// [b, s, kv_heads x d] (this rank's heads).
    fn reused(&self, x: &Tensor, store: usize) -> Result<(Tensor, Tensor)> {
        let width = x.dim(2)?;
        let start = self.hidden + self.per_layer * self.per_layer_slices;
        // Each slot's share of what is stored follows from its width on every rank, so
        // the split needs no tp size.
        let total: usize = self.stored.iter().map(|(_, w)| w).sum();
        let local = width - start;
        let mut at = start;
        for &(layer, w) in &self.stored {
            let size = local * w / total;
            if layer == store {
                let kv = size / 2;
                return Ok((x.narrow(2, at, kv)?, x.narrow(2, at + kv, kv)?));
            }
            at += size;
        }
        Err(candle_core::Error::Msg(format!(
            "the keys and values of layer {store} are not among those passed on"
        ))
        .into())
    }
}

/// x + norm(attention(norm(x))), then + norm(mlp(norm(x))) [with the experts], then the
/// per-layer input's branch, all times `layer_scalar`.
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Gemma4Layer {
    input_layernorm: RmsNorm,
    self_attn: Gemma4Attention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: GatedMlp,
    post_feedforward_layernorm: RmsNorm,
    #[parallel(name = "")]
    moe: Option<Gemma4Experts>,
    #[parallel(name = "")]
    per_layer: Option<PerLayerInput>,
    /// A buffer in transformers: read and saved, used without a gradient.
    layer_scalar: Param,
    #[parallel(skip)]
    rope: Arc<RotaryEmbedding>,
    #[parallel(skip)]
    window: Option<usize>,
    #[parallel(skip)]
    kv: KvSharing,
    #[parallel(skip)]
    carried: Carried,
}

impl Layer for Gemma4Layer {
    type Config = Gemma4Config;

    fn parse_config(text: &str, source: &str) -> Result<Gemma4Config> {
        Gemma4Config::parse(text, source)
    }

    fn build(c: &Gemma4Config, vb: VarBuilder) -> candle_core::Result<Gemma4> {
        let bad = |(key, m): (&str, String)| candle_core::Error::Msg(format!("{key}: {m}"));
        let plans = c.layer_plans().map_err(bad)?;
        let (full, sliding) = c.ropes().map_err(bad)?;
        let (full, sliding) = (Arc::new(full), Arc::new(sliding));
        let h = c.hidden_size;
        let norm = NormKind {
            eps: c.rms_norm_eps,
            gemma: false,
        };
        let body = BodyShape {
            vocab: c.vocab_size,
            hidden: h,
            layers: c.num_hidden_layers,
            tied: c.tie_word_embeddings,
            norm,
        };
        let per_layer = c.hidden_size_per_layer_input.unwrap_or(0);
        let n = c.num_hidden_layers;
        let mut model = Decoder::from_layers(body, vb.clone(), |l, vb| {
            let p = &plans[l];
            let moe = match c.enable_moe_block {
                false => None,
                true => {
                    let (e, i) = (
                        c.num_experts.unwrap_or(1),
                        c.moe_intermediate_size.unwrap_or(1),
                    );
                    let r = vb.pp("router");
                    Some(Gemma4Experts {
                        router: Gemma4Router {
                            proj: linear_no_bias(h, e, r.pp("proj"))?,
                            scale: Param::new(&r, h, "scale")?,
                            per_expert_scale: Param::new(&r, e, "per_expert_scale")?,
                        },
                        experts: FusedExperts::new(
                            &vb.pp("experts"),
                            (e, h, i),
                            ExpertLayout::OutIn,
                        )?
                        .with_activation(Activation::GeluTanh),
                        post_feedforward_layernorm_1: norm
                            .build(h, vb.pp("post_feedforward_layernorm_1"))?,
                        post_feedforward_layernorm_2: norm
                            .build(h, vb.pp("post_feedforward_layernorm_2"))?,
                        pre_feedforward_layernorm_2: norm
                            .build(h, vb.pp("pre_feedforward_layernorm_2"))?,
                        top_k: c.top_k_experts.unwrap_or(1),
                        eps: c.rms_norm_eps,
                    })
                }
            };
            let per_layer_input = match per_layer {
                0 => None,
                w => Some(PerLayerInput {
                    per_layer_input_gate: linear_no_bias(h, w, vb.pp("per_layer_input_gate"))?,
                    per_layer_projection: linear_no_bias(w, h, vb.pp("per_layer_projection"))?,
                    post_per_layer_input_norm: norm.build(h, vb.pp("post_per_layer_input_norm"))?,
                }),
            };
            let stored = plans[..l]
                .iter()
                .enumerate()
                .filter(|(_, q)| q.kv == KvSharing::Store)
                .map(|(s, q)| (s, q.kv_heads * q.head_dim))
                .collect();
            Ok(Gemma4Layer {
                input_layernorm: norm.build(h, vb.pp("input_layernorm"))?,
                self_attn: Gemma4Attention::new(c, p, norm, vb.pp("self_attn"))?,
                post_attention_layernorm: norm.build(h, vb.pp("post_attention_layernorm"))?,
                pre_feedforward_layernorm: norm.build(h, vb.pp("pre_feedforward_layernorm"))?,
                mlp: GatedMlp::new((h, p.inter), false, Activation::GeluTanh, vb.pp("mlp"))?,
                post_feedforward_layernorm: norm.build(h, vb.pp("post_feedforward_layernorm"))?,
                moe,
                per_layer: per_layer_input,
                layer_scalar: Param::new(&vb, 1, "layer_scalar")?,
                rope: match p.sliding {
                    true => sliding.clone(),
                    false => full.clone(),
                },
                window: p.sliding.then_some(c.sliding_window),
                kv: p.kv,
                carried: Carried {
                    hidden: h,
                    per_layer,
                    per_layer_slices: if per_layer > 0 { n - l } else { 0 },
                    stored,
                },
            })
        })?;
        model.embed_scale = Some((h as f64).sqrt());
        model.logit_softcap = c.final_logit_softcapping;
        if per_layer > 0 {
            let shape = (c.vocab_size_per_layer_input, h, n, per_layer);
            model.per_layer_inputs = Some(PerLayerInputs::new(shape, norm, vb.pp("model"))?);
        }
        let stores = plans.iter().any(|p| p.kv == KvSharing::Store);
        if per_layer > 0 || stores {
            model.carried_hidden = Some(h);
        }
        Ok(model)
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let c = &self.carried;
        let width = x.dim(2)?;
        let (h, w) = (c.hidden, c.per_layer);
        let hidden = match width == h {
            true => x.clone(),
            false => x.narrow(2, 0, h)?,
        };
        let reused = match self.kv {
            KvSharing::Reuse(store) => {
                let (k, v) = c.reused(x, store)?;
                let heads = |t| self.self_attn.heads(t, self.self_attn.num_kv_heads);
                Some((heads(k)?, heads(v)?, store))
            }
            _ => None,
        };
        let normed = self.input_layernorm.forward(&hidden)?;
        let window = self.window.map(Window::Sliding);
        let store = self.kv == KvSharing::Store;
        let (a, stored) =
            self.self_attn
                .forward(&normed, cx, (&self.rope, window), reused, store)?;
        let residual = (hidden + self.post_attention_layernorm.forward(&a)?)?;
        let m = self
            .mlp
            .forward(cx, &self.pre_feedforward_layernorm.forward(&residual)?)?;
        let m = match &self.moe {
            Some(moe) => moe.forward(cx, &residual, &m)?,
            None => m,
        };
        let mut out = (&residual + self.post_feedforward_layernorm.forward(&m)?)?;
        if let Some(p) = &self.per_layer {
            let input = x.narrow(2, h, w)?;
            let g = p.per_layer_input_gate.forward(&out)?.gelu()?;
            let y = p.per_layer_projection.forward(&(g * input)?)?;
            out = (&out + p.post_per_layer_input_norm.forward(&y)?)?;
        }
        let scalar = self.layer_scalar.value()?.detach().to_dtype(out.dtype())?;
        let out = out.broadcast_mul(&scalar)?;
        // What rides on: the later layers' inputs, the stored keys and values, this layer's.
        let start = h + w * c.per_layer_slices;
        let mut parts = vec![out];
        if c.per_layer_slices > 1 {
            parts.push(x.narrow(2, h + w, w * (c.per_layer_slices - 1))?);
        }
        if width > start {
            parts.push(x.narrow(2, start, width - start)?);
        }
        parts.extend(stored);
        Ok(match parts.len() {
            1 => parts.pop().expect("one"),
            _ => Tensor::cat(&parts, 2)?,
        })
    }

    fn attention_heads(&self) -> (usize, usize) {
        (self.self_attn.num_heads, self.self_attn.num_kv_heads)
    }

    fn may_skip_grad(name: &str) -> bool {
        crate::nn::lora::is_routed_expert(name) || name.ends_with("layer_scalar")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> Gemma4Config {
        Gemma4Config::parse(json, "config.json").expect("valid")
    }

    #[test]
    fn kv_sharing_follows_transformers_modes() {
        // transformers: [None, None, 'store', 'store', 'reuse', 'reuse'].
        let c = config(
            r#"{"model_type": "gemma4_text", "num_hidden_layers": 6, "num_kv_shared_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                "full_attention", "sliding_attention", "full_attention"]}"#,
        );
        let kv: Vec<KvSharing> = c.layer_plans().unwrap().iter().map(|p| p.kv).collect();
        use KvSharing::*;
        assert_eq!(kv, [Own, Own, Store, Store, Reuse(2), Reuse(3)]);
    }

    #[test]
    fn full_layers_take_the_global_head_sizes() {
        let c = config(
            r#"{"model_type": "gemma4_text", "num_hidden_layers": 2, "head_dim": 8,
                "global_head_dim": 16, "num_global_key_value_heads": 1, "attention_k_eq_v": true,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "layer_types": ["sliding_attention", "full_attention"]}"#,
        );
        let p = c.layer_plans().unwrap();
        assert_eq!((p[0].head_dim, p[0].kv_heads, p[0].k_eq_v), (8, 2, false));
        assert_eq!((p[1].head_dim, p[1].kv_heads, p[1].k_eq_v), (16, 1, true));
    }

    #[test]
    fn what_it_cannot_compute_is_refused_by_key() {
        let err = Gemma4Config::parse(
            r#"{"model_type": "gemma4_text", "use_bidirectional_attention": "all"}"#,
            "config.json",
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("use_bidirectional_attention"),
            "{err}"
        );
        let err = Gemma4Config::parse(
            r#"{"model_type": "gemma4_text", "num_hidden_layers": 2, "num_kv_shared_layers": 2}"#,
            "config.json",
        )
        .unwrap_err();
        assert!(err.to_string().contains("num_kv_shared_layers"), "{err}");
        let err = Gemma4Config::parse(
            r#"{"model_type": "gemma4_text", "enable_moe_block": true}"#,
            "config.json",
        )
        .unwrap_err();
        assert!(err.to_string().contains("num_experts"), "{err}");
    }
}
