//! The Llama / Qwen2 decoder: token embedding, N x (RMSNorm -> attention with rotary
//! embeddings and grouped-query heads -> residual, RMSNorm -> SwiGLU MLP -> residual), final
//! RMSNorm, LM head (tied to the embedding or not). Logits for every position.
//!
//! The model is annotated for tensor parallelism like any user model (`#[derive(Parallelize)]`):
//! q/k/v and gate/up are column-parallel, o and down row-parallel, the embedding and the LM
//! head vocab-parallel (logits stay split over the vocabulary; `parallel::Model::loss` never gathers
//! them), and head counts are divided by the tp size.

use super::causal::{CausalModel, LayerInputs};
use super::config::ModelConfig;
use crate::comm::autograd::{copy_to_group, reduce_from_group};
use crate::error::{Error, Result};
use crate::kernels::fused::rotary as apply_rotary;
use crate::nn::tiled_mlp::tiled_swiglu;
use crate::nn::{embedding, linear, linear_no_bias, rms_norm};
use crate::nn::{Embedding, Linear, RmsNorm, RotaryEmbedding, Weight};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

#[derive(Clone, Parallelize)]
#[parallel(fsdp_unit)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    #[parallel(tp = "column", name = "self_attn.q_proj")]
    q_proj: Linear,
    #[parallel(tp = "column", name = "self_attn.k_proj")]
    k_proj: Linear,
    #[parallel(tp = "column", name = "self_attn.v_proj")]
    v_proj: Linear,
    #[parallel(tp = "row", name = "self_attn.o_proj")]
    o_proj: Linear,
    // Qwen3's per-head norms: they act on the heads this rank holds, so under tp their
    // gradients are partial sums (found at the first step; this struct's unannotated
    // parameters are `auto`).
    #[parallel(name = "self_attn.q_norm")]
    q_norm: Option<RmsNorm>,
    #[parallel(name = "self_attn.k_norm")]
    k_norm: Option<RmsNorm>,
    post_attention_layernorm: RmsNorm,
    #[parallel(tp = "column", name = "mlp.gate_proj")]
    gate_proj: Linear,
    #[parallel(tp = "column", name = "mlp.up_proj")]
    up_proj: Linear,
    #[parallel(tp = "row", name = "mlp.down_proj")]
    down_proj: Linear,
    /// Query and key/value heads on this rank.
    #[parallel(tp = "divide")]
    num_heads: usize,
    #[parallel(tp = "divide")]
    num_kv_heads: usize,
}

/// The Llama / Qwen2 network. Trained as `parallel::CausalLm`, which attaches the strategies.
#[derive(Parallelize)]
pub struct Llama {
    #[parallel(skip)]
    rope: RotaryEmbedding,
    /// Each layer's sliding attention window (None: full attention).
    #[parallel(skip)]
    windows: Vec<Option<usize>>,
    #[parallel(skip)]
    head_dim: usize,
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
        ModelConfig::from_json(text, source)
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
        let (q, kv) = (config.num_attention_heads * d, config.num_kv_heads() * d);
        let eps = config.rms_norm_eps;
        let lin = |vb: VarBuilder, (i, o): (usize, usize), bias: bool| match bias {
            true => linear(i, o, vb),
            false => linear_no_bias(i, o, vb),
        };
        let qk_norm = |vb: VarBuilder| match config.qk_norm() {
            true => rms_norm(d, eps, vb).map(Some),
            false => Ok(None),
        };
        let m = vb.pp("model");
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let vb = m.pp("layers").pp(l);
                let (attn, mlp) = (vb.pp("self_attn"), vb.pp("mlp"));
                Ok(DecoderLayer {
                    input_layernorm: rms_norm(h, eps, vb.pp("input_layernorm"))?,
                    q_proj: lin(attn.pp("q_proj"), (h, q), config.qkv_bias())?,
                    k_proj: lin(attn.pp("k_proj"), (h, kv), config.qkv_bias())?,
                    v_proj: lin(attn.pp("v_proj"), (h, kv), config.qkv_bias())?,
                    o_proj: lin(attn.pp("o_proj"), (q, h), config.o_bias())?,
                    q_norm: qk_norm(attn.pp("q_norm"))?,
                    k_norm: qk_norm(attn.pp("k_norm"))?,
                    post_attention_layernorm: rms_norm(h, eps, vb.pp("post_attention_layernorm"))?,
                    gate_proj: lin(mlp.pp("gate_proj"), (h, i), config.mlp_bias)?,
                    up_proj: lin(mlp.pp("up_proj"), (h, i), config.mlp_bias)?,
                    down_proj: lin(mlp.pp("down_proj"), (i, h), config.mlp_bias)?,
                    num_heads: config.num_attention_heads,
                    num_kv_heads: config.num_kv_heads(),
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
        Ok(Llama {
            rope,
            windows,
            head_dim: d,
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
        layer_forward(&self.layers[l], self.windows[l], self, cx, x).map_err(Error::into_candle)
    }

    fn final_norm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.norm.forward(x)
    }

    fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    fn heads(&self) -> Option<(usize, usize)> {
        self.layers.first().map(|l| (l.num_heads, l.num_kv_heads))
    }

    fn supports_tiled_mlp() -> bool {
        true
    }
}

/// One decoder layer: x + attention(norm(x)), then + mlp(norm(x)).
fn layer_forward(
    layer: &DecoderLayer,
    window: Option<usize>,
    net: &Llama,
    cx: &LayerInputs,
    x: &Tensor,
) -> Result<Tensor> {
    let (b, s, _) = x.dims3()?;
    let d = net.head_dim;
    let (cos, sin) = cx.cos_sin(&net.rope)?;
    let (heads, kv_heads) = (layer.num_heads, layer.num_kv_heads);
    let h = layer.input_layernorm.forward(x)?;
    let split = |t: Tensor, n: usize| -> candle_core::Result<Tensor> {
        crate::kernels::fused::swap_heads(&t.reshape((b, s, n, d))?)
    };
    // Qwen3 normalises each head's queries and keys (over head_dim) before rotary.
    let norm = |t: Tensor, n: &Option<RmsNorm>| -> candle_core::Result<Tensor> {
        match n {
            Some(n) => n.forward(&t),
            None => Ok(t),
        }
    };
    let q = norm(split(layer.q_proj.forward(&h)?, heads)?, &layer.q_norm)?;
    let k = norm(split(layer.k_proj.forward(&h)?, kv_heads)?, &layer.k_norm)?;
    let (q, k) = (apply_rotary(&q, &cos, &sin)?, apply_rotary(&k, &cos, &sin)?);
    let v = split(layer.v_proj.forward(&h)?, kv_heads)?;
    let a = crate::kernels::fused::swap_heads(&cx.attention_in_window(&q, &k, &v, window)?)?
        .reshape((b, s, heads * d))?;
    let x = (x + layer.o_proj.forward(&a)?)?;
    let h = layer.post_attention_layernorm.forward(&x)?;
    Ok((&x + mlp(layer, cx, &h)?)?)
}

/// A layer's SwiGLU MLP; with `tiled_mlp` (and the weights held whole on this rank, no
/// biases) computed in sequence tiles that keep no [tokens x intermediate] activations.
fn mlp(layer: &DecoderLayer, cx: &LayerInputs, h: &Tensor) -> Result<Tensor> {
    let weights = (
        &layer.gate_proj.weight,
        &layer.up_proj.weight,
        &layer.down_proj.weight,
    );
    let no_bias = [&layer.gate_proj, &layer.up_proj, &layer.down_proj]
        .iter()
        .all(|l| l.bias.is_none());
    let (Weight::Local(gate), Weight::Local(up), Weight::Local(down)) = weights else {
        return plain_mlp(layer, h);
    };
    if !cx.tiled_mlp || !no_bias {
        return plain_mlp(layer, h);
    }
    let (b, s, hidden) = h.dims3()?;
    let x = h.reshape((b * s, hidden))?;
    // Under tp: Megatron's f before the column-split gate/up and g after the row-split down.
    let x = match cx.tp() {
        Some(tp) => copy_to_group(&x, tp)?,
        None => x,
    };
    let y = tiled_swiglu(&x, &Tensor::cat(&[gate, up], 0)?, down)?;
    let y = match cx.tp() {
        Some(tp) => reduce_from_group(&y, tp)?,
        None => y,
    };
    Ok(y.reshape((b, s, hidden))?)
}

fn plain_mlp(layer: &DecoderLayer, h: &Tensor) -> Result<Tensor> {
    let mlp =
        crate::kernels::fused::swiglu(&layer.gate_proj.forward(h)?, &layer.up_proj.forward(h)?)?;
    Ok(layer.down_proj.forward(&mlp)?)
}
