//! Llama 4 (`model_type` llama4_text: Llama 4 Scout and Maverick's language model; the hub's
//! `llama4` checkpoints nest it, models/weights/composite.rs), as transformers'
//! Llama4ForCausalLM: Llama's layer order with
//! - rotary layers (`no_rope_layers` 1) that turn interleaved pairs of each head's features
//!   (as Meta's complex rotation), then L2-normalise queries and keys (`use_qk_norm`, no
//!   weight), and attend within chunks of `attention_chunk_size` positions (`layer_types`
//!   chunked_attention);
//! - NoPE layers (every `no_rope_layer_interval`-th) without rotary, attending to the whole
//!   document, their queries scaled by `log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`
//!   at position p (`attn_temperature_tuning`);
//! - feed-forward blocks (`feed_forward`): a dense gated MLP of `intermediate_size_mlp`, or on
//!   `moe_layers` a mixture: a router picks each token's top-k experts by logit, each
//!   chosen expert gets the token scaled by the sigmoid of its logit (the input scaled, not
//!   the output), experts fused as transformers keeps them (`experts.gate_up_proj`
//!   [experts, hidden, 2 x inter] with the gate half then the up half, `down_proj`
//!   [experts, inter, hidden]) and run as grouped GEMMs; a shared expert adds its output.
//!
//! Interleaved rotary as a permutation: a head's features reordered evens-then-odds turn by
//! the rotate-half rotary as the pairs turn by the interleaved one, and scores are the same
//! for any order of features that queries and keys share, as is an L2 norm. So queries and
//! keys are reordered before the rotary (values are not), and the kernels stay the same.
//!
//! The temperature counts positions within each document (a packed document and a
//! left-padded prompt get what they get alone); transformers counts a row's tokens from
//! its first, pads included, which differs only for left-padded rows past `floor_scale`.
//!
//! Strategies: under tp the attention is split by heads, the shared expert and the dense
//! MLP as dense ones, each expert's MLP too (gate_up by its columns in its two halves, down
//! by its rows), the router whole. peft's all-linear adapts the projections, not the router
//! (see [`Llama4Router`]) nor the fused experts (parameters: `target_parameters`). transformers computes no router loss for Llama 4:
//! `router_aux_loss_coef` is warned about when not 0.

use super::blocks::{deinterleave, log_position_scale, Decoder, GatedMlp, Layer, SelfAttention};
use super::moe::{dispatch_scaled_inputs, top_k, FusedExperts};
use crate::error::{Error, Result};
use crate::kernels::fused::{rms_normalize, rotary};
use crate::kernels::grouped::ExpertLayout;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::chain::{Chain, SplitHeads};
use crate::nn::{Linear, Param, RmsNorm, RotaryEmbedding, Window};
use crate::Parallelize;
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["llama4_text", "llama4"];

/// Llama4ForCausalLM.
pub type Llama4 = Decoder<Llama4Layer>;

/// `feed_forward.router`: logits = x W^T. A parameter, not a `Linear`: peft's all-linear
/// wraps transformers' router (an nn.Linear that returns scores and logits) in a layer that
/// then fails on the pair, so no adapter of ours goes where peft cannot run it.
#[derive(Debug, Clone, Parallelize)]
pub struct Llama4Router {
    weight: Param,
}

/// `feed_forward` on the MoE layers: the router, the experts and the shared expert.
#[derive(Debug, Clone, Parallelize)]
pub struct Llama4Moe {
    router: Llama4Router,
    experts: FusedExperts,
    shared_expert: GatedMlp,
    #[parallel(skip)]
    top_k: usize,
}

impl Llama4Moe {
    /// The block's output for `h` [batch, seq, hidden].
    fn forward(&self, cx: &LayerInputs, h: &Tensor) -> Result<Tensor> {
        let (b, s, hidden) = h.dims3()?;
        let n = b * s;
        let flat = h.reshape((n, hidden))?;
        let logits = flat.matmul(&self.router.weight.value()?.t()?)?;
        let count = logits.dim(1)?;
        let k = self.top_k;
        // The choice has no gradient: top-k logits on the host.
        let host: Vec<f32> = logits
            .detach()
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let chosen: Vec<u32> = host
            .chunks(count)
            .flat_map(|row| top_k(row, k).into_iter().map(|e| e as u32))
            .collect();
        // sigmoid in f32 as transformers scores, cast back; each chosen expert gets its
        // token scaled by it.
        let index = Tensor::new(chosen.as_slice(), h.device())?.reshape((n, k))?;
        let picked = logits.to_dtype(DType::F32)?.gather(&index, 1)?;
        let scores = candle_nn::ops::sigmoid(&picked)?.to_dtype(h.dtype())?;
        let routed = dispatch_scaled_inputs(cx, &flat, (&chosen, count), &scores, |xs, counts| {
            self.experts.forward(cx, xs, counts)
        })?;
        let shared = self.shared_expert.forward(cx, h)?;
        Ok((shared + routed.reshape((b, s, hidden))?)?)
    }
}

/// How a layer's attention differs from Llama's.
#[derive(Debug, Clone, Copy)]
struct AttentionKind {
    /// L2 norm of queries and keys after rotary, with this epsilon.
    qk_norm: Option<f64>,
    /// The NoPE layers' query temperature: (floor_scale, attn_scale).
    temperature: Option<(f64, f64)>,
}

/// x + attention(norm(x)), then + feed_forward(norm(x)).
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Llama4Layer {
    input_layernorm: RmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    #[parallel(name = "feed_forward")]
    dense: Option<GatedMlp>,
    #[parallel(name = "feed_forward")]
    sparse: Option<Llama4Moe>,
    /// The rotary table (shared by the layers), None on NoPE layers.
    #[parallel(skip)]
    rope: Option<Arc<RotaryEmbedding>>,
    /// Chunked attention on the rotary layers (None: the whole document).
    #[parallel(skip)]
    window: Option<Window>,
    #[parallel(skip)]
    kind: AttentionKind,
}

impl Llama4Layer {
    /// `x + attention(h)`.
    fn attention_add(&self, h: &Tensor, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let a = &self.self_attn;
        let (b, s, _) = h.dims3()?;
        let heads = |proj: &Linear, n: usize| -> Result<Tensor> {
            let split = SplitHeads {
                batch: b,
                seq: s,
                heads: n,
                head_dim: a.head_dim,
                rotary: None,
                scale: None,
            };
            Ok(proj.forward_chain(h, &Chain::split(split))?)
        };
        let q = heads(&a.q_proj, a.num_heads)?;
        let k = heads(&a.k_proj, a.num_kv_heads)?;
        let v = heads(&a.v_proj, a.num_kv_heads)?;
        let (q, k) = match &self.rope {
            Some(rope) => {
                let (cos, sin) = cx.cos_sin(rope)?;
                let turn = |t: &Tensor| rotary(&deinterleave(t)?, &cos, &sin);
                (turn(&q)?, turn(&k)?)
            }
            None => (q, k),
        };
        let (q, k) = match self.kind.qk_norm {
            Some(eps) => (rms_normalize(&q, eps)?, rms_normalize(&k, eps)?),
            None => (q, k),
        };
        let q = match self.kind.temperature {
            Some((floor, scale)) => {
                let t = log_position_scale(&cx.position_ids, (1.0, floor), scale)?;
                q.to_dtype(DType::F32)?
                    .broadcast_mul(&t)?
                    .to_dtype(q.dtype())?
            }
            None => q,
        };
        let out = a.heads().attend_heads(&q, &k, &v, cx, self.window)?;
        Ok(a.o_proj
            .forward_chain(&out, &Chain::merge_and_add(true, Some(x)))?)
    }
}

/// Llama 4's keys beyond the Llama family's.
pub struct Llama4Config {
    pub experts: usize,
    pub top_k: usize,
    /// Whether each layer's feed-forward is a mixture.
    pub moe: Vec<bool>,
    /// The dense MLPs' width (`intermediate_size_mlp`; the experts' is `intermediate_size`).
    pub dense_inter: usize,
    pub qk_norm: bool,
    pub temperature: Option<(f64, f64)>,
}

/// Reads them from a llama4_text config; None for another model type (the planner asks
/// every config).
pub fn read_config(c: &ModelConfig, source: &str) -> Option<Result<Llama4Config>> {
    (c.model_type == "llama4_text").then(|| check(c, source))
}

/// Reads them; errors name `source` and the key.
fn check(c: &ModelConfig, source: &str) -> Result<Llama4Config> {
    let err = |key: &str, message: String| Error::config(source, key, message);
    let get = |key: &str| c.extra.get(key).filter(|v| !v.is_null());
    let count = |key: &str, default: usize| -> Result<usize> {
        match get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| err(key, format!("{v} is not a count"))),
        }
    };
    let flag = |key: &str, default: bool| -> Result<bool> {
        match get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| err(key, format!("{v} is not true or false"))),
        }
    };
    let number = |key: &str, default: f64| -> Result<f64> {
        match get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| err(key, format!("{v} is not a number"))),
        }
    };
    let n = c.num_hidden_layers;
    let experts = count("num_local_experts", 16)?;
    let top_k = count("num_experts_per_tok", 1)?;
    if top_k == 0 || top_k > experts {
        return Err(err(
            "num_experts_per_tok",
            format!("{top_k} is not between 1 and the {experts} experts"),
        ));
    }
    // transformers: moe_layers, else every interleave_moe_layer_step-th layer.
    let moe_layers: Vec<usize> = match get("moe_layers") {
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|l| l.as_u64().map(|l| l as usize)).collect())
            .filter(|l: &Vec<usize>| l.iter().all(|&l| l < n))
            .ok_or_else(|| {
                err(
                    "moe_layers",
                    format!("{v} is not a list of layers below {n}"),
                )
            })?,
        None => {
            let step = count("interleave_moe_layer_step", 1)?;
            if step == 0 {
                return Err(err(
                    "interleave_moe_layer_step",
                    "must be at least 1".into(),
                ));
            }
            (step - 1..n).step_by(step).collect()
        }
    };
    let floor = number("floor_scale", 8192.0)?;
    if floor <= 0.0 {
        return Err(err("floor_scale", format!("{floor} is not positive")));
    }
    let scale = number("attn_scale", 0.1)?;
    if number("router_jitter_noise", 0.0)? != 0.0 {
        // transformers' Llama 4 router reads no jitter either: said, not refused.
        tracing::warn!("{source}: router_jitter_noise has no effect: Llama 4's router adds no noise (as transformers')");
    }
    if let Some(v) = get("router_aux_loss_coef").and_then(|v| v.as_f64()) {
        if v != 0.0 {
            tracing::warn!(
                "{source}: router_aux_loss_coef {v} has no effect: transformers computes no \
                 router load-balancing loss for llama4_text"
            );
        }
    }
    Ok(Llama4Config {
        experts,
        top_k,
        moe: (0..n).map(|l| moe_layers.contains(&l)).collect(),
        dense_inter: count("intermediate_size_mlp", 16384)?,
        qk_norm: flag("use_qk_norm", true)?,
        temperature: flag("attn_temperature_tuning", true)?.then_some((floor, scale)),
    })
}

impl Layer for Llama4Layer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        check(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Llama4> {
        let l4 = check(config, "config.json").map_err(Error::into_candle)?;
        let parts = config.layer_parts()?;
        let (h, i, e) = (config.hidden_size, config.intermediate_size, l4.experts);
        let act = super::blocks::Activation::Silu;
        Decoder::from_layers(parts.body, vb, |l, vb| {
            let ff = vb.pp("feed_forward");
            let (dense, sparse) = match l4.moe[l] {
                false => (
                    Some(GatedMlp::new((h, l4.dense_inter), false, act, ff)?),
                    None,
                ),
                true => {
                    let experts = ff.pp("experts");
                    let moe = Llama4Moe {
                        router: Llama4Router {
                            weight: Param::new(&ff.pp("router"), (e, h), "weight")?,
                        },
                        experts: FusedExperts::new(&experts, (e, h, i), ExpertLayout::InOut)?,
                        shared_expert: GatedMlp::new((h, i), false, act, ff.pp("shared_expert"))?,
                        top_k: l4.top_k,
                    };
                    (None, Some(moe))
                }
            };
            let rotary = parts.ropes[l];
            Ok(Llama4Layer {
                input_layernorm: parts.norm.build(h, vb.pp("input_layernorm"))?,
                self_attn: SelfAttention::new(parts.attention, vb.pp("self_attn"))?,
                post_attention_layernorm: parts.norm.build(h, vb.pp("post_attention_layernorm"))?,
                dense,
                sparse,
                rope: rotary.then(|| parts.rope.clone()),
                window: parts.windows[l],
                kind: AttentionKind {
                    qk_norm: (rotary && l4.qk_norm).then_some(config.rms_norm_eps),
                    temperature: l4.temperature.filter(|_| !rotary),
                },
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = self.attention_add(&h, x, cx)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        match (&self.dense, &self.sparse) {
            (Some(mlp), _) => mlp.forward_add(cx, &h, &x),
            (None, Some(moe)) => Ok((&x + moe.forward(cx, &h)?)?),
            (None, None) => Ok(x),
        }
    }

    fn attention_heads(&self) -> (usize, usize) {
        (self.self_attn.num_heads, self.self_attn.num_kv_heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The NoPE layers' scale is 1 before floor_scale - 1 and grows by log steps after.
    #[test]
    fn temperature_follows_transformers_formula() {
        let p = Tensor::new(&[[0i64, 6, 7, 15, 23]], &Device::Cpu).unwrap();
        let t: Vec<f32> = log_position_scale(&p, (1.0, 8.0), 0.5)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want = |p: f64| (((p + 1.0) / 8.0).floor().ln_1p() * 0.5 + 1.0) as f32;
        let want: Vec<f32> = [0.0, 6.0, 7.0, 15.0, 23.0].map(want).to_vec();
        assert_eq!(t, want);
        assert_eq!((t[0], t[1]), (1.0, 1.0));
    }
}
