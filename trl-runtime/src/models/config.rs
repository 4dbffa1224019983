//! An HF `config.json` of the Llama family (Llama, Qwen2, Qwen3, Mistral, SmolLM3, OLMo 2 and 3).

use super::blocks::{AttentionShape, BodyShape, NormKind, PreNormAttention, QkNorm};
use crate::error::{Error, Result};
use crate::nn::{RopeScaling, Window};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    /// Qwen2's layout without q/k/v biases (unless `attention_bias`), with an RMSNorm over
    /// each head's queries and keys before rotary.
    Qwen3,
    /// Llama's layout without biases, attending within a sliding window (`sliding_window`).
    Mistral,
    /// Llama's layout with some layers without rotary embeddings (`no_rope_layers`, NoPE).
    SmolLm3,
    /// Norms after attention and the MLP, q/k norms over the whole projections (models/olmo2.rs).
    Olmo2,
    /// OLMo 2's blocks with sliding-window layers, which may have their own rotary base
    /// (models/olmo2.rs).
    Olmo3,
    /// Fused qkv and gate/up projections, partial rotary (models/phi3.rs).
    Phi3,
    /// Qwen3 with mixture-of-experts MLPs (models/qwen3_moe.rs).
    Qwen3Moe,
    /// Mistral with mixture-of-experts MLPs (models/mixtral.rs).
    Mixtral,
    /// Attention sinks, fused experts with a clamped SwiGLU (models/gpt_oss.rs).
    GptOss,
    /// Partial rotary, DeepSeek's mixture of experts (models/glm4_moe.rs).
    Glm4Moe,
    /// Latent attention, DeepSeek's mixture of experts (models/deepseek_v3.rs).
    DeepseekV3,
    /// Chunked and NoPE layers, a sigmoid-routed mixture with a shared expert
    /// (models/llama4.rs).
    Llama4,
    /// Gated DeltaNet and gated full-attention layers, experts with a gated shared one
    /// (models/qwen3_next.rs: Qwen3-Next and Qwen3.5).
    Qwen3Next,
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_act() -> String {
    "silu".into()
}
fn default_max_pos() -> usize {
    2048
}

/// The fields the models use; everything else in config.json is kept verbatim in `extra` so a
/// saved checkpoint carries it back out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelConfig {
    pub model_type: String,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// transformers >= 5 writes `rope_parameters` (rope_type, rope_theta, scaling factors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama's switch for q/k/v/o biases (Qwen2 always has q/k/v biases).
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ModelConfig {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read model config {}", path.display()), e))?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// As [`Self::from_json`], for a model that reads only `model_types`.
    pub fn from_json_for(text: &str, source: &str, model_types: &[&str]) -> Result<Self> {
        let cfg = Self::from_json(text, source)?;
        check_model_type(&cfg.model_type, source, model_types)?;
        Ok(cfg)
    }

    pub fn from_json(text: &str, source: &str) -> Result<Self> {
        let invalid = |key: String, e: serde_json::Error| Error::Config {
            file: source.into(),
            key,
            message: format!("not a valid model config: {e}"),
        };
        let at = |e: &serde_json::Error| format!("<line {} column {}>", e.line(), e.column());
        // A vision-language checkpoint's language model (models/composite.rs).
        let mut json =
            super::composite::language_model_json(text).map_err(|e| invalid(at(&e), e))?;
        transformers_defaults(&mut json);
        let cfg: ModelConfig =
            serde_json::from_value(json).map_err(|e| invalid("<document>".into(), e))?;
        cfg.validate(source)?;
        Ok(cfg)
    }

    fn validate(&self, source: &str) -> Result<()> {
        let err = |key: &str, message: String| {
            Err(Error::Config {
                file: source.into(),
                key: key.into(),
                message,
            })
        };
        self.architecture().map_err(|m| Error::Config {
            file: source.into(),
            key: "model_type".into(),
            message: m,
        })?;
        // Quantized weights (MXFP4 was made dense by the loader) and dropout, which no model
        // here implements: refused for every model type rather than silently ignored.
        let quant = self
            .extra
            .get("quantization_config")
            .filter(|q| !q.is_null());
        if let Some(q) = quant {
            let method = q
                .get("quant_method")
                .and_then(|m| m.as_str())
                .unwrap_or("?");
            return err(
                "quantization_config",
                format!(
                    "'{method}' weights cannot be trained here (MXFP4, the hub's gpt-oss, are \
                     read dequantized): save the checkpoint dense first (in Python: \
                     AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16), then \
                     .save_pretrained(out))"
                ),
            );
        }
        for key in ["attention_dropout", "resid_pdrop", "embd_pdrop"] {
            let p = self.extra.get(key).and_then(|v| v.as_f64()).unwrap_or(0.0);
            if p != 0.0 {
                return err(
                    key,
                    format!("{p}: dropout is not implemented; set it to 0.0"),
                );
            }
        }
        if self.hidden_act != "silu" {
            return err(
                "hidden_act",
                format!(
                    "'{}' is not supported: the Llama family's models use silu",
                    self.hidden_act
                ),
            );
        }
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
        ] {
            if v == 0 {
                return err(key, "must be at least 1".into());
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return err(
                "num_attention_heads",
                format!(
                    "hidden_size {} is not divisible by {} heads: set head_dim",
                    self.hidden_size, self.num_attention_heads
                ),
            );
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return err(
                "num_key_value_heads",
                format!(
                    "{} attention heads cannot be grouped over {} key/value heads",
                    self.num_attention_heads,
                    self.num_kv_heads()
                ),
            );
        }
        if !self.head_dim().is_multiple_of(2) {
            return err(
                "head_dim",
                format!("{} must be even for rotary embeddings", self.head_dim()),
            );
        }
        let r = self.rotary_dim();
        if r == 0 || !r.is_multiple_of(2) || r > self.head_dim() {
            return err(
                "partial_rotary_factor",
                format!(
                    "turns {r} of {} features per head: it must turn an even number, at least 2",
                    self.head_dim()
                ),
            );
        }
        if let Err(m) = self.rotary().and_then(|_| self.rotary_for(true)) {
            return err(
                if self.rope_parameters.is_some() {
                    "rope_parameters"
                } else {
                    "rope_scaling"
                },
                m,
            );
        }
        if let Err((key, m)) = self.layer_windows() {
            return err(key, m);
        }
        if let Err((key, m)) = self.layer_ropes() {
            return err(key, m);
        }
        Ok(())
    }

    /// The rotary embedding of the full-attention layers (either config layout).
    pub fn rotary(&self) -> std::result::Result<crate::nn::RotaryEmbedding, String> {
        self.rotary_for(false)
    }

    /// The rotary embedding of full-attention layers, or of sliding ones (`sliding`): the same
    /// unless the config gives the sliding layers their own (OLMo 3).
    pub fn rotary_for(
        &self,
        sliding: bool,
    ) -> std::result::Result<crate::nn::RotaryEmbedding, String> {
        let (theta, mut scaling) = self.rope_settings(sliding)?;
        // Phi-3's configs keep original_max_position_embeddings beside rope_scaling.
        if let Some(s) = scaling
            .as_mut()
            .filter(|s| s.original_max_position_embeddings.is_none())
        {
            s.original_max_position_embeddings = self
                .extra
                .get("original_max_position_embeddings")
                .and_then(|v| v.as_u64())
                .map(|v| v as usize);
        }
        crate::nn::RotaryEmbedding::new(
            self.rotary_dim(),
            theta,
            self.max_position_embeddings,
            scaling.as_ref(),
        )
    }

    /// The rotary base and scaling of full-attention or sliding layers. transformers 5 writes
    /// OLMo 3's `rope_parameters` keyed by layer type (`full_attention`, `sliding_attention`);
    /// its older configs scale only the full-attention layers (`rope_scaling`).
    fn rope_settings(
        &self,
        sliding: bool,
    ) -> std::result::Result<(f64, Option<RopeScaling>), String> {
        let kind = if sliding {
            "sliding_attention"
        } else {
            "full_attention"
        };
        match &self.rope_parameters {
            Some(p)
                if ["full_attention", "sliding_attention"]
                    .iter()
                    .any(|k| p.extra.contains_key(*k)) =>
            {
                let Some(v) = p.extra.get(kind) else {
                    return Ok((self.rope_theta, None));
                };
                let s: RopeScaling =
                    serde_json::from_value(v.clone()).map_err(|e| format!("{kind}: {e}"))?;
                Ok((s.rope_theta.unwrap_or(self.rope_theta), Some(s)))
            }
            Some(p) => Ok((p.rope_theta.unwrap_or(self.rope_theta), Some(p.clone()))),
            None if sliding && self.model_type == "olmo3" => Ok((self.rope_theta, None)),
            None => Ok((self.rope_theta, self.rope_scaling.clone())),
        }
    }

    pub fn architecture(&self) -> std::result::Result<Architecture, String> {
        match self.model_type.as_str() {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "mistral" => Ok(Architecture::Mistral),
            "smollm3" => Ok(Architecture::SmolLm3),
            "olmo2" => Ok(Architecture::Olmo2),
            "olmo3" => Ok(Architecture::Olmo3),
            "phi3" => Ok(Architecture::Phi3),
            "qwen3_moe" => Ok(Architecture::Qwen3Moe),
            "mixtral" => Ok(Architecture::Mixtral),
            "gpt_oss" => Ok(Architecture::GptOss),
            "glm4_moe" => Ok(Architecture::Glm4Moe),
            "deepseek_v3" | "glm4_moe_lite" => Ok(Architecture::DeepseekV3),
            "llama4_text" => Ok(Architecture::Llama4),
            "mistral4" => Ok(Architecture::DeepseekV3),
            "qwen3_next" | "qwen3_5_text" | "qwen3_5_moe_text" => Ok(Architecture::Qwen3Next),
            other => Err(format!(
                "model_type '{other}' is not supported: use llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, smollm3, olmo2, olmo3, phi3, gpt_oss, glm4_moe, glm4_moe_lite, deepseek_v3, mistral4, llama4_text, qwen3_next, qwen3_5_text or qwen3_5_moe_text (or \
                 your own model: docs/your-model.md)"
            )),
        }
    }

    /// Each layer's attention window (None: full attention), as transformers reads the
    /// config: `layer_types` ("sliding_attention" layers use `sliding_window`,
    /// "chunked_attention" ones `attention_chunk_size`), else for Mistral `sliding_window` on
    /// every layer, else Qwen2/Qwen3's `use_sliding_window` from layer `max_window_layers`
    /// on. Err names the key and why.
    pub fn layer_windows(
        &self,
    ) -> std::result::Result<Vec<Option<Window>>, (&'static str, String)> {
        let n = self.num_hidden_layers;
        let size = |key: &'static str| match self.extra.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(w) if w >= 1 => Ok(Some(w as usize)),
                _ => Err((
                    key,
                    format!("{v} is not a window: give a positive number of tokens, or null"),
                )),
            },
        };
        let window = size("sliding_window")?;
        let need = |what: String| match window {
            Some(w) => Ok(Some(Window::Sliding(w))),
            None => Err((
                "sliding_window",
                format!("{what}, but sliding_window is null"),
            )),
        };
        if let Some(types) = self.extra.get("layer_types").and_then(|v| v.as_array()) {
            let chunk = size("attention_chunk_size")?;
            return attention_kinds(types, n)?
                .into_iter()
                .enumerate()
                .map(|(i, kind)| match (kind, chunk) {
                    (LayerAttention::Full | LayerAttention::Linear, _) => Ok(None),
                    (LayerAttention::Sliding, _) => need(format!("layer {i} is sliding_attention")),
                    (LayerAttention::Chunked, Some(c)) => Ok(Some(Window::Chunked(c))),
                    (LayerAttention::Chunked, None) => Err((
                        "attention_chunk_size",
                        format!("layer {i} is chunked_attention, but attention_chunk_size is null"),
                    )),
                })
                .collect();
        }
        if self.model_type == "olmo3" {
            // transformers' default: three sliding layers, then a full one.
            return (0..n)
                .map(|i| match (i + 1) % 4 {
                    0 => Ok(None),
                    _ => need(format!("layer {i} is sliding_attention")),
                })
                .collect();
        }
        if self.model_type == "gpt_oss" {
            // transformers' default: sliding layers 0, 2, 4, ..., full ones between.
            return (0..n)
                .map(|i| match i % 2 {
                    0 => need(format!("layer {i} is sliding_attention")),
                    _ => Ok(None),
                })
                .collect();
        }
        if self.model_type == "llama4_text" {
            // transformers' default: chunked attention on the rotary layers.
            let chunk = size("attention_chunk_size")?.map(Window::Chunked);
            let ropes = self.layer_ropes()?;
            return Ok(ropes.into_iter().map(|r| chunk.filter(|_| r)).collect());
        }
        if matches!(self.model_type.as_str(), "mistral" | "mixtral" | "phi3") {
            return Ok(vec![window.map(Window::Sliding); n]);
        }
        let sliding = self
            .extra
            .get("use_sliding_window")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        if !sliding {
            return Ok(vec![None; n]);
        }
        let from = self
            .extra
            .get("max_window_layers")
            .and_then(|v| v.as_u64())
            .map_or(0, |m| m as usize);
        (0..n)
            .map(|i| match i >= from {
                true => need("use_sliding_window is true".into()),
                false => Ok(None),
            })
            .collect()
    }

    /// Whether each layer applies rotary embeddings: all but SmolLM3's and Llama 4's NoPE
    /// layers (`no_rope_layers`, 1 = rotary, else every `no_rope_layer_interval`-th layer, 4
    /// by default, has none), as transformers reads them.
    pub fn layer_ropes(&self) -> std::result::Result<Vec<bool>, (&'static str, String)> {
        let n = self.num_hidden_layers;
        if !matches!(self.model_type.as_str(), "smollm3" | "llama4_text") {
            return Ok(vec![true; n]);
        }
        if let Some(v) = self.extra.get("no_rope_layers").filter(|v| !v.is_null()) {
            let flags: Option<Vec<bool>> = v
                .as_array()
                .map(|a| a.iter().map(|f| f.as_u64().map(|f| f != 0)).collect())
                .and_then(|f: Option<Vec<bool>>| f);
            return match flags {
                Some(f) if f.len() == n => Ok(f),
                _ => Err((
                    "no_rope_layers",
                    format!("{v} is not one 0/1 flag per layer ({n} layers)"),
                )),
            };
        }
        let interval = match self.extra.get("no_rope_layer_interval") {
            None | Some(serde_json::Value::Null) => 4,
            Some(v) => match v.as_u64() {
                Some(i) if i >= 1 => i as usize,
                _ => {
                    return Err((
                        "no_rope_layer_interval",
                        format!("{v} is not a positive layer count"),
                    ))
                }
            },
        };
        Ok((0..n).map(|l| !(l + 1).is_multiple_of(interval)).collect())
    }

    /// What a layer of the Llama family is built from: the rotary table, each layer's
    /// window and rotary use, and the blocks' shapes; config errors as Candle's, naming
    /// config.json's key.
    pub fn layer_parts(&self) -> candle_core::Result<LayerParts> {
        let rope_key = match self.rope_parameters {
            Some(_) => "rope_parameters",
            None => "rope_scaling",
        };
        let rope = self
            .rotary()
            .map_err(|m| candle_config_error((rope_key, m)))?;
        let rope = Arc::new(rope);
        // One table for both unless the sliding layers' settings differ.
        let sliding_rope = match self.rope_settings(true) == self.rope_settings(false) {
            true => rope.clone(),
            false => Arc::new(
                self.rotary_for(true)
                    .map_err(|m| candle_config_error((rope_key, m)))?,
            ),
        };
        let (norm, attention, body) = self.shapes();
        Ok(LayerParts {
            sliding_rope,
            rope,
            windows: self.layer_windows().map_err(candle_config_error)?,
            ropes: self.layer_ropes().map_err(candle_config_error)?,
            norm,
            attention,
            body,
        })
    }

    /// The Llama family's shapes of its blocks: RMSNorms, attention, the decoder's body.
    pub fn shapes(&self) -> (NormKind, AttentionShape, BodyShape) {
        let norm = NormKind {
            eps: self.rms_norm_eps,
            gemma: false,
        };
        let attention = AttentionShape {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_kv_heads(),
            head_dim: self.head_dim(),
            qkv_bias: self.qkv_bias(),
            o_bias: self.o_bias(),
            qk_norm: match self.model_type.as_str() {
                _ if self.qk_norm() => QkNorm::PerHead(norm),
                "olmo2" | "olmo3" => QkNorm::WholeProjection(norm),
                _ => QkNorm::None,
            },
            query_scale: None,
            softcap: None,
            sinks: false,
            rotary_dim: Some(self.rotary_dim()),
        };
        let body = BodyShape {
            vocab: self.vocab_size,
            hidden: self.hidden_size,
            layers: self.num_hidden_layers,
            tied: self.tie_word_embeddings,
            norm,
        };
        (norm, attention, body)
    }

    /// The features of each head that rotary embeddings turn: `partial_rotary_factor` of
    /// them (at the top level, or in rope_parameters / rope_scaling), all by default.
    pub fn rotary_dim(&self) -> usize {
        let factor = [
            self.extra.get("partial_rotary_factor"),
            self.rope_parameters
                .as_ref()
                .and_then(|p| p.extra.get("partial_rotary_factor")),
            self.rope_scaling
                .as_ref()
                .and_then(|p| p.extra.get("partial_rotary_factor")),
        ]
        .into_iter()
        .flatten()
        .find_map(|v| v.as_f64())
        .unwrap_or(1.0);
        (self.head_dim() as f64 * factor) as usize
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// q/k/v projections carry a bias (always for Qwen2, by `attention_bias` for Llama and
    /// Qwen3).
    pub fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2" || self.attention_bias
    }

    /// The output projection carries a bias (Llama and Qwen3 with `attention_bias`).
    pub fn o_bias(&self) -> bool {
        matches!(
            self.model_type.as_str(),
            "llama" | "qwen3" | "qwen3_moe" | "smollm3" | "olmo2" | "olmo3" | "gpt_oss"
        ) && self.attention_bias
    }

    /// An RMSNorm over each head's queries and keys (Qwen3, Qwen3-MoE; GLM-4 MoE by
    /// `use_qk_norm`).
    pub fn qk_norm(&self) -> bool {
        match self.model_type.as_str() {
            "qwen3" | "qwen3_moe" => true,
            "glm4_moe" => self.extra.get("use_qk_norm").and_then(|v| v.as_bool()) == Some(true),
            _ => false,
        }
    }

    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serialises")
    }

    /// Every parameter name in HF's layout with its shape, in a stable order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim(),
            self.num_kv_heads() * self.head_dim(),
        );
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut add = |name: &str, shape: Vec<usize>| out.push((format!("{p}.{name}"), shape));
            add("input_layernorm.weight", vec![h]);
            add("self_attn.q_proj.weight", vec![q, h]);
            add("self_attn.k_proj.weight", vec![kv, h]);
            add("self_attn.v_proj.weight", vec![kv, h]);
            if self.qkv_bias() {
                add("self_attn.q_proj.bias", vec![q]);
                add("self_attn.k_proj.bias", vec![kv]);
                add("self_attn.v_proj.bias", vec![kv]);
            }
            if self.qk_norm() {
                add("self_attn.q_norm.weight", vec![self.head_dim()]);
                add("self_attn.k_norm.weight", vec![self.head_dim()]);
            }
            add("self_attn.o_proj.weight", vec![h, q]);
            if self.o_bias() {
                add("self_attn.o_proj.bias", vec![h]);
            }
            add("post_attention_layernorm.weight", vec![h]);
            add("mlp.gate_proj.weight", vec![i, h]);
            add("mlp.up_proj.weight", vec![i, h]);
            add("mlp.down_proj.weight", vec![h, i]);
            if self.mlp_bias {
                add("mlp.gate_proj.bias", vec![i]);
                add("mlp.up_proj.bias", vec![i]);
                add("mlp.down_proj.bias", vec![h]);
            }
        }
        out.push(("model.norm.weight".into(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".into(), vec![v, h]));
        }
        out
    }

    /// Parameter count (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

/// The values transformers' config classes give keys a checkpoint's config.json leaves out,
/// where they differ from the Llama family's defaults here: the GLM and DeepSeek models'
/// norms' epsilon, context length and partial rotary, and latent attention's `head_dim`
/// (transformers' name for the rotary part of a head: DeepSeek-V3 sets it so, GLM-4.7-Flash
/// maps it to `qk_rope_head_dim`), Qwen3.5-MoE's missing `intermediate_size`.
pub(crate) fn transformers_defaults(json: &mut serde_json::Value) {
    let Some(map) = json.as_object_mut() else {
        return;
    };
    let model_type = map
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    let defaults: &[(&str, serde_json::Value)] = match model_type.as_str() {
        "glm4_moe" => &[
            ("rms_norm_eps", serde_json::json!(1e-5)),
            ("max_position_embeddings", serde_json::json!(131072)),
        ],
        "glm4_moe_lite" => &[
            ("rms_norm_eps", serde_json::json!(1e-5)),
            ("max_position_embeddings", serde_json::json!(202752)),
        ],
        "deepseek_v3" => &[("max_position_embeddings", serde_json::json!(4096))],
        // Llama4TextConfig's defaults (its rope_theta: default_theta).
        "llama4_text" => &[
            ("rms_norm_eps", serde_json::json!(1e-5)),
            ("max_position_embeddings", serde_json::json!(131072)),
            ("head_dim", serde_json::json!(128)),
            ("rope_theta", serde_json::json!(500000.0)),
        ],
        _ => &[],
    };
    // Qwen3.5-MoE's config has no intermediate_size (every MLP is a mixture): its experts'
    // width stands in for the field the dense models read.
    if model_type == "qwen3_5_moe_text" && !map.contains_key("intermediate_size") {
        if let Some(width) = map.get("moe_intermediate_size").cloned() {
            map.insert("intermediate_size".into(), width);
        }
    }
    for (key, value) in defaults {
        if !map.contains_key(*key) {
            map.insert(key.to_string(), value.clone());
        }
    }
    // Mistral4Config: head_dim is the query/key width, the rotary part by partial_rotary_factor.
    if model_type == "mistral4" && !map.contains_key("head_dim") {
        let width = ["qk_nope_head_dim", "qk_rope_head_dim"]
            .iter()
            .map(|k| map.get(*k).and_then(|v| v.as_u64()))
            .sum::<Option<u64>>();
        if let Some(w) = width {
            map.insert("head_dim".into(), serde_json::json!(w));
        }
    }
    // Qwen3NextConfig: `kwargs.setdefault("partial_rotary_factor", 0.25)`.
    let rotary_given = map.contains_key("partial_rotary_factor")
        || ["rope_parameters", "rope_scaling"].iter().any(|k| {
            map.get(*k)
                .and_then(|p| p.get("partial_rotary_factor"))
                .is_some()
        });
    if matches!(
        model_type.as_str(),
        "qwen3_next" | "qwen3_5_text" | "qwen3_5_moe_text"
    ) && !rotary_given
    {
        map.insert("partial_rotary_factor".into(), serde_json::json!(0.25));
    }
    if matches!(model_type.as_str(), "deepseek_v3" | "glm4_moe_lite") {
        if let Some(rope) = map.get("qk_rope_head_dim").cloned() {
            map.insert("head_dim".into(), rope);
        }
    }
    // Glm4MoeConfig: `kwargs.setdefault("partial_rotary_factor", 0.5)`.
    let in_rope = ["rope_parameters", "rope_scaling"].iter().any(|k| {
        map.get(*k)
            .and_then(|p| p.get("partial_rotary_factor"))
            .is_some()
    });
    if model_type == "glm4_moe" && !in_rope && !map.contains_key("partial_rotary_factor") {
        map.insert("partial_rotary_factor".into(), serde_json::json!(0.5));
    }
}

/// How a layer attends by transformers' `layer_types`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerAttention {
    Full,
    Sliding,
    /// Llama 4's chunked_attention.
    Chunked,
    /// Qwen3-Next's linear_attention (Gated DeltaNet: no attention window).
    Linear,
}

/// How each of `n` layers attends by transformers' `layer_types` (`full_attention`,
/// `sliding_attention` or `chunked_attention`); Err names the key and why.
pub fn attention_kinds(
    types: &[serde_json::Value],
    n: usize,
) -> std::result::Result<Vec<LayerAttention>, (&'static str, String)> {
    if types.len() != n {
        return Err((
            "layer_types",
            format!("{} entries for {n} layers", types.len()),
        ));
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("full_attention") => Ok(LayerAttention::Full),
            Some("sliding_attention") => Ok(LayerAttention::Sliding),
            Some("chunked_attention") => Ok(LayerAttention::Chunked),
            Some("linear_attention") => Ok(LayerAttention::Linear),
            _ => Err((
                "layer_types",
                format!(
                    "{t} (layer {i}) is not supported: use full_attention, sliding_attention, \
                     chunked_attention or linear_attention"
                ),
            )),
        })
        .collect()
}

/// Whether each of `n` layers attends in a sliding window by transformers' `layer_types`
/// (`full_attention` or `sliding_attention`); Err names the key and why.
pub fn sliding_layers(
    types: &[serde_json::Value],
    n: usize,
) -> std::result::Result<Vec<bool>, (&'static str, String)> {
    attention_kinds(types, n)?
        .into_iter()
        .enumerate()
        .map(|(i, kind)| match kind {
            LayerAttention::Full => Ok(false),
            LayerAttention::Sliding => Ok(true),
            LayerAttention::Chunked | LayerAttention::Linear => Err((
                "layer_types",
                format!(
                    "{} (layer {i}) is not supported by this model",
                    types[i].as_str().unwrap_or("?")
                ),
            )),
        })
        .collect()
}

/// Refuses a `model_type` a model file does not read, naming those it does.
fn check_model_type(found: &str, source: &str, model_types: &[&str]) -> Result<()> {
    match model_types.contains(&found) {
        true => Ok(()),
        false => Err(Error::Config {
            file: source.into(),
            key: "model_type".into(),
            message: format!(
                "'{found}' is not read by this model (it reads {}): load it with \
                 AutoModelForCausalLM",
                model_types.join(", ")
            ),
        }),
    }
}

/// A model file's own config type `T` read from config.json's `text` (a vision-language
/// checkpoint's language model: composite.rs), its `model_type` one of `model_types`; errors
/// name `source` and where the text is not `T`.
pub fn text_config<T: serde::de::DeserializeOwned>(
    text: &str,
    source: &str,
    model_types: &[&str],
) -> Result<T> {
    let invalid = |key: String, e: serde_json::Error| {
        Error::config(source, &key, format!("not a valid model config: {e}"))
    };
    let json = super::composite::language_model_json(text)
        .map_err(|e| invalid(format!("<line {} column {}>", e.line(), e.column()), e))?;
    let found = json
        .get("model_type")
        .and_then(|t| t.as_str())
        .unwrap_or("");
    check_model_type(found, source, model_types)?;
    serde_json::from_value(json).map_err(|e| invalid("<document>".into(), e))
}

/// A config error as Candle's (what a model's `build` returns), naming config.json's key.
pub fn candle_config_error((key, message): (&str, String)) -> candle_core::Error {
    candle_core::Error::Msg(format!("config.json, {key}: {message}"))
}

/// See [`ModelConfig::layer_parts`].
pub struct LayerParts {
    pub rope: Arc<crate::nn::RotaryEmbedding>,
    /// The sliding layers' (OLMo 3's have their own; else `rope` again).
    pub sliding_rope: Arc<crate::nn::RotaryEmbedding>,
    /// Each layer's attention window (None: global).
    pub windows: Vec<Option<Window>>,
    /// Whether each layer applies rotary embeddings (SmolLM3's NoPE layers do not).
    pub ropes: Vec<bool>,
    pub norm: NormKind,
    pub attention: AttentionShape,
    pub body: BodyShape,
}

impl LayerParts {
    /// Layer `l`'s rotary table (its window says which).
    pub fn rope_of(&self, l: usize) -> Arc<crate::nn::RotaryEmbedding> {
        match self.windows[l] {
            Some(Window::Sliding(_)) => self.sliding_rope.clone(),
            _ => self.rope.clone(),
        }
    }

    /// Layer `l`'s [`PreNormAttention`] from its `vb`.
    pub fn pre_norm_attention(
        &self,
        l: usize,
        vb: &VarBuilder,
    ) -> candle_core::Result<PreNormAttention> {
        let rope = self.ropes[l].then(|| self.rope_of(l));
        PreNormAttention::new((self.norm, self.attention), (rope, self.windows[l]), vb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// OLMo 3's rotary settings read alike from transformers 5's `rope_parameters` keyed by
    /// layer type and from transformers 4's `rope_theta` + `rope_scaling`, which scales the
    /// full-attention layers only.
    #[test]
    fn olmo3_rope_reads_alike_from_either_layout() {
        let yarn = r#"{"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64"#;
        let head = r#""model_type": "olmo3", "vocab_size": 10, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "sliding_window": 8"#;
        let v5 = format!(
            r#"{{{head}, "rope_parameters": {{
                "full_attention": {yarn}, "rope_theta": 500000.0}},
                "sliding_attention": {{"rope_type": "default", "rope_theta": 500000.0}}}}}}"#
        );
        let v4 = format!(r#"{{{head}, "rope_theta": 500000.0, "rope_scaling": {yarn}}}}}"#);
        let (v5, v4) = (
            ModelConfig::from_json(&v5, "v5").unwrap(),
            ModelConfig::from_json(&v4, "v4").unwrap(),
        );
        for sliding in [false, true] {
            let (a, b) = (
                v5.rope_settings(sliding).unwrap(),
                v4.rope_settings(sliding).unwrap(),
            );
            assert_eq!(a.0, b.0, "sliding {sliding}");
            let kind =
                |s: &Option<RopeScaling>| s.as_ref().map(|s| (s.rope_type.clone(), s.factor));
            let want = (!sliding).then(|| ("yarn".to_string(), Some(8.0)));
            assert_eq!(kind(&b.1), want, "sliding {sliding}");
            assert_eq!(kind(&a.1).filter(|(t, _)| t != "default"), want);
        }
        // Three sliding layers, then a full one (transformers' default layer_types).
        let windows = v4.layer_windows().unwrap();
        let w = Some(Window::Sliding(8));
        assert_eq!(windows, vec![w, w, w, None]);
    }

    /// Keys transformers' config classes fill in: GLM-4.7-Flash's head_dim is its rotary part
    /// (its 2048 hidden features do not divide over 20 heads, and need not), GLM-4 MoE turns
    /// half of each head, and both take their norms' epsilon of 1e-5.
    #[test]
    fn transformers_defaults_fill_what_configs_leave_out() {
        let lite = r#"{"model_type": "glm4_moe_lite", "vocab_size": 10, "hidden_size": 2048,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 20,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 192}"#;
        let c = ModelConfig::from_json(lite, "lite").unwrap();
        assert_eq!(
            (c.head_dim(), c.rotary_dim(), c.rms_norm_eps),
            (64, 64, 1e-5)
        );
        let glm = r#"{"model_type": "glm4_moe", "vocab_size": 10, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}"#;
        let c = ModelConfig::from_json(glm, "glm").unwrap();
        assert_eq!((c.head_dim(), c.rotary_dim()), (16, 8));
        // Given, the factor is the config's.
        let full = glm.replace(
            "\"num_attention_heads\": 4",
            "\"num_attention_heads\": 4, \"partial_rotary_factor\": 1.0",
        );
        assert_eq!(
            ModelConfig::from_json(&full, "glm").unwrap().rotary_dim(),
            16
        );
    }
}
