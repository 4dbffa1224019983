//! The Llama family's decoder (llama, qwen2, qwen3, mistral, smollm3): token embedding, N x (RMSNorm -> attention with rotary
//! embeddings and grouped-query heads -> residual, RMSNorm -> SwiGLU MLP -> residual), final
//! RMSNorm, LM head (tied to the embedding or not). Logits for every position.
//!
//! The model is annotated for tensor parallelism like any user model (`#[derive(Parallelize)]`,
//! in blocks.rs): q/k/v and gate/up are column-parallel, o and down row-parallel, the embedding
//! and the LM head vocab-parallel (logits stay split over the vocabulary;
//! `parallel::Model::loss` never gathers them), and head counts are divided by the tp size.

use super::blocks::{Activation, Decoder, GatedMlp, Layer, PreNormAttention};
use crate::error::Result;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["llama", "qwen2", "qwen3", "mistral", "smollm3", "qwen3_vl"];

/// LlamaForCausalLM and its relatives.
pub type Llama = Decoder<LlamaLayer>;

/// One decoder layer: x + attention(norm(x)), then + mlp(norm(x)).
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct LlamaLayer {
    /// input_layernorm, self_attn, post_attention_layernorm.
    #[parallel(name = "")]
    attention: PreNormAttention,
    mlp: GatedMlp,
}

impl Layer for LlamaLayer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_for(text, source, MODEL_TYPES)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Llama> {
        let parts = config.layer_parts()?;
        let (h, i) = (config.hidden_size, config.intermediate_size);
        Decoder::from_layers(parts.body, vb, |l, vb| {
            Ok(LlamaLayer {
                attention: parts.pre_norm_attention(l, &vb)?,
                mlp: GatedMlp::new((h, i), config.mlp_bias, Activation::Silu, vb.pp("mlp"))?,
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (h, x) = self.attention.forward(x, cx)?;
        self.mlp.forward_add(cx, &h, &x)
    }

    fn attention_heads(&self) -> (usize, usize) {
        self.attention.heads()
    }

    fn tiles_mlp(&self) -> bool {
        true
    }
}
