//! OLMo 2 (`model_type` olmo2), as transformers' Olmo2ForCausalLM: Llama's blocks with the
//! norms after attention and after the MLP (no norm before them), and q/k RMSNorms over the
//! whole q and k projections (not per head). Its config is the Llama family's.
//!
//! Under tensor parallelism the q/k projections are split by heads, so their norms gather the
//! projection (blocks.rs: `norm_whole_projection`); the norms' weights stay whole and their
//! gradients are partial sums over tp (found at the first step, as Qwen3's).

use super::blocks::{candle, Activation, AttentionShape, GatedMlp, SelfAttention};
use super::causal::{CausalModel, LayerInputs};
use super::config::ModelConfig;
use crate::error::Result;
use crate::nn::{embedding, linear_no_bias, rms_norm};
use crate::nn::{Embedding, Linear, RmsNorm, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["olmo2"];

#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
struct DecoderLayer {
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
    post_feedforward_layernorm: RmsNorm,
}

/// Olmo2ForCausalLM.
#[derive(Parallelize)]
pub struct Olmo2 {
    #[parallel(skip)]
    rope: RotaryEmbedding,
    #[parallel(tp = "vocab", name = "model.embed_tokens")]
    embed_tokens: Embedding,
    #[parallel(name = "model.layers")]
    layers: Vec<DecoderLayer>,
    #[parallel(name = "model.norm")]
    norm: RmsNorm,
    #[parallel(tp = "vocab")]
    lm_head: Linear,
}

impl CausalModel for Olmo2 {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_for(text, source, MODEL_TYPES)
    }

    fn new(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let rope = config
            .rotary()
            .map_err(|m| candle_core::Error::Msg(format!("config.json, rope_scaling: {m}")))?;
        let (h, d, eps) = (config.hidden_size, config.head_dim(), config.rms_norm_eps);
        let (heads, kv_heads) = (config.num_attention_heads, config.num_kv_heads());
        let shape = AttentionShape {
            hidden: h,
            heads,
            kv_heads,
            head_dim: d,
            qkv_bias: config.attention_bias,
            o_bias: config.attention_bias,
        };
        let m = vb.pp("model");
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let vb = m.pp("layers").pp(l);
                let attn = vb.pp("self_attn");
                let mut self_attn = SelfAttention::new(shape, attn.clone(), None)?;
                self_attn.q_norm = Some(rms_norm(heads * d, eps, attn.pp("q_norm"))?);
                self_attn.k_norm = Some(rms_norm(kv_heads * d, eps, attn.pp("k_norm"))?);
                self_attn.norm_whole_projection = true;
                Ok(DecoderLayer {
                    self_attn,
                    post_attention_layernorm: rms_norm(h, eps, vb.pp("post_attention_layernorm"))?,
                    mlp: GatedMlp::new(
                        (h, config.intermediate_size),
                        config.mlp_bias,
                        Activation::Silu,
                        vb.pp("mlp"),
                    )?,
                    post_feedforward_layernorm: rms_norm(
                        h,
                        eps,
                        vb.pp("post_feedforward_layernorm"),
                    )?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let embed_tokens = embedding(config.vocab_size, h, m.pp("embed_tokens"))?;
        let lm_head = match config.tie_word_embeddings {
            true => Linear::from_weights(embed_tokens.weight.clone(), None),
            false => linear_no_bias(h, config.vocab_size, vb.pp("lm_head"))?,
        };
        Ok(Olmo2 {
            rope,
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
        let layer = &self.layers[l];
        let run = || -> Result<Tensor> {
            let a = layer.self_attn.forward(x, cx, Some(&self.rope), None)?;
            let x = (x + layer.post_attention_layernorm.forward(&a)?)?;
            let m = layer.mlp.forward(cx, &x)?;
            Ok((&x + layer.post_feedforward_layernorm.forward(&m)?)?)
        };
        run().map_err(candle)
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
