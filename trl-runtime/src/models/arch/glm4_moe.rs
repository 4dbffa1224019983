//! GLM-4 MoE (`model_type` glm4_moe: GLM-4.5, GLM-4.6, GLM-4.7), as transformers'
//! Glm4MoeForCausalLM: Llama's layer order with grouped-query attention (q/k/v biases by
//! `attention_bias`, per-head q/k norms by `use_qk_norm`, rotary on the first
//! `partial_rotary_factor` of each head), a dense MLP on the first `first_k_dense_replace`
//! layers and DeepSeek's mixture of experts (deepseek_moe.rs) on the others.
//!
//! The checkpoints' multi-token prediction layers (`num_nextn_predict_layers`, stored after
//! the last layer) are not part of transformers' model, nor of this one.

use super::blocks::{Decoder, GatedMlp, Layer, PreNormAttention};
use super::deepseek_moe::{mlp_add, DeepseekMoe, DeepseekMoeConfig};
use crate::error::{Error, Result};
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["glm4_moe"];

/// Glm4MoeForCausalLM.
pub type Glm4Moe = Decoder<Glm4MoeLayer>;

/// x + attention(norm(x)), then + mlp(norm(x)) with a dense MLP or DeepSeek's mixture.
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Glm4MoeLayer {
    /// input_layernorm, self_attn, post_attention_layernorm.
    #[parallel(name = "")]
    attention: PreNormAttention,
    #[parallel(name = "mlp")]
    dense: Option<GatedMlp>,
    #[parallel(name = "mlp")]
    sparse: Option<DeepseekMoe>,
}

impl Layer for Glm4MoeLayer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        DeepseekMoeConfig::read(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Glm4Moe> {
        let moe = DeepseekMoeConfig::read(config, "config.json").map_err(Error::into_candle)?;
        let parts = config.layer_parts()?;
        Decoder::from_layers(parts.body, vb, |l, vb| {
            let (dense, sparse) = moe.mlp(config, l, vb.pp("mlp"), |vb| moe.moe(config, vb))?;
            Ok(Glm4MoeLayer {
                attention: parts.pre_norm_attention(l, &vb)?,
                dense,
                sparse,
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (h, x) = self.attention.forward(x, cx)?;
        mlp_add(self.dense.as_ref(), self.sparse.as_ref(), cx, &h, &x)
    }

    fn attention_heads(&self) -> (usize, usize) {
        self.attention.heads()
    }

    fn may_skip_grad(name: &str) -> bool {
        crate::nn::lora::is_routed_expert(name) || super::deepseek_moe::is_correction_bias(name)
    }
}
