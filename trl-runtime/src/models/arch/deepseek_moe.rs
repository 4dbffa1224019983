//! DeepSeek's mixture of experts, as transformers' DeepseekV3MoE and Glm4MoeMoE compute it:
//! a router (`mlp.gate`) scores each expert by a sigmoid; for the choice only, a load-balancing
//! bias (`mlp.gate.e_score_correction_bias`) is added, the experts are cut into `n_group`
//! groups, the `topk_group` groups with the largest sum of their two best scores are kept,
//! and the top-k experts of those are chosen. Their (unbiased) scores, renormalised over the
//! k when `norm_topk_prob`, times `routed_scaling_factor`, weight the routed experts' outputs
//! (moe.rs's [`dispatch`]); the shared experts (`mlp.shared_experts`, one SwiGLU MLP of
//! `n_shared_experts` x the experts' width) run on every token beside them.
//!
//! The bias is a buffer in transformers, moved between steps by DeepSeek's own trainer and
//! never by the loss: here it is read from and saved to the checkpoint, gets no gradient (it
//! only moves the choice, made on the host) and keeps its value. transformers computes no
//! router load-balancing loss for these models, so there is none here either.
//!
//! Strategies as moe.rs's: the router and the bias whole on every tp rank, each expert and
//! the shared MLP split as a dense MLP.

use super::blocks::GatedMlp;
use super::moe::{dispatch, run_experts, top_k, Experts};
use crate::error::{Error, Result};
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::{Linear, Param};
use crate::Parallelize;
use candle_core::{DType, Tensor, D};

/// `mlp.gate`: the router's weight and its load-balancing bias.
#[derive(Debug, Clone, Parallelize)]
pub struct TopkRouter {
    /// One logit per expert (`mlp.gate.weight`).
    #[parallel(tp = "replicate", name = "")]
    pub proj: Linear,
    /// Added to the scores for the choice only.
    #[parallel(tp = "replicate")]
    pub e_score_correction_bias: Param,
}

/// The routing constants of a config.json ([`DeepseekMoeConfig::read`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routing {
    pub experts: usize,
    pub top_k: usize,
    pub groups: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scale: f64,
}

#[derive(Debug, Clone, Parallelize)]
pub struct DeepseekMoe {
    pub gate: TopkRouter,
    pub experts: Experts<GatedMlp>,
    pub shared_experts: GatedMlp,
    #[parallel(skip)]
    pub routing: Routing,
}

/// A layer's mixture of experts: `residual + moe(h)` for `h` [batch, seq, hidden] (DeepSeek's
/// here, Mistral 4's).
pub trait SparseMlp: Parallelize + Send + Sync + Clone + std::fmt::Debug + 'static {
    fn forward_add(&self, cx: &LayerInputs, h: &Tensor, residual: &Tensor) -> Result<Tensor>;
}

impl SparseMlp for DeepseekMoe {
    fn forward_add(&self, cx: &LayerInputs, h: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let (b, s, hidden) = h.dims3()?;
        let flat = h.reshape((b * s, hidden))?;
        let r = self.routing;
        // sigmoid in f32, as transformers scores (Candle's op: its gradient comes from its
        // output, no overflow).
        let logits = self.gate.proj.forward(&flat)?.to_dtype(DType::F32)?;
        let scores = candle_nn::ops::sigmoid(&logits)?;
        let bias: Vec<f32> = self
            .gate
            .e_score_correction_bias
            .value()?
            .detach()
            .to_dtype(DType::F32)?
            .to_vec1()?;
        let (chosen, weights) = route(&scores, &bias, r)?;
        let routed = dispatch(
            cx,
            &flat,
            (&chosen, r.experts),
            &weights,
            |rows, index, counts| run_experts(self.experts.local(), cx, rows, index, counts),
        )?;
        let x = (residual + routed.reshape((b, s, hidden))?)?;
        self.shared_experts.forward_add(cx, h, &x)
    }
}

/// The experts each token chose by its `scores` [tokens, experts] (sigmoid or softmax
/// scores; `bias` added for the choice alone, [`choose`]), k a token, and their weights: the
/// chosen scores, renormalised over the k when `norm_topk_prob`, times the scale.
pub fn route(scores: &Tensor, bias: &[f32], r: Routing) -> Result<(Vec<u32>, Tensor)> {
    let host: Vec<f32> = scores
        .detach()
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let chosen: Vec<u32> = host
        .chunks(r.experts)
        .flat_map(|row| choose(row, bias, r).into_iter().map(|e| e as u32))
        .collect();
    let index = Tensor::new(chosen.as_slice(), scores.device())?
        .reshape((chosen.len() / r.top_k, r.top_k))?;
    let mut weights = scores.gather(&index, 1)?;
    if r.norm_topk_prob {
        weights = weights.broadcast_div(&(weights.sum_keepdim(D::Minus1)? + 1e-20)?)?;
    }
    Ok((chosen, (weights * r.scale)?))
}

/// The experts one token chose from its `scores` (after the sigmoid) and the `bias`: the
/// top-k of the biased scores within the `topk_group` groups whose two best biased scores
/// sum highest (transformers' DeepseekV3TopkRouter).
pub fn choose(scores: &[f32], bias: &[f32], r: Routing) -> Vec<usize> {
    let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let per_group = r.experts / r.groups;
    let group_scores: Vec<f32> = biased
        .chunks(per_group)
        .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
        .collect();
    let kept = top_k(&group_scores, r.topk_group);
    let masked: Vec<f32> = biased
        .iter()
        .enumerate()
        .map(|(e, &v)| match kept.contains(&(e / per_group)) {
            true => v,
            false => f32::NEG_INFINITY,
        })
        .collect();
    top_k(&masked, r.top_k)
}

/// DeepSeek's mixture-of-experts keys of a config.json (DeepSeek-V3's and GLM-4 MoE's names).
pub struct DeepseekMoeConfig {
    pub routing: Routing,
    /// `moe_intermediate_size`: each routed expert's width.
    pub inter: usize,
    pub shared: usize,
    /// Whether each layer's MLP is this mixture (else a dense one): `mlp_layer_types`
    /// (GLM-4.7-Flash), else all but the first `first_k_dense_replace`.
    pub sparse: Vec<bool>,
}

impl DeepseekMoeConfig {
    /// Reads them from `c`; errors name `source` and the key.
    pub fn read(c: &ModelConfig, source: &str) -> Result<Self> {
        let err = |key: &str, message: String| Error::config(source, key, message);
        let get = |key: &str| c.extra.get(key).filter(|v| !v.is_null());
        let count = |key: &str, default: Option<usize>| -> Result<usize> {
            match get(key) {
                Some(v) => v
                    .as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| err(key, format!("{v} is not a count"))),
                None => default.ok_or_else(|| err(key, "missing".into())),
            }
        };
        // The original code's names for the routing transformers implements (sigmoid
        // scores, group-limited top-k without aux loss); the hub's FP8 weights are refused with
        // every quantization (ModelConfig::validate).
        for (key, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
            if let Some(v) = get(key).filter(|v| v.as_str() != Some(want)) {
                return Err(err(
                    key,
                    format!(
                        "{v}: transformers' {} routes as '{want}' only",
                        c.model_type
                    ),
                ));
            }
        }
        let experts = count("n_routed_experts", None)?;
        let top_k = count("num_experts_per_tok", None)?;
        // transformers' defaults where a key is absent, by model type.
        let deepseek = c.model_type == "deepseek_v3";
        let groups = count("n_group", Some(if deepseek { 8 } else { 1 }))?;
        let topk_group = count("topk_group", Some(if deepseek { 4 } else { 1 }))?;
        if experts == 0 || top_k == 0 || top_k > experts {
            return Err(err(
                "num_experts_per_tok",
                format!("{top_k} is not between 1 and the {experts} experts"),
            ));
        }
        if groups == 0 || !experts.is_multiple_of(groups) || experts / groups < 2 {
            return Err(err(
                "n_group",
                format!("{groups} groups of {experts} experts: each group must hold at least 2 experts (a group is scored by its two best), and the experts divide into the groups"),
            ));
        }
        if topk_group == 0 || topk_group > groups || topk_group * (experts / groups) < top_k {
            return Err(err(
                "topk_group",
                format!("{topk_group} of {groups} groups cannot hold the {top_k} chosen experts"),
            ));
        }
        let scale = match get("routed_scaling_factor") {
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| err("routed_scaling_factor", format!("{v} is not a number")))?,
            None => match c.model_type.as_str() {
                "deepseek_v3" => 2.5,
                "glm4_moe_lite" => 1.8,
                _ => 1.0,
            },
        };
        let shared = count("n_shared_experts", Some(1))?;
        if shared == 0 {
            return Err(err(
                "n_shared_experts",
                "0: transformers builds a shared MLP of 0 features; models without shared experts are not read".into(),
            ));
        }
        let n = c.num_hidden_layers;
        let sparse = match get("mlp_layer_types").map(|v| v.as_array()) {
            Some(Some(types)) if types.len() == n => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sparse") => Ok(true),
                    Some("dense") => Ok(false),
                    _ => Err(err(
                        "mlp_layer_types",
                        format!("{t}: use \"dense\" or \"sparse\""),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(_) => {
                let why = format!("give one of \"dense\" or \"sparse\" for each of the {n} layers");
                return Err(err("mlp_layer_types", why));
            }
            // GLM-4.7-Flash's default: the first layer dense (its first_k_dense_replace is
            // not read by transformers).
            None if c.model_type == "glm4_moe_lite" => (0..n).map(|l| l >= 1).collect(),
            None => {
                let default = match c.model_type.as_str() {
                    "deepseek_v3" => 3,
                    "mistral4" => 0,
                    _ => 1,
                };
                let first = count("first_k_dense_replace", Some(default))?;
                (0..n).map(|l| l >= first).collect()
            }
        };
        if let Some(v) = get("router_aux_loss_coef").and_then(|v| v.as_f64()) {
            if v != 0.0 {
                tracing::warn!(
                    "{source}: router_aux_loss_coef {v} has no effect: transformers computes no router load-balancing loss for {}",
                    c.model_type
                );
            }
        }
        Ok(DeepseekMoeConfig {
            routing: Routing {
                experts,
                top_k,
                groups,
                topk_group,
                norm_topk_prob: get("norm_topk_prob")
                    .and_then(|v| v.as_bool())
                    .unwrap_or(true),
                scale,
            },
            inter: count("moe_intermediate_size", None)?,
            shared,
            sparse,
        })
    }

    /// Layer `l`'s MLP from `vb` (`mlp`): dense, or the mixture `sparse(vb)` builds.
    pub fn mlp<M>(
        &self,
        c: &ModelConfig,
        l: usize,
        vb: candle_nn::VarBuilder,
        sparse: impl FnOnce(candle_nn::VarBuilder) -> candle_core::Result<M>,
    ) -> candle_core::Result<(Option<GatedMlp>, Option<M>)> {
        use super::blocks::Activation::Silu;
        match self.sparse[l] {
            true => Ok((None, Some(sparse(vb)?))),
            false => {
                let dense = GatedMlp::new((c.hidden_size, c.intermediate_size), false, Silu, vb)?;
                Ok((Some(dense), None))
            }
        }
    }

    /// DeepSeek's mixture from `vb` (`mlp`).
    pub fn moe(
        &self,
        c: &ModelConfig,
        vb: candle_nn::VarBuilder,
    ) -> candle_core::Result<DeepseekMoe> {
        use super::blocks::Activation::Silu;
        let h = c.hidden_size;
        let experts = (0..self.routing.experts)
            .map(|e| GatedMlp::new((h, self.inter), false, Silu, vb.pp("experts").pp(e)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let gate = vb.pp("gate");
        let moe = DeepseekMoe {
            gate: TopkRouter {
                proj: crate::nn::linear_no_bias(h, self.routing.experts, gate.clone())?,
                e_score_correction_bias: Param::new(
                    &gate,
                    self.routing.experts,
                    "e_score_correction_bias",
                )?,
            },
            experts: experts.into(),
            shared_experts: GatedMlp::new(
                (h, self.inter * self.shared),
                false,
                Silu,
                vb.pp("shared_experts"),
            )?,
            routing: self.routing,
        };
        Ok(moe)
    }
}

/// `x + mlp(h)` with a layer's dense MLP or its mixture of experts (the layers of
/// glm4_moe.rs, deepseek_v3.rs and mistral4.rs).
pub fn mlp_add<M: SparseMlp>(
    dense: Option<&GatedMlp>,
    sparse: Option<&M>,
    cx: &LayerInputs,
    h: &Tensor,
    x: &Tensor,
) -> Result<Tensor> {
    match (sparse, dense) {
        (Some(sparse), _) => sparse.forward_add(cx, h, x),
        (None, Some(dense)) => dense.forward_add(cx, h, x),
        (None, None) => Err(Error::Parallelism("a layer without an MLP".into())),
    }
}

/// Whether `name` is a router's load-balancing bias, which never gets a gradient.
pub fn is_correction_bias(name: &str) -> bool {
    name.ends_with(".e_score_correction_bias")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups by their two best biased scores, then the top-k within the kept groups: an
    /// expert with the best score of all is passed over when its group's pair is weak.
    #[test]
    fn choice_keeps_the_best_groups_then_the_best_experts() {
        let r = Routing {
            experts: 6,
            top_k: 2,
            groups: 3,
            topk_group: 1,
            norm_topk_prob: true,
            scale: 1.0,
        };
        // Groups (0,1) (2,3) (4,5): pair sums 0.95+0.0, 0.5+0.5, 0.45+0.45.
        let scores = [0.95, 0.0, 0.5, 0.5, 0.45, 0.45];
        let bias = [0.0; 6];
        let mut got = choose(&scores, &bias, r);
        got.sort();
        assert_eq!(got, vec![2, 3]);
        // The bias moves the choice: expert 1's lifts group 0 above group 1.
        let bias = [0.0, 0.3, 0.0, 0.0, 0.0, 0.0];
        let mut got = choose(&scores, &bias, r);
        got.sort();
        assert_eq!(got, vec![0, 1]);
        // Two groups kept: the best expert of all, then the best of the rest.
        let r = Routing { topk_group: 2, ..r };
        let mut got = choose(&scores, &[0.0; 6], r);
        got.sort();
        assert_eq!(got, vec![0, 2]);
    }
}
