//! What one rank holds at its peak, and how fast a step runs, before anything is loaded:
//! the figures `cargo trl plan` and `--profile auto` choose a layout with.
//!
//! Model state is exact: each strategy's rule below is how its file allocates (DDP keeps
//! weights, gradients, an fp32 master and two moments whole; ZeRO-1/2 slice the flat vector
//! of all parameters, padded to the group size; ZeRO-3 / FSDP slice each wrap unit, padded the
//! same way), and trl-runtime/tests/memory_plan.rs checks it equals `Trainer::memory` for every strategy.
//! Activations are what the autograd graph keeps per token, in elements of the compute dtype,
//! measured from the layers with a counting allocator (trl-runtime/tests/memory_plan.rs re-measures them on
//! other shapes and fails when the code and these constants part by more than 10%).

use super::{Model, Strategy, WrapPolicy, ZeroStage};
use crate::config::parallelism::ParallelDims;
use crate::error::Result;
use crate::models::moe::MoeConfig;
use crate::models::{AutoModelForCausalLM, CausalModel, ModelConfig};
use crate::nn::lora::is_routed_expert;
use crate::nn::lora::LoraConfig;
use crate::nn::Linear;
use crate::tp::PlanEntry;
use candle_core::{DType, Device};

/// One layout to estimate: the strategy over a mesh, and the work each rank does.
#[derive(Debug, Clone)]
pub struct Setup {
    pub strategy: Strategy,
    pub dims: ParallelDims,
    /// The compute dtype (weights and activations); master weights, gradients and moments
    /// are fp32 whatever it is.
    pub dtype: DType,
    pub lora: Option<LoraConfig>,
    /// Rows per device per micro-batch and their length (before a cp/sp split).
    pub batch: usize,
    /// Micro-batches per optimizer step (gradient_accumulation_steps): ZeRO-3 / FSDP keep no
    /// gradient slices through the first one's loss backward (they are taken by the update).
    pub micro_batches: usize,
    pub seq: usize,
    pub checkpointing: bool,
    /// Optimizer state (fp32 master and moments) kept in host memory, and under ZeRO-2/3 the
    /// reduced gradient slices streamed there.
    pub offload_optimizer: bool,
    /// Parameter slices kept in host memory (fsdp_offload_params, offload_param).
    pub offload_params: bool,
    /// ZeRO-2's units (full fine-tuning): DeepSpeed's reduce buckets or FSDP's wrap units
    /// ([`super::zero2_units`]), and whether their reductions overlap the backward.
    pub reduce_units: (WrapPolicy, bool),
    /// A second copy of the weights this rank holds (TR-DPO's reference).
    pub reference_copy: bool,
    /// On GPUs, where the fused loss's one-pass kernel takes every dtype (on the CPU, f32).
    pub gpu: bool,
    /// The router load-balancing loss is added (a mixture of experts with a non-zero
    /// `router_aux_loss_coef`, the default): each sparse layer keeps its probabilities once
    /// more, in f32, for the loss's backward.
    pub router_loss: bool,
    /// A CPU rank's compute threads (RAYON_NUM_THREADS, the training thread among them):
    /// each holds a GEMM packing buffer (`kernels::cpu_gemm::reserve_packing_buffers`).
    /// Unused on GPUs.
    pub threads: usize,
}

impl Setup {
    /// `strategy` over `dims` with `batch` rows of `seq` tokens, in the plainest form: fp32
    /// on the CPU, one thread, one micro-batch, no LoRA, checkpointing or offload.
    pub fn new(strategy: Strategy, dims: ParallelDims, batch: usize, seq: usize) -> Self {
        Setup {
            strategy,
            dims,
            dtype: DType::F32,
            lora: None,
            batch,
            micro_batches: 1,
            seq,
            checkpointing: false,
            offload_optimizer: false,
            offload_params: false,
            reduce_units: (WrapPolicy::Buckets(super::DEEPSPEED_REDUCE_BUCKET), false),
            reference_copy: false,
            gpu: false,
            router_loss: true,
            threads: 1,
        }
    }

    /// The setup of preference training over it (DPO): a micro-batch of n pairs is 2n
    /// sequences, and TR-DPO (`sync_ref_model`) keeps a copy of the weights.
    pub fn for_preference_pairs(&mut self, sync_ref_model: bool) {
        self.batch *= 2;
        self.reference_copy = sync_ref_model;
    }
}

/// Bytes one rank holds, by what holds them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Estimate {
    /// Weights in the compute dtype (a frozen LoRA base among them).
    pub parameters: usize,
    /// Gradients kept between backward and the update (a slice under ZeRO-2/3).
    pub gradients: usize,
    /// fp32 master weights and moments on the device (0 when offloaded).
    pub optimizer: usize,
    /// Optimizer state moved to host memory.
    pub host_optimizer: usize,
    /// Parameter slices in host memory (parameter offload).
    pub host_parameters: usize,
    /// Reduced gradient slices streamed to host memory (ZeRO-2/3 with optimizer offload).
    pub host_gradients: usize,
    /// What backward needs of the forward: per token, per layer, times the tokens of a rank.
    pub activations: usize,
    /// The runtime's own heap: tokenizer, data, host-collective buffers (measured).
    pub runtime: usize,
    /// Buffers a strategy keeps for its collectives between steps (ZeRO-2: the reduced
    /// gradient slice the host backend writes into).
    pub comm_buffers: usize,
    /// What the loss's logits add to `activations` at the backward's peak, when they exist
    /// whole (under tp, ZeRO-3/FSDP or soft-capping).
    pub logits: usize,
    /// Transient buffers of the step: the whole gradients while backward runs, the units
    /// gathered at once (ZeRO-3/FSDP), the flat buffers of the reductions.
    pub step_buffers: usize,
    /// Of `step_buffers`, the units whose all-gathers run ahead (ZeRO-3/FSDP prefetch):
    /// whether they are in memory at the peak depends on timing, so the peak is a bound.
    pub prefetch: usize,
    /// Transient buffers of the update, beyond the gradients (the flat copies ZeRO reduces
    /// and gathers; AdamW's temporaries). The step's transient is the larger of this and the
    /// backward's (activations, logits, step buffers).
    pub update_buffers: usize,
    /// A full checkpoint save over the training peak (streamed: one unit at a time).
    pub save: usize,
    /// A copy of this rank's weights kept beside them (TR-DPO's reference).
    pub reference: usize,
    /// The formulas with their numbers, one line each (`cargo trl plan --explain`).
    pub explain: Vec<String>,
}

impl Estimate {
    /// Model state on the device (what `Trainer::memory` reports).
    pub fn model_state(&self) -> usize {
        self.parameters + self.gradients + self.optimizer
    }

    /// What offload keeps in host memory.
    pub fn host(&self) -> usize {
        self.host_optimizer + self.host_parameters + self.host_gradients
    }

    /// The step's peak on the device, without the process's own base (runtime, CUDA context).
    pub fn peak(&self) -> usize {
        self.runtime
            + self.comm_buffers
            + self.reference
            + self.parameters
            + self.optimizer
            + self.gradients
            + self.transient()
    }

    /// What exists only during the step: the larger of backward's (activations, logits,
    /// step buffers: the loss's graph stays alive while checkpointed layers are recomputed)
    /// and the update's.
    pub fn transient(&self) -> usize {
        (self.activations + self.logits + self.step_buffers).max(self.update_buffers)
    }
}

/// Elements per token that backward keeps of one decoder layer (no checkpointing), in the
/// compute dtype, for hidden size `h`, query width `q` (heads x head_dim), key/value width `kv`
/// and MLP width `i` on this rank (measured; see the module docs).
fn layer_elements(h: f64, q: f64, kv: f64, i: f64, lora: bool, (tp, sp): (usize, usize)) -> f64 {
    // Tensor parallelism keeps each block's input and its all-reduced output once more.
    let tp_copies = if tp > 1 { 12.0 * h } else { 0.0 };
    // Ulysses keeps q, k, v and the attention output in both layouts of its all-to-alls
    // (measured: 4 h-wide and 4 kv-wide tensors more per layer at h = q = 2 kv).
    let sp_copies = if sp > 1 {
        2.0 * (2.0 * q + 2.0 * kv)
    } else {
        0.0
    };
    tp_copies
        + sp_copies
        + match lora {
            // Norm outputs and residuals (h), q/k/v with their rotated copies and the attention
            // output, gate/up/activation products (i).
            false => 4.07 * h + 5.79 * q + 7.22 * kv + 3.70 * i,
            // The adapters add their inputs and their outputs summed to every target (since
            // the scale goes on the rank-r input, each target's output once: q, k, v, o,
            // gate, up and down, one output width each less than the 11.25 h + 8.09 q +
            // 11.16 kv + 10.03 i measured before).
            true => 9.25 * h + 7.09 * q + 9.16 * kv + 8.03 * i,
        }
}

/// Elements per token a sparse MLP keeps beyond its experts' MLPs: the tokens gathered for
/// each of their `top_k` experts, the weighted outputs and their concatenation added back
/// (4 k h), the sum (h), and the router's f32 logits, probabilities and choices (20 f32 per
/// expert). Measured on 4 expert counts / widths (trl-runtime/tests/memory_plan.rs).
fn routing_elements(h: f64, experts: usize, top_k: usize, dsz: usize) -> f64 {
    4.0 * top_k as f64 * h + h + 80.0 * experts as f64 / dsz as f64
}

/// Elements per token outside the layers (embedding output, final norm, the fused loss's
/// hidden-state gradient).
fn outside_elements(h: f64, lora: bool) -> f64 {
    match lora {
        false => 11.12 * h,
        true => 12.32 * h,
    }
}

/// Elements per token kept per checkpointed layer: its input.
fn checkpoint_elements(h: f64) -> f64 {
    h
}

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
    params: Vec<PlanEntry>,
    /// The FSDP wrap units (one per decoder layer), in forward order.
    units: Vec<String>,
    /// The layers that can take a LoRA adapter, and the parameters that can.
    linears: Vec<String>,
    parameters: Vec<String>,
    /// Query and key/value heads (what tp and sp must divide).
    heads: Option<(usize, usize)>,
    /// The loss needs whole logits (final-logit soft-capping).
    pub logits_loss: bool,
    /// Sparse MLPs: experts, experts per token, each expert's width, sparse layers.
    moe: Option<(usize, usize, usize, usize)>,
    /// Parameters one token computes with: of the routed experts, only `top_k` of them.
    active_parameters: f64,
    /// The LM head is the embedding (its matmul runs; there is no second table).
    tied: bool,
    /// Attention norms q and k (their inputs and outputs are kept).
    qk_norm: bool,
    /// The dense MLP is SwiGLU without biases (`nn::gated`'s two ops where its weights are
    /// held on the rank, whole or tp's split, and carry no adapter).
    gated_mlp: bool,
    /// The routed experts are SwiGLU MLPs without biases (the same two ops).
    gated_experts: bool,
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
}

impl Dims {
    pub fn head_dim(&self) -> usize {
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
    /// count, which `bench train`'s MFU and so the GPU table use). The embedding lookup costs
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
        let layers = cfg.num_hidden_layers as f64;
        let passes = if checkpointing { 8.0 } else { 6.0 };
        passes * (matmul_params + adapters as f64) + passes * layers * seq as f64 * q
    }

    /// The shapes of model `N` (a user's model too) built from config.json's text `json`.
    pub fn of_model<N: CausalModel>(json: &str, source: &str) -> Result<Self> {
        let not_a_decoder = |e: serde_json::Error| {
            crate::Error::config(source, "<sizes>", format!("not a decoder's config: {e}"))
        };
        // A vision-language checkpoint's sizes are its language model's (models/composite.rs).
        let text = crate::models::composite::language_model_json(json).map_err(not_a_decoder)?;
        let dims: Dims = serde_json::from_value(text).map_err(not_a_decoder)?;
        let mut model = Model::<N>::skeleton_of(json.to_string(), DType::F32, &Device::Cpu)?;
        let (linears, parameters) = model.lora_sites()?;
        let net = model.net();
        let mut units = Vec::new();
        net.visit_units("", &mut |n| units.push(n.to_string()));
        // The mixture-of-experts keys are read by the Llama family's config (Qwen3-MoE, Mixtral).
        let moe = ModelConfig::from_json(json, source)
            .ok()
            .and_then(|c| MoeConfig::read(&c, source).ok());
        let params = crate::tp::plan(net, 1, false);
        let active_parameters = params
            .iter()
            .map(|e| {
                let n = e.full_shape.iter().product::<usize>() as f64;
                match &moe {
                    Some(m) if is_routed_expert(&e.name) => n * m.top_k as f64 / m.experts as f64,
                    _ => n,
                }
            })
            .sum();
        let moe = match moe {
            Some(m) if m.sparse.iter().any(|&s| s) => Some((
                m.experts,
                m.top_k,
                m.inter.unwrap_or(dims.intermediate_size),
                m.sparse.iter().filter(|&&s| s).count(),
            )),
            _ => None,
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

    /// Whether the model splits over `tp` ranks with its heads over `tp x sp`: every split
    /// dimension and head count divides.
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
    fn local(&self, tp: usize) -> Vec<(&str, usize)> {
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
    fn adapter_shapes(&self, lora: &LoraConfig) -> Option<crate::nn::lora::AdapterPlan> {
        let shapes = LoraConfig {
            dropout: 0.0,
            ..lora.clone()
        };
        crate::nn::lora::adapter_plan(&shapes, &self.linears, &self.parameters).ok()
    }

    /// Adapter elements on a rank of `tp` of every layer `lora` adapts (the plan
    /// `add_adapters` follows: A [r, in] and B [out, r] split as the layer's weight is, an
    /// expert's up projection sharing its gate's A; DoRA's magnitude with the output).
    fn adapters(&self, lora: &LoraConfig, tp: usize) -> Vec<(String, usize)> {
        let Some(plan) = self.adapter_shapes(lora) else {
            return Vec::new();
        };
        plan.layers
            .iter()
            .filter_map(|p| {
                if p.parameter {
                    // peft's ParamWrapper: A [E r, in], B [out, r E] (E = 1 for 2-D).
                    let e = self.params.iter().find(|e| e.name == p.name)?;
                    let (experts, inp, out) = crate::nn::param::lora_shape(&e.full_shape)?;
                    let split = e.split.dim.map(|d| (e.split.style, d));
                    let (a, b) = crate::nn::param::lora_split_dims(split);
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
    fn table_adapters(&self, lora: &LoraConfig) -> Vec<(String, usize)> {
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
    fn adapted_linear(&self, layer: &str, tp: usize) -> Option<(String, usize, usize)> {
        let weight = format!("{layer}.weight");
        let e = self.params.iter().find(|e| e.name == weight)?;
        let (a, b) = Linear::lora_split_dims(e.split.dim.map(|_| e.split.style));
        let part = |split: Option<usize>| if split.is_some() { tp } else { 1 };
        let (out, inp) = (e.full_shape[0] / part(b), e.full_shape[1] / part(a));
        Some((weight, inp, out))
    }

    /// Each linear layer `lora` adapts, its (input, output) widths on a rank of `tp`.
    fn adapted_linears(&self, lora: &LoraConfig, tp: usize) -> Vec<(usize, usize)> {
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
    fn dropped_inputs(&self, lora: &LoraConfig, tp: usize) -> f64 {
        if lora.dropout <= 0.0 {
            return 0.0;
        }
        let inputs: usize = self.adapted_linears(lora, tp).iter().map(|(i, _)| i).sum();
        inputs as f64
    }

    /// Input and output features per token of every adapted linear layer on a rank of `tp`:
    /// what LoRA's dropout, rank-r products and sums pass over beyond its FLOPs.
    fn adapted_features(&self, lora: &LoraConfig, tp: usize) -> f64 {
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
    fn saved(&self, lora: &LoraConfig, tp: usize) -> Vec<(String, usize)> {
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
    /// cuts them.
    /// Without the parameters `trained` (a LoRA run's modules trained whole, kept beside).
    fn unit_sizes(&self, tp: usize, policy: WrapPolicy, trained: &[(String, usize)]) -> Vec<usize> {
        let mut layer_sizes = vec![0usize; self.units.len()];
        let mut root = 0;
        let local = self.local(tp);
        let frozen = local
            .iter()
            .filter(|(n, _)| !trained.iter().any(|(t, _)| t == n));
        for &(name, n) in frozen {
            match super::fsdp::unit_of(name, &self.units) {
                Some(l) => layer_sizes[l] += n,
                None => root += n,
            }
        }
        // Each layer joins the unit the sharding puts it in.
        let layer_unit = super::fsdp::layer_units(&layer_sizes, policy);
        let mut units = vec![0; layer_unit.iter().max().map_or(1, |m| m + 1)];
        units[0] = root;
        for (u, n) in layer_unit.into_iter().zip(layer_sizes) {
            units[u] += n;
        }
        units
    }
}

/// Whether the layers run on wrap units' ops (ZeRO-3 / FSDP, and ZeRO-2's resident units
/// without LoRA), which keep different intermediates from ops on whole weights.
fn unit_ops(setup: &Setup) -> bool {
    match setup.strategy {
        Strategy::Fsdp(..) => true,
        Strategy::Zero(ZeroStage::Two) => setup.lora.is_none(),
        _ => false,
    }
}

/// Whether a step's gradients stay in the compute dtype, as Candle's backward makes them:
/// one micro-batch per step on a GPU with nothing to all-reduce (`Core::accumulate`; the
/// GPU optimizer reads them as they are, in f32 math). Otherwise they are summed in fp32.
pub fn native_gradients(gpu: bool, micro_batches: usize, single_replica: bool) -> bool {
    gpu && micro_batches == 1 && single_replica
}

fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

/// The per-rank memory of `setup` for the model `cfg`.
pub fn estimate(model: &ModelShapes, setup: &Setup) -> Estimate {
    let cfg = &model.dims;
    let d = setup.dims;
    let tp = d.tp.max(1);
    // ZeRO and FSDP shard over dp_shard and the ranks holding the other chunks of the rows.
    let n = d.dp_shard * d.cp * d.sp;
    let dsz = setup.dtype.size_in_bytes();
    let shapes = model.local(tp);
    let base: usize = shapes.iter().map(|(_, n)| n).sum();
    let mut e = Estimate::default();
    let mut why = Vec::new();

    // Trainable elements (all weights, or the adapters), and the frozen base.
    let adapters = setup.lora.as_ref().map(|l| model.adapters(l, tp));
    // Modules trained whole leave the frozen base (but a tied head's copy: its table stays).
    let trained = setup
        .lora
        .as_ref()
        .map_or(Vec::new(), |l| model.saved(l, tp));
    // A tied head trained apart from its embedding's copy (peft's default) still reads the
    // base table, which then stays.
    let tied_as_one = setup.lora.as_ref().is_some_and(|l| l.ensure_weight_tying);
    let head_reads_base = model.tied
        && !tied_as_one
        && !setup
            .lora
            .as_ref()
            .is_some_and(|l| l.saves("lm_head.weight"));
    let kept: usize = shapes
        .iter()
        .filter(|(n, _)| trained.iter().any(|(t, _)| t == n))
        .filter(|(n, _)| !(head_reads_base && n.ends_with("embed_tokens.weight")))
        .map(|(_, n)| n)
        .sum();
    let whole: usize = trained.iter().map(|(_, n)| n).sum();
    // ZeRO-2 without LoRA keeps its parameters whole in resident units, reducing each
    // unit's gradients as backward finishes it.
    let resident = setup.strategy == Strategy::Zero(ZeroStage::Two) && setup.lora.is_none();
    // The wrap units on this rank (frozen ones under LoRA).
    let units = match setup.strategy {
        Strategy::Fsdp(policy, _) => model.unit_sizes(tp, policy, &trained),
        _ if resident => model.unit_sizes(tp, setup.reduce_units.0, &[]),
        _ => Vec::new(),
    };
    let (p, frozen) = match &adapters {
        Some(a) => (a.iter().map(|(_, n)| n).sum::<usize>() + whole, base - kept),
        None => (base, 0),
    };
    let slice = |elems: usize| elems.div_ceil(n);
    // A flat slice spans parameters that decay and norms and biases that do not: ZeRO and
    // FSDP keep a byte per element saying which (`FlatLayout::shard_state`).
    const MASK: usize = 1;
    // Bytes per gradient element: fp32 sums, or as the backward makes them (DDP alone).
    let replicas = d.dp_replicate * d.dp_shard * d.cp * d.sp;
    let gsz = match setup.strategy == Strategy::Ddp
        && native_gradients(setup.gpu, setup.micro_batches, replicas == 1)
    {
        true => dsz,
        false => 4,
    };
    let opt_bytes;
    match (setup.strategy, setup.lora.is_some()) {
        (Strategy::Ddp, _) => {
            e.parameters = dsz * (p + frozen);
            e.gradients = gsz * p;
            opt_bytes = 12 * p;
            why.push(format!(
                "ddp: weights {dsz} x {} + gradients {gsz} x {p} + master and moments 12 x {p}",
                p + frozen
            ));
        }
        (Strategy::Zero(ZeroStage::Two), false) => {
            let s: usize = units.iter().map(|&u| slice(u)).sum();
            // The whole parameters (each unit padded to the group), this rank's slice a view
            // of them (in host memory, a copy, under parameter offload); fp32 master weights
            // apart.
            e.parameters = dsz * n * s + usize::from(setup.offload_params) * dsz * s;
            e.gradients = 4 * s;
            opt_bytes = (12 + MASK) * s;
            why.push(format!(
                "zero2: {} resident units, weights {dsz} x {} whole, gradients 4 x {s}, master, moments and decay mask 13 x {s} (each unit / {n})",
                units.len(),
                n * s,
            ));
        }
        (Strategy::Zero(stage), _) => {
            e.parameters = dsz * (p + frozen);
            e.gradients = match stage {
                ZeroStage::One => 4 * p,
                ZeroStage::Two => (4 * p).div_ceil(n),
            };
            opt_bytes = (12 + MASK) * slice(p);
            why.push(format!(
                "{}: weights {dsz} x {} + gradients {} + master, moments and decay mask 13 x {} (the flat vector / {n})",
                setup.strategy.name(),
                p + frozen,
                mib(e.gradients),
                slice(p)
            ));
        }
        (Strategy::Fsdp(..), false) => {
            let s: usize = units.iter().map(|&u| slice(u)).sum();
            // In fp32 the slice is its own master (but where the optimizer alone is offloaded:
            // its master in host memory); otherwise a compute-dtype copy beside it.
            let own_master = dsz == 4 && (setup.offload_params || !setup.offload_optimizer);
            e.parameters = dsz * s;
            e.gradients = 4 * s;
            opt_bytes = if own_master { 8 * s } else { 12 * s } + MASK * s;
            why.push(format!(
                "zero3: {} units, {s} elements per rank (each unit padded to {n}): weights {dsz}, gradients 4, {} bytes of optimizer state each",
                units.len(),
                opt_bytes / s.max(1)
            ));
        }
        (Strategy::Fsdp(..), true) => {
            // The frozen base is sharded in its units; the adapters stay whole, their
            // gradients and optimizer state sharded as ZeRO-2 does.
            let s: usize = units.iter().map(|&u| slice(u)).sum();
            e.parameters = dsz * (s + p);
            e.gradients = (4 * p).div_ceil(n);
            opt_bytes = (12 + MASK) * slice(p);
            why.push(format!(
                "zero3 + LoRA: base slices {dsz} x {s} + adapters whole {dsz} x {p}, their gradients and state / {n}"
            ));
        }
    }
    let lora_run = setup.lora.is_some();
    if setup.reference_copy {
        e.reference = e.parameters;
        why.push(format!(
            "reference: a copy of the weights, {}",
            mib(e.reference)
        ));
    }
    if setup.offload_optimizer {
        e.host_optimizer = opt_bytes;
        // The units' reduced gradient slices stream out as they arrive.
        if !units.is_empty() && !lora_run {
            e.host_gradients = std::mem::take(&mut e.gradients);
        }
    } else {
        e.optimizer = opt_bytes;
    }
    if setup.offload_params && !units.is_empty() {
        let slices = dsz * units.iter().map(|&u| slice(u)).sum::<usize>();
        e.host_parameters = slices;
        e.parameters -= slices;
    }

    // Activations: the tokens this rank computes, times what each layer keeps per token.
    let lora = setup.lora.is_some();
    let tokens = setup.batch * setup.seq / (d.cp * d.sp).max(1);
    let (h, q, kv, i) = (
        cfg.hidden_size as f64,
        (cfg.num_attention_heads * cfg.head_dim()) as f64 / tp as f64,
        (cfg.num_kv_heads() * cfg.head_dim()) as f64 / tp as f64,
        cfg.intermediate_size as f64 / tp as f64,
    );
    let layers = cfg.num_hidden_layers as f64;
    // LoRA's dropped inputs, per layer (on average).
    let dropped = setup
        .lora
        .as_ref()
        .map_or(0.0, |l| model.dropped_inputs(l, tp) / layers);
    // One layer and all of them, per token (with or without adapters).
    let stack = |lora: bool| {
        // With adapters a dense MLP's gate and up run as chains (the unit's op under ZeRO-3
        // / FSDP), so neither the base's output nor the adapter's product is kept beside
        // their sum: 4 i fewer than the constants, measured before that, count.
        let (dropped, chained_mlp) = if lora { (dropped, 4.0 * i) } else { (0.0, 0.0) };
        // Weights held on this rank (whole or tp's split), no adapters: the gated MLP's two
        // ops keep (gate | up) and not SwiGLU's product (`nn::gated`), i fewer.
        let weights_held = !unit_ops(setup);
        let gated = |applies: bool, width: f64| match applies && weights_held && !lora {
            true => width,
            false => 0.0,
        };
        let dense = layer_elements(h, q, kv, i, lora, (tp, d.sp)) + dropped
            - chained_mlp
            - gated(model.gated_mlp, i);
        // A sparse layer: each token runs through `top_k` experts' MLPs, plus the router.
        match model.moe {
            None => (dense, layers * dense),
            Some((experts, top_k, inter, sparse)) => {
                // The router loss's copy of the probabilities: one f32 per expert.
                let router_loss = match setup.router_loss {
                    true => 4.0 * experts as f64 / dsz as f64,
                    false => 0.0,
                };
                let routed = layer_elements(
                    h,
                    q,
                    kv,
                    (top_k * inter) as f64 / tp as f64,
                    lora,
                    (tp, d.sp),
                ) + dropped
                    + routing_elements(h, experts, top_k, dsz)
                    + router_loss
                    - gated(model.gated_experts, (top_k * inter) as f64 / tp as f64);
                let sparse = sparse as f64;
                (
                    routed.max(dense),
                    sparse * routed + (layers - sparse) * dense,
                )
            }
        }
    };
    let (layer, kept) = stack(lora);
    // Projections run with the ops around them as one op (`nn::chain`), so the graph keeps
    // fewer of their intermediates than the constants (measured on Qwen2 before the chain)
    // count. `moe_down`: what a sparse MLP's residual add (outside the chain) still keeps.
    let row_split = tp > 1;
    let (chained, moe_down) = match (lora, unit_ops(setup)) {
        // Whole weights: instead of each output before its bias, after it, its split copy
        // and attention's output merged back (6 q, 4 kv for k, 3 for v: Qwen2 has biases) and
        // the outputs the residual adds took (2 h), the rotated q and k, v split and
        // attention's output (2 q + 2 kv), with q/k norms their inputs and outputs (2 q +
        // 2 kv more). A row-split output projection is not chained (q + 2 h stay).
        (false, false) => {
            let norms = if model.qk_norm { 2.0 * (q + kv) } else { 0.0 };
            let rows = if row_split { q + 2.0 * h } else { 0.0 };
            let kept = 2.0 * q + 2.0 * kv + norms + rows;
            (kept - (6.0 * q + 7.0 * kv + 2.0 * h), h)
        }
        // LoRA: the frozen base's output and its sum with the adapter's are no longer kept,
        // for q and k (and their split copies: 3 q, 3 kv), v (2 kv), o_proj and down_proj
        // (4 h; not when row-split); nor the adapter's product for q, k and v (q + 2 kv: the
        // chain takes the rank-r hidden and B instead).
        (true, false) => {
            let rows = if row_split { 4.0 * h } else { 0.0 };
            (rows - (4.0 * q + 7.0 * kv + 4.0 * h), 2.0 * h)
        }
        // ZeRO-3 / FSDP (no adapter): a unit's op takes the chain but the residual: q's and
        // k's outputs before and after the split (2 q + 2 kv), v's (kv) and attention's
        // output merged for o_proj (q; not when row-split).
        (false, true) => {
            let rows = if row_split { q } else { 0.0 };
            (rows - (3.0 * q + 3.0 * kv), 0.0)
        }
        // ZeRO-3 / FSDP with LoRA: the unit's adapted op chains q, k and v (measured 3 q +
        // 5 kv fewer); o_proj and down_proj (a residual) are not chained.
        (true, true) => (-(3.0 * q + 5.0 * kv), 0.0),
    };
    let unchained_moe = model
        .moe
        .map_or(0.0, |(.., sparse)| sparse as f64 * moe_down);
    let (layer, kept) = (
        layer + chained + unchained_moe.min(moe_down),
        kept + layers * chained + unchained_moe,
    );
    // ZeRO-3 / FSDP keep 2 h more per layer and token (measured, with and without
    // checkpointing): a norm whose weight is in a unit runs as Candle's normalize ops and a
    // unit op scaling by the weight (`nn::RmsNorm`), not the fused kernel, and the graph keeps
    // those ops' intermediates. (A fused unit op for it measured 14% less step memory; the
    // step buffers below then over-count by ~3 MB at the test shape: not yet re-derived.)
    let unit_extra = match (setup.strategy, lora) {
        _ if unit_ops(setup) && !lora => layers * 2.0 * h,
        _ => 0.0,
    };
    let per_token = unit_extra
        + outside_elements(h, lora)
        + match setup.checkpointing {
            false => kept,
            // The recomputed layer's backward holds 2 h more than its forward keeps (its norms'
            // input gradients beside the next; measured).
            true => layers * checkpoint_elements(h) + layer + if lora { 0.0 } else { 2.0 * h },
        };
    e.activations = (per_token * tokens as f64) as usize * dsz;
    why.push(format!(
        "activations: {tokens} tokens x {per_token:.0} elements x {dsz} bytes ({}; {} layers of {layer:.0} per token)",
        if setup.checkpointing { "checkpointed: layer inputs kept, one layer recomputed at a time" } else { "every layer kept" },
        cfg.num_hidden_layers
    ));

    // During backward the whole gradients of what the rank computes with exist before their
    // reduction; under ZeRO-3 / FSDP only those of the units gathered.
    let largest_unit = units.iter().copied().max().unwrap_or(0);
    let root_unit = units.first().copied().unwrap_or(0);
    let layer_unit = units.iter().skip(1).copied().max().unwrap_or(0);
    // The head's gradient (fp32, the vocabulary's rows this rank holds), unless LoRA leaves
    // the head frozen (the loss skips it then).
    let head_trained = !lora
        || trained.iter().any(|(n, _)| {
            n.ends_with("lm_head.weight")
                || (model.tied && tied_as_one && n.ends_with("embed_tokens.weight"))
        });
    let head_grad = match head_trained {
        true => 4 * cfg.vocab_size * cfg.hidden_size / tp,
        false => 0,
    };
    // Gathered per use (ZeRO-3 / FSDP), not resident.
    let sharded = matches!(setup.strategy, Strategy::Fsdp(..));
    // ZeRO-3 / FSDP's gradient slices are taken by each update and come back as the layers
    // reduce: in a step's first micro-batch (the only one without accumulation) none exists
    // before the layers' backward.
    let first_micro_batch = setup.micro_batches <= 1;
    // The fused loss on a sharded head computes from a copy of it, held by the graph until the
    // backward ends: at the peak of a frozen base (LoRA); with the base trained, the step's
    // peak falls where the counts below have room for it (measured, tests/memory_plan.rs).
    let head_copy = match unit_ops(setup) && !whole_logits(model, setup) {
        true => dsz * cfg.vocab_size * cfg.hidden_size,
        false => 0,
    };
    // While the loss's backward runs (ZeRO-3 / FSDP): the root gathered, the head's gradient
    // and the last layer's unit arriving.
    let loss_buffers = dsz * (root_unit + layer_unit) + head_grad;
    e.step_buffers = match (setup.strategy, lora) {
        // Then, during the layers' backward: the root and the head's gradient (held until the
        // embedding's backward, the last), a layer's unit in use with its gradients, the next
        // one's weights arriving and the reduced slices of two units waiting to be added
        // (measured with gradients detached as they are deposited: `Unit::deposit`). Under
        // checkpointing the peak is a recomputed layer's backward: in a step's first
        // micro-batch the reduced slices are the step's gradient slices (`gradients` counts
        // them), and the root's and this layer's are still to come. Without it the peak is
        // the root's backward, last, beside every activation and every slice.
        (Strategy::Fsdp(..), false) => {
            let in_use = loss_buffers + (dsz + 4) * layer_unit;
            let layer_slice = (4 * layer_unit).div_ceil(n);
            match first_micro_batch && setup.checkpointing {
                true => in_use.saturating_sub(layer_slice + (4 * root_unit).div_ceil(n)),
                false => in_use + 2 * layer_slice,
            }
        }
        // ZeRO-2's resident units: the weights are held; during a unit's backward its
        // gradients as the ops make them, then their flat copy being reduce-scattered (with
        // overlap_comm, the previous unit's still in flight), beside the head's gradient
        // (held until the embedding's backward, the last).
        (Strategy::Zero(ZeroStage::Two), false) => {
            let overlap = usize::from(setup.reduce_units.1);
            head_grad + (dsz + 4 + 4 * overlap) * layer_unit
        }
        // A frozen base: the root (embedding, head) gathered while the loss runs, a layer's
        // unit in use and the next one's weights arriving; no gradients but the adapters'.
        (Strategy::Fsdp(..), true) => dsz * (root_unit + 2 * layer_unit) + head_copy + 4 * p,
        (_, true) => head_grad + gsz * p - e.gradients.min(gsz * p),
        (_, false) => gsz * p - e.gradients.min(gsz * p),
    };
    // Under checkpointing each layer's kept input is freed once its backward ran
    // (`parallel::checkpointing`), while the gradients of the layers done so far grow: the
    // inputs of the layers to come and the gradients of those done share the memory the
    // counts above give each in full (the larger of the two, per layer but the last).
    if setup.checkpointing {
        let in_layers = |n: &str| n.contains(".layers.");
        let layer_trainable: usize = match &adapters {
            Some(a) => a
                .iter()
                .chain(&trained)
                .filter(|(n, _)| in_layers(n))
                .map(|(_, n)| n)
                .sum(),
            None => shapes
                .iter()
                .filter(|(n, _)| in_layers(n))
                .map(|(_, n)| n)
                .sum(),
        };
        // The gradients backward holds: as made (then reduced) but under ZeRO-3 / FSDP,
        // whose units reduce theirs to slices as they go.
        let held = match sharded || resident {
            true => e.gradients,
            false => e.gradients.max(gsz * p),
        };
        let per_layer_grads = held as f64 * layer_trainable as f64 / p.max(1) as f64 / layers;
        let per_layer_input = (checkpoint_elements(h) * tokens as f64) * dsz as f64;
        let shared = (layers - 1.0).max(0.0) * per_layer_grads.min(per_layer_input);
        e.activations = e.activations.saturating_sub(shared as usize);
    }
    let loss_buffers = match sharded && !lora {
        true => loss_buffers,
        false => e.step_buffers,
    };
    if whole_logits(model, setup) {
        // The loss's backward holds 6 fp32 copies (measured), beside the step buffers it
        // needs (`loss_buffers`) and, under checkpointing, no recomputed layer (`activations`
        // counts one). Then it frees all but what the forward graph holds until the backward
        // ends, beside each layer's backward and the step buffers: the logits add whichever
        // phase is larger. What stays is measured: 3 copies; with LoRA under checkpointing
        // about 0.6 of an adapter-free layer more (fitted: 0.3-0.85 across the bench's
        // shapes; not traced to its tensors).
        let copy = 4 * tokens * cfg.vocab_size / tp;
        let per_layer = |elements: f64| (elements * tokens as f64) as usize * dsz;
        let recomputed = if setup.checkpointing {
            per_layer(layer)
        } else {
            0
        };
        let kept = match setup.checkpointing && lora {
            true => 3 * copy + per_layer(0.6 * stack(false).0),
            false => 3 * copy,
        };
        let absent = match (sharded || resident) && first_micro_batch {
            true => e.gradients,
            false => 0,
        };
        let loss_phase = (6 * copy + loss_buffers).saturating_sub(recomputed + absent);
        e.logits = loss_phase.saturating_sub(e.step_buffers).max(kept);
        why.push(format!(
            "logits: 6 fp32 copies x {tokens} tokens x {} vocabulary entries in the loss's backward, or what the forward keeps beside the layers' backward: {}",
            cfg.vocab_size / tp,
            mib(e.logits)
        ));
    }
    // Of the step buffers, the unit arriving ahead of its use: whether its all-gather has
    // landed at the peak depends on timing.
    if sharded {
        e.prefetch = dsz * layer_unit;
    }
    // The update, beyond the gradients: AdamW runs in place (`optim`), so one process adds
    // one fp32 copy of the largest gradient. DDP over several ranks all-reduces the gradients
    // in buckets, every bucket flattened before the first is waited on: a flat copy of all
    // the gradients and, while a bucket is reduced, its result beside its flat (at most one
    // bucket's bytes; measured, 2 and 4 ranks); AdamW's copy comes after they are freed. ZeRO-1
    // (and ZeRO-2 over LoRA adapters) reduces a bucket at a time (reduce_bucket_size), then
    // all-gathers the weights; ZeRO-2's resident units reduced theirs during backward.
    let largest = shapes.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let bucket = match setup.reduce_units.0 {
        WrapPolicy::Buckets(b) => b,
        _ => super::DEEPSPEED_REDUCE_BUCKET,
    };
    e.update_buffers = match (setup.strategy, lora) {
        (Strategy::Ddp, false) if replicas > 1 => 4 * p + (4 * p).min(super::ddp::BUCKET_BYTES),
        (Strategy::Ddp, false) => 4 * largest,
        // A bucket flattened (and the host backend's copy of it) beside the reduced slices,
        // then the gathered weights (measured, 1-4 ranks).
        (Strategy::Zero(ZeroStage::One), false) => {
            let b = p.min(bucket);
            let host_copy = if setup.gpu { 0 } else { 4 * b };
            (4 * b + host_copy + (4 * p).div_ceil(n)).max(4 * p)
        }
        _ => 0,
    };
    // The tokenizer, the rows and the host backend's buffers (256 KiB, measured), and on the
    // CPU one GEMM packing buffer per compute thread (the training thread is one of them).
    let packing = match setup.gpu {
        true => 0,
        false => setup.threads * crate::kernels::cpu_gemm::packing_buffer_bytes(),
    };
    e.runtime = (1 << 18) + packing;
    if setup.strategy == Strategy::Zero(ZeroStage::Two) && !resident && n > 1 {
        e.comm_buffers = (4 * p).div_ceil(n);
    }
    why.push(format!(
        "step buffers: backward {}, update {}",
        mib(e.step_buffers),
        mib(e.update_buffers)
    ));
    // A full save streams one unit at a time: its gathered weights and state.
    e.save = 16 * largest_unit;
    e.explain = why;
    e
}

/// What a rank computes and communicates with: its sustained matmul rate and the bandwidth
/// of the links its groups use.
#[derive(Debug, Clone, Copy)]
pub struct Hardware {
    /// Sustained matmul rate of one rank in the compute dtype (FLOP/s).
    pub flops: f64,
    /// The share of a whole (unsplit) step's time its matmuls take; the rest (norms,
    /// element-wise ops, the optimizer) is not split by tensor parallelism. 1 where `flops`
    /// already folds it in (the GPU table's MFU).
    pub matmul_share: f64,
    /// Collectives within a machine.
    pub intra: LinkSpeed,
    /// Collectives across machines.
    pub inter: LinkSpeed,
    /// Processes per machine: a group larger than this crosses machines.
    pub per_machine: usize,
    /// Parameters per second one rank updates with its optimizer state in host memory
    /// (gradients copied down, AdamW on the host, weights copied back); infinite where the
    /// device is the host.
    pub offload_params_per_s: f64,
    /// Whether data-parallel collectives run beside compute (NCCL on its own stream) or take
    /// their time from it (the host backend copies and sums on the cores the ranks' compute
    /// threads already fill).
    pub comm_overlaps: bool,
    /// Seconds one rank spends per logit in a loss over whole logits, beyond the head's
    /// matmul ([`cpu_whole_logits_seconds`] on a CPU; 0 in the GPU table, where the step's
    /// MFU was measured and this cost is not yet).
    pub logit_seconds: f64,
    /// Seconds one rank spends per token and per input and output feature of each layer
    /// LoRA adapts (dropout, the rank-r products, the sums) beyond what the FLOP rule charges
    /// ([`cpu_step_rates`] on a CPU; 0 in the GPU table: not yet measured there).
    pub adapter_element_seconds: f64,
}

/// The unit of every CPU matmul rate here: 512-cube f32 matmuls on the calling thread.
struct Gemm512 {
    a: Vec<f32>,
    c: Vec<f32>,
}

impl Gemm512 {
    const N: usize = 512;

    fn new() -> Self {
        let mut gemm = Gemm512 {
            a: vec![1f32; Self::N * Self::N],
            c: vec![0f32; Self::N * Self::N],
        };
        gemm.run(); // the pages touched and the caches warm before anything is timed
        gemm
    }

    fn run(&mut self) {
        use crate::kernels::cpu_gemm::{mm, Mat};
        let n = Self::N;
        mm(
            (n, n, n),
            &mut self.c,
            n,
            Mat::rows(&self.a, n),
            Mat::rows(&self.a, n),
            1.0,
            false,
        )
    }

    /// FLOP/s over `window` (at least two products).
    fn rate(&mut self, window: std::time::Duration) -> f64 {
        let start = std::time::Instant::now();
        let mut runs = 0u32;
        while start.elapsed() < window || runs < 2 {
            self.run();
            runs += 1;
        }
        2.0 * (Self::N as f64).powi(3) * runs as f64 / start.elapsed().as_secs_f64()
    }
}

/// FLOP/s of one rank's f32 matmuls while `ranks` ranks of `threads` compute threads each fill
/// this machine, as a launch runs them: every thread multiplies 512-cube matrices on its own,
/// all at once, over seven windows of a tenth of a second; the median window's total, shared
/// by the ranks. Timed with every rank's threads busy, so shared cores, memory bandwidth and a
/// loaded machine's clock are in it, and the median leaves out a window another process took.
pub fn cpu_rank_matmul_flops(ranks: usize, threads: usize) -> f64 {
    use std::sync::Barrier;
    use std::time::Duration;
    const WINDOWS: usize = 7;
    let ranks = ranks.max(1);
    let workers = ranks * threads.max(1);
    let barrier = Barrier::new(workers);
    let per_worker: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut gemm = Gemm512::new();
                    (0..WINDOWS)
                        .map(|_| {
                            barrier.wait();
                            gemm.rate(Duration::from_millis(100))
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let mut totals: Vec<f64> = (0..WINDOWS)
        .map(|w| per_worker.iter().map(|rates| rates[w]).sum())
        .collect();
    totals.sort_by(f64::total_cmp);
    match totals.get(WINDOWS / 2) {
        Some(&total) if total > 0.0 => total / ranks as f64,
        _ => 1e9,
    }
}

/// Seconds per logit of the loss over whole logits (forward and backward, fp32: the
/// log-softmax's passes over [tokens, vocabulary] that the fused loss never makes) on this CPU
/// with the threads candle's kernels use in this process (the best of three runs over
/// 1024 x 4096 logits). Memory-bound, so not in the matmul rate.
pub fn cpu_whole_logits_seconds() -> f64 {
    use candle_core::{Device, Tensor, Var};
    let (rows, vocab) = (1024, 4096);
    let run = || -> candle_core::Result<f64> {
        let logits = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, vocab), &Device::Cpu)?)?;
        let targets = Tensor::arange(0i64, rows as i64, &Device::Cpu)?;
        let start = std::time::Instant::now();
        // What training runs on whole logits: the loss with TRL's token figures.
        let loss = crate::nn::loss::cross_entropy_sum(logits.as_tensor(), &targets)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        loss.sum.backward()?;
        Ok(start.elapsed().as_secs_f64() / (rows * vocab) as f64)
    };
    let _ = run();
    (0..3)
        .filter_map(|_| run().ok())
        .fold(f64::INFINITY, f64::min)
        .min(1e-6)
}

/// How fast a link moves a collective: a fixed cost per collective and the bus bandwidth
/// beyond it (the time of an all-reduce of `b` bytes over `n` ranks is
/// `latency + 2 (n - 1) / n * b / bandwidth`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpeed {
    /// Seconds per collective, whatever its size.
    pub latency: f64,
    /// Bus bytes per second.
    pub bandwidth: f64,
}

impl LinkSpeed {
    /// Seconds of `count` collectives moving `bus_bytes` in all.
    pub fn seconds(&self, count: f64, bus_bytes: f64) -> f64 {
        count * self.latency + bus_bytes / self.bandwidth
    }
}

/// The host backend's all-reduce between `ranks` threads of this process, over the
/// shared-memory rings same-machine ranks use: timed at 64 KiB and 16 MiB of f32 (the best of
/// five after a warm-up, by the slowest rank), the latency and bandwidth that fit both.
pub fn host_all_reduce_speed(ranks: usize) -> Result<LinkSpeed> {
    use crate::comm::host::HostBackend;
    use crate::comm::store::{Store, StoreServer};
    use crate::comm::ReduceOp;
    use std::time::{Duration, Instant};
    let ranks = ranks.max(2);
    let sizes = [64usize << 10, 16 << 20];
    let token = "trl-bandwidth";
    let timeout = Duration::from_secs(30);
    let server = StoreServer::bind("127.0.0.1:0", token)?;
    let addr = server.addr().to_string();
    let per_rank = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let addr = &addr;
                s.spawn(move || -> Result<Vec<f64>> {
                    let store = std::sync::Arc::new(Store::connect(addr, token, timeout)?);
                    let host = HostBackend::new(store, token, rank, timeout);
                    let all: Vec<usize> = (0..ranks).collect();
                    let comm = host.group("bandwidth", &all)?;
                    let mut times = Vec::new();
                    for bytes in sizes {
                        let x = candle_core::Tensor::ones(bytes / 4, DType::F32, &Device::Cpu)?;
                        comm.all_reduce(&x, ReduceOp::Sum)?;
                        let mut best = f64::MAX;
                        for _ in 0..5 {
                            let start = Instant::now();
                            comm.all_reduce(&x, ReduceOp::Sum)?;
                            best = best.min(start.elapsed().as_secs_f64());
                        }
                        times.push(best);
                    }
                    Ok(times)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect::<Result<Vec<Vec<f64>>>>()
    })?;
    let slowest = |i: usize| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max);
    let (small, large) = (slowest(0), slowest(1));
    let n = ranks as f64;
    let bus = |bytes: usize| 2.0 * (n - 1.0) / n * bytes as f64;
    let bandwidth = (bus(sizes[1]) - bus(sizes[0])) / (large - small).max(1e-9);
    let latency = (small - bus(sizes[0]) / bandwidth).max(0.0);
    Ok(LinkSpeed { latency, bandwidth })
}

/// What a CPU training process holds before its model and rings (binary, libraries,
/// runtime: the tiny model's workers read ~13 MiB of RssFile and ~10 MiB of RssAnon there).
/// The trainer measures its own instead; `cargo trl plan` adds this.
pub const CPU_PROCESS_RSS: usize = 24 << 20;

/// Bytes of the host backend's shared-memory rings a CPU rank has touched once training has
/// gone round them (`comm::shared_memory_bytes` counts them in a run): two rings per group
/// it talks over with ranks of its own machine (to the next rank and from the one before,
/// for ring collectives), 2 (n - 1) for Ulysses' all-to-all over n. The groups: the
/// data-parallel one (every rank sharing the gradients: replicas, shards, cp and sp ranks;
/// split in two for HSDP), and tp, cp and sp each on their own.
pub fn cpu_ring_bytes(dims: ParallelDims, per_machine: usize) -> usize {
    let ring = 2 * crate::comm::host::SHM_RING_BYTES;
    if per_machine < 2 {
        return 0;
    }
    let shard = dims.dp_shard * dims.cp * dims.sp;
    let data_parallel = match (dims.dp_replicate > 1, shard > 1) {
        (true, true) => 2,
        (false, false) => 0,
        _ => 1,
    };
    let ring_groups = data_parallel + (dims.tp > 1) as usize + (dims.cp > 1) as usize;
    let ulysses_peers = dims.sp.min(per_machine).saturating_sub(1);
    (ring_groups + ulysses_peers) * ring
}

/// Threads candle's CPU kernels use in this process (RAYON_NUM_THREADS, else the cores).
pub fn cpu_threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// How fast a CPU rank trains, as a launch runs `ranks` ranks of `threads` compute threads
/// each: its matmul rate and the share of a step its matmuls take.
#[derive(Debug, Clone, Copy)]
pub struct CpuStepRates {
    /// FLOP/s of the rank's 512-cube f32 matmuls (every thread multiplying on its own).
    pub rank_flops: f64,
    /// Of a step's time, the share its matmuls take at `rank_flops`. The rest (norms,
    /// rotary, softmax, the optimizer, copies) is memory-bound, and machines differ in how
    /// fast it runs beside their matmuls: `bench model` read 0.77-0.84 of the matmul rate on
    /// earlier machines and 0.56 on one with AVX-512, so this is measured, not a constant.
    pub matmul_share: f64,
    /// Seconds per token and per adapted feature that LoRA adds beyond its FLOPs
    /// ([`Hardware::adapter_element_seconds`]).
    pub adapter_element_seconds: f64,
}

impl CpuStepRates {
    /// Each figure's mean over `all` (one or more timings).
    pub fn mean(all: &[CpuStepRates]) -> CpuStepRates {
        let mean = |f: fn(&CpuStepRates) -> f64| all.iter().map(f).sum::<f64>() / all.len() as f64;
        CpuStepRates {
            rank_flops: mean(|r| r.rank_flops),
            matmul_share: mean(|r| r.matmul_share),
            adapter_element_seconds: mean(|r| r.adapter_element_seconds),
        }
    }
}

/// [`CpuStepRates`] timed on this machine: forward and backward of a 2-layer model of the
/// built-in layers (hidden 256, intermediate 768, vocab 4096, 2 x 512 tokens, the fused loss),
/// its matmul FLOPs as [`step_time`] counts them, in five rounds of a step beside a tenth of
/// a second of 512-cube matmuls on every thread; the medians. The rate and the share come
/// from the same rounds, so their product (what a prediction divides by) is the step's own
/// speed: a shared machine's rate moves by a quarter within seconds, and a rate timed apart
/// from the share carried that into every prediction. Without a probe (it cannot run, or a
/// debug build: the tests' `cargo trl`, whose dependencies keep their debug assertions, so
/// not the release program a launch runs) the share is 0.75 beside [`cpu_rank_matmul_flops`].
pub fn cpu_step_rates(ranks: usize, threads: usize) -> CpuStepRates {
    const FALLBACK: f64 = 0.75;
    // LoRA's extra per adapted feature, in FLOPs at the matmul rate: ~400 measured here
    // (r 16, dropout 0.05, one thread).
    const FALLBACK_ADAPTER_FLOPS: f64 = 400.0;
    let fallback = || {
        let rank_flops = cpu_rank_matmul_flops(ranks, threads);
        CpuStepRates {
            rank_flops,
            matmul_share: FALLBACK,
            adapter_element_seconds: FALLBACK_ADAPTER_FLOPS / rank_flops,
        }
    };
    if cfg!(debug_assertions) {
        return fallback();
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Every rank runs the probe at once, each on a pool of its threads: the memory-bound
    // part slows when ranks share the machine's bandwidth. More ranks than cores (one thread
    // each) only take turns: as many probes as cores show the same share.
    let probed: Vec<CpuStepRates> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks.clamp(1, cores))
            .map(|_| {
                s.spawn(|| {
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(threads.max(1))
                        .build()
                        .map_err(|e| crate::Error::from(candle_core::Error::Msg(e.to_string())))
                        .and_then(|pool| pool.install(step_speed_probe))
                        .inspect_err(|e| {
                            tracing::warn!("cannot time a training step's speed ({e}); taking a matmul share of {FALLBACK}")
                        })
                        .ok()
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok().flatten())
            .collect()
    });
    if probed.is_empty() {
        return fallback();
    }
    let mean = CpuStepRates::mean(&probed);
    CpuStepRates {
        matmul_share: mean.matmul_share.clamp(0.2, 1.0),
        adapter_element_seconds: mean.adapter_element_seconds.max(0.0),
        ..mean
    }
}

/// One rank's [`cpu_step_rates`] on the current thread pool: each round times the pool's
/// matmuls, a step of the probe model and a step of it with LoRA (r 16, alpha 32, dropout
/// 0.05 on every linear layer, TRL's recipe).
fn step_speed_probe() -> Result<CpuStepRates> {
    use crate::models::Params;
    use crate::nn::lora::{with_dropout, Targets};
    use candle_core::Tensor;
    use std::time::Instant;
    let (batch, seq) = (2, 512);
    let json = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": seq, "rope_theta": 1000000.0, "tie_word_embeddings": true,
    })
    .to_string();
    let lora = LoraConfig::new(16, 32.0, 0.05, Targets::AllLinear);
    let source = "the step-speed probe";
    let cfg = ModelConfig::from_json(&json, source)?;
    let shapes = ModelShapes::of_json(&json, source)?;
    let tokens = (batch * seq) as f64;
    let adapters: usize = shapes.adapters(&lora, 1).iter().map(|(_, n)| *n).sum();
    let flops = shapes.matmul_flops_per_token(seq, false, 0) * tokens;
    let lora_flops = shapes.matmul_flops_per_token(seq, false, adapters) * tokens;
    let adapted_features = shapes.adapted_features(&lora, 1) * tokens;
    let new_model = || {
        super::CausalLm::new(
            cfg.clone(),
            Params::init(&cfg, 0, DType::F32, &Device::Cpu)?,
        )
    };
    let model = new_model()?;
    let mut lora_model = new_model()?;
    lora_model.add_adapters(&lora)?;
    let ids: Vec<u32> = (0..batch * seq)
        .map(|i| (i * 7919 % cfg.vocab_size) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (batch, seq), &Device::Cpu)?;
    let pos = Tensor::arange(0i64, seq as i64, &Device::Cpu)?
        .unsqueeze(0)?
        .repeat((batch, 1))?;
    let labels = ids.to_dtype(DType::I64)?;
    let step = |model: &super::CausalLm| -> Result<f64> {
        let start = Instant::now();
        with_dropout(7, || model.forward_loss(&ids, &pos, &labels))?
            .mean()?
            .backward()?;
        Ok(start.elapsed().as_secs_f64())
    };
    // The rank's rate as `cpu_rank_matmul_flops` takes it: every thread of the pool
    // multiplying on its own.
    let matmul = || -> f64 {
        rayon::broadcast(|_| Gemm512::new().rate(std::time::Duration::from_millis(100)))
            .iter()
            .sum()
    };
    step(&model)?;
    step(&lora_model)?;
    let (mut rates, mut shares, mut extra) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let rate = matmul();
        let (full, adapted) = (step(&model)?, step(&lora_model)?);
        shares.push(flops / rate / full);
        extra.push((adapted - full - (lora_flops - flops) / rate) / adapted_features);
        rates.push(rate);
    }
    Ok(CpuStepRates {
        rank_flops: median(&mut rates),
        matmul_share: median(&mut shares),
        adapter_element_seconds: median(&mut extra),
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Hardware {
    /// CPU ranks training at `rates` ([`cpu_step_rates`]), `per_machine` on a machine, the
    /// host backend's collectives between them at `link` (as [`host_all_reduce_speed`]
    /// measures it; across machines taken as the same), `logit_seconds` per logit of a
    /// whole-logits loss on a rank (the machine's [`cpu_whole_logits_seconds`] times the
    /// ranks sharing its memory).
    pub fn cpu(
        rates: CpuStepRates,
        per_machine: usize,
        link: LinkSpeed,
        logit_seconds: f64,
    ) -> Self {
        Hardware {
            flops: rates.rank_flops,
            logit_seconds,
            matmul_share: rates.matmul_share,
            adapter_element_seconds: rates.adapter_element_seconds,
            intra: link,
            inter: link,
            per_machine,
            offload_params_per_s: f64::INFINITY,
            comm_overlaps: false,
        }
    }
}

/// Whether the loss runs over whole logits: where the fused loss cannot, the head split (tp),
/// or off the one-pass kernel (bf16 on the CPU) a sharded head (ZeRO-3 / FSDP) or
/// soft-capped logits.
fn whole_logits(model: &ModelShapes, setup: &Setup) -> bool {
    let sharded = unit_ops(setup);
    let one_pass = crate::nn::tiled_loss::one_pass_dtype(setup.dtype, setup.gpu);
    setup.dims.tp > 1 || (!one_pass && (sharded || model.logits_loss))
}

/// Seconds of one optimizer step (one micro-batch per rank), by where they go.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTime {
    pub compute: f64,
    /// Data-parallel reductions and gathers (where they overlap compute, only what exceeds
    /// it counts).
    pub data_parallel: f64,
    /// Tensor- and sequence-parallel collectives, on the critical path.
    pub model_parallel: f64,
    /// Tokens of the whole job per second.
    pub tokens_per_second: f64,
}

/// The step time of `setup` on `hw`: 6 FLOP per parameter per token (8 with checkpointing's
/// second forward) plus causal attention's 6 s q per layer, at the rank's rate; ring
/// all-reduce volumes 2 (n-1)/n of the buffer, gathers and reduce-scatters (n-1)/n;
/// data-parallel time hidden behind compute or added to it ([`Hardware::comm_overlaps`]).
pub fn step_time(model: &ModelShapes, setup: &Setup, hw: &Hardware) -> StepTime {
    let cfg = &model.dims;
    let d = setup.dims;
    let world = d.dp_replicate * d.dp_shard * d.cp * d.sp * d.tp;
    let dsz = setup.dtype.size_in_bytes() as f64;
    let seq = setup.seq as f64;
    // LoRA: ~10% more on the reference shape at r 16, every linear layer.
    let adapters = setup.lora.as_ref().map_or(0, |l| {
        model.adapters(l, 1).iter().map(|(_, n)| *n).sum::<usize>()
    });
    let flops_per_token = model.matmul_flops_per_token(setup.seq, setup.checkpointing, adapters);
    let dp = (d.dp_replicate * d.dp_shard) as f64;
    let tokens = dp * setup.batch as f64 * seq;
    // The matmuls split over every rank; the rest over all ranks but, for its passes over
    // the whole hidden state, the tp ranks.
    let matmuls = tokens * flops_per_token / world as f64 / hw.flops;
    let tp = d.tp as f64;
    let replicated = cfg.replicated_elementwise_share();
    let mut compute =
        matmuls * (1.0 + (1.0 / hw.matmul_share - 1.0) * (replicated * tp + 1.0 - replicated));
    // A loss over whole logits: the log-softmax's passes over this rank's tokens and
    // vocabulary entries (memory-bound, beside the matmuls).
    let rank_tokens = setup.batch as f64 * seq / (d.cp * d.sp) as f64;
    // LoRA's dropout, rank-r products and sums, per input and output feature of each adapted
    // layer (this rank's part of it under tp).
    if let Some(l) = &setup.lora {
        compute += rank_tokens * model.adapted_features(l, d.tp) * hw.adapter_element_seconds;
    }
    if whole_logits(model, setup) {
        compute += rank_tokens * (cfg.vocab_size / d.tp) as f64 * hw.logit_seconds;
    }

    let link = |group: usize, span: usize| match group * span > hw.per_machine {
        true => hw.inter,
        false => hw.intra,
    };
    let ring = |n: usize| (n as f64 - 1.0) / n as f64;
    let trainable = match &setup.lora {
        Some(l) => model.adapters(l, d.tp).iter().map(|(_, n)| *n).sum(),
        None => model.local(d.tp).iter().map(|(_, n)| *n).sum::<usize>(),
    } as f64;
    let n_shard = d.dp_shard * d.cp * d.sp;
    let inner = d.tp * d.cp * d.sp;
    let shard = link(n_shard, d.tp);
    // Data-parallel traffic is a few large buckets: its bandwidth term.
    let mut dp_seconds = match setup.strategy {
        Strategy::Ddp => link(n_shard * d.dp_replicate, d.tp)
            .seconds(1.0, 2.0 * ring(n_shard * d.dp_replicate) * 4.0 * trainable),
        Strategy::Zero(_) => shard.seconds(1.0, ring(n_shard) * (4.0 + dsz) * trainable),
        // Gathered for forward and again for backward; gradients reduce-scattered.
        Strategy::Fsdp(..) => {
            let base = model.local(d.tp).iter().map(|(_, n)| *n).sum::<usize>() as f64;
            shard.seconds(1.0, ring(n_shard) * (2.0 * dsz * base + 4.0 * trainable))
        }
    };
    if d.dp_replicate > 1 && !matches!(setup.strategy, Strategy::Ddp) {
        // HSDP: the slices are all-reduced across the replicas.
        dp_seconds += link(d.dp_replicate, inner * d.dp_shard).seconds(
            1.0,
            2.0 * ring(d.dp_replicate) * 4.0 * trainable / n_shard as f64,
        );
    }
    // Per layer: tp all-reduces the attention and MLP outputs (2 forward, 2 backward, 2 more
    // recomputed); Ulysses all-to-alls q, k, v and the output both ways; the ring passes k and
    // v around (cp - 1 hops forward, twice that backward).
    let q = (cfg.num_attention_heads * cfg.head_dim()) as f64;
    let kv = (cfg.num_kv_heads() * cfg.head_dim()) as f64;
    let layers = cfg.num_hidden_layers as f64;
    let h = cfg.hidden_size as f64;
    let recompute = if setup.checkpointing { 1.5 } else { 1.0 };
    // Each is on the critical path: a latency per collective plus its bytes.
    let mut mp = 0.0;
    if d.tp > 1 {
        let count = layers * 4.0 * recompute;
        let bytes = count * 2.0 * ring(d.tp) * rank_tokens * h * dsz;
        mp += link(d.tp, 1).seconds(count, bytes);
    }
    if d.sp > 1 {
        // q, k, v and the output, forward and backward.
        let count = layers * 2.0 * recompute * 4.0;
        let volume = rank_tokens * (q + 2.0 * kv + q) / d.tp as f64 * dsz;
        let bytes = layers * 2.0 * recompute * ring(d.sp) * volume;
        mp += link(d.sp, d.tp).seconds(count, bytes);
    }
    if d.cp > 1 {
        let count = layers * 3.0 * recompute * (d.cp as f64 - 1.0);
        let volume = rank_tokens * 2.0 * kv / d.tp as f64 * dsz;
        mp += link(d.cp, d.tp).seconds(count, count * volume);
    }
    // An offloaded update runs after backward, on this rank's slice of the trainable state.
    let offload = match setup.offload_optimizer {
        true => trainable / n_shard as f64 / hw.offload_params_per_s,
        false => 0.0,
    };
    let busy = match hw.comm_overlaps {
        true => compute.max(dp_seconds),
        false => compute + dp_seconds,
    };
    let seconds = busy + mp + offload;
    StepTime {
        compute,
        data_parallel: dp_seconds,
        model_parallel: mp,
        tokens_per_second: tokens / seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 GFLOP/s, three quarters of a step in matmuls, no LoRA overhead.
    fn test_rates() -> CpuStepRates {
        CpuStepRates {
            rank_flops: 1e9,
            matmul_share: 0.75,
            adapter_element_seconds: 0.0,
        }
    }

    /// Two CPU ranks at [`test_rates`] on a machine whose collectives cost nothing, a loss over
    /// whole logits costing `logit_seconds` per logit: compute alone.
    fn compute_only_cpu(logit_seconds: f64) -> Hardware {
        let free = LinkSpeed {
            latency: 0.0,
            bandwidth: f64::INFINITY,
        };
        Hardware::cpu(test_rates(), 2, free, logit_seconds)
    }

    /// An fp32 CPU setup of `strategy` over `(dp_shard, tp)`: one 64-token row, one
    /// micro-batch, no checkpointing; tests change what they look at.
    fn cpu_setup(strategy: Strategy, (dp_shard, tp): (usize, usize)) -> Setup {
        let dims = ParallelDims {
            dp_replicate: 1,
            dp_shard,
            cp: 1,
            sp: 1,
            tp,
        };
        Setup::new(strategy, dims, 1, 64)
    }

    fn assets(path: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../assets")
            .join(path)
    }

    /// DDP's gradients: fp32 sums, but in the compute dtype on one GPU replica with one
    /// micro-batch per step (what `Core::accumulate` keeps), bf16 here.
    #[test]
    fn ddp_gradients_stay_in_the_compute_dtype_on_one_gpu_with_one_micro_batch() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        let p = m.num_parameters();
        let gradients = |dp: usize, micro_batches: usize, gpu: bool| {
            let setup = Setup {
                dtype: DType::BF16,
                micro_batches,
                gpu,
                ..cpu_setup(Strategy::Ddp, (dp, 1))
            };
            estimate(&m, &setup).gradients
        };
        assert_eq!(gradients(1, 1, true), 2 * p);
        assert_eq!(
            gradients(1, 2, true),
            4 * p,
            "micro-batches are summed in fp32"
        );
        assert_eq!(gradients(2, 1, true), 4 * p, "an all-reduce sums in fp32");
        assert_eq!(gradients(1, 1, false), 4 * p, "the CPU sums in fp32");
    }

    /// The shapes come from the model's own skeleton, which allocates nothing: Llama 3.1 70B's
    /// 70,553,706,496 parameters (transformers' count) are read in a test process.
    /// Llama-3.1-8B in bf16 on 8 GPUs against DeepSpeed 0.19.6's estimators, with P =
    /// 8,030,261,248 parameters and L = 525,336,576 in DeepSpeed's largest layer (the
    /// embedding): `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/
    /// stage_1_and_2.py) 2P + 18P/N, or 2P with cpu_offload; `estimate_zero3_model_states_
    /// mem_needs` (stage3.py) 4L + 18P/N, 4L + 2P/N with cpu_offload, 4L with cpu_offload_params
    /// too (FSDP's offload_params moves both). DeepSpeed counts the layer in use (its 16-bit
    /// weights and gradients, 4L) as model state, where the plan counts gathered units among
    /// the step's buffers: the comparison adds the same 4L to ours.
    #[test]
    fn model_state_is_what_deepspeeds_estimators_say() {
        let m = ModelShapes::from_file(assets("configs/llama-3.1-8b.json")).unwrap();
        let p = m.num_parameters() as f64;
        assert_eq!(p, 8_030_261_248.0);
        let (l, n) = (525_336_576.0, 8.0);
        let dims = ParallelDims {
            dp_shard: 8,
            ..ParallelDims::single()
        };
        let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
        let zero2 = Strategy::Zero(ZeroStage::Two);
        for (name, strategy, offload, offload_params, deepspeed) in [
            ("zero2", zero2, false, false, 2.0 * p + 18.0 * p / n),
            ("zero2+off", zero2, true, false, 2.0 * p),
            ("zero3", zero3, false, false, 4.0 * l + 18.0 * p / n),
            ("zero3+off", zero3, true, false, 4.0 * l + 2.0 * p / n),
            ("zero3+offp", zero3, true, true, 4.0 * l),
        ] {
            let setup = Setup {
                dtype: DType::BF16,
                gpu: true,
                checkpointing: true,
                offload_optimizer: offload,
                offload_params,
                ..Setup::new(strategy, dims, 1, 4096)
            };
            let e = estimate(&m, &setup);
            let layer = if name.starts_with("zero3") {
                4.0 * l
            } else {
                0.0
            };
            let ours = e.model_state() as f64 + layer;
            let ratio = ours / deepspeed;
            assert!(
                (ratio - 1.0).abs() < 0.10,
                "{name}: {ours:.3e} bytes per rank, DeepSpeed {deepspeed:.3e} ({ratio:.3})"
            );
            // What leaves the device is in host memory.
            if offload {
                assert!(e.host_optimizer > 0 && e.host_gradients > 0, "{name}");
            }
            assert_eq!(e.host_parameters > 0, offload_params, "{name}");
        }
    }

    #[test]
    fn a_70b_skeleton_is_counted_without_its_weights() {
        let m = ModelShapes::from_file(assets("configs/llama-3.1-70b.json")).unwrap();
        assert_eq!(m.num_parameters(), 70_553_706_496);
        assert!(!m.tied && m.moe.is_none());
        assert!(m.splits_over(8, 1) && !m.splits_over(3, 1));
    }

    /// The host backend's collectives are measured, not assumed: a latency and a bandwidth
    /// that a 2-rank all-reduce between threads of this process gives.
    #[test]
    fn the_host_link_is_measured() {
        let link = host_all_reduce_speed(2).unwrap();
        assert!(
            link.bandwidth.is_finite() && link.bandwidth > 1e6,
            "{link:?}"
        );
        assert!(link.latency >= 0.0 && link.latency < 1.0, "{link:?}");
    }

    /// Under tensor parallelism a rank halves its matmuls and its passes over heads and MLP
    /// features but makes those over the whole hidden state in full; LoRA adds its measured
    /// cost per token and adapted feature (this rank's part of each layer under tp).
    #[test]
    fn tp_splits_what_follows_the_heads_and_lora_adds_its_measured_cost() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        let mut hw = compute_only_cpu(0.0);
        let one = step_time(&m, &cpu_setup(Strategy::Ddp, (1, 1)), &hw).compute;
        let two = step_time(&m, &cpu_setup(Strategy::Ddp, (1, 2)), &hw).compute;
        let r = m.dims.replicated_elementwise_share();
        assert!(r > 0.1 && r < 0.9, "{r}");
        // Matmuls are 3/4 of the unsplit step (`test_rates`).
        let want = one * (0.75 / 2.0 + 0.25 * (r + (1.0 - r) / 2.0));
        assert!((two - want).abs() < 1e-9 * want, "{two} vs {want}");

        let lora = LoraConfig::new(8, 16.0, 0.05, crate::nn::lora::Targets::AllLinear);
        for tp in [1, 2] {
            let setup = Setup {
                lora: Some(lora.clone()),
                ..cpu_setup(Strategy::Ddp, (1, tp))
            };
            hw.adapter_element_seconds = 0.0;
            let without = step_time(&m, &setup, &hw).compute;
            hw.adapter_element_seconds = 1e-9;
            let with = step_time(&m, &setup, &hw).compute;
            // q, k, v, o, gate, up and down of every layer, in and out: the column-split
            // ones' outputs and the row-split ones' inputs a 1/tp each.
            let c = &m.dims;
            let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
            let q = (c.num_attention_heads * c.head_dim()) as f64;
            let kv = (c.num_kv_heads() * c.head_dim()) as f64;
            let features =
                c.num_hidden_layers as f64 * (7.0 * h + (2.0 * q + 2.0 * kv + 3.0 * i) / tp as f64);
            let added = 64.0 * features * 1e-9;
            assert!(((with - without) - added).abs() < 1e-9 * added, "tp {tp}");
        }
    }

    /// On CPU the host backend's collectives take their time from compute (the ranks'
    /// threads fill the cores); on GPUs NCCL's run beside it and only what exceeds it counts.
    #[test]
    fn cpu_collectives_add_to_the_step_and_gpu_ones_overlap() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        let setup = cpu_setup(Strategy::fsdp(WrapPolicy::PerLayer), (2, 1));
        let link = LinkSpeed {
            latency: 1e-3,
            bandwidth: 1e8,
        };
        let mut hw = Hardware::cpu(test_rates(), 2, link, 0.0);
        let cpu = step_time(&m, &setup, &hw);
        assert!(cpu.data_parallel > 0.0 && cpu.model_parallel == 0.0);
        let tokens = 2.0 * 64.0;
        let added = tokens / (cpu.compute + cpu.data_parallel);
        assert!(
            (cpu.tokens_per_second - added).abs() < 1e-9 * added,
            "{cpu:?}"
        );
        hw.comm_overlaps = true;
        let gpu = step_time(&m, &setup, &hw);
        let hidden = tokens / gpu.compute.max(gpu.data_parallel);
        assert!(
            (gpu.tokens_per_second - hidden).abs() < 1e-9 * hidden,
            "{gpu:?}"
        );
    }

    /// The rings a CPU rank touches, as the profiles' workers measured them (RssShmem of
    /// /proc/PID/status after `cargo trl launch --profile P sft` on the tiny model): 16.5 MiB
    /// on multi_cpu's 2 ranks, 33 MiB on fsdp2_tp_cpu's 4 (dp_shard 2 x tp 2), and
    /// context_parallel_cpu (cp 2) and alst_ulysses_cpu (dp_shard 2 x sp 2) as much as
    /// fsdp2_tp_cpu; nothing on one process or with ranks on other machines only.
    #[test]
    fn rings_of_the_groups_a_rank_talks_over() {
        let mib = |dims: ParallelDims, per_machine| cpu_ring_bytes(dims, per_machine) >> 20;
        let dims = |dp_replicate, dp_shard, cp, sp, tp| ParallelDims {
            dp_replicate,
            dp_shard,
            cp,
            sp,
            tp,
        };
        assert_eq!(mib(dims(1, 1, 1, 1, 1), 1), 0);
        assert_eq!(mib(dims(2, 1, 1, 1, 1), 2), 16);
        assert_eq!(mib(dims(1, 2, 1, 1, 1), 2), 16);
        assert_eq!(mib(dims(1, 2, 1, 1, 2), 4), 32);
        assert_eq!(mib(dims(1, 1, 2, 1, 1), 2), 32);
        assert_eq!(mib(dims(1, 2, 1, 2, 1), 4), 32);
        // HSDP: the shard group and the replica group.
        assert_eq!(mib(dims(2, 2, 1, 1, 1), 4), 32);
        // One process per machine: every peer is over TCP.
        assert_eq!(mib(dims(4, 1, 1, 1, 1), 1), 0);
    }

    /// A loss over whole logits (tp) costs its per-logit time beside the matmuls, each rank
    /// over its tokens and its share of the vocabulary; the fused loss (a whole head under
    /// DDP, or gathered under ZeRO-3 / FSDP) costs none.
    #[test]
    fn whole_logits_add_their_passes_to_the_step() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        let compute = |strategy, split, logit_seconds| {
            let setup = cpu_setup(strategy, split);
            step_time(&m, &setup, &compute_only_cpu(logit_seconds)).compute
        };
        let vocab = m.dims.vocab_size as f64;
        let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
        assert_eq!(compute(zero3, (2, 1), 1e-9), compute(zero3, (2, 1), 0.0));
        let added = compute(Strategy::Ddp, (1, 2), 1e-9) - compute(Strategy::Ddp, (1, 2), 0.0);
        assert!((added - 64.0 * vocab / 2.0 * 1e-9).abs() < 1e-12, "{added}");
        assert_eq!(
            compute(Strategy::Ddp, (2, 1), 1e-9),
            compute(Strategy::Ddp, (2, 1), 0.0)
        );
    }

    /// ZeRO-3's gradient slices are taken by each update: in a step's first micro-batch none
    /// exists while a whole-logits loss (the head split by tp) runs its backward, in later
    /// ones all do.
    #[test]
    fn accumulating_gradients_keeps_the_slices_through_the_loss() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        let mut setup = cpu_setup(Strategy::fsdp(WrapPolicy::PerLayer), (2, 2));
        setup.batch = 4;
        setup.seq = 256;
        let one = estimate(&m, &setup);
        setup.micro_batches = 4;
        let four = estimate(&m, &setup);
        assert_eq!(one.model_state(), four.model_state());
        let more = four.peak() - one.peak();
        assert!(
            more > 0 && more <= one.gradients,
            "{more} vs {}",
            one.gradients
        );
    }

    /// TR-DPO's reference is a copy of the weights each rank holds: whole under DDP, its
    /// slices under ZeRO-3, in the peak but not the model state.
    #[test]
    fn a_reference_copy_adds_the_held_weights() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        for (strategy, shard) in [
            (Strategy::Ddp, 1),
            (Strategy::fsdp(WrapPolicy::PerLayer), 2),
        ] {
            let mut setup = cpu_setup(strategy, (shard, 1));
            setup.batch = 2;
            let without = estimate(&m, &setup);
            setup.reference_copy = true;
            let with = estimate(&m, &setup);
            assert_eq!(with.reference, without.parameters);
            assert_eq!(with.peak() - without.peak(), without.parameters);
            assert_eq!(with.model_state(), without.model_state());
        }
    }

    /// Every tensor-parallel collective of a step pays the link's latency: 4 per layer
    /// (2 forward, 2 backward), 6 with checkpointing's recompute.
    #[test]
    fn each_tp_collective_pays_the_latency() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        let layers = m.dims.num_hidden_layers as f64;
        for (checkpointing, per_layer) in [(false, 4.0), (true, 6.0)] {
            let setup = Setup {
                checkpointing,
                ..cpu_setup(Strategy::Ddp, (1, 2))
            };
            let at = |latency: f64| {
                let link = LinkSpeed {
                    latency,
                    bandwidth: 1e9,
                };
                step_time(&m, &setup, &Hardware::cpu(test_rates(), 2, link, 0.0)).model_parallel
            };
            let extra = at(1e-3) - at(0.0);
            assert!(
                (extra - layers * per_layer * 1e-3).abs() < 1e-12,
                "checkpointing {checkpointing}: {extra} s"
            );
        }
    }

    /// Causal attention's FLOPs per token and layer: a query scores s / 2 keys on average,
    /// 2 FLOPs per key and feature in Q K^T and in P V, times 3 for forward and backward (4
    /// with checkpointing's second forward): 6 s q (8 s q), what `bench train`'s MFU and so
    /// the GPU table's rate count.
    #[test]
    fn attention_flops_are_the_causal_count() {
        let m = ModelShapes::from_file(assets("tiny/model/config.json")).unwrap();
        let q = (m.dims.num_attention_heads * m.dims.head_dim()) as f64;
        let layers = m.dims.num_hidden_layers as f64;
        for (checkpointing, passes) in [(false, 6.0), (true, 8.0)] {
            let seq = 1000;
            let attention = m.matmul_flops_per_token(seq, checkpointing, 0)
                - m.matmul_flops_per_token(0, checkpointing, 0);
            let causal = passes * layers * seq as f64 * q;
            assert!(
                (attention - causal).abs() < 1e-6 * causal,
                "{attention} vs {causal}"
            );
        }
    }

    /// A mixture of experts: every expert counted in the model state, only `top_k` of them in
    /// a token's compute; each expert's MLP split over tp like a dense one, the router whole.
    #[test]
    fn experts_are_parameters_and_top_k_of_them_compute() {
        let m = ModelShapes::from_file(assets("tiny-qwen3-moe/model/config.json")).unwrap();
        let (experts, top_k, inter, sparse) = m.moe.unwrap();
        let expert_params = sparse * experts * 3 * inter * m.dims.hidden_size;
        let total = m.num_parameters() as f64;
        let expected = total - expert_params as f64 * (1.0 - top_k as f64 / experts as f64);
        assert!((m.active_parameters - expected).abs() < 1e-6);
        let local: usize = m.local(2).iter().map(|(_, n)| n).sum();
        let router = m
            .local(2)
            .into_iter()
            .find(|(n, _)| n.ends_with("mlp.gate.weight"))
            .unwrap();
        assert_eq!(
            router.1,
            experts * m.dims.hidden_size,
            "the router stays whole"
        );
        assert!(local < m.num_parameters());
    }
}
