//! Mistral 4 (`model_type` mistral4: Mistral Small 4), as transformers' Mistral4ForCausalLM:
//! DeepSeek-V3's latent attention (deepseek_v3.rs's [`LatentAttention`]) with its queries
//! scaled by position (`rope_parameters`' `llama_4_scaling_beta`: 1 + beta x log(1 +
//! floor(p / original_max_position_embeddings))), dense MLPs on the first
//! `first_k_dense_replace` layers, and on the others a mixture of experts: a router
//! (`mlp.gate.weight`) whose softmax scores choose, within the `topk_group` best of `n_group`
//! groups (each scored by its two best), the top-k experts; their scores, renormalised
//! (`norm_topk_prob`) and scaled (`routed_scaling_factor`), weight the experts' outputs; the
//! experts fused as transformers keeps them, each a linear layer's weight
//! (`mlp.experts.gate_up_proj` [experts, 2 x inter, hidden], the gate rows then the up rows,
//! `down_proj` [experts, hidden, inter]) run as grouped GEMMs; and shared experts
//! (`mlp.shared_experts`) on every token.
//!
//! Strategies: latent attention as DeepSeek-V3's; under tp each expert's MLP split as a dense
//! one (gate_up by its output rows in its two halves, down by its input columns), the router
//! whole. No router loss, as in transformers. LoRA: attention, shared experts and dense MLPs
//! (peft's all-linear: the router and the fused experts are parameters); adapters on the
//! experts themselves are refused.

use super::blocks::{Decoder, GatedMlp, Layer};
use super::deepseek_moe::{route, DeepseekMoeConfig, Routing};
use super::deepseek_v3::{latent_dims, LatentAttention};
use super::moe::{dispatch, FusedExperts};
use crate::error::{Error, Result};
use crate::kernels::grouped::ExpertLayout;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::{Param, RmsNorm, RotaryEmbedding};
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use std::sync::Arc;

/// The `model_type`s this file reads.
pub const MODEL_TYPES: &[&str] = &["mistral4"];

/// Mistral4ForCausalLM.
pub type Mistral4 = Decoder<Mistral4Layer>;

/// `mlp.gate`: one logit per expert. A parameter, as transformers' (no nn.Linear: peft's
/// all-linear does not adapt it).
#[derive(Debug, Clone, Parallelize)]
pub struct Mistral4Router {
    weight: Param,
}

/// `mlp` on the sparse layers.
#[derive(Debug, Clone, Parallelize)]
pub struct Mistral4Moe {
    #[parallel(tp = "replicate")]
    gate: Mistral4Router,
    experts: FusedExperts,
    shared_experts: GatedMlp,
    #[parallel(skip)]
    routing: Routing,
}

impl Mistral4Moe {
    /// `x + mlp(h)` for `h` [batch, seq, hidden].
    fn forward_add(&self, cx: &LayerInputs, h: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (b, s, hidden) = h.dims3()?;
        let flat = h.reshape((b * s, hidden))?;
        let r = self.routing;
        let logits = flat.matmul(&self.gate.weight.value()?.t()?)?;
        // Softmax in the router's dtype, as transformers scores; the choice on the host.
        let scores = candle_nn::ops::softmax(&logits, candle_core::D::Minus1)?;
        let (chosen, weights) = route(&scores, &vec![0f32; r.experts], r)?;
        let routed = dispatch(&flat, (&chosen, r.experts), &weights, |tokens, counts| {
            // One gather: the grouped layers' backward gives every row's gradient at once.
            let xs = flat.index_select(tokens, 0)?;
            self.experts.forward(cx, &xs, counts)
        })?;
        let x = (x + routed.reshape((b, s, hidden))?)?;
        self.shared_experts.forward_add(cx, h, &x)
    }
}

/// x + attention(norm(x)), then + mlp(norm(x)) with a dense MLP or the mixture.
#[derive(Debug, Clone, Parallelize)]
#[parallel(fsdp_unit)]
pub struct Mistral4Layer {
    input_layernorm: RmsNorm,
    self_attn: LatentAttention,
    post_attention_layernorm: RmsNorm,
    #[parallel(name = "mlp")]
    dense: Option<GatedMlp>,
    #[parallel(name = "mlp")]
    sparse: Option<Mistral4Moe>,
    #[parallel(skip)]
    rope: Arc<RotaryEmbedding>,
}

impl Layer for Mistral4Layer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        latent_dims(&config, source)?;
        DeepseekMoeConfig::read(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Mistral4> {
        use super::blocks::Activation::Silu;
        let source = "config.json";
        let (dims, q_rank) = latent_dims(config, source).map_err(Error::into_candle)?;
        let moe = DeepseekMoeConfig::read(config, source).map_err(Error::into_candle)?;
        let rope = Arc::new(config.rotary().map_err(candle_core::Error::Msg)?);
        let (norm, _, body) = config.shapes();
        let (h, e, i) = (config.hidden_size, moe.routing.experts, moe.inter);
        Decoder::from_layers(body, vb, |l, vb| {
            let mlp = vb.pp("mlp");
            let (dense, sparse) = match moe.sparse[l] {
                false => {
                    let inter = config.intermediate_size;
                    (Some(GatedMlp::new((h, inter), false, Silu, mlp)?), None)
                }
                true => {
                    let experts = mlp.pp("experts");
                    let sparse = Mistral4Moe {
                        gate: Mistral4Router {
                            weight: Param::new(&mlp.pp("gate"), (e, h), "weight")?,
                        },
                        experts: FusedExperts::new(&experts, (e, h, i), ExpertLayout::OutIn)?,
                        shared_experts: GatedMlp::new(
                            (h, i * moe.shared),
                            false,
                            Silu,
                            mlp.pp("shared_experts"),
                        )?,
                        routing: moe.routing,
                    };
                    (None, Some(sparse))
                }
            };
            Ok(Mistral4Layer {
                input_layernorm: norm.build(h, vb.pp("input_layernorm"))?,
                self_attn: LatentAttention::new(config, dims, q_rank, vb.pp("self_attn"))?,
                post_attention_layernorm: norm.build(h, vb.pp("post_attention_layernorm"))?,
                dense,
                sparse,
                rope: rope.clone(),
            })
        })
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = self.self_attn.forward_add(&h, x, cx, &self.rope)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        match (&self.sparse, &self.dense) {
            (Some(moe), _) => moe.forward_add(cx, &h, &x),
            (None, Some(mlp)) => mlp.forward_add(cx, &h, &x),
            (None, None) => Ok(x),
        }
    }

    fn attention_heads(&self) -> (usize, usize) {
        (self.self_attn.num_heads, self.self_attn.num_heads)
    }
}
