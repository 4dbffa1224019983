//! Any causal language model, trained by the same trainer under every strategy.
//!
//! A model is written the plain Candle way (a constructor over a `VarBuilder`, layers from
//! [`crate::nn`], which are drop-ins for candle_nn's), annotated with `#[derive(Parallelize)]`,
//! and implements [`CausalModel`]: its embedding, its layers one at a time, its final norm and
//! its LM head. That split is all the strategies need: `crate::parallel::Model` holds the
//! network and the state the strategies attach and runs the forward itself, layer by layer.
//! The user never calls a hook. The built-in Llama / Qwen2 decoder ([`super::llama::Llama`]) is one
//! such model.

use crate::comm::Communicator;
use crate::context_parallel::{SeqAttention, SeqSplit};
use crate::error::Result;
use crate::nn::memo::Memo;
use crate::nn::module::Parallelize;
use crate::nn::{AttentionImpl, KvCache, Linear, RotaryEmbedding, Window, WithScoreMods};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::sync::{Arc, Mutex};

/// What the trainer and the strategies need from a causal LM. Implement it next to the
/// model's own `forward`: usually each method is one line calling what is already there.
pub trait CausalModel: Parallelize + Send + Sync + Sized + 'static {
    /// The model's `config.json`, as the model reads it.
    type Config: Send + Sync;

    /// Reads `config.json` (`source` names the file in errors). A `#[derive(Deserialize)]`
    /// config needs only `serde_json::from_str`.
    fn parse_config(text: &str, source: &str) -> Result<Self::Config>;

    /// Builds the model from `config` with its weights from `vb`, under their HF names
    /// (`model.layers.0.self_attn.q_proj.weight`). The names `#[derive(Parallelize)]` gives
    /// the fields (with `#[parallel(name = "...")]`) must be the same.
    fn new(config: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self>;

    /// Hidden states [batch, seq, hidden] entering the first layer.
    fn embed(&self, input_ids: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor>;

    fn num_layers(&self) -> usize;

    /// Layer `l` on `x` [batch, seq, hidden]. Attention goes through
    /// [`LayerInputs::attention`], so that packed rows, ring attention and Ulysses work.
    fn layer(&self, l: usize, x: &Tensor, cx: &LayerInputs) -> candle_core::Result<Tensor>;

    /// The last layer's output made ready for the LM head (the final norm).
    fn final_norm(&self, x: &Tensor) -> candle_core::Result<Tensor>;

    /// The LM head (an [`crate::nn::Linear`], `#[parallel(tp = "vocab")]` to split it).
    fn lm_head(&self) -> &Linear;

    /// Whether the parameter `name` may get no gradient in a step by design (a mixture of
    /// experts' routed experts): the first step's unused-parameter check lets it be.
    fn may_skip_grad(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    /// Final-logit soft-capping (Gemma 2's `final_logit_softcapping`): logits become
    /// `cap * tanh(logits / cap)` before the loss. None by default.
    fn logit_softcap(&self) -> Option<f64> {
        None
    }

    /// Query and key/value heads per rank, when attention has heads: checked against the
    /// sequence-parallel size before training starts (else at the first step).
    fn heads(&self) -> Option<(usize, usize)> {
        None
    }

    /// Whether the layers compute their MLP in sequence tiles when [`LayerInputs::tiled_mlp`]
    /// asks (ALST's TiledMLP); others get a warning at launch.
    fn supports_tiled_mlp(&self) -> bool {
        false
    }
}

/// What every layer of one forward shares: positions, the attention of this forward (its
/// mask built once, ring or Ulysses when sequences are split), the tensor-parallel group.
pub struct LayerInputs {
    /// Global positions [batch, seq] of this rank's tokens; restarting positions mark the
    /// documents of a packed row.
    pub position_ids: Tensor,
    pub(crate) attention: Arc<SeqAttention>,
    /// Sliding-window or soft-capped attention of this forward, by window and cap (its
    /// bits), built on first use.
    windowed: Memo<(Option<Window>, Option<u64>), Arc<SeqAttention>>,
    /// The largest position id, for [`Self::at_positions`]' bound check.
    max_position: std::sync::OnceLock<u32>,
    /// Which tokens open a document, for the layers with a recurrent state (Gated DeltaNet),
    /// read from the positions once per forward.
    document_starts: std::sync::OnceLock<Arc<Vec<Vec<bool>>>>,
    split: Option<SeqSplit>,
    how: AttentionImpl,
    pub(crate) tp: Option<Arc<dyn Communicator>>,
    /// The expert-parallel group, when the mixtures' experts are kept per rank.
    pub(crate) ep: Option<Arc<dyn Communicator>>,
    /// Compute MLPs in sequence tiles (`tiled_mlp`), for models that can.
    pub tiled_mlp: bool,
    /// The routers' load-balancing loss of this forward, when the trainer collects it.
    pub(crate) router_loss: Option<Arc<super::router_loss::RouterLoss>>,
    dtype: DType,
    device: Device,
    rotary: Memo<usize, (Tensor, Tensor)>,
    /// Generation's KV cache: attention runs over it (and the new keys join it).
    cache: Option<Arc<Mutex<KvCache>>>,
    /// Positions known on the host, and the rotary tables' rows as u32 on the device
    /// ([`Self::with_fixed_positions`]).
    fixed: Option<(Vec<i64>, Tensor, usize)>,
}

impl LayerInputs {
    /// For `position_ids` [batch, seq], computing in `dtype` on `device`: whole sequences
    /// with `attention`, or this rank's part of them under `split`.
    pub fn new(
        position_ids: &Tensor,
        split: Option<&SeqSplit>,
        attention: AttentionImpl,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let seq = SeqAttention::new(split, position_ids, attention, None, dtype, device)?;
        Ok(Self::of(
            position_ids,
            (split, attention, seq),
            dtype,
            device,
        ))
    }

    fn of(
        position_ids: &Tensor,
        (split, how, seq): (Option<&SeqSplit>, AttentionImpl, SeqAttention),
        dtype: DType,
        device: &Device,
    ) -> Self {
        LayerInputs {
            position_ids: position_ids.clone(),
            attention: Arc::new(seq),
            windowed: Memo::default(),
            max_position: std::sync::OnceLock::new(),
            document_starts: std::sync::OnceLock::new(),
            split: split.cloned(),
            how,
            tp: None,
            ep: None,
            tiled_mlp: false,
            router_loss: None,
            dtype,
            device: device.clone(),
            rotary: Memo::default(),
            cache: None,
            fixed: None,
        }
    }

    /// Whether this forward generates (attends over a KV cache): no gradient is wanted, and
    /// a layer takes the paths fastest for a few rows.
    pub fn generating(&self) -> bool {
        self.cache.is_some()
    }

    /// Inputs of one generated token per row at positions known on the host, `positions`
    /// [batch], whose rotary rows are gathered by `rows` (u32 [batch] on `device`): nothing
    /// is read back from the device or uploaded to it, so that the forward can be captured
    /// as a CUDA graph and replayed with new `rows` (`KvCache::fixed_positions`). Rotary
    /// tables are made for `capacity` positions at once.
    pub fn with_fixed_positions(
        position_ids: &Tensor,
        (positions, rows): (Vec<i64>, Tensor),
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let host: Vec<Vec<i64>> = positions.iter().map(|&p| vec![p]).collect();
        let how = AttentionImpl::default();
        let mask =
            crate::nn::AttentionMask::from_rows(&host, None, dtype, device, device.is_cpu())?;
        let seq = SeqAttention::Whole(mask, how);
        let mut cx = Self::of(position_ids, (None, how, seq), dtype, device);
        cx.fixed = Some((positions, rows, capacity));
        Ok(cx)
    }

    /// The same inputs attending over `cache` (generation): each attention call of the
    /// forward takes the next layer's slot of it.
    pub fn with_cache(mut self, cache: Arc<Mutex<KvCache>>) -> Self {
        self.cache = Some(cache);
        self
    }

    /// Generation's KV cache, for a layer that keeps something else than its keys and values
    /// in it (latent attention: [`KvCache::hold`]). Drop the guard before any
    /// [`Self::attention_with`] of the same forward: that call locks the cache too.
    pub fn kv_cache(&self) -> Option<std::sync::MutexGuard<'_, KvCache>> {
        let cache = self.cache.as_ref()?;
        Some(cache.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Causal attention of `q` [batch, heads, seq, head_dim] over `k`, `v` [batch, kv_heads,
    /// seq, head_dim] (fewer key/value heads: grouped-query attention), documents of packed
    /// rows kept apart; the ring or Ulysses exchange when sequences are split. (A model
    /// written for `candle_flash_attn::flash_attn` can call [`crate::nn::flash_attn`] instead.)
    pub fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        self.attention_with(q, k, v, None, None, None)
    }

    /// Rows of `table` [max_positions, dim] at this forward's position ids: [batch, seq, dim].
    /// What a model written with an `offset` (`cos.narrow(0, offset, seq_len)`, as
    /// candle-transformers' models do) takes instead: positions that restart in packed rows,
    /// and the global positions of this rank's chunk under cp or sp. The result goes to
    /// `nn::rotary_emb::rope` as its 3-D cos / sin.
    pub fn at_positions(&self, table: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s) = self.position_ids.dims2()?;
        let ids = self
            .position_ids
            .flatten_all()?
            .to_dtype(DType::U32)?
            .to_device(table.device())?;
        let (rows, dim) = table.dims2()?;
        // The largest position, read once per forward (a device sync on a GPU).
        let max = match self.max_position.get() {
            Some(&m) => m,
            None => {
                let m = ids.max_all()?.to_scalar::<u32>()?;
                let _ = self.max_position.set(m);
                m
            }
        } as usize;
        if max >= rows {
            candle_core::bail!(
                "position {max} is beyond the {rows} rows of the position table \
                 (max_position_embeddings): lower max_length"
            );
        }
        table.index_select(&ids, 0)?.reshape((b, s, dim))
    }

    /// [`Self::attention`] with each query seeing at most the `window` latest keys of its
    /// document (sliding-window layers: Mistral, Qwen2/3's `layer_types`); None: every
    /// earlier key. Under cp and sp the window is over global positions, as without a split.
    pub fn attention_in_window(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        self.attention_with(q, k, v, window.map(Window::Sliding), None, None)
    }

    /// [`Self::attention`] within a `window` of keys when given (sliding or chunked), with
    /// the scores soft-capped at `softcap` when given (`cap * tanh(scores / cap)`, Gemma 2's
    /// `attn_logit_softcapping`) and this layer's attention `sinks` [heads] (gpt-oss) when
    /// given.
    pub fn attention_with(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<Window>,
        softcap: Option<f64>,
        sinks: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        if let Some(cache) = &self.cache {
            let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
            return cache.attend((q, k, v), window, softcap, sinks);
        }
        if window.is_none() && softcap.is_none() {
            return self.attention.apply_with_sinks(q, k, v, sinks);
        }
        // Built lazily in the first layer that asks, on every rank of a split in the same
        // order (Ulysses gathers the positions), and shared by the layers after it.
        let key = (window, softcap.map(f64::to_bits));
        let attention = self.windowed.get_or_build(key, || {
            Ok(Arc::new(
                SeqAttention::new(
                    self.split.as_ref(),
                    &self.position_ids,
                    self.how,
                    window,
                    self.dtype,
                    &self.device,
                )?
                .with_softcap(softcap),
            ))
        })?;
        attention.apply_with_sinks(q, k, v, sinks)
    }

    /// `rope`'s cos and sin [batch, seq, dim] at this forward's positions, computed once per
    /// forward and shared by every layer.
    pub fn cos_sin(&self, rope: &RotaryEmbedding) -> candle_core::Result<(Tensor, Tensor)> {
        let key = rope as *const RotaryEmbedding as usize;
        self.rotary.get_or_build(key, || {
            // Tables that depend on the length (dynamic NTK, longrope) follow the whole
            // sequence's, not this rank's part of it.
            let max_position = match (&self.split, rope.depends_on_length()) {
                (Some(split), true) => {
                    let local = self.position_ids.to_dtype(DType::F64)?.max_all()?;
                    let global = split
                        .group
                        .all_reduce(&local.reshape(1)?, crate::comm::ReduceOp::Max)
                        .map_err(|e| e.into_candle())?;
                    Some(global.to_vec1::<f64>()?[0] as i64)
                }
                _ => None,
            };
            if let Some((positions, rows, capacity)) = &self.fixed {
                // Tables for the whole generation at once: a replayed step cannot grow them.
                if rope.depends_on_length() {
                    candle_core::bail!(
                        "rotary tables that depend on the length (dynamic NTK, longrope) \
                         are not fixed across generation steps"
                    );
                }
                let last = Some(capacity.max(&1) - 1).map(|c| c as i64);
                let shape = (positions.len(), 1);
                return rope.cos_sin_at((positions, rows), shape, last, self.dtype, &self.device);
            }
            rope.cos_sin_within(&self.position_ids, max_position, self.dtype, &self.device)
        })
    }

    /// Which tokens of each whole row open a document (`nn::gated_delta::document_starts`),
    /// computed on the host once per forward and shared by the layers that ask. Under
    /// context parallelism or Ulysses, the whole rows' in row order (every rank's positions
    /// gathered, once per forward): what a layer that runs whole rows of some heads needs.
    pub fn document_starts(&self) -> crate::Result<Arc<Vec<Vec<bool>>>> {
        if let Some(starts) = self.document_starts.get() {
            return Ok(starts.clone());
        }
        let positions = match &self.split {
            None => self.position_ids.clone(),
            Some(split) => {
                let gathered = split
                    .group
                    .all_gather(&self.position_ids.to_dtype(DType::I64)?, 1)?;
                let at = split.gathered_at(self.position_ids.dim(1)?)?;
                let at = Tensor::new(at.as_slice(), gathered.device())?;
                gathered.index_select(&at, 1)?
            }
        };
        let starts = Arc::new(crate::nn::gated_delta::document_starts(&positions)?);
        Ok(self.document_starts.get_or_init(|| starts).clone())
    }

    /// How this forward's rows are split over ranks (context parallelism, Ulysses), if they
    /// are.
    pub fn sequence_split(&self) -> Option<&SeqSplit> {
        self.split.as_ref()
    }

    /// Whether this forward holds a part of each row (context parallelism, Ulysses).
    pub fn splits_sequences(&self) -> bool {
        self.split.is_some()
    }

    /// The tensor-parallel group, when layers are split.
    pub fn tp(&self) -> Option<&Arc<dyn Communicator>> {
        self.tp.as_ref()
    }

    /// The expert-parallel group, when experts are kept per rank.
    pub fn ep(&self) -> Option<&Arc<dyn Communicator>> {
        self.ep.as_ref()
    }
}
