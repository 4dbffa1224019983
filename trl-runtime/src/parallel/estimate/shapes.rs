//! A model's shapes as the planner reads them: parameters per tensor and per rank, wrap units, adapters.

use super::{Model, WrapPolicy};
use crate::error::Result;
use crate::models::config::Architecture;
use crate::models::deepseek_moe::DeepseekMoeConfig;
use crate::models::moe::MoeConfig;
use crate::models::{AutoModelForCausalLM, CausalModel, ModelConfig};
use crate::nn::lora::is_routed_expert;
use crate::nn::lora::LoraConfig;
use crate::nn::Linear;
use crate::tp::PlanEntry;
use candle_core::{DType, Device};

/// A model's parameters as the estimate counts them, read off the model itself: its skeleton
/// (the built-in model of the config's `model_type`, every weight a view of one zero, so
/// nothing is allocated) gives each parameter's full shape and `#[parallel]` split, its wrap
/// units and the layers that take adapters. Every architecture is counted as it is built and
/// split (MoE experts, fused projections, extra norms), and a change to a model's plan
/// changes the estimate with it.
#[derive(Debug, Clone)]
pub struct ModelShapes {
    /// The sizes activations scale with, from config.json.
    pub dims: Dims,
    /// Every parameter (tied ones once) with its full shape and split, as for one rank.
    pub(super) params: Vec<PlanEntry>,
    /// The FSDP wrap units (one per decoder layer), in forward order.
    pub(super) units: Vec<String>,
    /// The layers that can take a LoRA adapter, and the parameters that can.
    pub(super) linears: Vec<String>,
    pub(super) parameters: Vec<String>,
    /// Query and key/value heads (what tp and sp must divide).
    pub(super) heads: Option<(usize, usize)>,
    /// The loss needs whole logits (final-logit soft-capping).
    pub logits_loss: bool,
    /// Sparse MLPs: experts, experts per token, each expert's width, sparse layers.
    pub(super) moe: Option<(usize, usize, usize, usize)>,
    /// Parameters one token computes with: of the routed experts, only `top_k` of them.
    pub(super) active_parameters: f64,
    /// The LM head is the embedding (its matmul runs; there is no second table).
    pub(super) tied: bool,
    /// Attention norms q and k (their inputs and outputs are kept).
    pub(super) qk_norm: bool,
    /// The dense MLP is SwiGLU without biases (`nn::gated`'s two ops where its weights are
    /// held on the rank, whole or tp's split, and carry no adapter).
    pub(super) gated_mlp: bool,
    /// The routed experts are SwiGLU MLPs without biases (the same two ops).
    pub(super) gated_experts: bool,
}

/// The sizes of a decoder that activations and compute scale with, under transformers' key
/// names (every built-in architecture writes them so).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Dims {
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    /// Latent attention's per-head widths (DeepSeek-V3): the kernels attend over the wider of
    /// the query (nope + rope) and value widths, the other padded.
    #[serde(default)]
    pub qk_nope_head_dim: Option<usize>,
    #[serde(default)]
    pub qk_rope_head_dim: Option<usize>,
    #[serde(default)]
    pub v_head_dim: Option<usize>,
    /// Latent attention's key/value latent (what its generation cache holds with the rotary
    /// key).
    #[serde(default)]
    pub kv_lora_rank: Option<usize>,
    /// Which layers attend how (`layer_types`): Gated DeltaNet's `linear_attention` layers
    /// keep a recurrent state in the generation cache, not keys and values.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Gated DeltaNet's sizes (Qwen3-Next's and Qwen3.5's `linear_*` keys).
    #[serde(default)]
    pub linear_num_key_heads: Option<usize>,
    #[serde(default)]
    pub linear_num_value_heads: Option<usize>,
    #[serde(default)]
    pub linear_key_head_dim: Option<usize>,
    #[serde(default)]
    pub linear_value_head_dim: Option<usize>,
    #[serde(default)]
    pub linear_conv_kernel_dim: Option<usize>,
    /// The keys a `sliding_attention` layer sees (`layer_types`).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// The positions a `chunked_attention` layer attends within (Llama 4).
    #[serde(default)]
    pub attention_chunk_size: Option<usize>,
    /// Each layer's window as the Llama family's model reads its config
    /// (`ModelConfig::layer_windows`: Mistral's window on every layer, Qwen2's
    /// `max_window_layers`, ...), where that config reads it; else `layer_types` decides.
    #[serde(skip)]
    pub windows: Option<Vec<Option<crate::nn::mask::Window>>>,
}

impl Dims {
    /// The Gated DeltaNet layers (`linear_attention`) among the layers (`layer_types`, which
    /// [`ModelShapes::of_model`] fills as Qwen3-Next's model reads its config where it has none).
    pub fn linear_attention_layers(&self) -> usize {
        self.layer_types.as_ref().map_or(0, |types| {
            types.iter().filter(|t| *t == "linear_attention").count()
        })
    }

    /// What a Gated DeltaNet layer holds per row while generating, in elements: the
    /// convolution's last inputs (kernel - 1 of the query, key and value channels) and the
    /// delta rule's state (value heads x key dim x value dim).
    pub fn recurrent_state(&self) -> (usize, usize) {
        let (nk, nv) = (
            self.linear_num_key_heads.unwrap_or(16),
            self.linear_num_value_heads.unwrap_or(32),
        );
        let (dk, dv) = (
            self.linear_key_head_dim.unwrap_or(128),
            self.linear_value_head_dim.unwrap_or(128),
        );
        let kernel = self.linear_conv_kernel_dim.unwrap_or(4);
        ((kernel - 1) * (2 * nk * dk + nv * dv), nv * dk * dv)
    }

    /// Attention's length per token at sequence length `seq`, summed over the layers, in units
    /// of the causal count (a full layer's query scores s / 2 keys on average: s): a sliding
    /// layer of window W counts 2 W - W^2 / s (the keys its queries score, doubled), a chunked
    /// layer of chunk C (Llama 4) (n C^2 + r^2) / s for n whole chunks and r tokens after
    /// them, a `linear_attention` layer none (its rule is [`Self::linear_rule_flops`]). These
    /// are the scores the layer needs; the kernels skip whole tiles outside a window or chunk,
    /// so they compute up to a tile per query more (about twice a 128-key window). The
    /// layers' windows are [`Self::windows`] where the model's config reads them, else
    /// `layer_types` with `sliding_window` / `attention_chunk_size`, else every layer is full.
    pub fn attended_length(&self, seq: usize) -> f64 {
        use crate::nn::mask::Window;
        let s = seq as f64;
        let reach = |w: Option<Window>| match w {
            Some(Window::Sliding(w)) if w < seq => {
                let w = w as f64;
                2.0 * w - w * w / s
            }
            Some(Window::Chunked(c)) if c < seq => {
                let (n, r) = ((seq / c) as f64, (seq % c) as f64);
                let c = c as f64;
                (n * c * c + r * r) / s
            }
            _ => s,
        };
        let linear = self.linear_attention_layers() as f64 * s;
        if let Some(windows) = &self.windows {
            return windows.iter().map(|w| reach(*w)).sum::<f64>() - linear;
        }
        let Some(types) = &self.layer_types else {
            return self.num_hidden_layers as f64 * s;
        };
        types
            .iter()
            .map(|t| match t.as_str() {
                "linear_attention" => 0.0,
                "sliding_attention" => reach(self.sliding_window.map(Window::Sliding)),
                "chunked_attention" => reach(self.attention_chunk_size.map(Window::Chunked)),
                _ => s,
            })
            .sum()
    }

    /// The Gated DeltaNet layers' rule per token, forward: 2 FLOPs for each of the recurrence's
    /// three products per state element (the prediction S^T k, the write k delta^T, the read
    /// S^T q), over every value head's [key dim, value dim] state.
    pub fn linear_rule_flops(&self) -> f64 {
        let (_, state) = self.recurrent_state();
        self.linear_attention_layers() as f64 * 6.0 * state as f64
    }

    /// The per-head width attention runs at.
    pub fn head_dim(&self) -> usize {
        if let (Some(nope), Some(rope), Some(v)) = (
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        ) {
            return (nope + rope).max(v);
        }
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Of a layer's element-wise passes, the share over the hidden state, which every
    /// tensor-parallel rank makes whole: two norms and two residual adds (10 h element reads
    /// and writes) against rotary, attention's inputs and output and the SwiGLU (4 q + 4 kv
    /// + 3 i), which split with the heads and the MLP.
    pub fn replicated_elementwise_share(&self) -> f64 {
        let h = self.hidden_size as f64;
        let q = (self.num_attention_heads * self.head_dim()) as f64;
        let kv = (self.num_kv_heads() * self.head_dim()) as f64;
        let i = self.intermediate_size as f64;
        10.0 * h / (10.0 * h + 4.0 * q + 4.0 * kv + 3.0 * i)
    }
}

impl ModelShapes {
    /// Whether `lora` can adapt this model: its targets match layers (and parameters) the
    /// model has, with what they allow; else the error `add_adapters` would give.
    pub fn check_lora(&self, lora: &LoraConfig) -> Result<()> {
        crate::nn::lora::adapter_plan(lora, &self.linears, &self.parameters).map(|_| ())
    }

    /// The shapes of the built-in model of the config.json at `path`.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            crate::Error::io(format!("cannot read model config {}", path.display()), e)
        })?;
        // As the trainer reads it: MXFP4 experts are trained dequantized.
        let text = crate::models::mxfp4::dense_config(&text);
        Self::of_json(&text, &path.display().to_string())
    }

    /// The shapes of the built-in model config.json's text `json` (read from `source`)
    /// describes: whichever `model_type` `AutoModelForCausalLM` builds.
    pub fn of_json(json: &str, source: &str) -> Result<Self> {
        Self::of_model::<AutoModelForCausalLM>(json, source)
    }

    /// Matmul FLOPs of one token's forward and backward at sequence length `seq`: 6 per
    /// parameter it runs through (8 with checkpointing's second forward) and causal
    /// attention's 6 s q per layer (a query scores s / 2 keys on average, 2 FLOPs per key and
    /// feature in Q K^T and again in P V, the backward twice the forward: the PaLM paper's
    /// count, which `bench train`'s MFU and so the GPU table use), s shortened per layer by
    /// its window or chunk ([`Dims::attended_length`]); a Gated DeltaNet layer's rule 3 times
    /// its forward ([`Dims::linear_rule_flops`], 4 times with checkpointing). The embedding lookup costs
    /// nothing; a tied head still runs its matmul; a token runs through its routed experts
    /// only. LoRA's `adapters` parameters run beside the base's, and the base is charged a full
    /// step's 6 although its frozen weights get no gradient (4). On a CPU what LoRA costs
    /// beyond this rule is measured against it (`CpuStepRates::adapter_element_seconds`), so
    /// the rule's third only sets where that measurement starts; the GPU table has no such
    /// figure yet.
    pub fn matmul_flops_per_token(&self, seq: usize, checkpointing: bool, adapters: usize) -> f64 {
        let cfg = &self.dims;
        let embed = (cfg.vocab_size * cfg.hidden_size) as f64;
        let matmul_params = self.active_parameters - if self.tied { 0.0 } else { embed };
        let q = (cfg.num_attention_heads * cfg.head_dim()) as f64;
        let passes = if checkpointing { 8.0 } else { 6.0 };
        passes * (matmul_params + adapters as f64)
            + passes * cfg.attended_length(seq) * q
            + passes / 2.0 * cfg.linear_rule_flops()
    }

    /// The shapes of model `N` (a user's model too) built from config.json's text `json`.
    pub fn of_model<N: CausalModel>(json: &str, source: &str) -> Result<Self> {
        let not_a_decoder = |e: serde_json::Error| {
            crate::Error::config(source, "<sizes>", format!("not a decoder's config: {e}"))
        };
        // A vision-language checkpoint's sizes are its language model's (models/weights/composite.rs).
        let mut text =
            crate::models::composite::language_model_json(json).map_err(not_a_decoder)?;
        crate::models::config::transformers_defaults(&mut text);
        // Gemma 4's mixture, read by its own config (not the Llama family's): with
        // `enable_moe_block` every layer runs `top_k_experts` of `num_experts` experts,
        // `moe_intermediate_size` wide, beside its dense MLP.
        let gemma4_moe = (text.get("model_type").and_then(|v| v.as_str()) == Some("gemma4_text"))
            .then(|| serde_json::from_value::<crate::models::gemma4::Gemma4Config>(text.clone()))
            .and_then(|c| c.ok())
            .filter(|c| c.enable_moe_block)
            .and_then(|c| {
                Some((
                    c.num_experts?,
                    // The model's own defaults (models/arch/gemma4.rs).
                    c.top_k_experts.unwrap_or(1),
                    c.moe_intermediate_size.unwrap_or(1),
                    c.num_hidden_layers,
                ))
            });
        let mut dims: Dims = serde_json::from_value(text).map_err(not_a_decoder)?;
        let config = ModelConfig::from_json(json, source).ok();
        dims.windows = config.as_ref().and_then(|c| c.layer_windows().ok());
        // Qwen3-Next's layers without `layer_types`, as its model reads them.
        let hybrid = |c: &&ModelConfig| c.architecture() == Ok(Architecture::Qwen3Next);
        if dims.layer_types.is_none() {
            dims.layer_types = config
                .as_ref()
                .filter(hybrid)
                .and_then(|c| crate::models::qwen3_next::linear_layers(c, source).ok())
                .map(|linear| {
                    let kind = |l: bool| {
                        if l {
                            "linear_attention"
                        } else {
                            "full_attention"
                        }
                    };
                    linear.into_iter().map(|l| kind(l).to_string()).collect()
                });
        }
        let mut model = Model::<N>::skeleton_of(json.to_string(), DType::F32, &Device::Cpu)?;
        let (linears, parameters) = model.lora_sites()?;
        let net = model.net();
        let mut units = Vec::new();
        net.visit_units("", &mut |n| units.push(n.to_string()));
        // The mixture-of-experts keys are read by the Llama family's config (Qwen3-MoE, Mixtral).
        // Llama 4's: top-k routed experts and the shared expert on its `moe_layers`, dense
        // MLPs of `intermediate_size_mlp` on the others (the planner's dense width).
        let llama4 = ModelConfig::from_json(json, source)
            .ok()
            .and_then(|c| crate::models::llama4::read_config(&c, source)?.ok());
        if let Some(l) = &llama4 {
            dims.intermediate_size = l.dense_inter;
        }
        let moe = ModelConfig::from_json(json, source)
            .ok()
            .filter(|_| llama4.is_none())
            .and_then(|c| MoeConfig::read(&c, source).ok());
        let params = crate::tp::plan(net, 1, false);
        // DeepSeek's (DeepSeek-V3, GLM-4 MoE): top-k routed experts per token, and the shared
        // expert, which every token runs through, counted as `n_shared_experts` more.
        let deepseek = ModelConfig::from_json(json, source)
            .ok()
            .and_then(|c| DeepseekMoeConfig::read(&c, source).ok().map(|m| (c, m)));
        let routed_share = match (&moe, &deepseek, &llama4) {
            (Some(m), ..) => Some(m.top_k as f64 / m.experts as f64),
            (None, Some((_, m)), _) => Some(m.routing.top_k as f64 / m.routing.experts as f64),
            (None, None, Some(l)) => Some(l.top_k as f64 / l.experts as f64),
            _ => gemma4_moe.map(|(experts, top_k, ..)| top_k as f64 / experts as f64),
        };
        let active_parameters = params
            .iter()
            .map(|e| {
                let n = e.full_shape.iter().product::<usize>() as f64;
                match routed_share {
                    Some(share) if is_routed_expert(&e.name) => n * share,
                    _ => n,
                }
            })
            .sum();
        let experts_inter = ModelConfig::from_json(json, source)
            .ok()
            .map_or(0, |c| c.intermediate_size);
        let moe = match (moe, deepseek) {
            _ if llama4.as_ref().is_some_and(|l| l.moe.iter().any(|&s| s)) => {
                let l = llama4.as_ref().expect("checked");
                Some((
                    l.experts,
                    l.top_k + 1,
                    experts_inter,
                    l.moe.iter().filter(|&&s| s).count(),
                ))
            }
            (Some(m), _) if m.sparse.iter().any(|&s| s) => Some((
                m.experts,
                m.top_k,
                m.inter.unwrap_or(dims.intermediate_size),
                m.sparse.iter().filter(|&&s| s).count(),
            )),
            (None, Some((_, m))) if m.sparse.iter().any(|&s| s) => Some((
                m.routing.experts,
                m.routing.top_k + m.shared,
                m.inter,
                m.sparse.iter().filter(|&&s| s).count(),
            )),
            _ => gemma4_moe,
        };
        // A tied head is visited under the embedding's name only.
        let tied = !params.iter().any(|e| e.name.ends_with("lm_head.weight"));
        let qk_norm = params
            .iter()
            .any(|e| e.name.ends_with("self_attn.q_norm.weight"));
        // The layers that tile their MLP run it as SwiGLU; `nn::gated` takes those without biases.
        let gated_mlp = net.supports_tiled_mlp()
            && !params
                .iter()
                .any(|e| e.name.ends_with("mlp.gate_proj.bias"));
        let gated_experts = moe.is_some()
            && !params
                .iter()
                .any(|e| e.name.contains(".experts.") && e.name.ends_with("bias"));
        Ok(ModelShapes {
            qk_norm,
            gated_mlp,
            gated_experts,
            dims,
            params,
            units,
            linears,
            parameters,
            heads: net.heads(),
            logits_loss: net.logit_softcap().is_some(),
            moe,
            active_parameters,
            tied,
        })
    }

    /// Each decoder layer's cached key/value heads and head width, read off its
    /// `self_attn.k_proj` (the width from its q_norm where it has one, else the config's):
    /// what layers differ in (Gemma 4's full layers are wider; a layer reusing another's keys
    /// and values, or a Gated DeltaNet layer, has no k_proj and caches none). None for a
    /// model without such layers (fused or latent projections).
    pub(super) fn kv_layers(&self) -> Option<Vec<(usize, usize)>> {
        let shape = |l: usize, what: &str| {
            let name = format!("model.layers.{l}.self_attn.{what}");
            self.params
                .iter()
                .find(|e| e.name == name)
                .map(|e| e.full_shape[0])
        };
        let layers: Vec<(usize, usize)> = (0..self.dims.num_hidden_layers)
            .map(|l| match shape(l, "k_proj.weight") {
                None => (0, 0),
                Some(out) => {
                    let d = shape(l, "q_norm.weight").unwrap_or(self.dims.head_dim());
                    (out / d, d)
                }
            })
            .collect();
        layers.iter().any(|&(heads, _)| heads > 0).then_some(layers)
    }

    /// Whether the model splits over `tp` ranks with its heads over `tp x sp`: every split
    /// dimension and head count divides.
    /// The routed experts of each sparse layer, for a mixture of experts (what an ep size
    /// must divide).
    pub fn experts(&self) -> Option<usize> {
        self.moe.map(|(experts, ..)| experts)
    }

    /// This rank's parameters on a rank of `tp` holding 1 / `ep` of the routed experts.
    pub(super) fn local_ep(&self, tp: usize, ep: usize) -> Vec<(&str, usize)> {
        self.local(tp)
            .into_iter()
            .map(|(name, n)| match is_routed_expert(name) {
                true => (name, n / ep.max(1)),
                false => (name, n),
            })
            .collect()
    }

    pub fn splits_over(&self, tp: usize, sp: usize) -> bool {
        let heads = self
            .heads
            .is_none_or(|(q, kv)| q.is_multiple_of(tp * sp) && kv.is_multiple_of(tp));
        heads
            && self.params.iter().all(|e| {
                e.split
                    .dim
                    .is_none_or(|d| e.full_shape[d].is_multiple_of(tp))
            })
    }

    /// Parameter count (tied weights once).
    pub fn num_parameters(&self) -> usize {
        self.params
            .iter()
            .map(|e| e.full_shape.iter().product::<usize>())
            .sum()
    }

    /// Each parameter's elements on a rank of `tp`.
    pub(super) fn local(&self, tp: usize) -> Vec<(&str, usize)> {
        self.params
            .iter()
            .map(|e| {
                let n: usize = e.full_shape.iter().product();
                let split = e.split.dim.is_some();
                (e.name.as_str(), if split { n / tp.max(1) } else { n })
            })
            .collect()
    }

    /// The plan `add_adapters` follows for `lora`, for its shapes only: dropout (which
    /// experts and parameters refuse) changes none. None where `lora` does not fit the model
    /// (`check_lora` says why).
    pub(super) fn adapter_shapes(&self, lora: &LoraConfig) -> Option<crate::nn::lora::AdapterPlan> {
        let shapes = LoraConfig {
            dropout: 0.0,
            ..lora.clone()
        };
        crate::nn::lora::adapter_plan(&shapes, &self.linears, &self.parameters).ok()
    }

    /// Adapter elements on a rank of `tp` of every layer `lora` adapts (the plan
    /// `add_adapters` follows: A [r, in] and B [out, r] split as the layer's weight is, an
    /// expert's up projection sharing its gate's A; DoRA's magnitude with the output).
    pub(super) fn adapters(&self, lora: &LoraConfig, tp: usize) -> Vec<(String, usize)> {
        let Some(plan) = self.adapter_shapes(lora) else {
            return Vec::new();
        };
        plan.layers
            .iter()
            .filter_map(|p| {
                if p.parameter {
                    // peft's ParamWrapper: A [E r, in], B [out, r E] (E = 1 for 2-D).
                    let e = self.params.iter().find(|e| e.name == p.name)?;
                    // Either reading of a 3-D tensor counts the same elements (its in/out
                    // features swap with the halves they split).
                    let reading = crate::kernels::grouped::ExpertLayout::InOut;
                    let (experts, inp, out) = crate::nn::param::lora_shape(&e.full_shape, reading)?;
                    let split = e.split.dim.map(|d| (e.split.style, d));
                    let in_dim = crate::nn::param::adapter_in_dim(e.full_shape.len(), reading);
                    let (a, b) = crate::nn::param::lora_split_dims(split, in_dim);
                    let part = |split: Option<usize>| if split.is_some() { tp } else { 1 };
                    let r = p.config.r * experts;
                    return Some((p.name.clone(), r * inp / part(a) + out * r / part(b)));
                }
                let (weight, inp, out) = self.adapted_linear(&p.name, tp)?;
                let r = p.config.r;
                let mut n = out * r;
                if p.shares_a.is_none() {
                    n += r * inp;
                }
                if lora.dora {
                    n += out;
                }
                Some((weight, n))
            })
            .chain(self.table_adapters(lora))
            .collect()
    }

    /// The embeddings' adapters (`models::peft::add_adapters`): LoRA on a named embedding
    /// (A [r, vocab] + B [hidden, r]) and trainable tokens ([n, hidden]), kept whole.
    pub(super) fn table_adapters(&self, lora: &LoraConfig) -> Vec<(String, usize)> {
        self.params
            .iter()
            .filter(|e| e.name.ends_with("embed_tokens.weight") && e.full_shape.len() == 2)
            .filter_map(|e| {
                let module = e.name.trim_end_matches(".weight");
                let (vocab, hidden) = (e.full_shape[0], e.full_shape[1]);
                let named = matches!(&lora.targets, crate::nn::lora::Targets::Names(_))
                    && lora.targets(module, false);
                let tokens = lora
                    .trainable_token_indices
                    .iter()
                    .find(|(m, _)| module == m || module.ends_with(&format!(".{m}")));
                match (named, tokens) {
                    (true, _) => Some((e.name.clone(), lora.r * (vocab + hidden))),
                    (false, Some((_, ids))) => Some((e.name.clone(), ids.len() * hidden)),
                    _ => None,
                }
            })
            .collect()
    }

    /// An adapted linear layer's weight name and its input and output widths on a rank of
    /// `tp`, as its adapter splits them (A [r, in] with the input, B [out, r] with the output).
    pub(super) fn adapted_linear(&self, layer: &str, tp: usize) -> Option<(String, usize, usize)> {
        let weight = format!("{layer}.weight");
        let e = self.params.iter().find(|e| e.name == weight)?;
        let (a, b) = Linear::lora_split_dims(e.split.dim.map(|_| e.split.style));
        let part = |split: Option<usize>| if split.is_some() { tp } else { 1 };
        let (out, inp) = (e.full_shape[0] / part(b), e.full_shape[1] / part(a));
        Some((weight, inp, out))
    }

    /// Each linear layer `lora` adapts, its (input, output) widths on a rank of `tp`.
    pub(super) fn adapted_linears(&self, lora: &LoraConfig, tp: usize) -> Vec<(usize, usize)> {
        let Some(plan) = self.adapter_shapes(lora) else {
            return Vec::new();
        };
        plan.layers
            .iter()
            .filter(|p| !p.parameter)
            .filter_map(|p| self.adapted_linear(&p.name, tp))
            .map(|(_, inp, out)| (inp, out))
            .collect()
    }

    /// Elements per token that LoRA's dropout keeps on a rank of `tp`, over all layers: each
    /// adapted linear layer's dropped input (what its A's gradient needs), as wide as the
    /// input the rank holds. None without dropout (the adapters see the input itself).
    pub(super) fn dropped_inputs(&self, lora: &LoraConfig, tp: usize) -> f64 {
        if lora.dropout <= 0.0 {
            return 0.0;
        }
        let inputs: usize = self.adapted_linears(lora, tp).iter().map(|(i, _)| i).sum();
        inputs as f64
    }

    /// Input and output features per token of every adapted linear layer on a rank of `tp`:
    /// what LoRA's dropout, rank-r products and sums pass over beyond its FLOPs.
    pub(super) fn adapted_features(&self, lora: &LoraConfig, tp: usize) -> f64 {
        let features: usize = self
            .adapted_linears(lora, tp)
            .iter()
            .map(|(i, o)| i + o)
            .sum();
        features as f64
    }

    /// The trainable copies of the modules a LoRA run trains whole (`modules_to_save`), on a
    /// rank of `tp`: each of their weights (a tied head's copy is the size of the embedding
    /// it was tied to, which stays in the frozen base; with ensure_weight_tying the pair is
    /// one copy, the embedding's).
    pub(super) fn saved(&self, lora: &LoraConfig, tp: usize) -> Vec<(String, usize)> {
        let tied_as_one = self.tied && lora.ensure_weight_tying;
        let mut out: Vec<(String, usize)> = self
            .local(tp)
            .into_iter()
            .filter(|(name, _)| {
                lora.saves(name)
                    || (tied_as_one
                        && name.ends_with("embed_tokens.weight")
                        && lora.saves("lm_head.weight"))
            })
            .map(|(name, n)| (name.to_string(), n))
            .collect();
        if self.tied && !tied_as_one && lora.saves("lm_head.weight") {
            let table = self
                .local(tp)
                .into_iter()
                .find(|(n, _)| n.ends_with("embed_tokens.weight"));
            if let Some((_, n)) = table {
                out.push(("lm_head.weight".into(), n));
            }
        }
        out
    }

    /// Elements of each ZeRO-3 / FSDP wrap unit on a rank of `tp` (root first), as `fsdp.rs`
    /// cuts them: (the unit's, its experts') where expert parallelism (`ep` > 1) puts this
    /// rank's share of a layer unit's routed experts in a unit of their own, else (all, 0).
    /// Without the parameters `trained` (a LoRA run's modules trained whole, kept beside).
    pub(super) fn unit_sizes(
        &self,
        (tp, ep): (usize, usize),
        policy: WrapPolicy,
        trained: &[(String, usize)],
    ) -> Vec<(usize, usize)> {
        // Per layer: (elements, of which routed experts').
        let mut layer_sizes = vec![(0usize, 0usize); self.units.len()];
        let mut root = 0;
        // Under expert parallelism the units hold this rank's share of the experts.
        let local = self.local_ep(tp, ep);
        let frozen = local
            .iter()
            .filter(|(n, _)| !trained.iter().any(|(t, _)| t == n));
        for &(name, n) in frozen {
            match crate::parallel::fsdp::unit_of(name, &self.units) {
                Some(l) => {
                    layer_sizes[l].0 += n;
                    if ep > 1 && is_routed_expert(name) {
                        layer_sizes[l].1 += n;
                    }
                }
                None => root += n,
            }
        }
        // Each layer joins the unit the sharding puts it in.
        let totals: Vec<usize> = layer_sizes.iter().map(|s| s.0).collect();
        let layer_unit = crate::parallel::fsdp::layer_units(&totals, policy);
        let mut units = vec![(0, 0); layer_unit.iter().max().map_or(1, |m| m + 1)];
        units[0].0 = root;
        for (u, (n, experts)) in layer_unit.into_iter().zip(layer_sizes) {
            units[u].0 += n - experts;
            units[u].1 += experts;
        }
        units
    }
}
