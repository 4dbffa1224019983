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
//! (peft's all-linear: the router and the fused experts are parameters); the experts take
//! adapters as peft's `target_parameters`.

use super::blocks::{Decoder, GatedMlp, Layer};
use super::deepseek_moe::{route, DeepseekMoeConfig, Routing, SparseMlp};
use super::deepseek_v3::{latent_dims, LatentLayer};
use super::moe::{dispatch, FusedExperts};
use crate::error::Result;
use crate::kernels::grouped::ExpertLayout;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::Param;
use crate::Parallelize;
use candle_core::Tensor;
use candle_nn::VarBuilder;

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

impl SparseMlp for Mistral4Moe {
    fn forward_add(&self, cx: &LayerInputs, h: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (b, s, hidden) = h.dims3()?;
        let flat = h.reshape((b * s, hidden))?;
        let r = self.routing;
        let logits = flat.matmul(&self.gate.weight.value()?.t()?)?;
        // Softmax in the router's dtype, as transformers scores; the choice on the host.
        let scores = candle_nn::ops::softmax(&logits, candle_core::D::Minus1)?;
        let (chosen, weights) = route(&scores, &vec![0f32; r.experts], r)?;
        let routed = dispatch(
            cx,
            &flat,
            (&chosen, r.experts),
            &weights,
            |rows, index, counts| {
                // One gather: the grouped layers' backward gives every row's gradient at once.
                let xs = rows.index_select(index, 0)?;
                self.experts.forward(cx, &xs, counts)
            },
        )?;
        let x = (x + routed.reshape((b, s, hidden))?)?;
        self.shared_experts.forward_add(cx, h, &x)
    }
}

impl Mistral4Moe {
    /// The mixture `moe` describes from `vb` (`mlp`).
    fn new(moe: &DeepseekMoeConfig, hidden: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        use super::blocks::Activation::Silu;
        let (h, e, i) = (hidden, moe.routing.experts, moe.inter);
        Ok(Mistral4Moe {
            gate: Mistral4Router {
                weight: Param::new(&vb.pp("gate"), (e, h), "weight")?,
            },
            experts: FusedExperts::new(&vb.pp("experts"), (e, h, i), ExpertLayout::OutIn)?,
            shared_experts: GatedMlp::new(
                (h, i * moe.shared),
                false,
                Silu,
                vb.pp("shared_experts"),
            )?,
            routing: moe.routing,
        })
    }
}

/// x + attention(norm(x)), then + mlp(norm(x)) with a dense MLP or the mixture: DeepSeek-V3's
/// layer with Mistral 4's mixture.
pub type Mistral4Layer = LatentLayer<Mistral4Moe>;

impl Layer for Mistral4Layer {
    type Config = ModelConfig;

    fn parse_config(text: &str, source: &str) -> Result<ModelConfig> {
        let config = ModelConfig::from_json_for(text, source, MODEL_TYPES)?;
        latent_dims(&config, source)?;
        DeepseekMoeConfig::read(&config, source)?;
        Ok(config)
    }

    fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Mistral4> {
        let h = config.hidden_size;
        Self::build_latent(config, vb, |moe, vb| Mistral4Moe::new(moe, h, vb))
    }

    fn forward(&self, x: &Tensor, cx: &LayerInputs) -> Result<Tensor> {
        self.forward_latent(x, cx)
    }

    fn attention_heads(&self) -> (usize, usize) {
        self.heads()
    }
}
