//! Qwen3-MoE (`model_type` qwen3_moe), as transformers' Qwen3MoeForCausalLM: Qwen3's layer
//! (per-head q/k norms) with a sparse mixture-of-experts MLP (moe.rs) on every
//! `decoder_sparse_step`-th layer but those in `mlp_only_layers`, which keep a dense one.
//! The router's load-balancing loss is router_loss.rs's.

use super::blocks::{Activation, Decoder, GatedMlp, Layer, PreNormAttention};
use super::moe::{MoeConfig, SparseMoe};
use crate::error::{Error, Result};
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::linear_no_bias;
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["qwen3_moe"];

/// Qwen3MoeForCausalLM.
pub type Qwen3Moe = Decoder<Qwen3MoeLayer>;

/// x + attention(norm(x)), then + mlp(norm(x)) with a dense or a sparse MLP.
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Qwen3MoeLayer {
    /// input_layernorm, self_attn, post_attention_layernorm.
    #[parallel(name = "")]
    attention: PreNormAttention,
    #[parallel(name = "mlp")]
    dense: Option<GatedMlp>,
    #[parallel(name = "mlp")]
    sparse: Option<SparseMoe<GatedMlp>>,
}

impl Layer for Qwen3MoeLayer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        let moe = MoeConfig::read(&config, source)?;
        if moe.inter.is_none() {
            let why = "missing: the experts' hidden size";
            return Err(Error::config(source, "moe_intermediate_size", why));
        }
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Qwen3Moe> {
        let moe = MoeConfig::read(config, "config.json").map_err(Error::into_candle)?;
        let inter = moe.inter.unwrap_or(config.intermediate_size);
        let parts = config.layer_parts()?;
        let h = config.hidden_size;
        Decoder::from_layers(parts.body, vb, |l, vb| {
            let mlp = vb.pp("mlp");
            let (dense, sparse) = match moe.sparse[l] {
                false => {
                    let size = (h, config.intermediate_size);
                    (
                        Some(GatedMlp::new(size, false, Activation::Silu, mlp)?),
                        None,
                    )
                }
                true => {
                    let experts = (0..moe.experts)
                        .map(|e| {
                            let vb = mlp.pp("experts").pp(e);
                            GatedMlp::new((h, inter), false, Activation::Silu, vb)
                        })
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    let gate = linear_no_bias(h, moe.experts, mlp.pp("gate"))?;
                    let sparse = SparseMoe {
                        gate,
                        experts: experts.into(),
                        top_k: moe.top_k,
                        norm_topk_prob: moe.norm_topk_prob,
                    };
                    (None, Some(sparse))
                }
            };
            Ok(Qwen3MoeLayer {
                attention: parts.pre_norm_attention(l, &vb)?,
                dense,
                sparse,
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (h, x) = self.attention.forward(x, cx)?;
        match (&self.sparse, &self.dense) {
            (Some(sparse), _) => Ok((&x + sparse.forward(cx, &h)?)?),
            (None, Some(dense)) => dense.forward_add(cx, &h, &x),
            (None, None) => Err(Error::Parallelism(
                "a Qwen3-MoE layer without an MLP".into(),
            )),
        }
    }

    fn attention_heads(&self) -> (usize, usize) {
        self.attention.heads()
    }

    fn may_skip_grad(name: &str) -> bool {
        crate::nn::lora::is_routed_expert(name)
    }
}
