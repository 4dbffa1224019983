//! Phi-3 and Phi-4-mini (`model_type` phi3), as transformers' Phi3ForCausalLM: Llama's layer
//! with fused projections (`qkv_proj`: queries, keys and values in one weight; `gate_up_proj`:
//! gate and up), partial rotary embeddings (`partial_rotary_factor`), longrope scaling, and an
//! optional sliding window on every layer.
//!
//! Under tensor parallelism the fused projections are column-parallel by sections: each rank
//! holds its share of the q, k and v rows (of gate and up), so its output is its heads' q, k,
//! v (its gate and up features) in the whole's order; o and down are row-parallel, as in
//! every other model.

use super::blocks::{Decoder, Heads, Layer};
use crate::error::Result;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::{linear_no_bias, Linear, RmsNorm, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["phi3"];

/// Phi3ForCausalLM.
pub type Phi3 = Decoder<Phi3Layer>;

/// x + attention(norm(x)), then + mlp(norm(x)), with fused projections.
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Phi3Layer {
    input_layernorm: RmsNorm,
    #[parallel(tp = "column", name = "self_attn.qkv_proj")]
    qkv_proj: Linear,
    #[parallel(tp = "row", name = "self_attn.o_proj")]
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    #[parallel(tp = "column", name = "mlp.gate_up_proj")]
    gate_up_proj: Linear,
    #[parallel(tp = "row", name = "mlp.down_proj")]
    down_proj: Linear,
    /// Query and key/value heads on this rank.
    #[parallel(tp = "divide")]
    heads: usize,
    #[parallel(tp = "divide")]
    kv_heads: usize,
    /// Head size, rotary features per head.
    #[parallel(skip)]
    shape: (usize, usize),
    #[parallel(skip)]
    rope: Arc<RotaryEmbedding>,
    #[parallel(skip)]
    window: Option<crate::nn::Window>,
}

impl Layer for Phi3Layer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        // Its dropouts are refused with every model's (ModelConfig::validate).
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Phi3> {
        let parts = config.layer_parts()?;
        let (rope, windows, norm) = (parts.rope, parts.windows, parts.norm);
        let (h, i, d) = (
            config.hidden_size,
            config.intermediate_size,
            config.head_dim(),
        );
        let (heads, kv_heads) = (config.num_attention_heads, config.num_kv_heads());
        let rotary_dim = config.rotary_dim();
        Decoder::from_layers(parts.body, vb, |l, vb| {
            let (attn, mlp) = (vb.pp("self_attn"), vb.pp("mlp"));
            Ok(Phi3Layer {
                input_layernorm: norm.build(h, vb.pp("input_layernorm"))?,
                qkv_proj: linear_no_bias(h, (heads + 2 * kv_heads) * d, attn.pp("qkv_proj"))?
                    .with_sections(&[heads * d, kv_heads * d, kv_heads * d]),
                o_proj: linear_no_bias(heads * d, h, attn.pp("o_proj"))?,
                post_attention_layernorm: norm.build(h, vb.pp("post_attention_layernorm"))?,
                gate_up_proj: linear_no_bias(h, 2 * i, mlp.pp("gate_up_proj"))?
                    .with_sections(&[i, i]),
                down_proj: linear_no_bias(i, h, mlp.pp("down_proj"))?,
                heads,
                kv_heads,
                shape: (d, rotary_dim),
                rope: rope.clone(),
                window: windows[l],
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (heads, kv_heads, (d, rotary_dim)) = (self.heads, self.kv_heads, self.shape);
        let h = self.input_layernorm.forward(x)?;
        let qkv = self.qkv_proj.forward(&h)?;
        let last = qkv.rank() - 1;
        let q = qkv.narrow(last, 0, heads * d)?;
        let k = qkv.narrow(last, heads * d, kv_heads * d)?;
        let v = qkv.narrow(last, (heads + kv_heads) * d, kv_heads * d)?;
        let attend = Heads {
            heads,
            kv_heads,
            head_dim: d,
            q_norm: None,
            k_norm: None,
            norm_whole_projection: false,
            query_scale: None,
            softcap: None,
            sinks: None,
            rotary_dim: Some(rotary_dim),
        };
        let a = attend.attend((q, k, v), cx, Some(&self.rope), self.window)?;
        let x = (x + self.o_proj.forward(&a)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        let gate_up = self.gate_up_proj.forward(&h)?;
        let i = gate_up.dim(last)? / 2;
        let (gate, up) = (gate_up.narrow(last, 0, i)?, gate_up.narrow(last, i, i)?);
        let m = crate::kernels::fused::swiglu(&gate.contiguous()?, &up.contiguous()?)?;
        Ok((&x + self.down_proj.forward(&m)?)?)
    }

    fn attention_heads(&self) -> (usize, usize) {
        (self.heads, self.kv_heads)
    }
}
