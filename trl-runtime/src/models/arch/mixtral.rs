//! Mixtral (`model_type` mixtral), as transformers' MixtralForCausalLM: Mistral's layer (an
//! optional sliding window on every layer) with a sparse mixture-of-experts MLP
//! (`block_sparse_moe`, moe.rs) whose experts are `w1` (gate), `w3` (up) and `w2` (down), the
//! top-k weights always renormalised. The router's load-balancing loss is router_loss.rs's;
//! jitter noise is not built (refused).

use super::blocks::{gated_mlp, Activation, Decoder, Layer, PreNormAttention};
use super::moe::{Expert, MoeConfig, SparseMoe};
use crate::error::{Error, Result};
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::{linear_no_bias, Linear};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["mixtral"];

/// MixtralForCausalLM.
pub type Mixtral = Decoder<MixtralLayer>;

/// One expert: `w2(silu(w1(x)) * w3(x))`, split under tp as a dense MLP.
#[derive(Debug, Clone, Parallelize)]
pub struct MixtralExpert {
    #[parallel(tp = "column")]
    w1: Linear,
    #[parallel(tp = "row")]
    w2: Linear,
    #[parallel(tp = "column")]
    w3: Linear,
}

impl Expert for MixtralExpert {
    fn forward(&self, cx: &LayerInputs, x: &Tensor) -> Result<Tensor> {
        gated_mlp(
            (&self.w1, &self.w3, &self.w2),
            Activation::Silu,
            cx,
            x,
            None,
        )
    }
}

/// x + attention(norm(x)), then + moe(norm(x)).
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct MixtralLayer {
    /// input_layernorm, self_attn, post_attention_layernorm.
    #[parallel(name = "")]
    attention: PreNormAttention,
    block_sparse_moe: SparseMoe<MixtralExpert>,
}

fn check(config: &ModelConfig, source: &str) -> Result<MoeConfig> {
    let jitter = config
        .extra
        .get("router_jitter_noise")
        .and_then(|v| v.as_f64());
    if jitter.is_some_and(|j| j != 0.0) {
        return Err(Error::Config {
            file: source.into(),
            key: "router_jitter_noise".into(),
            message: format!(
                "{}: router jitter is not implemented; set it to 0.0",
                jitter.unwrap_or(0.0)
            ),
        });
    }
    MoeConfig::read(config, source)
}

impl Layer for MixtralLayer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        check(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Mixtral> {
        let moe = check(config, "config.json").map_err(Error::into_candle)?;
        let parts = config.layer_parts()?;
        let (h, i) = (config.hidden_size, config.intermediate_size);
        Decoder::from_layers(parts.body, vb, |l, vb| {
            let block = vb.pp("block_sparse_moe");
            let experts = (0..moe.experts)
                .map(|e| {
                    let vb = block.pp("experts").pp(e);
                    Ok(MixtralExpert {
                        w1: linear_no_bias(h, i, vb.pp("w1"))?,
                        w2: linear_no_bias(i, h, vb.pp("w2"))?,
                        w3: linear_no_bias(h, i, vb.pp("w3"))?,
                    })
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(MixtralLayer {
                attention: parts.pre_norm_attention(l, &vb)?,
                block_sparse_moe: SparseMoe {
                    gate: linear_no_bias(h, moe.experts, block.pp("gate"))?,
                    experts: experts.into(),
                    top_k: moe.top_k,
                    norm_topk_prob: true,
                },
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (h, x) = self.attention.forward(x, cx)?;
        Ok((&x + self.block_sparse_moe.forward(cx, &h)?)?)
    }

    fn attention_heads(&self) -> (usize, usize) {
        self.attention.heads()
    }

    fn may_skip_grad(name: &str) -> bool {
        crate::nn::lora::is_routed_expert(name)
    }
}
