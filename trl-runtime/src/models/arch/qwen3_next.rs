//! Qwen3-Next (`model_type` qwen3_next) and Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`; the
//! hub's vision-language `qwen3_5` / `qwen3_5_moe` through weights/composite.rs), as
//! transformers' Qwen3NextForCausalLM, Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM compute
//! them.
//!
//! Qwen3-Next: a hybrid of
//! Gated DeltaNet layers (`linear_attn`, gated_deltanet.rs) and full-attention layers
//! (`self_attn`) by `layer_types` (linear_attention / full_attention; by default three linear
//! layers, then a full one), (1 + w) RMSNorms throughout, and Qwen3-MoE's mixture of experts
//! (moe.rs: softmax top-k, renormalised by `norm_topk_prob`, `mlp_only_layers` /
//! `decoder_sparse_step`) plus a shared expert gated per token by
//! sigmoid(`shared_expert_gate`(x)).
//!
//! The full-attention layers gate their output: `q_proj` gives per head its query and a gate
//! of the head's width, the attention output is multiplied by sigmoid(gate) before
//! `o_proj`; per-head (1 + w) q/k norms, rotary on the first `partial_rotary_factor` (0.25)
//! of each head.
//!
//! Qwen3.5 differs in three places: its Gated DeltaNet keeps its input projections apart
//! (gated_deltanet.rs, [`Projections::Apart`]); Qwen3.5's MLPs are dense on every layer
//! (`intermediate_size`), Qwen3.5-MoE's sparse on every layer with the top-k always
//! renormalised (transformers drops `norm_topk_prob`, `mlp_only_layers` and
//! `decoder_sparse_step` from its config and reads none of them); its rotary embedding is
//! Qwen3-VL's multimodal one (`mrope_section`), which text positions make plain RoPE.
//!
//! Strategies: ZeRO and FSDP as any model (each layer a unit); under tp the full attention
//! and the MLPs split as Qwen3-MoE's, the Gated DeltaNet layers whole on every rank. Under
//! context parallelism and Ulysses the full attention runs as any model's, the Gated DeltaNet
//! layers split by their key heads (gated_deltanet.rs). Generation keeps the linear layers'
//! recurrent state in the cache.

use super::blocks::{lin, Decoder, GatedMlp, Heads, Layer, NormKind};
use super::gated_deltanet::{DeltaNetShape, GatedDeltaNet, Projections};
use super::moe::{MoeConfig, SparseMoe};
use crate::error::{Error, Result};
use crate::models::causal::LayerInputs;
use crate::models::config::{attention_kinds, LayerAttention, ModelConfig};
use crate::nn::chain::Chain;
use crate::nn::{Linear, RmsNorm, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::ops::sigmoid;
use candle_nn::VarBuilder;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &[
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_5",
    "qwen3_5_moe",
];

/// Qwen3NextForCausalLM.
pub type Qwen3Next = Decoder<Qwen3NextLayer>;

/// `self_attn` of the full-attention layers: attention with an output gate.
#[derive(Debug, Clone, Parallelize)]
pub struct GatedAttention {
    /// Per head its query and gate ([q | gate], each head_dim): split by heads under tp.
    #[parallel(tp = "column")]
    q_proj: Linear,
    #[parallel(tp = "column")]
    k_proj: Linear,
    #[parallel(tp = "column")]
    v_proj: Linear,
    #[parallel(tp = "row")]
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    #[parallel(tp = "divide")]
    num_heads: usize,
    #[parallel(tp = "divide")]
    num_kv_heads: usize,
    #[parallel(skip)]
    head_dim: usize,
    #[parallel(skip)]
    rotary_dim: usize,
}

impl GatedAttention {
    /// `residual + o_proj(attention(h) * sigmoid(gate))`.
    fn forward_add(
        &self,
        h: &Tensor,
        residual: &Tensor,
        cx: &LayerInputs,
        rope: &RotaryEmbedding,
    ) -> Result<Tensor> {
        let (b, s, _) = h.dims3()?;
        let (n, d) = (self.num_heads, self.head_dim);
        let qg = self.q_proj.forward(h)?.reshape((b, s, n, 2 * d))?;
        let q = qg.narrow(3, 0, d)?.reshape((b, s, n * d))?;
        let gate = qg.narrow(3, d, d)?.reshape((b, s, n * d))?;
        let heads = Heads {
            heads: n,
            kv_heads: self.num_kv_heads,
            head_dim: d,
            q_norm: Some(&self.q_norm),
            k_norm: Some(&self.k_norm),
            norm_whole_projection: false,
            query_scale: None,
            softcap: None,
            sinks: None,
            rotary_dim: Some(self.rotary_dim),
        };
        let (k, v) = (self.k_proj.forward(h)?, self.v_proj.forward(h)?);
        let a = heads.attend((q.contiguous()?, k, v), cx, Some(rope), None)?;
        let gated = (a * sigmoid(&gate)?)?;
        let out = Chain::merge_and_add(false, Some(residual));
        Ok(self.o_proj.forward_chain(&gated, &out)?)
    }
}

/// `mlp` on the sparse layers: Qwen3-MoE's experts, and the gated shared expert.
#[derive(Debug, Clone, Parallelize)]
pub struct SharedExpertMoe {
    #[parallel(name = "")]
    routed: SparseMoe<GatedMlp>,
    shared_expert: GatedMlp,
    #[parallel(tp = "replicate")]
    shared_expert_gate: Linear,
}

impl SharedExpertMoe {
    fn forward(&self, cx: &LayerInputs, h: &Tensor) -> Result<Tensor> {
        let routed = self.routed.forward(cx, h)?;
        let shared = self.shared_expert.forward(cx, h)?;
        let gate = sigmoid(&self.shared_expert_gate.forward(h)?)?;
        Ok((routed + shared.broadcast_mul(&gate)?)?)
    }
}

/// x + mixer(norm(x)), then + mlp(norm(x)); the mixer Gated DeltaNet or gated attention.
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Qwen3NextLayer {
    input_layernorm: RmsNorm,
    linear_attn: Option<GatedDeltaNet>,
    self_attn: Option<GatedAttention>,
    post_attention_layernorm: RmsNorm,
    #[parallel(name = "mlp")]
    dense: Option<GatedMlp>,
    #[parallel(name = "mlp")]
    sparse: Option<SharedExpertMoe>,
    #[parallel(skip)]
    rope: Arc<RotaryEmbedding>,
    /// The full-attention layers' query and key/value heads on this rank (for every layer:
    /// the checks of sequence parallelism read the first).
    #[parallel(tp = "divide")]
    heads: usize,
    #[parallel(tp = "divide")]
    kv_heads: usize,
}

/// Qwen3-Next's keys beyond Qwen3-MoE's; errors name `source` and the key.
struct Qwen3NextConfig {
    /// None: dense on every layer (Qwen3.5).
    moe: Option<MoeConfig>,
    /// Whether each layer is a Gated DeltaNet one.
    linear: Vec<bool>,
    delta: DeltaNetShape,
    shared_inter: usize,
    /// Whether peft maps LoRA targets onto the fused experts and router (Qwen3-Next's
    /// transformers 4 names) or sees neither (Qwen3.5-MoE).
    peft_converts: bool,
}

/// Which layers are Gated DeltaNet ones, as transformers reads Qwen3-Next's config: by
/// `layer_types`, else all but every `full_attention_interval`-th (4). `cargo trl plan` counts
/// them so too.
pub fn linear_layers(c: &ModelConfig, source: &str) -> Result<Vec<bool>> {
    let err = |key: &str, message: String| Error::config(source, key, message);
    let n = c.num_hidden_layers;
    match c.extra.get("layer_types").and_then(|v| v.as_array()) {
        Some(types) => attention_kinds(types, n)
            .map_err(|(k, m)| err(k, m))?
            .into_iter()
            .enumerate()
            .map(|(i, kind)| match kind {
                LayerAttention::Linear => Ok(true),
                LayerAttention::Full => Ok(false),
                _ => Err(err(
                    "layer_types",
                    format!(
                        "layer {i}: Qwen3-Next's layers are linear_attention or full_attention"
                    ),
                )),
            })
            .collect(),
        None => {
            let interval = match c
                .extra
                .get("full_attention_interval")
                .filter(|v| !v.is_null())
            {
                None => 4,
                Some(v) => v
                    .as_u64()
                    .map(|n| n as usize)
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        err(
                            "full_attention_interval",
                            format!("{v} is not a positive count"),
                        )
                    })?,
            };
            Ok((0..n).map(|i| (i + 1) % interval != 0).collect())
        }
    }
}

fn check(c: &ModelConfig, source: &str) -> Result<Qwen3NextConfig> {
    let err = |key: &str, message: String| Error::config(source, key, message);
    let count = |key: &str, default: usize| -> Result<usize> {
        match c.extra.get(key).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .filter(|&n| n > 0)
                .ok_or_else(|| err(key, format!("{v} is not a positive count"))),
        }
    };
    let n = c.num_hidden_layers;
    let linear = linear_layers(c, source)?;
    let (key_heads, value_heads) = (
        count("linear_num_key_heads", 16)?,
        count("linear_num_value_heads", 32)?,
    );
    if !value_heads.is_multiple_of(key_heads) {
        return Err(err(
            "linear_num_value_heads",
            format!("{value_heads} value heads cannot share {key_heads} key heads evenly"),
        ));
    }
    let delta = DeltaNetShape {
        hidden: c.hidden_size,
        key_heads,
        value_heads,
        key_dim: count("linear_key_head_dim", 128)?,
        value_dim: count("linear_value_head_dim", 128)?,
        conv_kernel: count("linear_conv_kernel_dim", 4)?,
        eps: c.rms_norm_eps,
        chunk: 64,
        projections: match c.model_type.as_str() {
            "qwen3_next" => Projections::Grouped,
            _ => Projections::Apart,
        },
    };
    let moe = match c.model_type.as_str() {
        "qwen3_5_text" => None,
        "qwen3_5_moe_text" => Some(MoeConfig {
            norm_topk_prob: true,
            sparse: vec![true; n],
            ..MoeConfig::read(c, source)?
        }),
        _ => Some(MoeConfig::read(c, source)?),
    };
    Ok(Qwen3NextConfig {
        peft_converts: c.model_type == "qwen3_next",
        moe,
        linear,
        delta,
        shared_inter: count("shared_expert_intermediate_size", 512)?,
    })
}

impl Layer for Qwen3NextLayer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        check(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Qwen3Next> {
        use super::blocks::Activation::Silu;
        let q3 = check(config, "config.json").map_err(Error::into_candle)?;
        let parts = config.layer_parts()?;
        let norm = NormKind {
            eps: config.rms_norm_eps,
            gemma: true,
        };
        let mut body = parts.body;
        body.norm = norm;
        let (h, d) = (config.hidden_size, config.head_dim());
        let (heads, kv) = (config.num_attention_heads, config.num_kv_heads());
        Decoder::from_layers(body, vb, |l, vb| {
            let (linear_attn, self_attn) = match q3.linear[l] {
                true => (
                    Some(GatedDeltaNet::new(q3.delta, vb.pp("linear_attn"))?),
                    None,
                ),
                false => {
                    let a = vb.pp("self_attn");
                    let bias = config.attention_bias;
                    let attention = GatedAttention {
                        q_proj: lin(a.pp("q_proj"), (h, 2 * heads * d), bias)?,
                        k_proj: lin(a.pp("k_proj"), (h, kv * d), bias)?,
                        v_proj: lin(a.pp("v_proj"), (h, kv * d), bias)?,
                        o_proj: lin(a.pp("o_proj"), (heads * d, h), bias)?,
                        q_norm: norm.build(d, a.pp("q_norm"))?,
                        k_norm: norm.build(d, a.pp("k_norm"))?,
                        num_heads: heads,
                        num_kv_heads: kv,
                        head_dim: d,
                        rotary_dim: config.rotary_dim(),
                    };
                    (None, Some(attention))
                }
            };
            let mlp = vb.pp("mlp");
            let moe = q3.moe.as_ref().filter(|moe| moe.sparse[l]);
            let (dense, sparse) = match moe {
                None => {
                    let dense = GatedMlp::new((h, config.intermediate_size), false, Silu, mlp)?;
                    (Some(dense), None)
                }
                Some(moe) => {
                    let inter = moe.inter.unwrap_or(config.intermediate_size);
                    // peft converts Qwen3-Next's targets onto its fused experts and router,
                    // not Qwen3.5-MoE's (transformers maps no conversion for it): there
                    // neither is an nn.Linear to peft, and all-linear adapts the shared
                    // expert instead.
                    let seen = q3.peft_converts;
                    let experts = (0..moe.experts)
                        .map(|e| GatedMlp::new((h, inter), false, Silu, mlp.pp("experts").pp(e)))
                        .map(|m| m.map(|m| m.seen_by_peft(seen)))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    let router = crate::nn::linear_no_bias(h, moe.experts, mlp.pp("gate"))?
                        .seen_by_peft(seen);
                    let sparse = SharedExpertMoe {
                        routed: SparseMoe {
                            gate: router,
                            experts: experts.into(),
                            top_k: moe.top_k,
                            norm_topk_prob: moe.norm_topk_prob,
                        },
                        shared_expert: GatedMlp::new(
                            (h, q3.shared_inter),
                            false,
                            Silu,
                            mlp.pp("shared_expert"),
                        )?,
                        shared_expert_gate: lin(mlp.pp("shared_expert_gate"), (h, 1), false)?,
                    };
                    (None, Some(sparse))
                }
            };
            Ok(Qwen3NextLayer {
                input_layernorm: norm.build(h, vb.pp("input_layernorm"))?,
                linear_attn,
                self_attn,
                post_attention_layernorm: norm.build(h, vb.pp("post_attention_layernorm"))?,
                dense,
                sparse,
                rope: parts.rope.clone(),
                heads,
                kv_heads: kv,
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = match (&self.linear_attn, &self.self_attn) {
            (Some(linear), _) => (x + linear.forward(&h, cx)?)?,
            (None, Some(attention)) => attention.forward_add(&h, x, cx, &self.rope)?,
            (None, None) => x.clone(),
        };
        let h = self.post_attention_layernorm.forward(&x)?;
        match (&self.sparse, &self.dense) {
            (Some(moe), _) => Ok((&x + moe.forward(cx, &h)?)?),
            (None, Some(mlp)) => mlp.forward_add(cx, &h, &x),
            (None, None) => Ok(x),
        }
    }

    fn attention_heads(&self) -> (usize, usize) {
        (self.heads, self.kv_heads)
    }

    fn may_skip_grad(name: &str) -> bool {
        crate::nn::lora::is_routed_expert(name)
    }
}
