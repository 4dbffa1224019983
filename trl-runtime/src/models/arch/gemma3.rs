//! Gemma 3 (text; `model_type` gemma3_text) and Gemma 2 (`gemma2`), as transformers'
//! Gemma3ForCausalLM and Gemma2ForCausalLM: embeddings scaled by sqrt(hidden), N x (norm ->
//! attention -> norm -> residual, norm -> GeGLU MLP -> norm -> residual), final norm, LM head
//! tied to the embedding. Their differences from Llama: RMSNorms scale by (1 + w); queries
//! scaled by `query_pre_attn_scalar`^-1/2; sliding-window layers; tanh-GELU MLPs; final-logit
//! soft-capping. Gemma 3 adds per-head q/k norms and sliding layers with their own RoPE base
//! (`layer_types`, or every `sliding_window_pattern`-th layer global); Gemma 2 soft-caps the
//! attention scores (`attn_logit_softcapping`, in every attention path, the fused kernels
//! included) and alternates sliding and global layers, one RoPE base for all.
//!
//! Gemma 3's vision-language checkpoints (`gemma3`, Gemma3ForConditionalGeneration: 4B and
//! larger) train their language model, read from `text_config` (models/weights/composite.rs).
//!
//! The tp plan is Llama's (blocks.rs); each layer is one FSDP unit.

use super::blocks::SelfAttention;
use super::blocks::{
    Activation, AttentionShape, BodyShape, Decoder, GatedMlp, Layer, NormKind, QkNorm,
};
use crate::error::{Error, Result};
use crate::models::causal::LayerInputs;
use crate::models::config::sliding_layers;
use crate::nn::{RmsNorm, RopeScaling, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use serde::Deserialize;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["gemma3_text", "gemma2", "gemma3"];

/// The keys of a gemma3_text config.json this model reads (transformers' defaults; a
/// missing `Option` key is None).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Gemma3Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default = "one")]
    pub num_key_value_heads: usize,
    #[serde(default = "d256")]
    pub head_dim: usize,
    #[serde(default = "eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d256")]
    pub query_pre_attn_scalar: usize,
    #[serde(default = "window")]
    pub sliding_window: Option<usize>,
    pub layer_types: Option<Vec<serde_json::Value>>,
    pub sliding_window_pattern: Option<usize>,
    #[serde(default = "max_pos")]
    pub max_position_embeddings: usize,
    /// transformers 5: `{full_attention: {...}, sliding_attention: {...}}`.
    pub rope_parameters: Option<serde_json::Value>,
    /// transformers 4: the global layers' base, scaling and the local layers' base.
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<RopeScaling>,
    pub rope_local_base_freq: Option<f64>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "gelu")]
    pub hidden_activation: String,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub use_bidirectional_attention: Option<bool>,
}

fn one() -> usize {
    1
}
fn d256() -> usize {
    256
}
fn eps() -> f64 {
    1e-6
}
fn window() -> Option<usize> {
    Some(4096)
}
fn max_pos() -> usize {
    131072
}
fn gelu() -> String {
    "gelu_pytorch_tanh".into()
}
fn yes() -> bool {
    true
}

impl Gemma3Config {
    fn gemma2(&self) -> bool {
        self.model_type == "gemma2"
    }

    fn parse(text: &str, source: &str) -> Result<Self> {
        let err = |key: &str, message: String| Error::config(source, key, message);
        // Gemma 3's vision-language checkpoints train their language model (composite.rs).
        let mut c: Gemma3Config = crate::models::config::text_config(text, source, MODEL_TYPES)?;
        if Activation::parse(&c.hidden_activation) != Some(Activation::GeluTanh) {
            return Err(err(
                "hidden_activation",
                format!(
                    "'{}' is not supported: Gemma uses gelu_pytorch_tanh",
                    c.hidden_activation
                ),
            ));
        }
        // Gemma 2's defaults where its config.json has no key (null keeps a cap off).
        if c.gemma2() {
            let raw: serde_json::Value = serde_json::from_str(text).unwrap_or_default();
            for (key, cap, default) in [
                (
                    "attn_logit_softcapping",
                    &mut c.attn_logit_softcapping,
                    50.0,
                ),
                (
                    "final_logit_softcapping",
                    &mut c.final_logit_softcapping,
                    30.0,
                ),
            ] {
                if raw.get(key).is_none() {
                    *cap = Some(default);
                }
            }
        }
        for (key, cap) in [
            ("attn_logit_softcapping", c.attn_logit_softcapping),
            ("final_logit_softcapping", c.final_logit_softcapping),
        ] {
            if cap.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
                return Err(err(
                    key,
                    format!("{cap:?}: a cap is a positive number or null"),
                ));
            }
        }
        if c.use_bidirectional_attention == Some(true) {
            return Err(err(
                "use_bidirectional_attention",
                "a causal language model attends causally: set it to false".into(),
            ));
        }
        if c.num_key_value_heads == 0
            || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{} attention heads cannot be grouped over {} key/value heads",
                    c.num_attention_heads, c.num_key_value_heads
                ),
            ));
        }
        c.layer_kinds().map_err(|(k, m)| err(k, m))?;
        c.ropes().map_err(|(k, m)| err(k, m))?;
        Ok(c)
    }

    /// Whether each layer is a sliding-window one: `layer_types`, else every layer but each
    /// `sliding_window_pattern`-th (6 by default), as transformers fills them in.
    fn layer_kinds(&self) -> std::result::Result<Vec<bool>, (&'static str, String)> {
        let n = self.num_hidden_layers;
        let kinds: Vec<bool> = match &self.layer_types {
            Some(types) => sliding_layers(types, n)?,
            // Gemma 2 alternates, the first layer sliding.
            None if self.gemma2() => (0..n).map(|i| i % 2 == 0).collect(),
            None => {
                let p = self.sliding_window_pattern.unwrap_or(6).max(1);
                (0..n).map(|i| !(i + 1).is_multiple_of(p)).collect()
            }
        };
        if kinds.iter().any(|&s| s) && self.sliding_window.is_none() {
            return Err((
                "sliding_window",
                "null, but some layers are sliding_attention".into(),
            ));
        }
        Ok(kinds)
    }

    /// The global and the local (sliding layers') rotary embeddings, from either layout.
    fn ropes(
        &self,
    ) -> std::result::Result<(RotaryEmbedding, RotaryEmbedding), (&'static str, String)> {
        let (global, local) = match &self.rope_parameters {
            // Gemma 2: one table for every layer (transformers 5 writes it flat).
            Some(p) if self.gemma2() => {
                let one = serde_json::from_value::<RopeScaling>(p.clone())
                    .map_err(|e| ("rope_parameters", e.to_string()))?;
                (Some(one.clone()), Some(one))
            }
            Some(p) => {
                let read = |kind: &str| -> std::result::Result<Option<RopeScaling>, _> {
                    p.get(kind)
                        .map(|v| serde_json::from_value::<RopeScaling>(v.clone()))
                        .transpose()
                        .map_err(|e| ("rope_parameters", format!("{kind}: {e}")))
                };
                (read("full_attention")?, read("sliding_attention")?)
            }
            None if self.gemma2() => (self.rope_scaling.clone(), self.rope_scaling.clone()),
            None => (self.rope_scaling.clone(), None),
        };
        let theta = |p: &Option<RopeScaling>, old: Option<f64>, default: f64| {
            p.as_ref()
                .and_then(|p| p.rope_theta)
                .or(old)
                .unwrap_or(default)
        };
        let make = |p: &Option<RopeScaling>, theta: f64| {
            let scaling = p.as_ref().filter(|p| p.rope_type != "default");
            RotaryEmbedding::new(self.head_dim, theta, self.max_position_embeddings, scaling)
                .map_err(|m| ("rope_parameters", m))
        };
        let (global_base, local_base) = match self.gemma2() {
            true => (self.rope_theta, self.rope_theta),
            false => (self.rope_theta, self.rope_local_base_freq),
        };
        let default_global = if self.gemma2() { 10_000.0 } else { 1_000_000.0 };
        Ok((
            make(&global, theta(&global, global_base, default_global))?,
            make(&local, theta(&local, local_base, 10_000.0))?,
        ))
    }
}

/// Gemma3ForCausalLM.
pub type Gemma3 = Decoder<Gemma3Layer>;

/// x + norm(attention(norm(x))), then + norm(mlp(norm(x))).
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Gemma3Layer {
    input_layernorm: RmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: GatedMlp,
    post_feedforward_layernorm: RmsNorm,
    /// The global or the local (sliding layers') rotary table.
    #[parallel(skip)]
    rope: Arc<RotaryEmbedding>,
    /// The sliding window (None: a global layer).
    #[parallel(skip)]
    window: Option<usize>,
}

impl Layer for Gemma3Layer {
    type Config = Gemma3Config;

    fn parse_config(text: &str, source: &str) -> Result<Gemma3Config> {
        Gemma3Config::parse(text, source)
    }

    fn build(c: &Gemma3Config, vb: VarBuilder) -> candle_core::Result<Gemma3> {
        let bad = |(key, m): (&str, String)| candle_core::Error::Msg(format!("{key}: {m}"));
        let (global, local) = c.ropes().map_err(bad)?;
        let (global, local) = (Arc::new(global), Arc::new(local));
        let sliding = c.layer_kinds().map_err(bad)?;
        let (h, d) = (c.hidden_size, c.head_dim);
        let norm = NormKind {
            eps: c.rms_norm_eps,
            gemma: true,
        };
        let shape = AttentionShape {
            hidden: h,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: d,
            qkv_bias: c.attention_bias,
            o_bias: c.attention_bias,
            qk_norm: match c.gemma2() {
                true => QkNorm::None,
                false => QkNorm::PerHead(norm),
            },
            // The kernels scale scores by 1/sqrt(head_dim); Gemma's is
            // 1/sqrt(query_pre_attn_scalar).
            query_scale: Some((d as f64 / c.query_pre_attn_scalar as f64).sqrt()),
            softcap: c.attn_logit_softcapping,
            sinks: false,
            rotary_dim: None,
        };
        let body = BodyShape {
            vocab: c.vocab_size,
            hidden: h,
            layers: c.num_hidden_layers,
            tied: c.tie_word_embeddings,
            norm,
        };
        let mut model = Decoder::from_layers(body, vb, |l, vb| {
            let self_attn = SelfAttention::new(shape, vb.pp("self_attn"))?;
            let mlp = (h, c.intermediate_size);
            Ok(Gemma3Layer {
                input_layernorm: norm.build(h, vb.pp("input_layernorm"))?,
                self_attn,
                post_attention_layernorm: norm.build(h, vb.pp("post_attention_layernorm"))?,
                pre_feedforward_layernorm: norm.build(h, vb.pp("pre_feedforward_layernorm"))?,
                mlp: GatedMlp::new(mlp, false, Activation::GeluTanh, vb.pp("mlp"))?,
                post_feedforward_layernorm: norm.build(h, vb.pp("post_feedforward_layernorm"))?,
                rope: match sliding[l] {
                    true => local.clone(),
                    false => global.clone(),
                },
                window: c.sliding_window.filter(|_| sliding[l]),
            })
        })?;
        model.embed_scale = Some((h as f64).sqrt());
        model.logit_softcap = c.final_logit_softcapping;
        Ok(model)
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let a = self.self_attn.forward(
            &h,
            cx,
            Some(&self.rope),
            self.window.map(crate::nn::Window::Sliding),
        )?;
        let x = (x + self.post_attention_layernorm.forward(&a)?)?;
        let h = self.pre_feedforward_layernorm.forward(&x)?;
        let m = self.mlp.forward(cx, &h)?;
        Ok((&x + self.post_feedforward_layernorm.forward(&m)?)?)
    }

    fn attention_heads(&self) -> (usize, usize) {
        (self.self_attn.num_heads, self.self_attn.num_kv_heads)
    }
}
