//! gpt-oss (`model_type` gpt_oss), as transformers' GptOssForCausalLM: Llama's layer order
//! with biased attention projections, attention sinks (a learned logit per head that joins
//! the softmax, `self_attn.sinks`), alternating sliding and full layers (`layer_types`), YaRN
//! rotary, and a mixture of experts in every layer: a biased router whose top-k logits are
//! softmaxed (= the top-k probabilities renormalised), and experts kept as transformers keeps
//! them, fused 3-D parameters (`mlp.experts.gate_up_proj` [experts, hidden, 2 x inter] with
//! gate and up interleaved, `down_proj` [experts, inter, hidden], and their biases), run as
//! grouped GEMMs over tokens sorted by expert, with gpt-oss's clamped SwiGLU.
//!
//! Strategies: ZeRO and FSDP shard the fused expert tensors with the rest of the layer's unit;
//! under tp the attention (and its sinks) is split by heads and each expert's MLP as a dense
//! one (gate_up columns, down rows), the router whole. Checkpoints quantized to MXFP4 (the
//! hub's) are read dequantized (models/weights/mxfp4.rs); other quantizations are refused.

use super::blocks::{Decoder, Layer, PreNormAttention};
use super::moe::{routed, MoeConfig};
use crate::comm::autograd::{copy_to_group, reduce_from_group};
use crate::error::{Error, Result};
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::grouped::grouped_linear;
use crate::nn::Param;
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["gpt_oss"];

/// GptOssForCausalLM.
pub type GptOss = Decoder<GptOssLayer>;

/// `mlp.router`: logits = x W^T + b. Not a `Linear`: peft's `all-linear` does not adapt it.
#[derive(Debug, Clone, Parallelize)]
pub struct GptOssRouter {
    weight: Param,
    bias: Param,
}

/// `mlp.experts`: every expert's weights in one tensor each. Under tp each expert's MLP is
/// split as a dense one: gate_up by its columns (gate and up interleaved: a contiguous slice
/// holds matching pairs), down by its rows; the down bias, whole, is added after the sum.
#[derive(Debug, Clone, Parallelize)]
pub struct GptOssExperts {
    gate_up_proj: Param,
    gate_up_proj_bias: Param,
    down_proj: Param,
    down_proj_bias: Param,
    /// The SwiGLU's sigmoid gain (`swiglu_alpha`) and clamp (`swiglu_limit`).
    #[parallel(skip)]
    alpha: f64,
    #[parallel(skip)]
    limit: f64,
}

impl GptOssExperts {
    /// Rows `xs` [rows, hidden] sorted by expert (`counts[e]` for expert e) through their
    /// experts: down((up + 1) * gate * sigmoid(alpha * gate)), gate clamped above at the
    /// limit and up on both sides.
    fn forward(&self, cx: &LayerInputs, xs: &Tensor, counts: &[usize]) -> Result<Tensor> {
        // Under tp: Megatron's f before the split columns and g after the split rows.
        let xs = match cx.tp() {
            Some(tp) => copy_to_group(xs, tp)?,
            None => xs.clone(),
        };
        let (gate_up, bias) = (&self.gate_up_proj, &self.gate_up_proj_bias);
        let gate_up = grouped_linear(&xs, gate_up, Some(bias), counts)?;
        let m = gate_up.dim(0)?;
        let act = crate::kernels::fused::clamped_swiglu(&gate_up, self.alpha, self.limit)?;
        let Some(tp) = cx.tp() else {
            // The down bias in the grouped GEMM's pass (its gradient per expert's rows).
            let bias = Some(&self.down_proj_bias);
            return Ok(grouped_linear(&act, &self.down_proj, bias, counts)?);
        };
        // Under tp the down rows are split: the bias is added once, after the sum.
        let y = reduce_from_group(&grouped_linear(&act, &self.down_proj, None, counts)?, tp)?;
        let experts: Vec<u32> = (0u32..)
            .zip(counts)
            .flat_map(|(e, &n)| std::iter::repeat_n(e, n))
            .collect();
        let experts = Tensor::from_vec(experts, m, xs.device())?;
        let bias = self.down_proj_bias.value()?.index_select(&experts, 0)?;
        Ok((y + bias)?)
    }
}

/// `mlp`: the router and the experts.
#[derive(Debug, Clone, Parallelize)]
pub struct GptOssMlp {
    router: GptOssRouter,
    experts: GptOssExperts,
    #[parallel(skip)]
    top_k: usize,
}

impl GptOssMlp {
    fn forward(&self, cx: &LayerInputs, x: &Tensor) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let flat = x.reshape((b * s, h))?;
        let (w, bias) = (self.router.weight.value()?, self.router.bias.value()?);
        let logits = crate::kernels::fused::linear(&flat, &w, Some(&bias))?;
        // Softmax over the top-k logits = their probabilities renormalised.
        let out = routed(
            cx,
            &flat,
            &logits,
            (self.top_k, true),
            |rows, index, counts| {
                // One gather: the grouped layer's backward gives every row's gradient at once.
                let xs = rows.index_select(index, 0)?;
                self.experts.forward(cx, &xs, counts)
            },
        )?;
        Ok(out.reshape((b, s, h))?)
    }
}

/// x + attention(norm(x)), then + mlp(norm(x)).
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct GptOssLayer {
    /// input_layernorm, self_attn (with sinks), post_attention_layernorm.
    #[parallel(name = "")]
    attention: PreNormAttention,
    mlp: GptOssMlp,
}

/// gpt-oss's keys beyond the Llama family's: the experts (MoeConfig) and the SwiGLU's
/// constants (quantizations other than MXFP4, which the loader makes dense, and attention
/// dropout are refused with every model's: ModelConfig::validate).
fn check(config: &ModelConfig, source: &str) -> Result<(MoeConfig, f64, f64)> {
    let number = |key: &str, default: f64| -> Result<f64> {
        match config.extra.get(key).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| *x > 0.0)
                .ok_or_else(|| Error::config(source, key, format!("{v} is not a positive number"))),
        }
    };
    let (alpha, limit) = (number("swiglu_alpha", 1.702)?, number("swiglu_limit", 7.0)?);
    Ok((MoeConfig::read(config, source)?, alpha, limit))
}

impl Layer for GptOssLayer {
    type Config = ModelConfig;
    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        check(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<GptOss> {
        let (moe, alpha, limit) = check(config, "config.json").map_err(Error::into_candle)?;
        let mut parts = config.layer_parts()?;
        parts.attention.sinks = true;
        let (h, i, e) = (config.hidden_size, config.intermediate_size, moe.experts);
        Decoder::from_layers(parts.body, vb, |l, vb| {
            let mlp = vb.pp("mlp");
            let (router, experts) = (mlp.pp("router"), mlp.pp("experts"));
            Ok(GptOssLayer {
                attention: parts.pre_norm_attention(l, &vb)?,
                mlp: GptOssMlp {
                    router: GptOssRouter {
                        weight: Param::new(&router, (e, h), "weight")?,
                        bias: Param::new(&router, e, "bias")?,
                    },
                    experts: GptOssExperts {
                        gate_up_proj: Param::new(&experts, (e, h, 2 * i), "gate_up_proj")?
                            .adapted_in_out()
                            .split_column(2)
                            .expert_stack(),
                        gate_up_proj_bias: Param::new(&experts, (e, 2 * i), "gate_up_proj_bias")?
                            .split_column(1)
                            .expert_stack(),
                        down_proj: Param::new(&experts, (e, i, h), "down_proj")?
                            .adapted_in_out()
                            .split_row(1)
                            .expert_stack(),
                        down_proj_bias: Param::new(&experts, (e, h), "down_proj_bias")?
                            .expert_stack(),
                        alpha,
                        limit,
                    },
                    top_k: moe.top_k,
                },
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let (h, x) = self.attention.forward(x, cx)?;
        Ok((&x + self.mlp.forward(cx, &h)?)?)
    }

    fn attention_heads(&self) -> (usize, usize) {
        self.attention.heads()
    }
}
