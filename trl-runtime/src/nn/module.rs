//! The module trait every layer and model implements ([`Parallelize`], derived with
//! `#[derive(Parallelize)]`): list its parameters under their HF names, split them over a
//! tensor-parallel group, swap how each weight is held (FSDP units), and name its FSDP wrap
//! units. It is what torch's `nn.Module` gives `named_parameters()` and DTensor's
//! `parallelize_module` in one. The layers of this module implement it; `crate::tp` plans and
//! applies the split, `crate::parallel` the sharding.

use super::Weight;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use candle_core::{Tensor, TensorId, Var};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How one parameter is split over the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TpStyle {
    Column {
        gather_output: bool,
    },
    Row,
    Vocab,
    Replicate,
    /// Whole on every rank but applied to features split over the group (per-head q/k
    /// norms): each rank computes part of its gradient, which is summed over the group.
    Partial,
    /// Whole on every rank, not annotated, in a struct whose column layers split its
    /// activations: replicated or partial, as the first step's gradients show (the same on
    /// every rank, or not).
    Auto,
}

impl TpStyle {
    pub fn name(&self) -> &'static str {
        match self {
            TpStyle::Column { .. } => "column",
            TpStyle::Row => "row",
            TpStyle::Vocab => "vocab",
            TpStyle::Replicate => "replicate",
            TpStyle::Partial => "partial",
            TpStyle::Auto => "auto",
        }
    }
}

/// Where a parameter sits in the plan: the style of its layer and the dimension split over
/// the group (None: replicated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Split {
    pub style: TpStyle,
    pub dim: Option<usize>,
    /// The sections of a fused weight along `dim`, each split on its own.
    #[serde(default)]
    pub sections: Sections,
}

/// The sections of a fused weight along its split dimension (Phi-3's `qkv_proj`: the q, k
/// and v rows; `gate_up_proj`: gate and up). Each is split over the group on its own, so a
/// rank holds its share of every section, laid out as the whole is (its q, then its k, then
/// its v), as vLLM's QKVParallelLinear splits; an equal slice of the whole would give rank 0
/// all the queries. [`Sections::WHOLE`]: one section, an ordinary split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Sections([usize; 3]);

impl Sections {
    pub const WHOLE: Sections = Sections([0; 3]);

    /// Up to three sections of these lengths, in order.
    pub fn of(lens: &[usize]) -> Sections {
        assert!(lens.len() <= 3, "at most three sections, not {lens:?}");
        let mut s = [0; 3];
        s[..lens.len()].copy_from_slice(lens);
        Sections(s)
    }

    pub fn is_whole(&self) -> bool {
        *self == Self::WHOLE
    }

    /// The lengths along a dimension of size `full` (WHOLE: `full` itself).
    fn lens(&self, full: usize) -> Vec<usize> {
        match self.is_whole() {
            true => vec![full],
            false => self.0.iter().copied().filter(|&l| l > 0).collect(),
        }
    }
}

impl Split {
    pub const REPLICATED: Split = Split::whole(TpStyle::Replicate);
    pub const PARTIAL: Split = Split::whole(TpStyle::Partial);
    pub const AUTO: Split = Split::whole(TpStyle::Auto);

    /// Kept whole on every rank, in `style`.
    pub const fn whole(style: TpStyle) -> Split {
        Split {
            style,
            dim: None,
            sections: Sections::WHOLE,
        }
    }

    /// Split along `dim` in `sections` (the style does not change how it is cut).
    pub const fn sectioned(dim: usize, sections: Sections) -> Split {
        Split {
            style: TpStyle::Replicate,
            dim: Some(dim),
            sections,
        }
    }

    /// Split along `dim` (None: whole) in one section.
    pub const fn on(style: TpStyle, dim: Option<usize>) -> Split {
        Split {
            style,
            dim,
            sections: Sections::WHOLE,
        }
    }

    /// This split under a field annotated `style` (`replicate` or `partial`): a whole
    /// parameter takes the style; a split one is unchanged.
    pub fn whole_as(self, style: TpStyle) -> Split {
        match self.dim {
            None => Split::whole(style),
            Some(_) => self,
        }
    }

    /// Where rank `rank`'s part of a tensor of `shape` lies along the split dimension: a
    /// (start, len) per section (None: the whole tensor); an error naming `name` when a
    /// section does not divide by `parts`.
    pub fn ranges(
        &self,
        name: &str,
        shape: &[usize],
        rank: usize,
        parts: usize,
    ) -> Result<Option<Vec<(usize, usize)>>> {
        let Some(dim) = self.dim else {
            return Ok(None);
        };
        let lens = self.sections.lens(shape[dim]);
        if lens.iter().sum::<usize>() != shape[dim] {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: format!(
                    "its sections {lens:?} do not add up to dimension {dim} of shape {shape:?}"
                ),
            });
        }
        let mut start = 0;
        let mut out = Vec::with_capacity(lens.len());
        for len in lens {
            let mut one = shape.to_vec();
            one[dim] = len;
            let (s, l) = slice_range(name, &one, dim, rank, parts)?;
            out.push((start + s, l));
            start += len;
        }
        Ok(Some(out))
    }

    /// Rank `rank`'s part of the whole tensor `t` (a view for one section, else a copy).
    pub fn part(&self, name: &str, t: &Tensor, rank: usize, parts: usize) -> Result<Tensor> {
        let (Some(dim), Some(ranges)) = (self.dim, self.ranges(name, t.dims(), rank, parts)?)
        else {
            return Ok(t.clone());
        };
        let pieces = ranges
            .iter()
            .map(|&(s, l)| t.narrow(dim, s, l))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(match pieces.len() {
            1 => pieces[0].clone(),
            _ => Tensor::cat(&pieces, dim)?,
        })
    }

    /// Rank `rank` of `size`'s part of `t` as a new trainable variable, owning only its
    /// elements.
    pub fn variable(&self, name: &str, t: &Tensor, (rank, size): (usize, usize)) -> Result<Tensor> {
        let part = self.part(name, t, rank, size)?;
        Ok(Var::from_tensor(&part.detach())?.as_tensor().clone())
    }

    /// The whole tensor from every rank's part `t` (collective over `comm`).
    pub fn gather(&self, t: &Tensor, comm: &dyn Communicator) -> Result<Tensor> {
        let Some(dim) = self.dim else {
            return Ok(t.clone());
        };
        let all = comm.all_gather(t, dim)?;
        if self.sections.is_whole() {
            return Ok(all);
        }
        // Rank r's part is its share of each section in turn: regroup by section.
        let (n, local) = (comm.size(), t.dim(dim)?);
        let mut pieces = Vec::new();
        let mut offset = 0;
        for len in self.sections.lens(local * n) {
            for r in 0..n {
                pieces.push(all.narrow(dim, r * local + offset, len / n)?);
            }
            offset += len / n;
        }
        Ok(Tensor::cat(&pieces, dim)?)
    }

    /// This split under an unannotated field of a struct with column and row layers: a
    /// replicated parameter becomes `auto` (found from its gradients); others are unchanged.
    pub fn in_split_region(self) -> Split {
        match self.style {
            TpStyle::Replicate => Split::AUTO,
            _ => self,
        }
    }

    /// Whether each tensor-parallel rank holds only part of this parameter's gradient.
    pub fn is_partial(&self) -> bool {
        self.style == TpStyle::Partial
    }
}

/// The tensor-parallel group a model is split over.
pub struct TpContext {
    comm: Arc<dyn Communicator>,
    /// Slices already cut, by the full tensor and dimension, so that a weight shared by two
    /// layers (tied embeddings) stays one parameter after splitting.
    cut: Mutex<HashMap<(TensorId, usize), Tensor>>,
}

impl TpContext {
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        TpContext {
            comm,
            cut: Mutex::new(HashMap::new()),
        }
    }

    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank's equal slice of `t` along `dim` (of each of its `sections`), as a new
    /// trainable variable.
    pub fn shard(&self, name: &str, t: &Tensor, dim: usize, sections: Sections) -> Result<Tensor> {
        let mut cut = self.cut.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = cut.get(&(t.id(), dim)) {
            return Ok(done.clone());
        }
        let var = Split::sectioned(dim, sections).variable(name, t, (self.rank(), self.size()))?;
        cut.insert((t.id(), dim), var.clone());
        Ok(var)
    }

    /// `count / tp`, for per-rank counts such as attention heads.
    pub fn divide(&self, name: &str, count: usize) -> Result<usize> {
        let n = self.size();
        if !count.is_multiple_of(n) {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: format!(
                    "{count} is not divisible by tp = {n}: each rank must get the same number \
                     (for attention heads, pick a tp size that divides both the query and the \
                     key/value head counts)"
                ),
            });
        }
        Ok(count / n)
    }
}

/// Where rank `rank`'s slice of dimension `dim` of `shape` starts and how long it is, when
/// that dimension splits into `parts` equal slices; else an error naming tensor `name`.
fn slice_range(
    name: &str,
    shape: &[usize],
    dim: usize,
    rank: usize,
    parts: usize,
) -> Result<(usize, usize)> {
    let full = shape[dim];
    if !full.is_multiple_of(parts) {
        return Err(Error::TensorParallel {
            name: name.into(),
            message: format!(
                "dimension {dim} has size {full}, which is not divisible by tp = {parts} \
                 (shape {shape:?}); choose a tp size that divides it"
            ),
        });
    }
    let len = full / parts;
    Ok((rank * len, len))
}

/// `name.segment`, or `segment` at the top.
pub fn child_name(name: &str, segment: &str) -> String {
    if name.is_empty() {
        segment.to_string()
    } else {
        format!("{name}.{segment}")
    }
}

/// A field holding a layer's weight: a `Weight`, or an `Option<Weight>` (a bias).
pub trait WeightSlot {
    fn slot(&self) -> Option<&Weight>;
    fn slot_mut(&mut self) -> Option<&mut Weight>;
}

impl WeightSlot for Weight {
    fn slot(&self) -> Option<&Weight> {
        Some(self)
    }
    fn slot_mut(&mut self) -> Option<&mut Weight> {
        Some(self)
    }
}

impl WeightSlot for Option<Weight> {
    fn slot(&self) -> Option<&Weight> {
        self.as_ref()
    }
    fn slot_mut(&mut self) -> Option<&mut Weight> {
        self.as_mut()
    }
}

/// What [`Parallelize::visit_params`] calls: each parameter's HF name, tensor and split.
pub type ParamFn<'a> = dyn FnMut(&str, &Tensor, Split) + 'a;
/// What [`Parallelize::visit_weights_mut`] calls: each parameter slot by HF name.
pub type WeightFn<'a> = dyn FnMut(&str, &mut Weight) -> Result<()> + 'a;
/// What [`Parallelize::visit_linears_mut`] calls: each layer a LoRA adapter can go on.
pub type LinearFn<'a> = dyn FnMut(&str, &mut dyn LoraTarget) -> Result<()> + 'a;
/// What [`Parallelize::shard_experts`] calls: each expert parameter this rank keeps, by HF
/// name, and how it is held.
pub type ExpertFn<'a> = dyn FnMut(&str, ExpertHold) + 'a;

/// This rank's share of every mixture's experts under expert parallelism: rank `rank` of an
/// ep group of `size` keeps experts `[rank * n / size, (rank + 1) * n / size)` of each layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpShard {
    pub rank: usize,
    pub size: usize,
}

impl EpShard {
    /// The experts this rank keeps of the `n` of mixture `name`; an error when they do not
    /// divide.
    pub fn range(&self, name: &str, n: usize) -> Result<std::ops::Range<usize>> {
        if self.size == 0 || !n.is_multiple_of(self.size) {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: format!(
                    "its {n} experts do not divide over ep = {}: choose an ep size that divides \
                     the number of experts",
                    self.size
                ),
            });
        }
        let per = n / self.size;
        Ok(self.rank * per..(self.rank + 1) * per)
    }
}

/// How expert parallelism holds an expert parameter this rank keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertHold {
    /// Every expert's tensor stacked on dim 0 (fused experts): this rank holds its experts'
    /// rows, `per_rank` of them.
    Stack { per_rank: usize },
    /// One expert's own parameter, `{list}.{index}.…` (`index` global), `per_rank` experts
    /// of the list on each rank.
    Listed {
        list: String,
        index: usize,
        per_rank: usize,
    },
}

/// `Parallelize` for a layer whose weights stay whole on every tensor-parallel rank (the
/// norms): `"suffix" => field` for each weight field, in the order they are listed.
macro_rules! whole_layer {
    ($t:ty: $($suffix:literal => $field:ident),+) => {
        impl $crate::nn::module::Parallelize for $t {
            fn visit_params(
                &self,
                name: &str,
                f: &mut $crate::nn::module::ParamFn,
            ) {
                use $crate::nn::module::{child_name, Split, WeightSlot};
                $(if let Some($crate::nn::Weight::Local(t)) = self.$field.slot() {
                    f(&child_name(name, $suffix), t, Split::REPLICATED)
                })+
            }
            fn visit_weights_mut(
                &mut self,
                name: &str,
                f: &mut $crate::nn::module::WeightFn,
            ) -> $crate::error::Result<()> {
                use $crate::nn::module::{child_name, WeightSlot};
                $(if let Some(w) = self.$field.slot_mut() {
                    f(&child_name(name, $suffix), w)?;
                })+
                Ok(())
            }
        }
    };
}
pub(crate) use whole_layer;

/// A model (or part of one) that can be split over a tensor-parallel group and whose
/// parameters can be listed. Derive it with `#[derive(Parallelize)]`; the layers of
/// [`crate::nn`], `Vec`, `Option`, `Box`, trainable `Tensor`s and plain numbers implement it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not implement `Parallelize`, so #[derive(Parallelize)] cannot visit it",
    label = "this field's type holds no known parameters",
    note = "layers: use trl_runtime::nn::{{Linear, Embedding, RmsNorm}} (drop-in for candle_nn's)",
    note = "your own module types: add #[derive(Parallelize)] to them",
    note = "fields without parameters (rotary tables, configs, activations): mark them #[parallel(skip)]"
)]
pub trait Parallelize {
    /// Whether every value of this type is one FSDP wrap unit (`#[parallel(fsdp_unit)]` on
    /// the struct).
    const FSDP_UNIT: bool = false;

    /// Splits the annotated layers inside for this rank of `tp`; `name` is this value's HF name.
    /// Nothing to do for what is replicated (the default).
    fn parallelize(&mut self, name: &str, tp: &TpContext) -> Result<()> {
        let _ = (name, tp);
        Ok(())
    }

    /// Calls `f` with every parameter's HF name, tensor and split.
    fn visit_params(&self, name: &str, f: &mut ParamFn);

    /// Calls `f` with every parameter slot, to swap how it is held (FSDP wraps them). None by
    /// default (plain values, bare tensors).
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> Result<()> {
        let _ = (name, f);
        Ok(())
    }

    /// Calls `f` with every layer that can take a LoRA adapter (each `nn::Linear`) inside.
    /// None by default.
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> Result<()> {
        let _ = (name, f);
        Ok(())
    }

    /// Calls `f` with the name of every FSDP wrap unit inside, in forward (field) order.
    fn visit_units(&self, name: &str, f: &mut dyn FnMut(&str)) {
        let _ = (name, f);
    }

    /// This value as a wrap unit (a field marked `#[parallel(fsdp_unit)]`): itself, or for a
    /// `Vec` each element.
    fn visit_as_unit(&self, name: &str, f: &mut dyn FnMut(&str)) {
        f(name)
    }

    /// Keeps only this rank's experts of every mixture inside (expert parallelism), calling
    /// `f` with each expert parameter kept. Nothing to do for what holds no experts (the
    /// default).
    fn shard_experts(&mut self, name: &str, ep: EpShard, f: &mut ExpertFn) -> Result<()> {
        let _ = (name, ep, f);
        Ok(())
    }
}

/// Holds `lora`'s `A` and `B` as trainable variables, each cut along its dimension in `dims`
/// (None: whole) to rank `rank` of `size` when `tp` is given (a split layer's or parameter's
/// adapter); each in the weight's sections along the features it shares with the weight
/// (`a_sections`: A's inputs, `b_sections`: B's outputs), and DoRA's magnitude as `B`'s rows.
pub fn split_lora(
    lora: &mut super::lora::Lora,
    name: &str,
    (a_dim, b_dim): (Option<usize>, Option<usize>),
    (a_sections, b_sections): (Sections, Sections),
    tp: Option<(usize, usize)>,
) -> Result<()> {
    let cut = |t: &Tensor, part: &str, dim: Option<usize>, s: Sections| -> Result<Tensor> {
        match (tp, dim) {
            (Some(tp), Some(d)) => Split::sectioned(d, s).variable(&child_name(name, part), t, tp),
            _ => Ok(Var::from_tensor(t)?.as_tensor().clone()),
        }
    };
    lora.a = cut(&lora.a, "lora_A.weight", a_dim, a_sections)?;
    lora.b = cut(&lora.b, "lora_B.weight", b_dim, b_sections)?;
    if let Some(m) = &lora.magnitude {
        lora.magnitude = Some(cut(m, "lora_magnitude_vector", b_dim, b_sections)?);
    }
    Ok(())
}

/// A layer that can take a LoRA adapter (`nn::Linear`; see `nn::lora`), or a parameter
/// adapted directly (`nn::Param`: peft's `target_parameters`).
pub trait LoraTarget {
    /// Adds an adapter at the layer's full size, sliced as its tensor-parallel split requires,
    /// and freezes the layer's own weights.
    fn add_lora(&mut self, name: &str, config: &super::lora::LoraConfig) -> Result<()>;
    /// The adapter, once added.
    fn lora_mut(&mut self) -> Option<&mut super::lora::Lora>;
    /// Whether this is a parameter (chosen by `target_parameters`) rather than a linear
    /// layer (chosen by `target_modules`).
    fn is_parameter(&self) -> bool {
        false
    }
    /// How peft reads a 3-D parameter's features for its adapter (`nn::Param`); a linear
    /// layer's weight is [out, in].
    fn adapter_layout(&self) -> crate::kernels::grouped::ExpertLayout {
        crate::kernels::grouped::ExpertLayout::OutIn
    }
    /// Whether this is an embedding table (LoRA as peft's `lora.Embedding`; trainable tokens).
    fn is_embedding(&self) -> bool {
        false
    }
    /// Trains the rows `indices` of this table whole (peft's `trainable_token_indices`).
    fn add_tokens(&mut self, name: &str, indices: &[u32]) -> Result<()> {
        let _ = indices;
        Err(crate::Error::config(
            "training arguments",
            "trainable_token_indices",
            format!("{name} is not an embedding table or an LM head"),
        ))
    }
    /// The adapter on this table (an embedding's, or the one a head computes with).
    fn table_adapter(&self) -> Option<&super::embedding_adapter::EmbeddingAdapter> {
        None
    }
    /// Makes this layer compute with `adapter`'s table of its frozen weight (a head tied to an
    /// adapted embedding).
    fn share_table(
        &mut self,
        name: &str,
        adapter: super::embedding_adapter::EmbeddingAdapter,
    ) -> Result<()> {
        let _ = adapter;
        Err(crate::Error::config(
            "training arguments",
            "lora_target_modules",
            format!("{name} cannot compute with an adapted table"),
        ))
    }
    /// The frozen weight's id (a head tied to an embedding shares it).
    fn weight_id(&self) -> Option<candle_core::TensorId> {
        None
    }
}

/// A layer whose parameters can be split as `style` (implemented by [`crate::nn::Linear`]
/// and [`crate::nn::Embedding`]).
pub trait TpLayer {
    fn shard(&mut self, name: &str, style: TpStyle, tp: &TpContext) -> Result<()>;
    /// The split of each parameter under `style` (before or after sharding).
    fn visit_split(&self, name: &str, style: TpStyle, f: &mut ParamFn);
}

/// Layers that can be column-parallel (output features split).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be column-parallel",
    label = "#[parallel(tp = \"column\")] needs a linear layer",
    note = "column parallelism splits a weight's output features: it applies to trl_runtime::nn::Linear \
            (swap `candle_nn::Linear` for it; the constructor is the same)"
)]
pub trait ColumnParallel: TpLayer {}

/// Layers that can be row-parallel (input features split, outputs summed over the group).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be row-parallel",
    label = "#[parallel(tp = \"row\")] needs a linear layer",
    note = "row parallelism splits a weight's input features and sums the partial outputs: it \
            applies to trl_runtime::nn::Linear (swap `candle_nn::Linear` for it)"
)]
pub trait RowParallel: TpLayer {}

/// An optional layer takes its style when present (DeepSeek's queries: `q_proj`, or
/// `q_a_proj` + `q_b_proj` when `q_lora_rank` is set).
impl<T: TpLayer> TpLayer for Option<T> {
    fn shard(&mut self, name: &str, style: TpStyle, tp: &TpContext) -> Result<()> {
        match self {
            Some(layer) => layer.shard(name, style, tp),
            None => Ok(()),
        }
    }
    fn visit_split(&self, name: &str, style: TpStyle, f: &mut ParamFn) {
        if let Some(layer) = self {
            layer.visit_split(name, style, f)
        }
    }
}
impl<T: ColumnParallel> ColumnParallel for Option<T> {}
impl<T: RowParallel> RowParallel for Option<T> {}

/// Layers that can be vocab-parallel (vocabulary rows split).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be vocab-parallel",
    label = "#[parallel(tp = \"vocab\")] needs an embedding or an LM head",
    note = "vocab parallelism splits the vocabulary rows: it applies to trl_runtime::nn::Embedding \
            (masked lookup) and to an LM head trl_runtime::nn::Linear (vocabulary-sharded logits)"
)]
pub trait VocabParallel: TpLayer {}

/// Counts split over the group (`#[parallel(tp = "divide")]`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be divided by the tp size",
    label = "#[parallel(tp = \"divide\")] needs an integer count",
    note = "`divide` is for counts such as attention heads (usize, u32, ...)"
)]
pub trait DividedByTp {
    fn divide(&mut self, name: &str, tp: &TpContext) -> Result<()>;
}

macro_rules! counts {
    ($($t:ty),*) => {$(
        impl DividedByTp for $t {
            fn divide(&mut self, name: &str, tp: &TpContext) -> Result<()> {
                *self = tp.divide(name, *self as usize)? as $t;
                Ok(())
            }
        }
    )*};
}
counts!(usize, u32, u64, i32, i64);

/// Plain values hold no parameters.
macro_rules! no_params {
    ($($t:ty),*) => {$(
        impl Parallelize for $t {
            fn visit_params(&self, _: &str, _: &mut ParamFn) {}
        }
    )*};
}
no_params!(usize, u32, u64, i32, i64, f32, f64, bool, String);

/// A `Tensor` field is a parameter when it is trainable (a `Var`), else a buffer.
impl Parallelize for Tensor {
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        if self.is_variable() {
            f(name, self, Split::REPLICATED)
        }
    }
}

/// Elements are named by index (`layers.0`, `layers.1`, ...), as in HF checkpoints.
impl<T: Parallelize> Parallelize for Vec<T> {
    fn parallelize(&mut self, name: &str, tp: &TpContext) -> Result<()> {
        for (i, x) in self.iter_mut().enumerate() {
            x.parallelize(&child_name(name, &i.to_string()), tp)?;
        }
        Ok(())
    }
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        for (i, x) in self.iter().enumerate() {
            x.visit_params(&child_name(name, &i.to_string()), f);
        }
    }
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> Result<()> {
        for (i, x) in self.iter_mut().enumerate() {
            x.visit_weights_mut(&child_name(name, &i.to_string()), f)?;
        }
        Ok(())
    }
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> Result<()> {
        for (i, x) in self.iter_mut().enumerate() {
            x.visit_linears_mut(&child_name(name, &i.to_string()), f)?;
        }
        Ok(())
    }
    fn visit_units(&self, name: &str, f: &mut dyn FnMut(&str)) {
        for (i, x) in self.iter().enumerate() {
            let n = child_name(name, &i.to_string());
            if T::FSDP_UNIT {
                f(&n)
            } else {
                x.visit_units(&n, f)
            }
        }
    }
    fn visit_as_unit(&self, name: &str, f: &mut dyn FnMut(&str)) {
        for i in 0..self.len() {
            f(&child_name(name, &i.to_string()))
        }
    }
    fn shard_experts(&mut self, name: &str, ep: EpShard, f: &mut ExpertFn) -> Result<()> {
        for (i, x) in self.iter_mut().enumerate() {
            x.shard_experts(&child_name(name, &i.to_string()), ep, f)?;
        }
        Ok(())
    }
}

impl<T: Parallelize> Parallelize for Option<T> {
    fn parallelize(&mut self, name: &str, tp: &TpContext) -> Result<()> {
        match self {
            Some(x) => x.parallelize(name, tp),
            None => Ok(()),
        }
    }
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        if let Some(x) = self {
            x.visit_params(name, f)
        }
    }
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> Result<()> {
        match self {
            Some(x) => x.visit_weights_mut(name, f),
            None => Ok(()),
        }
    }
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> Result<()> {
        match self {
            Some(x) => x.visit_linears_mut(name, f),
            None => Ok(()),
        }
    }
    fn visit_units(&self, name: &str, f: &mut dyn FnMut(&str)) {
        if let Some(x) = self {
            if T::FSDP_UNIT {
                f(name)
            } else {
                x.visit_units(name, f)
            }
        }
    }
    fn shard_experts(&mut self, name: &str, ep: EpShard, f: &mut ExpertFn) -> Result<()> {
        match self {
            Some(x) => x.shard_experts(name, ep, f),
            None => Ok(()),
        }
    }
}

impl<T: Parallelize> Parallelize for Box<T> {
    const FSDP_UNIT: bool = T::FSDP_UNIT;
    fn parallelize(&mut self, name: &str, tp: &TpContext) -> Result<()> {
        (**self).parallelize(name, tp)
    }
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        (**self).visit_params(name, f)
    }
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> Result<()> {
        (**self).visit_weights_mut(name, f)
    }
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> Result<()> {
        (**self).visit_linears_mut(name, f)
    }
    fn visit_units(&self, name: &str, f: &mut dyn FnMut(&str)) {
        (**self).visit_units(name, f)
    }
    fn shard_experts(&mut self, name: &str, ep: EpShard, f: &mut ExpertFn) -> Result<()> {
        (**self).shard_experts(name, ep, f)
    }
}
