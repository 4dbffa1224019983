//! A [`CausalModel`] with the strategies applied to it: [`Model`] holds the network and the
//! state `parallelize` attaches (tensor-parallel group, sequence split, ZeRO-3 / FSDP units,
//! activation checkpointing) and runs the forward itself, layer by layer, so that it can
//! gather a layer's FSDP unit before the layer and free it after, and recompute a layer in
//! backward. The user's model stays a plain model and never calls a hook.

use super::checkpointing::{Checkpointing, Layers};
use super::fsdp::Holding;
use super::fsdp::{shard_model, shard_model_reading};
use super::{Prefetch, ShardedModel, WrapPolicy};
use crate::comm::Communicator;
use crate::context_parallel::SeqSplit;
use crate::error::{Error, Result};
use crate::kernels::grouped::ExpertLayout;
use crate::models::params::{
    read_config, shapes_and_aliases, Checked, FilesBackend, Others, Params, WeightFiles,
};
use crate::models::{AutoModelForCausalLM, CausalModel, LayerInputs, ModelConfig};
use crate::nn::embedding::TiedGrad;
use crate::nn::lora::{AdapterPlan, LoraConfig};
use crate::nn::loss::{cross_entropy_sum, shift_labels};
use crate::nn::tiled_loss::tied_linear_cross_entropy;
use crate::nn::{AttentionImpl, LossSum};
use crate::nn::{KvCache, Weight};
use crate::tp::{vocab_parallel_cross_entropy, PlanEntry, Split, TpContext};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Per-position figures of a forward (see [`Model::forward_token_logps`]).
pub struct TokenLogps {
    /// log p(target) per position, [n] f32, 0 where ignored; carries the graph when trained.
    pub logps: Tensor,
    /// The targets that count (not ignored).
    pub count: usize,
    /// The logits' mean over the vocabulary per position, [n] f32, detached.
    pub mean_logits: Tensor,
    /// log sum_v p_v^2 per position, [n] f32, detached, when asked (WPO's weights).
    pub log_sum_sq: Option<Tensor>,
    /// Each position's entropy and top-1 flag, [n, 2] f32, detached, 0 where ignored (TRL's
    /// `entropy` and `mean_token_accuracy`; [`crate::nn::loss::token_stats_of`]).
    pub stats: Tensor,
}

/// A model `N` with what the strategies attach to it. `parallel::parallelize` sets it up;
/// the trainer runs it.
pub struct Model<N: CausalModel> {
    pub config: N::Config,
    /// `config.json` as read (written back unchanged into checkpoints).
    config_json: String,
    /// Every parameter's full shape by HF name (before any split).
    shapes: BTreeMap<String, Vec<usize>>,
    net: Arc<N>,
    /// The parameters this rank holds whole (its tensor-parallel slices under tp; empty when
    /// they are sharded by ZeRO-3 / FSDP).
    pub params: Params,
    /// The wrap units when parameters are sharded (ZeRO-3 / FSDP).
    /// Whether generation said how it runs (once per run).
    pub(crate) said_how: std::sync::atomic::AtomicBool,
    pub sharding: Option<Arc<ShardedModel>>,
    /// The tensor-parallel group once split (logits are then split over the vocabulary).
    tp: Option<Arc<dyn Communicator>>,
    /// The split of every parameter, recorded when split (the weights may be sharded later).
    tp_plan: Vec<PlanEntry>,
    /// The expert-parallel group once each rank keeps its share of the experts, and which
    /// parameters are its experts'.
    ep: Option<Arc<dyn Communicator>>,
    expert_plan: Arc<super::expert::ExpertPlan>,
    /// How sequences are split (Ulysses over sp: inputs are this rank's chunk; ring over cp:
    /// its two balanced chunks).
    split: Option<SeqSplit>,
    /// How attention is computed (transformers' attn_implementation).
    pub attention: AttentionImpl,
    /// Fuse the LM head with the loss in sequence tiles ([`Self::forward_targets`]).
    pub tiled_loss: bool,
    /// Compute the MLPs in sequence tiles, recomputed in backward (ALST's TiledMLP).
    pub tiled_mlp: bool,
    /// Recompute each layer in backward, keeping only its input (activation checkpointing;
    /// see [`Self::backward`]).
    pub checkpointing: Option<Arc<Checkpointing>>,
    /// LoRA adapters on a frozen base, when added ([`Self::add_adapters`]).
    lora: Option<LoraConfig>,
    /// The last forward's tied LM head gradient, for the embedding's backward to add into
    /// (see [`TiedGrad`]); whatever the backward left in it is added after.
    tied: Mutex<Option<TiedGrad>>,
    /// A vision-language checkpoint's tensors besides this language model's, written with
    /// it into every full checkpoint (models/weights/composite.rs).
    others: Option<Others>,
}

fn config_error(source: &str, message: String) -> Error {
    Error::Config {
        file: source.into(),
        key: "<model>".into(),
        message,
    }
}

impl<N: CausalModel> Model<N> {
    /// Builds `N` from `config.json`'s text with the tensors `backend` hands out, then makes
    /// every weight a trainable variable (a weight shared by two layers stays one) unless it
    /// is a `skeleton`: its weights stay views of one zero (a variable would allocate the full
    /// size) until a split or a shard gives each rank its own slices.
    fn build(
        config_json: String,
        source: &str,
        backend: Box<dyn SimpleBackend>,
        (dtype, device): (DType, &Device),
        skeleton: bool,
    ) -> Result<Self> {
        let config = N::parse_config(&config_json, source)?;
        let recorder = Arc::new(Recorder {
            inner: backend,
            asked: Mutex::default(),
        });
        // Models read the VarBuilder's dtype and device for their own tables (rotary).
        let vb =
            VarBuilder::from_backend(Box::new(Recording(recorder.clone())), dtype, device.clone());
        let mut net = N::new(&config, vb)
            .map_err(|e| config_error(source, format!("the model cannot be built from it: {e}")))?;
        // The names the model was loaded under must be the names it is saved under.
        let asked = std::mem::take(&mut *recorder.asked.lock().unwrap_or_else(|e| e.into_inner()));
        let (shapes, aliases) = shapes_and_aliases(&net);
        if let Some(name) = asked
            .iter()
            .find(|n| !shapes.contains_key(*n) && !aliases.contains(*n))
        {
            let mut names: Vec<&String> = shapes.keys().chain(&aliases).collect();
            names.sort();
            return Err(Error::TensorParallel {
                name: name.clone(),
                message: format!(
                    "loaded through the VarBuilder but #[derive(Parallelize)] names no field so \
                     (it names {} parameters, e.g. {:?}): give the field \
                     #[parallel(name = \"...\")] with its HF path, or mark a field that is not a \
                     parameter #[parallel(skip)]",
                    names.len(),
                    names.iter().take(3).collect::<Vec<_>>()
                ),
            });
        }
        if !skeleton {
            crate::tp::make_variables(&mut net)?;
        }
        let params = crate::tp::named_parameters(&net)?;
        Ok(Model {
            config,
            config_json,
            shapes,
            net: Arc::new(net),
            params,
            sharding: None,
            said_how: Default::default(),
            tp: None,
            tp_plan: Vec::new(),
            ep: None,
            expert_plan: Default::default(),
            split: None,
            attention: AttentionImpl::default(),
            tiled_loss: false,
            tiled_mlp: false,
            checkpointing: None,
            lora: None,
            tied: Mutex::new(None),
            others: None,
        })
    }

    /// The model of `config_json` over `params` (whose tensors it shares: optimizer updates
    /// are seen).
    pub fn with_params(config_json: String, params: Params) -> Result<Self> {
        let tensors: HashMap<String, Tensor> = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let (dtype, device) = tensors
            .values()
            .next()
            .map_or((DType::F32, Device::Cpu), |t| {
                (t.dtype(), t.device().clone())
            });
        Self::build(
            config_json,
            "config.json",
            Box::new(Checked(tensors)),
            (dtype, &device),
            false,
        )
    }

    /// Loads `config.json` and the weights from an HF checkpoint directory: every parameter
    /// the model asks for present with its shape, nothing unexpected in the files.
    pub fn from_pretrained(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let (json, source) = read_config(dir)?;
        let files = Arc::new(WeightFiles::open(dir)?);
        let backend = FilesBackend {
            files: files.clone(),
            dtype,
            device: device.clone(),
        };
        let mut model = Self::build(
            json,
            &source,
            Box::new(Checked(backend)),
            (dtype, device),
            false,
        )?;
        files.check(&model.shapes, &model.aliases())?;
        model.others = files.others();
        Ok(model)
    }

    /// The model's structure without its values: every weight is a view of one zero at its
    /// full shape (nothing full-size is allocated). For plans, and for loading slices into.
    pub fn skeleton_of(config_json: String, dtype: DType, device: &Device) -> Result<Self> {
        Self::skeleton_with(config_json, dtype, device, None)
    }

    /// A skeleton of the checkpoint in `dir` (its config; its tensor names answer the
    /// model's `vb.contains_tensor`).
    pub fn skeleton_for(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let (json, _) = read_config(dir)?;
        let files = Arc::new(WeightFiles::open(dir)?);
        let mut model = Self::skeleton_with(json, dtype, device, Some(files.clone()))?;
        files.check(&model.shapes, &model.aliases())?;
        model.others = files.others();
        Ok(model)
    }

    fn skeleton_with(
        config_json: String,
        dtype: DType,
        device: &Device,
        files: Option<Arc<WeightFiles>>,
    ) -> Result<Self> {
        let zero = Tensor::zeros((), dtype, device)?;
        let backend = ZerosBackend { zero, files };
        Self::build(
            config_json,
            "config.json",
            Box::new(backend),
            (dtype, device),
            true,
        )
    }

    /// Names a tied weight is also visited under (an LM head sharing the embedding).
    fn aliases(&self) -> HashSet<String> {
        shapes_and_aliases(&*self.net).1
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
        let files = WeightFiles::open(dir)?;
        // Splitting the skeleton allocates only this rank's slices, then filled from the files.
        let mut model = Self::skeleton_for(dir, dtype, device)?;
        model.parallelize(tp.clone())?;
        for entry in &model.tp_plan {
            let value = files.load_part(
                &entry.name,
                entry.split,
                tp.rank(),
                tp.size(),
                dtype,
                device,
            )?;
            model
                .params
                .get(&entry.name)
                .expect("planned")
                .set(&value)?;
        }
        Ok(model)
    }

    /// `config.json` as read.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    /// Every parameter's full shape by HF name (tied weights once).
    pub fn parameter_shapes(&self) -> &BTreeMap<String, Vec<usize>> {
        &self.shapes
    }

    /// The network itself.
    pub fn net(&self) -> &N {
        &self.net
    }

    fn net_mut(&mut self) -> Result<&mut N> {
        Arc::get_mut(&mut self.net).ok_or_else(|| {
            Error::Parallelism(
                "the model is still in use by a forward: set it up before running it".into(),
            )
        })
    }

    /// Shards the parameters (this rank's tensor-parallel slices, if split) over `comm` in
    /// wrap units for ZeRO-3 / FSDP: one per `#[parallel(fsdp_unit)]` layer, grouped by
    /// `policy`, plus the root, held as `holding` says (ZeRO-2's resident units too).
    /// `params` is emptied; the units hold the values.
    pub fn shard(
        &mut self,
        (policy, prefetch, holding): (WrapPolicy, Prefetch, Holding),
        comm: Arc<dyn Communicator>,
    ) -> Result<()> {
        self.shard_with_experts((policy, prefetch, holding), comm, None)
    }

    /// [`Self::shard`] under expert parallelism: this rank's experts (those of its
    /// [`Self::expert_plan`]) go into units of their own over `experts`, the ranks holding the
    /// same experts, the rest over `comm` as without ep.
    pub fn shard_with_experts(
        &mut self,
        (policy, prefetch, holding): (WrapPolicy, Prefetch, Holding),
        comm: Arc<dyn Communicator>,
        experts: Option<Arc<dyn Communicator>>,
    ) -> Result<()> {
        self.check_units(policy)?;
        // The layers' weights are swapped for unit slots; these handles would keep the full
        // tensors alive.
        self.params = Params::default();
        let plan = self.expert_plan().clone();
        let holds = |name: &str| plan.holds(name);
        let experts = experts.map(|c| (&holds as &(dyn Fn(&str) -> bool + Sync), c));
        let sharding = shard_model(self.net_mut()?, (policy, prefetch, holding), comm, experts)?;
        self.sharding = Some(sharding);
        // What is not in a unit (LoRA adapters) trains whole on every rank.
        self.params = crate::tp::named_parameters(&*self.net)?;
        Ok(())
    }

    /// Shards a skeleton over `comm` in ZeRO-3 / FSDP units read straight from the
    /// checkpoint in `dir`: each rank reads only its slice of every unit, so no rank ever
    /// holds the whole model (FSDP's cpu_ram_efficient_loading, DeepSpeed's zero3_init). The
    /// same units and values as loading the model whole and calling [`Self::shard`].
    pub fn shard_reading(
        &mut self,
        dir: impl AsRef<Path>,
        (policy, prefetch, holding): (WrapPolicy, Prefetch, Holding),
        comm: Arc<dyn Communicator>,
    ) -> Result<()> {
        self.check_units(policy)?;
        let files = WeightFiles::open(dir.as_ref())?;
        files.check(&self.shapes, &self.aliases())?;
        let Weight::Local(embed) = &self.net.lm_head().weight else {
            return Err(Error::TensorParallel {
                name: "model".into(),
                message: "the model is already sharded".into(),
            });
        };
        let (dtype, device) = (embed.dtype(), embed.device().clone());
        let shapes = self
            .shapes
            .iter()
            .map(|(n, s)| (n.clone(), Shape::from(s.clone())))
            .collect();
        let read = |name: &str, start: usize, len: usize| {
            files.load_flat(name, start, len, DType::F32, &device)
        };
        self.params = Params::default();
        let sharding = shard_model_reading(
            self.net_mut()?,
            shapes,
            (dtype, &device),
            &read,
            (policy, prefetch, holding),
            comm,
        )?;
        self.sharding = Some(sharding);
        self.params = crate::tp::named_parameters(&*self.net)?;
        Ok(())
    }

    /// ZeRO-3 / FSDP gathers one unit per layer around the layer's forward: the layers must
    /// be the units (unless the whole model is one, NO_WRAP).
    fn check_units(&self, policy: WrapPolicy) -> Result<()> {
        if self.sharding.is_some() {
            return Err(Error::TensorParallel {
                name: "model".into(),
                message: "the model is already sharded".into(),
            });
        }
        let mut units = 0;
        self.net.visit_units("", &mut |_| units += 1);
        if units != self.net.num_layers() && policy != WrapPolicy::Whole {
            return Err(Error::Parallelism(format!(
                "ZeRO-3 / FSDP wraps each layer in a unit, but the model marks {units} \
                 #[parallel(fsdp_unit)] value(s) for {} layers: put #[parallel(fsdp_unit)] on \
                 the layer struct (the type of the `layers: Vec<...>` field)",
                self.net.num_layers()
            )));
        }
        Ok(())
    }

    /// Splits the model over the tensor-parallel group `tp` (Megatron layout, as the
    /// annotations say); `params` then holds this rank's slices.
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
        let net = self.net_mut()?;
        crate::tp::parallelize(net, &TpContext::new(tp.clone()))?;
        crate::tp::make_variables(net)?;
        if let Some(lora) = self.lora.clone() {
            // The slices were made variables with the rest: the base stays frozen.
            crate::models::peft::freeze_base(self.net_mut()?, &lora)?;
        }
        self.params = crate::tp::named_parameters(&*self.net)?;
        self.tp_plan = crate::tp::plan(&*self.net, tp.size(), true);
        self.tp = Some(tp);
        Ok(())
    }

    /// Keeps this rank's share of every mixture's experts, the ep group `ep` holding the
    /// rest ([`super::expert`]); `params` then holds this rank's experts. Call it after the
    /// tensor-parallel split and before any sharding.
    pub fn shard_experts(&mut self, ep: Arc<dyn Communicator>) -> Result<()> {
        if ep.size() == 1 {
            return Ok(());
        }
        if self.sharding.is_some() {
            return Err(Error::Parallelism(
                "keep each rank's experts before sharding with ZeRO-3 / FSDP".into(),
            ));
        }
        let shard = crate::nn::module::EpShard {
            rank: ep.rank(),
            size: ep.size(),
        };
        let mut holds = BTreeMap::new();
        let net = self.net_mut()?;
        net.shard_experts("", shard, &mut |name, hold| {
            holds.insert(name.to_string(), hold);
        })?;
        if holds.is_empty() {
            return Err(Error::Parallelism(
                "the model has no mixture of experts, so expert parallelism has nothing to split"
                    .into(),
            ));
        }
        crate::tp::make_variables(net)?;
        if let Some(lora) = self.lora.clone() {
            // The kept experts were made variables with the rest: the base stays frozen.
            crate::models::peft::freeze_base(self.net_mut()?, &lora)?;
        }
        self.params = crate::tp::named_parameters(&*self.net)?;
        if let Some(tp) = &self.tp {
            self.tp_plan = crate::tp::plan(&*self.net, tp.size(), true);
        }
        self.expert_plan = Arc::new(super::expert::ExpertPlan {
            holds,
            ranks: ep.size(),
        });
        self.ep = Some(ep);
        Ok(())
    }

    /// The expert-parallel group, once experts are kept per rank.
    pub fn ep(&self) -> Option<&Arc<dyn Communicator>> {
        self.ep.as_ref()
    }

    /// Which parameters are this rank's experts (empty without expert parallelism).
    pub fn expert_plan(&self) -> &Arc<super::expert::ExpertPlan> {
        &self.expert_plan
    }

    /// Whole tensors from this rank's: tensor-parallel slices joined, every rank's experts
    /// gathered (collective: every rank calls it with the same names).
    pub fn gather_split<V: super::expert::Tensors>(
        &self,
        values: BTreeMap<String, V>,
        tp_gather: impl FnOnce(
            BTreeMap<String, V>,
            &[PlanEntry],
            &dyn Communicator,
        ) -> Result<BTreeMap<String, V>>,
    ) -> Result<BTreeMap<String, V>> {
        let values = match &self.tp {
            Some(tp) => tp_gather(values, &self.tp_plan, tp.as_ref())?,
            None => values,
        };
        match &self.ep {
            Some(ep) => self.expert_plan.gather(values, ep.as_ref()),
            None => Ok(values),
        }
    }

    /// Makes every weight a constant (a model run but never trained: distillation's
    /// teacher): no gradient reaches it, ZeRO-3 / FSDP units made of it only gather and free.
    /// Call it before sharding.
    pub fn freeze(&mut self) -> Result<()> {
        if self.sharding.is_some() {
            return Err(Error::Parallelism(
                "freeze the model before sharding it for ZeRO-3 / FSDP".into(),
            ));
        }
        let mut constants: HashMap<candle_core::TensorId, Tensor> = HashMap::new();
        self.net_mut()?.visit_weights_mut("", &mut |_, w| {
            if let Weight::Local(t) = w {
                if t.is_variable() {
                    let c = constants
                        .entry(t.id())
                        .or_insert_with(|| t.detach())
                        .clone();
                    *w = Weight::Local(c);
                }
            }
            Ok(())
        })?;
        self.params = crate::tp::named_parameters(&*self.net)?;
        Ok(())
    }

    /// Trains LoRA adapters instead of the model (see [`crate::nn::lora`]): every weight
    /// becomes a constant (no gradient, no optimizer state, kept in the compute dtype) but
    /// those of `lora_modules_to_save`, and the linear layers `config` targets get adapters
    /// (sliced as their tensor-parallel split requires). `params` then holds what trains.
    /// Call it before sharding for ZeRO-3 / FSDP.
    pub fn add_adapters(&mut self, config: &LoraConfig) -> Result<AdapterPlan> {
        if self.sharding.is_some() {
            return Err(Error::Parallelism(
                "add LoRA adapters before sharding the model for ZeRO-3 / FSDP".into(),
            ));
        }
        // peft's task type says what the model is: SEQ_CLS a classifier (its score head).
        let classifier = self.shapes.contains_key("score.weight");
        if config.sequence_classification != classifier {
            let message = match classifier {
                true => "CAUSAL_LM adapters on a sequence classifier: pass SEQ_CLS (as TRL's reward script does), so that peft leaves the score head out of all-linear and trains it whole",
                false => "SEQ_CLS adapters are for a sequence classifier (the reward trainer's); this model is a causal LM: use CAUSAL_LM",
            };
            return Err(Error::config(
                "training arguments",
                "lora_task_type",
                message,
            ));
        }
        let plan = crate::models::peft::add_adapters(self.net_mut()?, config)?;
        self.params = crate::tp::named_parameters(&*self.net)?;
        if let Some(tp) = &self.tp {
            self.tp_plan = crate::tp::plan(&*self.net, tp.size(), true);
        }
        self.lora = Some(config.clone());
        Ok(plan)
    }

    /// The names of the layers that can take a LoRA adapter (each `nn::Linear`) and of the
    /// parameters that can (2-D and 3-D `nn::Param`s: `target_parameters`), as
    /// [`Self::add_adapters`] visits them.
    pub fn lora_sites(&mut self) -> Result<(Vec<String>, Vec<String>)> {
        crate::models::peft::lora_sites(self.net_mut()?)
    }

    /// Applies a LoRA adapter saved by peft (`PeftModel.save_pretrained`) or by a LoRA run
    /// here, to continue training it or to evaluate: adapters added as its
    /// `adapter_config.json` says, with the values of its `adapter_model.safetensors`.
    pub fn load_adapter(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let Weight::Local(head) = &self.net.lm_head().weight else {
            return Err(Error::Parallelism(
                "load the adapter before sharding the model for ZeRO-3 / FSDP".into(),
            ));
        };
        let (dtype, device) = (head.dtype(), head.device().clone());
        let sites = self.lora_sites()?.1;
        let (config, tensors) = crate::models::peft::read(dir, dtype, &device, &sites)?;
        let source = dir.join(crate::models::peft::ADAPTER_WEIGHTS);
        match &self.lora {
            None => {
                self.add_adapters(&config)?;
            }
            Some(mine) if mine.r != config.r => {
                return Err(Error::config(
                    dir.join(crate::models::peft::ADAPTER_CONFIG)
                        .display()
                        .to_string(),
                    "r",
                    format!("{}, this run's lora_r is {}", config.r, mine.r),
                ))
            }
            Some(_) => {}
        }
        self.set_trainable(&tensors, &source.display().to_string())
    }

    /// The LoRA setup, when the model trains adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Sets the adapters (and modules trained whole) from `values`, full-size tensors by our
    /// parameter names (`...q_proj.lora_A.weight`), each rank taking its tensor-parallel
    /// slice. Every trainable parameter must be given.
    pub fn set_trainable(&self, values: &BTreeMap<String, Tensor>, source: &str) -> Result<()> {
        let splits: HashMap<&str, Split> = self
            .tp_plan
            .iter()
            .map(|e| (e.name.as_str(), e.split))
            .collect();
        let tp = self.tp.as_ref().map(|c| (c.rank(), c.size()));
        let part = |name: &str, value: &Tensor| -> Result<Tensor> {
            match (tp, splits.get(name)) {
                (Some((rank, size)), Some(split)) => split.part(name, value, rank, size),
                _ => Ok(value.clone()),
            }
        };
        crate::models::peft::set_trainable(&*self.net, values, &part, source)
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
        if let Some((heads, kv_heads)) = self.net.heads().filter(|_| !split.ring) {
            crate::context_parallel::ulysses::kv_repeats(heads, kv_heads, n)
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

    /// The values this rank trains, in a fixed order: the parameters it holds whole (or its
    /// tensor-parallel slices), then its slice of each ZeRO-3 / FSDP unit. Shallow: they
    /// share storage with the model (copy them to keep a snapshot).
    pub fn held_values(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = self
            .params
            .iter()
            .map(|(_, v)| v.as_tensor().clone())
            .collect();
        if let Some(sh) = &self.sharding {
            out.extend(sh.shards());
        }
        out
    }

    /// Swaps the values this rank trains with `values` (as [`Self::held_values`] lists them):
    /// a second set of weights of the same layout, such as TR-DPO's reference, is run by
    /// swapping it in and back, with no second model.
    pub fn swap_held_values(&self, values: &mut [Tensor]) -> Result<()> {
        let n = self.params.len();
        if values.len() != n + self.sharding.as_ref().map_or(0, |s| s.units.len()) {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "{} values to swap for a model holding a different set",
                values.len()
            ))));
        }
        for ((_, var), v) in self.params.iter().zip(values.iter_mut()) {
            let current = var.as_tensor().copy()?;
            var.set(v)?;
            *v = current;
        }
        if let Some(sh) = &self.sharding {
            sh.swap_shards(&mut values[n..])?;
        }
        Ok(())
    }

    /// Parameter count of the whole model (however it is split or sharded; tied once).
    pub fn num_parameters(&self) -> usize {
        self.shapes
            .values()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    /// Writes the model in HF layout (config.json + safetensors).
    pub fn save_pretrained(
        &self,
        dir: impl AsRef<Path>,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        let others = self.others.clone();
        self.params
            .save(dir, &self.config_json, max_shard_bytes, others)
    }

    /// A vision-language checkpoint's other tensors, to write beside this language model's
    /// (None for any other model).
    pub fn others(&self) -> Option<Others> {
        self.others.clone()
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
        let hidden = self.hidden_states(input_ids, position_ids, false)?;
        let logits = self.head_logits(&hidden)?;
        match &self.tp {
            Some(tp) => tp.all_gather(&logits.detach(), 2),
            None => Ok(logits),
        }
    }

    /// Logits [batch, seq, vocab] for `input_ids` [batch, seq] (u32) at `position_ids`
    /// [batch, seq]. Positions that restart mark document boundaries of packed rows.
    pub fn forward(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        let hidden = self.hidden_states(input_ids, position_ids, true)?;
        self.head_logits(&hidden)
    }

    /// The LM head's logits of `hidden`, soft-capped when the model asks (elementwise, so
    /// also on this rank's vocabulary part under tp).
    pub(crate) fn head_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.net.lm_head().forward(hidden)?;
        Ok(match self.net.logit_softcap() {
            Some(cap) => ((logits / cap)?.tanh()? * cap)?,
            None => logits,
        })
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
    /// shifted, as sequence chunks carry them). With `tiled_loss`, and always where the fused
    /// loss has its one-pass kernel (CPU f32, GPUs), the LM head and the cross-entropy run fused in sequence tiles and the logits never
    /// exist whole (the head must be held whole, without bias: under tp or FSDP the loss is
    /// computed from the logits).
    pub fn forward_targets(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
    ) -> Result<LossSum> {
        self.targets_loss(input_ids, position_ids, targets, true)
    }

    /// [`Self::forward_targets`] for evaluation: the same value, but the fused loss computes
    /// no gradients (it would in forward: two more GEMMs per tile).
    pub fn eval_targets(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
    ) -> Result<LossSum> {
        self.targets_loss(input_ids, position_ids, targets, false)
    }

    /// The LM head's weight whole on this rank where `usable` takes it: held (DDP), or
    /// gathered with the root unit, which stays gathered through the step (ZeRO-3 / FSDP); in
    /// training then a graph tensor whose gradient goes back to the unit beside the
    /// embedding's (`sharded::whole`). None under tp or with a bias: the loss runs from the
    /// logits.
    fn whole_head(&self, train: bool, usable: impl Fn(&Tensor) -> bool) -> Result<Option<Tensor>> {
        let head = self.net.lm_head();
        if head.bias.is_some() || self.tp.is_some() {
            return Ok(None);
        }
        // An adapted head (trainable tokens, a tied embedding's LoRA, its own LoRA) is whole
        // as the table it computes with; a LoRA with dropout runs through its layer.
        if let Some(table) = &head.table {
            let w = table.table(&head.whole_weight()?)?;
            return Ok(usable(&w).then_some(w));
        }
        if let Some(lora) = &head.lora {
            if lora.magnitude.is_some() || (train && lora.dropout > 0.0) {
                return Ok(None);
            }
            let w = head.whole_weight()?;
            let delta = lora.weight_delta(w.dims(), ExpertLayout::InOut)?;
            let w = (&w + delta.to_dtype(w.dtype())?)?;
            return Ok(usable(&w).then_some(w));
        }
        Ok(match &head.weight {
            Weight::Local(w) => usable(w).then(|| w.clone()),
            // Asked on the gathered view: the graph tensor adds an op the unit waits on in
            // backward, so it is made only for a loss that uses it.
            Weight::Sharded(s) => {
                let gathered = crate::nn::sharded::gathered(s)?;
                match (usable(&gathered), train) {
                    (false, _) => None,
                    (true, true) => Some(crate::nn::sharded::whole(s)?),
                    (true, false) => Some(gathered),
                }
            }
        })
    }

    fn targets_loss(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
        train: bool,
    ) -> Result<LossSum> {
        // The fused loss runs whenever the head is whole here: asked for (use_liger_kernel),
        // or where it is one pass per row (CPU f32, GPUs) and so faster than the logits path.
        // Soft-capped logits (Gemma) only in the one-pass kernel's tiles.
        let softcap = self.net.logit_softcap();
        let one_pass = |w: &Tensor| crate::nn::tiled_loss::fused_applies(w, w);
        let fused = |w: &Tensor| match softcap {
            Some(_) => one_pass(w),
            None => self.tiled_loss || one_pass(w),
        };
        let Some(head) = self.whole_head(train, fused)? else {
            return self.logits_loss(&self.forward(input_ids, position_ids)?, targets);
        };
        if !train {
            let hidden = self.hidden_states(input_ids, position_ids, true)?.detach();
            let (b, s, h) = hidden.dims3()?;
            let flat = hidden.reshape((b * s, h))?;
            let head = head.detach();
            return Ok(tied_linear_cross_entropy(
                &flat, &head, targets, None, softcap,
            )?);
        }
        // A table that is also the head gets its whole gradient in one buffer: the loss's
        // part (computed in forward) plus the lookup's rows, added in place.
        let tied = TiedGrad::default();
        let hidden = {
            let _scope = tied.scope(&head);
            self.hidden_states(input_ids, position_ids, true)?
        };
        let tied = tied.claimed().then_some(tied);
        *self.tied.lock().unwrap_or_else(|e| e.into_inner()) = tied.clone();
        let (b, s, h) = hidden.dims3()?;
        Ok(tied_linear_cross_entropy(
            &hidden.reshape((b * s, h))?,
            &head,
            targets,
            tied,
            softcap,
        )?)
    }

    /// Each position's log-probability of its aligned target (`targets` as in
    /// [`Self::forward_targets`]), [batch * seq] in f32, 0 where the target is ignored, and
    /// each position's logits averaged over the vocabulary (detached; TRL's `logits/*`
    /// metrics). With the head held whole the logits never exist at once (tiled, recomputed
    /// in backward, each position weighed by its own gradient); under tp the vocab-parallel
    /// loss gives them. `train`: whether gradients flow (else everything is detached).
    /// `sum_sq`: also each position's log sum_v p_v^2 (detached; a second pass over the head
    /// where it is whole).
    pub fn forward_token_logps(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
        train: bool,
        sum_sq: bool,
    ) -> Result<TokenLogps> {
        self.forward_token_logps_at(input_ids, position_ids, targets, train, sum_sq, 1.0)
    }

    /// [`Self::forward_token_logps`] of `logits / temperature` (GRPO scores completions at
    /// the temperature that sampled them, as TRL's fused head does): with the head whole the
    /// hidden states are divided instead (h.w / T = (h / T).w), so the logits still never
    /// exist at once.
    pub fn forward_token_logps_at(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
        train: bool,
        sum_sq: bool,
        temperature: f64,
    ) -> Result<TokenLogps> {
        let scale = |t: Tensor| -> Result<Tensor> {
            Ok(match temperature {
                1.0 => t,
                temp => (t / temp)?,
            })
        };
        let whole = match self.net.logit_softcap() {
            Some(_) => None,
            None => self.whole_head(train, |_| true)?,
        };
        let mut log_sum_sq = None;
        let (nll, count, mean_logits, stats) = match whole {
            Some(w) => {
                let hidden = self.hidden_states(input_ids, position_ids, true)?;
                let (hidden, w) = match train {
                    true => (hidden, w),
                    // Nothing tracked: the loss op records no backward.
                    false => (hidden.detach(), w.detach()),
                };
                let (b, s, h) = hidden.dims3()?;
                let flat = scale(hidden.reshape((b * s, h))?)?;
                let (nll, count, stats) = crate::nn::tiled_loss::tiled_rows(&flat, &w, targets)?;
                // The mean over the vocabulary of h.w_v is h . mean_v(w_v); the column sums by a
                // GEMM with a ones row (f32 accumulation, no f32 copy of the [vocab, h] head).
                let vocab = w.dim(0)?;
                let ones = Tensor::ones((1, vocab), w.dtype(), w.device())?;
                let mean_w = (ones.matmul(&w.detach())?.to_dtype(DType::F32)? / vocab as f64)?;
                let mean_logits = flat
                    .detach()
                    .to_dtype(DType::F32)?
                    .matmul(&mean_w.t()?)?
                    .squeeze(1)?;
                if sum_sq {
                    let lss = crate::nn::tiled_loss::tiled_log_sum_sq(&flat, &w)?;
                    log_sum_sq = Some(lss.to_dtype(DType::F32)?);
                }
                (nll, count, mean_logits, stats)
            }
            None => {
                let logits = scale(self.forward(input_ids, position_ids)?)?;
                let logits = if train { logits } else { logits.detach() };
                let vocab = logits.dim(candle_core::D::Minus1)?;
                let local_sum = logits
                    .detach()
                    .to_dtype(DType::F32)?
                    .sum_keepdim(candle_core::D::Minus1)?
                    .flatten_all()?;
                if sum_sq {
                    let z = logits.to_dtype(DType::F32)?.reshape(((), vocab))?;
                    log_sum_sq = Some(match &self.tp {
                        Some(tp) => crate::tp::vocab_parallel_log_sum_sq(&z, tp)?,
                        None => crate::nn::loss::log_sum_sq_probs(&z)?,
                    });
                }
                let (nll, count, mean_logits, stats) = match &self.tp {
                    Some(tp) => {
                        let sum = tp.all_reduce(&local_sum, crate::comm::ReduceOp::Sum)?;
                        let (nll, count, stats) =
                            crate::tp::loss::token_nll_with_stats(&logits, targets, tp)?;
                        (nll, count, (sum / (vocab * tp.size()) as f64)?, stats)
                    }
                    None => {
                        let (nll, count, stats) =
                            crate::nn::loss::cross_entropy_with_stats(&logits, targets)?;
                        (nll, count, (local_sum / vocab as f64)?, stats)
                    }
                };
                (nll, count, mean_logits, stats)
            }
        };
        Ok(TokenLogps {
            logps: nll.to_dtype(DType::F32)?.neg()?,
            count,
            mean_logits,
            log_sum_sq,
            stats,
        })
    }

    /// The distillation loss of this model (the student) against `teacher` on the same
    /// tokens ([`crate::nn::divergence`]): sum over this rank's positions of `weights[i]` x the
    /// divergence of position i's next-token distributions (0-weight positions are left out;
    /// `weights` per local position, row-major). The teacher runs without a graph, split and
    /// sharded as it is held. With both heads whole (no tp, no bias) the logits never exist at
    /// once (tiled, gradients computed in forward); under tp from each rank's vocabulary part,
    /// reduced over the group. Returns the loss (a scalar with the student's graph when
    /// `train`), and each counted position's divergence and student entropy.
    pub fn distillation_loss<T: CausalModel>(
        &self,
        teacher: &Model<T>,
        (input_ids, position_ids): (&Tensor, &Tensor),
        weights: &[f64],
        (beta, temperature): (f64, f64),
        train: bool,
    ) -> Result<(Tensor, Vec<f64>, Vec<f64>)> {
        use crate::nn::divergence::{divergence_rows, tiled_divergence, HeadSide};
        let hidden = self.hidden_states(input_ids, position_ids, true)?;
        let hidden = if train { hidden } else { hidden.detach() };
        // The teacher's embeddings get no NEFTune noise (transformers hooks the student's).
        let t_hidden = crate::nn::embedding::with_neftune(None, || {
            teacher.hidden_states(input_ids, position_ids, true)
        })?
        .detach();
        let (b, s, _) = hidden.dims3()?;
        if weights.len() != b * s {
            return Err(Error::Parallelism(format!(
                "distillation: {} weights for {} positions",
                weights.len(),
                b * s
            )));
        }
        // Only the positions that count go through the heads (TRL projects those alone).
        let kept: Vec<u32> = (0..b * s)
            .filter(|&i| weights[i] != 0.0)
            .map(|i| i as u32)
            .collect();
        // No completion token in this rank's part: one position at weight 0 runs the same
        // heads, graph and collectives as the other ranks' (no empty tensors), for a zero loss.
        let empty = kept.is_empty();
        let kept = if empty { vec![0] } else { kept };
        let w: Vec<f64> = kept.iter().map(|&i| weights[i as usize]).collect();
        let index = Tensor::new(kept.as_slice(), hidden.device())?;
        let pick = |x: &Tensor| -> Result<Tensor> {
            let (_, _, width) = x.dims3()?;
            Ok(x.reshape((b * s, width))?.index_select(&index, 0)?)
        };
        let (hs, ht) = (pick(&hidden)?, pick(&t_hidden)?);
        if self.tp.is_none() && teacher.tp.is_none() {
            let student_head = self.whole_head(train, |_| true)?;
            let teacher_head = teacher.whole_head(false, |_| true)?;
            if let (Some(ws), Some(wt)) = (student_head, teacher_head) {
                let ws = if train { ws } else { ws.detach() };
                let out = tiled_divergence(
                    HeadSide {
                        hidden: &hs,
                        weight: &ws,
                        softcap: self.net.logit_softcap(),
                    },
                    HeadSide {
                        hidden: &ht,
                        weight: &wt.detach(),
                        softcap: teacher.net.logit_softcap(),
                    },
                    &w,
                    (beta, temperature),
                    train,
                )?;
                return Ok(match empty {
                    true => (out.loss, Vec::new(), Vec::new()),
                    false => (out.loss, out.divergence, out.entropy),
                });
            }
        }
        // From the logits: this rank's vocabulary part under tp (both models split alike).
        let zs = (self.head_logits(&hs)? / temperature)?;
        let zt = (teacher.head_logits(&ht)?.detach() / temperature)?;
        let (div, entropy) = match &self.tp {
            Some(tp) => crate::tp::loss::vocab_parallel_divergence(&zs, &zt, beta, tp)?,
            None => divergence_rows(&zs, &zt, beta, &crate::nn::divergence::WHOLE)?,
        };
        let wt = Tensor::new(w.as_slice(), div.device())?.to_dtype(div.dtype())?;
        let loss = (&div * wt)?.sum_all()?;
        let loss = if train { loss } else { loss.detach() };
        let host = |t: &Tensor| -> Result<Vec<f64>> {
            Ok(t.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?)
        };
        match empty {
            true => Ok((loss, Vec::new(), Vec::new())),
            false => Ok((loss, host(&div)?, host(&entropy)?)),
        }
    }

    /// Gradients of `loss` (a scalar of this model's forward) for every parameter: Candle's
    /// backward, plus the gradients of layers recomputed by activation checkpointing.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut store = loss.backward()?;
        if let Some(c) = &self.checkpointing {
            c.merge_into(&mut store)?;
        }
        let tied = self.tied.lock().unwrap_or_else(|e| e.into_inner()).take();
        // The head's gradient still in the slot: the lookup's backward did not run. (A slot is
        // only opened for a head held whole.)
        if let (Some(grad), Weight::Local(head)) =
            (tied.and_then(|t| t.take()), &self.net.lm_head().weight)
        {
            let sum = match store.remove(head) {
                Some(g) => (g + grad)?,
                None => grad,
            };
            store.insert(head, sum);
        }
        Ok(store)
    }

    /// The final hidden states [batch, seq, hidden] (after the final norm). `chunked`: the
    /// inputs are this rank's part of the sequence under sp or cp (else whole sequences).
    fn hidden_states(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        chunked: bool,
    ) -> Result<Tensor> {
        self.hidden_states_over(input_ids, position_ids, chunked, None)
    }

    /// [`Self::hidden_states`], attending over generation's KV `cache` when given (whole rows,
    /// no checkpointing, each layer's output detached: generation keeps no graph).
    pub(crate) fn hidden_states_over(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        chunked: bool,
        cache: Option<&Arc<Mutex<KvCache>>>,
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
        let device = input_ids.device().clone();
        // The compute dtype is the weights'.
        let dtype = match &self.net.lm_head().weight {
            Weight::Local(w) => w.dtype(),
            Weight::Sharded(s) => s.dtype(),
        };
        let mut cx =
            LayerInputs::new(position_ids, split.as_ref(), self.attention, dtype, &device)?;
        cx.tp = self.tp.clone();
        cx.ep = self.ep.clone();
        cx.tiled_mlp = self.tiled_mlp;
        if let Some(c) = cache {
            cx = cx.with_cache(c.clone());
        }
        // A training forward whose trainer adds the routers' load-balancing loss.
        let router_loss = crate::models::router_loss::active().filter(|_| chunked);
        cx.router_loss = router_loss.clone();
        let x = self.net.embed(input_ids, &cx)?;
        let stack = Stack {
            net: self.net.clone(),
            cx,
            sharding: self.sharding.clone(),
            params: self
                .params
                .iter()
                .map(|(_, v)| v.as_tensor().clone())
                .collect(),
        };
        let x = match &self.checkpointing {
            _ if cache.is_some() => {
                let mut x = x.detach();
                for l in 0..stack.count() {
                    x = stack.forward(l, &x, false)?.detach();
                }
                x
            }
            Some(c) => c.run(&x, Arc::new(stack))?,
            None => {
                let mut x = x;
                for l in 0..stack.count() {
                    x = stack.forward(l, &x, false)?;
                }
                x
            }
        };
        if let Some(loss) = router_loss {
            loss.seal(split.as_ref().map(|s| &s.group))?;
        }
        Ok(self.net.final_norm(&x)?)
    }
}

/// The layers of one forward, runnable again in backward (activation checkpointing).
struct Stack<N: CausalModel> {
    net: Arc<N>,
    cx: LayerInputs,
    sharding: Option<Arc<ShardedModel>>,
    /// The parameters held as variables (a recomputed layer's gradients are looked up among
    /// them; those of other layers simply get none).
    params: Vec<Tensor>,
}

impl<N: CausalModel> Layers for Stack<N> {
    fn count(&self) -> usize {
        self.net.num_layers()
    }

    fn forward(&self, l: usize, x: &Tensor, recompute: bool) -> candle_core::Result<Tensor> {
        // A recomputed layer's unit is gathered on demand and freed by its backward.
        let _unit = match (&self.sharding, recompute) {
            (Some(sh), false) => sh.enter_layer(l).map_err(Error::into_candle)?,
            _ => None,
        };
        // What `nn::flash_attn` runs inside the layer.
        let _attention = crate::nn::flash_attn::enter(self.cx.attention.clone());
        self.net.layer(l, x, &self.cx)
    }

    fn params(&self, _l: usize) -> Vec<Tensor> {
        self.params.clone()
    }
}

/// Remembers which names the model asked its VarBuilder for.
struct Recorder {
    inner: Box<dyn SimpleBackend>,
    asked: Mutex<Vec<String>>,
}

impl Recorder {
    fn record(&self, name: &str) {
        let mut asked = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        asked.push(name.to_string());
    }
}

/// The recorder as the VarBuilder's backend.
struct Recording(Arc<Recorder>);

impl SimpleBackend for Recording {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0.record(name);
        self.0.inner.get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.record(name);
        self.0.inner.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.inner.contains_tensor(name)
    }
}

/// A skeleton: every weight a broadcast view of one zero.
struct ZerosBackend {
    zero: Tensor,
    /// The checkpoint the skeleton stands for, if any.
    files: Option<Arc<WeightFiles>>,
}

impl SimpleBackend for ZerosBackend {
    fn get(
        &self,
        s: Shape,
        _: &str,
        _: candle_nn::Init,
        _: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        self.zero.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("{name}: a skeleton needs the shape of every weight (use vb.get)")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.files.as_ref().is_some_and(|f| f.contains(name))
    }
}

/// The built-in model of a checkpoint's `model_type` as the trainer runs it.
pub type CausalLm = Model<AutoModelForCausalLM>;

impl Model<AutoModelForCausalLM> {
    /// Builds the model over `params` (whose tensors it shares: optimizer updates are seen).
    pub fn new(config: ModelConfig, params: Params) -> Result<Self> {
        Self::with_params(config.to_json_pretty(), params)
    }

    /// The model's structure without its values (see [`Model::skeleton_of`]).
    pub fn skeleton(config: ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        Self::skeleton_of(config.to_json_pretty(), dtype, device)
    }

    /// The parameters of the built-in model in `dir` that take adapters directly
    /// (`target_parameters`), each with how peft reads it, from its structure alone (what
    /// `merge_adapter` asks).
    pub fn parameter_sites_of(dir: &Path) -> Result<Vec<(String, ExpertLayout)>> {
        let mut skeleton = Self::skeleton_for(dir, DType::F32, &Device::Cpu)?;
        crate::models::peft::parameter_sites(skeleton.net_mut()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(tied: bool) -> CausalLm {
        let json = serde_json::json!({
            "model_type": "qwen2", "vocab_size": 37, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": tied, "initializer_range": 0.2,
        });
        let cfg = ModelConfig::from_json(&json.to_string(), "tiny").unwrap();
        let params = Params::init(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
        CausalLm::new(cfg, params).unwrap()
    }

    /// With a tied table (f32 on the CPU: the fused loss), the forward opens the slot, the
    /// lookup claims it, and Candle's own backward leaves it empty: the loss put the head's
    /// gradient in and the lookup took it (not `Model::backward`'s fallback), and the table has
    /// one gradient. An untied model opens none. (Gradient values: tests/models.rs.)
    #[test]
    fn the_lookup_takes_the_tied_heads_gradient() {
        let ids = Tensor::new(&[[3u32, 9, 12, 5, 1, 30, 2, 8]], &Device::Cpu).unwrap();
        let pos = Tensor::new(&[[0i64, 1, 2, 3, 4, 5, 6, 7]], &Device::Cpu).unwrap();
        let targets = Tensor::new(&[[9i64, 12, 5, 1, 30, 2, 8, -100]], &Device::Cpu).unwrap();
        for tied in [true, false] {
            let m = tiny(tied);
            let ls = m.forward_targets(&ids, &pos, &targets).unwrap();
            let slot = m.tied.lock().unwrap().clone();
            assert_eq!(slot.is_some(), tied, "tied {tied}: the slot");
            let store = ls.sum.backward().unwrap();
            if let Some(slot) = slot {
                assert!(slot.claimed());
                assert!(
                    slot.take().is_none(),
                    "the lookup did not take the head's gradient"
                );
            }
            let Weight::Local(head) = &m.net.lm_head().weight else {
                panic!("a whole head")
            };
            assert!(store.get(head).is_some(), "tied {tied}: no head gradient");
        }
    }
}
