//! The Llama family's decoder (llama, qwen2, qwen3, mistral, smollm3): token embedding, N x (RMSNorm -> attention with rotary
//! embeddings and grouped-query heads -> residual, RMSNorm -> SwiGLU MLP -> residual), final
//! RMSNorm, LM head (tied to the embedding or not). Logits for every position.
//!
//! The model is annotated for tensor parallelism like any user model (`#[derive(Parallelize)]`):
//! q/k/v and gate/up are column-parallel, o and down row-parallel, the embedding and the LM
//! head vocab-parallel (logits stay split over the vocabulary; `parallel::Model::loss` never gathers
//! them), and head counts are divided by the tp size.

use super::blocks::{candle, Activation, AttentionShape, GatedMlp, NormKind, SelfAttention};
use super::causal::{CausalModel, LayerInputs};
use super::config::ModelConfig;
use crate::error::Result;
use crate::nn::{embedding, linear_no_bias, rms_norm};
use crate::nn::{Embedding, Linear, RmsNorm, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["llama", "qwen2", "qwen3", "mistral", "smollm3"];

#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
}

/// The Llama / Qwen2 network. Trained as `parallel::CausalLm`, which attaches the strategies.
#[derive(Parallelize)]
pub struct Llama {
    #[parallel(skip)]
    rope: RotaryEmbedding,
    /// Each layer's sliding attention window (None: full attention).
    #[parallel(skip)]
    windows: Vec<Option<usize>>,
    /// Whether each layer applies rotary embeddings (SmolLM3's NoPE layers do not).
    #[parallel(skip)]
    ropes: Vec<bool>,
    #[parallel(tp = "vocab", name = "model.embed_tokens")]
    embed_tokens: Embedding,
    #[parallel(name = "model.layers")]
    layers: Vec<DecoderLayer>,
    #[parallel(name = "model.norm")]
    norm: RmsNorm,
    #[parallel(tp = "vocab")]
    lm_head: Linear,
}

impl CausalModel for Llama {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_for(text, source, MODEL_TYPES)
    }

    fn new(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let rope = config
            .rotary()
            .map_err(|m| candle_core::Error::Msg(format!("config.json, rope_scaling: {m}")))?;
        let (h, i, v, d) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
            config.head_dim(),
        );
        let eps = config.rms_norm_eps;
        let shape = AttentionShape {
            hidden: h,
            heads: config.num_attention_heads,
            kv_heads: config.num_kv_heads(),
            head_dim: d,
            qkv_bias: config.qkv_bias(),
            o_bias: config.o_bias(),
        };
        let qk_norm = config.qk_norm().then_some(NormKind { eps, gemma: false });
        let m = vb.pp("model");
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let vb = m.pp("layers").pp(l);
                Ok(DecoderLayer {
                    input_layernorm: rms_norm(h, eps, vb.pp("input_layernorm"))?,
                    self_attn: SelfAttention::new(shape, vb.pp("self_attn"), qk_norm)?,
                    post_attention_layernorm: rms_norm(h, eps, vb.pp("post_attention_layernorm"))?,
                    mlp: GatedMlp::new((h, i), config.mlp_bias, Activation::Silu, vb.pp("mlp"))?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let embed_tokens = embedding(v, h, m.pp("embed_tokens"))?;
        let lm_head = match config.tie_word_embeddings {
            true => Linear::from_weights(embed_tokens.weight.clone(), None),
            false => linear_no_bias(h, v, vb.pp("lm_head"))?,
        };
        let windows = config
            .layer_windows()
            .map_err(|(key, m)| candle_core::Error::Msg(format!("config.json, {key}: {m}")))?;
        let ropes = config
            .layer_ropes()
            .map_err(|(key, m)| candle_core::Error::Msg(format!("config.json, {key}: {m}")))?;
        Ok(Llama {
            rope,
            windows,
            ropes,
            embed_tokens,
            layers,
            norm: rms_norm(h, eps, m.pp("norm"))?,
            lm_head,
        })
    }

    fn embed(&self, input_ids: &Tensor, _: &LayerInputs) -> candle_core::Result<Tensor> {
        self.embed_tokens.forward(input_ids)
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer(&self, l: usize, x: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor> {
        let rope = self.ropes[l].then_some(&self.rope);
        layer_forward(&self.layers[l], self.windows[l], rope, cx, x).map_err(candle)
    }

    fn final_norm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.norm.forward(x)
    }

    fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    fn heads(&self) -> Option<(usize, usize)> {
        let attn = &self.layers.first()?.self_attn;
        Some((attn.num_heads, attn.num_kv_heads))
    }

    fn supports_tiled_mlp(&self) -> bool {
        true
    }
}

/// One decoder layer: x + attention(norm(x)), then + mlp(norm(x)).
fn layer_forward(
    layer: &DecoderLayer,
    window: Option<usize>,
    rope: Option<&RotaryEmbedding>,
    cx: &LayerInputs,
    x: &Tensor,
) -> Result<Tensor> {
    let h = layer.input_layernorm.forward(x)?;
    let x = (x + layer.self_attn.forward(&h, cx, rope, window)?)?;
    let h = layer.post_attention_layernorm.forward(&x)?;
    Ok((&x + layer.mlp.forward(cx, &h)?)?)
}
