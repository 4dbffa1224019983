//! OLMo 2 (`model_type` olmo2), as transformers' Olmo2ForCausalLM: Llama's blocks with the
//! norms after attention and after the MLP (no norm before them), and q/k RMSNorms over the
//! whole q and k projections (not per head). Its config is the Llama family's. OLMo 3
//! (`olmo3`, Olmo3ForCausalLM) is the same with sliding-window layers (`layer_types`), whose
//! rotary base and scaling may differ from the full-attention layers'.
//!
//! Under tensor parallelism the q/k projections are split by heads, so their norms gather the
//! projection (blocks.rs: `norm_whole_projection`); the norms' weights stay whole and their
//! gradients are partial sums over tp (found at the first step, as Qwen3's).

use super::blocks::SelfAttention;
use super::blocks::{Activation, Decoder, GatedMlp, Layer};
use crate::error::Result;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::{RmsNorm, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["olmo2", "olmo3"];

/// Olmo2ForCausalLM and Olmo3ForCausalLM.
pub type Olmo2 = Decoder<Olmo2Layer>;

/// x + norm(attention(x)), then + norm(mlp(x)).
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Olmo2Layer {
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
    post_feedforward_layernorm: RmsNorm,
    #[parallel(skip)]
    rope: Arc<RotaryEmbedding>,
    /// OLMo 3's sliding layers' window (None: full attention).
    #[parallel(skip)]
    window: Option<crate::nn::Window>,
}

impl Layer for Olmo2Layer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_for(text, source, MODEL_TYPES)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Olmo2> {
        let h = config.hidden_size;
        // OLMo 2's attention_bias puts a bias on o too; its q/k norms span the projections.
        let parts = config.layer_parts()?;
        let (norm, shape) = (parts.norm, parts.attention);
        Decoder::from_layers(parts.body, vb, |l, vb| {
            let self_attn = SelfAttention::new(shape, vb.pp("self_attn"))?;
            let mlp = (h, config.intermediate_size);
            Ok(Olmo2Layer {
                self_attn,
                post_attention_layernorm: norm.build(h, vb.pp("post_attention_layernorm"))?,
                mlp: GatedMlp::new(mlp, config.mlp_bias, Activation::Silu, vb.pp("mlp"))?,
                post_feedforward_layernorm: norm.build(h, vb.pp("post_feedforward_layernorm"))?,
                rope: parts.rope_of(l),
                window: parts.windows[l],
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let a = self
            .self_attn
            .forward(x, cx, Some(&self.rope), self.window)?;
        let x = (x + self.post_attention_layernorm.forward(&a)?)?;
        let m = self.mlp.forward(cx, &x)?;
        Ok((&x + self.post_feedforward_layernorm.forward(&m)?)?)
    }

    fn attention_heads(&self) -> (usize, usize) {
        (self.self_attn.num_heads, self.self_attn.num_kv_heads)
    }

    fn tiles_mlp(&self) -> bool {
        true
    }
}
