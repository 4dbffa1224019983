//! The Llama / Qwen2 decoder: token embedding, N x (RMSNorm -> attention with rotary
//! embeddings and grouped-query heads -> residual, RMSNorm -> SwiGLU MLP -> residual), final
//! RMSNorm, LM head (tied to the embedding or not). Logits for every position.
//!
//! The model is annotated for tensor parallelism like any user model (`#[derive(Parallelize)]`):
//! q/k/v and gate/up are column-parallel, o and down row-parallel, the embedding and the LM
//! head vocab-parallel (logits stay split over the vocabulary; [`CausalLm::loss`] never gathers
//! them), and head counts are divided by the tp size.

use super::config::ModelConfig;
use super::params::{Params, WeightFiles};
use crate::comm::autograd::{copy_to_group, reduce_from_group};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nn::fused::rotary as apply_rotary;
use crate::nn::loss::{cross_entropy_sum, shift_labels};
use crate::nn::seq_attention::{SeqAttention, SeqSplit};
use crate::nn::tiled_mlp::tiled_swiglu;
use crate::nn::{tiled_linear_cross_entropy, LossSum};
use crate::nn::{AttentionImpl, Embedding, Linear, RmsNorm, RotaryEmbedding, Weight};
use crate::parallel::checkpointing::{Checkpointing, Layers};
use crate::parallel::fsdp::{shard_model, shard_model_reading};
use crate::parallel::{Prefetch, ShardedModel, WrapPolicy};
use crate::tp::{vocab_parallel_cross_entropy, PlanEntry, TpContext};
use crate::Parallelize;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::sync::Arc;

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

#[derive(Parallelize)]
pub struct CausalLm {
    #[parallel(skip)]
    pub config: ModelConfig,
    /// The parameters this rank holds whole (its tensor-parallel slices under tp; empty when
    /// they are sharded by ZeRO-3 / FSDP).
    #[parallel(skip)]
    pub params: Params,
    /// The wrap units when parameters are sharded (ZeRO-3 / FSDP).
    #[parallel(skip)]
    pub sharding: Option<Arc<ShardedModel>>,
    /// The tensor-parallel group once split (logits are then split over the vocabulary).
    #[parallel(skip)]
    tp: Option<Arc<dyn Communicator>>,
    /// The split of every parameter, recorded when split (the weights may be sharded later).
    #[parallel(skip)]
    tp_plan: Vec<PlanEntry>,
    /// How sequences are split (Ulysses over sp: inputs are this rank's chunk; ring over cp:
    /// its two balanced chunks).
    #[parallel(skip)]
    split: Option<SeqSplit>,
    #[parallel(skip)]
    rope: RotaryEmbedding,
    /// How attention is computed (transformers' attn_implementation).
    #[parallel(skip)]
    pub attention: AttentionImpl,
    /// Fuse the LM head with the loss in sequence tiles ([`Self::forward_loss`]).
    #[parallel(skip)]
    pub tiled_loss: bool,
    /// Compute the MLPs in sequence tiles, recomputed in backward (ALST's TiledMLP).
    #[parallel(skip)]
    pub tiled_mlp: bool,
    /// Recompute each decoder layer in backward, keeping only its input (activation
    /// checkpointing; see [`Self::backward`]).
    #[parallel(skip)]
    pub checkpointing: Option<Arc<Checkpointing>>,
    #[parallel(tp = "vocab", name = "model.embed_tokens")]
    embed_tokens: Embedding,
    #[parallel(name = "model.layers")]
    layers: Vec<DecoderLayer>,
    #[parallel(name = "model.norm")]
    norm: RmsNorm,
    #[parallel(tp = "vocab")]
    lm_head: Linear,
}

impl CausalLm {
    /// Builds the model over `params` (whose tensors it shares: optimizer updates are seen).
    pub fn new(config: ModelConfig, params: Params) -> Result<Self> {
        let lookup = |name: &str| {
            params
                .get(name)
                .map(|v| Weight::Local(v.as_tensor().clone()))
        };
        let mut model = Self::build(config, &lookup)?;
        model.params = params;
        Ok(model)
    }

    /// Shards the parameters (this rank's tensor-parallel slices, if split) over `comm` in
    /// wrap units for ZeRO-3 / FSDP: one per decoder layer (`#[parallel(fsdp_unit)]`), grouped
    /// by `policy`, plus the root. `params` is emptied; the units hold the values.
    pub fn shard(
        &mut self,
        policy: WrapPolicy,
        prefetch: Prefetch,
        comm: Arc<dyn Communicator>,
    ) -> Result<()> {
        if self.sharding.is_some() {
            return Err(Error::TensorParallel {
                name: "model".into(),
                message: "the model is already sharded".into(),
            });
        }
        // The layers' weights are swapped for unit slots; these handles would keep the full
        // tensors alive.
        self.params = Params::default();
        self.sharding = Some(shard_model(self, policy, prefetch, comm)?);
        Ok(())
    }

    /// Shards a [`Self::skeleton`] over `comm` in ZeRO-3 / FSDP units read straight from the
    /// checkpoint in `dir`: each rank reads only its slice of every unit, so no rank ever
    /// holds the whole model (FSDP's cpu_ram_efficient_loading, DeepSpeed's zero3_init). The
    /// same units and values as loading the model whole and calling [`Self::shard`].
    pub fn shard_reading(
        &mut self,
        dir: impl AsRef<Path>,
        policy: WrapPolicy,
        prefetch: Prefetch,
        comm: Arc<dyn Communicator>,
    ) -> Result<()> {
        let files = WeightFiles::open(dir.as_ref(), &self.config)?;
        let Weight::Local(embed) = &self.embed_tokens.weight else {
            return Err(Error::TensorParallel {
                name: "model".into(),
                message: "the model is already sharded".into(),
            });
        };
        let (dtype, device) = (embed.dtype(), embed.device().clone());
        let shapes = self
            .config
            .parameter_shapes()
            .into_iter()
            .map(|(n, s)| (n, candle_core::Shape::from(s)))
            .collect();
        let read = |name: &str, start: usize, len: usize| {
            files.load_flat(name, start, len, DType::F32, &device)
        };
        self.params = Params::default();
        self.sharding = Some(shard_model_reading(
            self,
            shapes,
            (dtype, &device),
            &read,
            policy,
            prefetch,
            comm,
        )?);
        Ok(())
    }

    fn build(config: ModelConfig, lookup: &dyn Fn(&str) -> Option<Weight>) -> Result<Self> {
        let rope = config.rotary().map_err(|m| Error::Config {
            file: "config.json".into(),
            key: "rope_scaling".into(),
            message: m,
        })?;
        let eps = config.rms_norm_eps;
        let weight = |name: &str| -> Result<Weight> {
            lookup(name).ok_or_else(|| {
                Error::Candle(candle_core::Error::Msg(format!(
                    "no parameter named {name}"
                )))
            })
        };
        let linear = |name: &str| -> Result<Linear> {
            let bias = lookup(&format!("{name}.bias"));
            Ok(Linear::from_weights(
                weight(&format!("{name}.weight"))?,
                bias,
            ))
        };
        let norm = |name: &str| -> Result<RmsNorm> {
            Ok(RmsNorm::new(weight(&format!("{name}.weight"))?, eps))
        };
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                Ok(DecoderLayer {
                    input_layernorm: norm(&format!("{p}.input_layernorm"))?,
                    q_proj: linear(&format!("{p}.self_attn.q_proj"))?,
                    k_proj: linear(&format!("{p}.self_attn.k_proj"))?,
                    v_proj: linear(&format!("{p}.self_attn.v_proj"))?,
                    o_proj: linear(&format!("{p}.self_attn.o_proj"))?,
                    post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm"))?,
                    gate_proj: linear(&format!("{p}.mlp.gate_proj"))?,
                    up_proj: linear(&format!("{p}.mlp.up_proj"))?,
                    down_proj: linear(&format!("{p}.mlp.down_proj"))?,
                    num_heads: config.num_attention_heads,
                    num_kv_heads: config.num_kv_heads(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_weight = weight("model.embed_tokens.weight")?;
        let lm_head = if config.tie_word_embeddings {
            Linear::from_weights(embed_weight.clone(), None)
        } else {
            linear("lm_head")?
        };
        Ok(CausalLm {
            rope,
            attention: AttentionImpl::default(),
            tiled_loss: false,
            tiled_mlp: false,
            checkpointing: None,
            embed_tokens: Embedding::from_weight(embed_weight),
            layers,
            norm: norm("model.norm")?,
            lm_head,
            config,
            params: Params::default(),
            sharding: None,
            tp: None,
            tp_plan: Vec::new(),
            split: None,
        })
    }

    /// Splits the model over the tensor-parallel group `tp` (Megatron layout, see the module
    /// docs); `params` then holds this rank's slices. Heads must divide by the group size.
    pub fn parallelize(&mut self, tp: Arc<dyn Communicator>) -> Result<()> {
        if tp.size() == 1 {
            return Ok(());
        }
        if self.sharding.is_some() {
            return Err(Error::TensorParallel {
                name: "model".into(),
                message: "split tensor-parallel layers before sharding with ZeRO-3 / FSDP".into(),
            });
        }
        crate::tp::parallelize(self, &TpContext::new(tp.clone()))?;
        crate::tp::make_variables(self)?;
        self.params = crate::tp::named_parameters(self)?;
        self.tp_plan = crate::tp::plan(self, tp.size(), true);
        self.tp = Some(tp);
        Ok(())
    }

    /// How each parameter is split over the tensor-parallel group (empty before
    /// [`Self::parallelize`] or for a group of one).
    pub fn tp_plan(&self) -> &[PlanEntry] {
        &self.tp_plan
    }

    /// Runs attention sequence-parallel over `sp` (Ulysses): from then on `forward` takes
    /// this rank's chunk of every row (chunks in rank order; position ids are the global
    /// ones) and returns that chunk's logits. Head counts (per tp rank) must split over `sp`.
    pub fn sequence_parallel(&mut self, sp: Arc<dyn Communicator>) -> Result<()> {
        self.split_sequences(SeqSplit {
            group: sp,
            ring: false,
            comm_dtype: None,
        })
    }

    /// Runs attention context-parallel over `cp` (ring attention): from then on `forward`
    /// takes this rank's two chunks of every row (chunks r and 2cp-1-r of 2cp, concatenated;
    /// position ids are the global ones) and returns their logits.
    pub fn context_parallel(&mut self, cp: Arc<dyn Communicator>) -> Result<()> {
        self.split_sequences(SeqSplit {
            group: cp,
            ring: true,
            comm_dtype: None,
        })
    }

    /// Splits sequences as `split` says (see [`Self::sequence_parallel`] and
    /// [`Self::context_parallel`]); a group of one changes nothing.
    pub fn split_sequences(&mut self, split: SeqSplit) -> Result<()> {
        let n = split.group.size();
        if n == 1 {
            return Ok(());
        }
        if self.split.is_some() {
            return Err(Error::Parallelism(
                "context and sequence parallelism together are not supported: set cp or sp".into(),
            ));
        }
        if let Some(layer) = self.layers.first().filter(|_| !split.ring) {
            crate::nn::ulysses::kv_repeats(layer.num_heads, layer.num_kv_heads, n)
                .map_err(Error::Parallelism)?;
        }
        self.split = Some(split);
        Ok(())
    }

    /// How sequences are split, when they are.
    pub fn split(&self) -> Option<&SeqSplit> {
        self.split.as_ref()
    }

    /// The context-parallel group, when sequences are split over a ring.
    pub fn cp(&self) -> Option<&Arc<dyn Communicator>> {
        self.split.as_ref().filter(|s| s.ring).map(|s| &s.group)
    }

    /// The sequence-parallel group, when sequences are split by Ulysses.
    pub fn sp(&self) -> Option<&Arc<dyn Communicator>> {
        self.split.as_ref().filter(|s| !s.ring).map(|s| &s.group)
    }

    /// The tensor-parallel group, once split.
    pub fn tp(&self) -> Option<&Arc<dyn Communicator>> {
        self.tp.as_ref()
    }

    /// Next-token loss of `logits` from [`Self::forward`] (vocabulary-split under tp: the
    /// vocab-parallel cross-entropy, which never gathers them).
    pub fn loss(&self, logits: &Tensor, labels: &Tensor) -> Result<LossSum> {
        self.logits_loss(logits, &shift_labels(labels)?)
    }

    /// The loss of `logits` against aligned `targets`: vocab-parallel under tp.
    fn logits_loss(&self, logits: &Tensor, targets: &Tensor) -> Result<LossSum> {
        match &self.tp {
            Some(tp) => vocab_parallel_cross_entropy(logits, targets, tp),
            None => Ok(cross_entropy_sum(logits, targets)?),
        }
    }

    /// Logits over the whole vocabulary (gathered under tp) of whole sequences (not split
    /// over sp: every rank of the group computes them all), for generation.
    pub fn forward_full(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        let logits =
            self.lm_head
                .forward(&self.hidden_states(input_ids, position_ids, false)?)?;
        match &self.tp {
            Some(tp) => tp.all_gather(&logits.detach(), 2),
            None => Ok(logits),
        }
    }

    /// Parameter count of the whole model (however it is split or sharded).
    pub fn num_parameters(&self) -> usize {
        if !self.tp_plan.is_empty() {
            return self
                .tp_plan
                .iter()
                .map(|e| e.full_shape.iter().product::<usize>())
                .sum();
        }
        match &self.sharding {
            Some(s) => s.num_elements(),
            None => self.params.num_elements(),
        }
    }

    /// Loads `config.json` and the weights from an HF checkpoint directory.
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_file(dir.join(super::params::CONFIG_FILE))?;
        let params = Params::load(dir, &config, dtype, device)?;
        Self::new(config, params)
    }

    /// The model's structure without its values: every weight is a view of one zero at its
    /// full shape (nothing full-size is allocated). For plans, and for loading slices into.
    pub fn skeleton(config: ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        let zero = Tensor::zeros((), dtype, device)?;
        let shapes: std::collections::HashMap<String, Vec<usize>> =
            config.parameter_shapes().into_iter().collect();
        let lookup = |name: &str| {
            let shape = shapes.get(name)?;
            zero.broadcast_as(shape.as_slice()).ok().map(Weight::Local)
        };
        Self::build(config, &lookup)
    }

    /// Loads an HF checkpoint directory split over `tp`: each rank reads only its slices of
    /// the split tensors from the safetensors files (and the replicated ones whole), so no rank
    /// ever holds the full model. A dimension or head count the group size does not divide is
    /// an error naming the tensor.
    pub fn from_pretrained_split(
        dir: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        tp: Arc<dyn Communicator>,
    ) -> Result<Self> {
        if tp.size() == 1 {
            return Self::from_pretrained(dir, dtype, device);
        }
        let dir = dir.as_ref();
        let config = ModelConfig::from_file(dir.join(super::params::CONFIG_FILE))?;
        let files = WeightFiles::open(dir, &config)?;
        // Splitting the skeleton allocates only this rank's slices, then filled from the files.
        let mut model = Self::skeleton(config, dtype, device)?;
        model.parallelize(tp.clone())?;
        for entry in &model.tp_plan {
            let value = match entry.split.dim {
                Some(d) => files.load_part(&entry.name, d, tp.rank(), tp.size(), dtype, device)?,
                None => files.load(&entry.name, dtype, device)?,
            };
            model
                .params
                .get(&entry.name)
                .expect("planned")
                .set(&value)?;
        }
        Ok(model)
    }

    /// Writes the model in HF layout (config.json + safetensors).
    pub fn save_pretrained(
        &self,
        dir: impl AsRef<Path>,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        self.params.save(dir, &self.config, max_shard_bytes)
    }

    /// Logits [batch, seq, vocab] for `input_ids` [batch, seq] (u32) at `position_ids`
    /// [batch, seq]. Positions that restart mark document boundaries of packed rows.
    pub fn forward(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        let hidden = self.hidden_states(input_ids, position_ids, true)?;
        Ok(self.lm_head.forward(&hidden)?)
    }

    /// The next-token loss of `labels` (not yet shifted) for `input_ids` at `position_ids`.
    pub fn forward_loss(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        labels: &Tensor,
    ) -> Result<LossSum> {
        self.forward_targets(input_ids, position_ids, &shift_labels(labels)?)
    }

    /// The loss of aligned `targets` (position t's own target, -100 for none: labels already
    /// shifted, as sequence chunks carry them). With `tiled_loss` the LM head and the
    /// cross-entropy run fused in sequence tiles and the logits never exist whole (the head
    /// must be held whole: under tp or FSDP the loss is computed from the logits).
    pub fn forward_targets(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
    ) -> Result<LossSum> {
        let head = match (&self.lm_head.weight, &self.tp) {
            (Weight::Local(w), None) if self.tiled_loss => w.clone(),
            _ => return self.logits_loss(&self.forward(input_ids, position_ids)?, targets),
        };
        let hidden = self.hidden_states(input_ids, position_ids, true)?;
        let (b, s, h) = hidden.dims3()?;
        Ok(tiled_linear_cross_entropy(
            &hidden.reshape((b * s, h))?,
            &head,
            targets,
        )?)
    }

    /// Gradients of `loss` (a scalar of this model's forward) for every parameter: Candle's
    /// backward, plus the gradients of layers recomputed by activation checkpointing.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut store = loss.backward()?;
        if let Some(c) = &self.checkpointing {
            c.merge_into(&mut store)?;
        }
        Ok(store)
    }

    /// The final hidden states [batch, seq, hidden] (after the last norm). `chunked`: the
    /// inputs are this rank's part of the sequence under sp or cp (else whole sequences).
    fn hidden_states(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        chunked: bool,
    ) -> Result<Tensor> {
        // Split by `sequence_parallel` / `context_parallel`, or by a #[context_parallel] step.
        let split = match chunked {
            true => self
                .split
                .clone()
                .or_else(crate::context_parallel::active_split),
            false => None,
        };
        // Sharded parameters: the root unit (embedding, final norm, LM head) is gathered for
        // the whole pass, each layer's unit only while the layer runs.
        let _root = match &self.sharding {
            Some(sh) => Some(sh.begin_forward()?),
            None => None,
        };
        let x = self.embed_tokens.forward(input_ids)?;
        let (dtype, device) = (x.dtype(), x.device().clone());
        let attention =
            SeqAttention::new(split.as_ref(), position_ids, self.attention, dtype, &device)?;
        let (cos, sin) = self.rope.cos_sin(position_ids, dtype, &device)?;
        let stack = DecoderStack {
            layers: self.layers.clone(),
            cx: LayerCtx {
                attention: Arc::new(attention),
                cos,
                sin,
                tp: self.tp.clone(),
                tiled_mlp: self.tiled_mlp,
                head_dim: self.config.head_dim(),
            },
            sharding: self.sharding.clone(),
        };
        let x = match &self.checkpointing {
            Some(c) => c.run(&x, Arc::new(stack))?,
            None => {
                let mut x = x;
                for l in 0..stack.count() {
                    x = stack.forward(l, &x, false)?;
                }
                x
            }
        };
        Ok(self.norm.forward(&x)?)
    }
}

/// What every layer of one forward shares.
struct LayerCtx {
    attention: Arc<SeqAttention>,
    cos: Tensor,
    sin: Tensor,
    tp: Option<Arc<dyn Communicator>>,
    tiled_mlp: bool,
    head_dim: usize,
}

/// The decoder layers of one forward, runnable again in backward (activation checkpointing).
struct DecoderStack {
    layers: Vec<DecoderLayer>,
    cx: LayerCtx,
    sharding: Option<Arc<ShardedModel>>,
}

impl Layers for DecoderStack {
    fn count(&self) -> usize {
        self.layers.len()
    }

    fn forward(&self, l: usize, x: &Tensor, recompute: bool) -> candle_core::Result<Tensor> {
        // A recomputed layer's unit is gathered on demand and freed by its backward.
        let _unit = match (&self.sharding, recompute) {
            (Some(sh), false) => sh.enter_layer(l).map_err(Error::into_candle)?,
            _ => None,
        };
        layer_forward(&self.layers[l], &self.cx, x).map_err(Error::into_candle)
    }

    fn params(&self, l: usize) -> Vec<Tensor> {
        let mut out = Vec::new();
        self.layers[l].visit_params("", &mut |_, t, _| out.push(t.clone()));
        out
    }
}

/// One decoder layer: x + attention(norm(x)), then + mlp(norm(x)).
fn layer_forward(layer: &DecoderLayer, cx: &LayerCtx, x: &Tensor) -> Result<Tensor> {
    let (b, s, _) = x.dims3()?;
    let d = cx.head_dim;
    let (heads, kv_heads) = (layer.num_heads, layer.num_kv_heads);
    let h = layer.input_layernorm.forward(x)?;
    let split = |t: Tensor, n: usize| -> candle_core::Result<Tensor> {
        t.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous()
    };
    let q = apply_rotary(&split(layer.q_proj.forward(&h)?, heads)?, &cx.cos, &cx.sin)?;
    let k = apply_rotary(
        &split(layer.k_proj.forward(&h)?, kv_heads)?,
        &cx.cos,
        &cx.sin,
    )?;
    let v = split(layer.v_proj.forward(&h)?, kv_heads)?;
    let a = cx
        .attention
        .apply(&q, &k, &v)?
        .transpose(1, 2)?
        .reshape((b, s, heads * d))?;
    let x = (x + layer.o_proj.forward(&a)?)?;
    let h = layer.post_attention_layernorm.forward(&x)?;
    Ok((&x + mlp(layer, cx, &h)?)?)
}

/// A layer's SwiGLU MLP; with `tiled_mlp` (and the weights held whole on this rank, no
/// biases) computed in sequence tiles that keep no [tokens x intermediate] activations.
fn mlp(layer: &DecoderLayer, cx: &LayerCtx, h: &Tensor) -> Result<Tensor> {
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
    let x = match &cx.tp {
        Some(tp) => copy_to_group(&x, tp)?,
        None => x,
    };
    let y = tiled_swiglu(&x, &Tensor::cat(&[gate, up], 0)?, down)?;
    let y = match &cx.tp {
        Some(tp) => reduce_from_group(&y, tp)?,
        None => y,
    };
    Ok(y.reshape((b, s, hidden))?)
}

fn plain_mlp(layer: &DecoderLayer, h: &Tensor) -> Result<Tensor> {
    let mlp = crate::nn::fused::swiglu(&layer.gate_proj.forward(h)?, &layer.up_proj.forward(h)?)?;
    Ok(layer.down_proj.forward(&mlp)?)
}
