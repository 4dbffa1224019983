//! A parameter a model uses as a tensor rather than through a layer (gpt-oss's attention
//! sinks, its experts' fused 3-D weights): named as in the checkpoint (no `.weight` suffix),
//! held as any weight is (whole, or a ZeRO-3 / FSDP slot), and split under tensor parallelism
//! as it says itself ([`Param::split_column`], [`Param::split_row`]): a tensor has no
//! layer whose kind would imply the dimension, so the model names it where it builds it.
//!
//! A 2-D or 3-D parameter takes a LoRA adapter as peft's ParamWrapper adds one
//! (`target_parameters`): a 2-D [out, in] weight as a linear layer's, a 3-D one with one
//! adapter per expert, stacked ([`Lora::expert_stacks`]), its features read as peft reads
//! them: [experts, out, in], or [experts, in, out] for experts transformers marks
//! `is_transposed` (gpt-oss) ([`Param::adapter_layout`]).

use super::lora::{Lora, LoraConfig};
use super::module::{
    child_name, split_lora, LoraTarget, Parallelize, Sections, Split, TpContext, TpStyle,
};
use super::module::{EpShard, ExpertFn, ExpertHold, LinearFn, ParamFn, WeightFn};
use super::sharded;
use super::Weight;
use crate::error::{Error, Result as TrlResult};
use crate::kernels::grouped::ExpertLayout;
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct Param {
    pub weight: Weight,
    /// How tensor parallelism splits it: a style (column: it feeds split features; row: it
    /// reads them) and the dimension cut. None: whole on every rank.
    pub split: Option<(TpStyle, usize)>,
    /// The sections of a fused tensor along the split dimension, each split on its own
    /// (Llama 4's experts' gate_up_proj: the gate half, then the up half).
    pub sections: Sections,
    /// How a fused expert tensor holds each expert's matrix (`nn::grouped`).
    pub layout: ExpertLayout,
    /// How peft's ParamWrapper reads a 3-D tensor to shape its adapter: [experts, out, in]
    /// unless transformers marks the experts `is_transposed` (gpt-oss: [experts, in, out]).
    /// Llama 4's are read [experts, out, in] although they compute [experts, in, out].
    pub adapter_layout: ExpertLayout,
    /// A LoRA adapter on it (this rank's slices), once added.
    pub lora: Option<Lora>,
    /// This rank and the tensor-parallel group's size, once split.
    tp: Option<(usize, usize)>,
    /// Every expert's tensor of a mixture, stacked on dim 0: expert parallelism keeps this
    /// rank's rows ([`Param::expert_stack`]).
    pub experts: bool,
}

impl Param {
    /// `name` from `vb`, of `shape`, whole on every tensor-parallel rank.
    pub fn new(
        vb: &candle_nn::VarBuilder,
        shape: impl Into<candle_core::Shape>,
        name: &str,
    ) -> Result<Self> {
        Ok(Param {
            weight: Weight::Local(vb.get(shape, name)?),
            split: None,
            sections: Sections::WHOLE,
            layout: ExpertLayout::InOut,
            adapter_layout: ExpertLayout::OutIn,
            lora: None,
            tp: None,
            experts: false,
        })
    }

    /// The same parameter marked as every expert's tensor stacked on dim 0: expert
    /// parallelism keeps only this rank's experts of it.
    pub fn expert_stack(self) -> Self {
        Param {
            experts: true,
            ..self
        }
    }

    /// The same parameter split along `dim` as a column-parallel layer's output is.
    pub fn split_column(mut self, dim: usize) -> Self {
        let style = TpStyle::Column {
            gather_output: false,
        };
        self.split = Some((style, dim));
        self
    }

    /// [`Self::split_column`] of a fused tensor: each of the sections of lengths `lens`
    /// along `dim` split on its own, a rank holding its share of each in order.
    pub fn split_column_sections(self, dim: usize, lens: &[usize]) -> Self {
        Param {
            sections: Sections::of(lens),
            ..self.split_column(dim)
        }
    }

    /// A fused expert tensor held [experts, out, in] (each expert a linear layer's weight).
    pub fn out_in(self) -> Self {
        Param {
            layout: ExpertLayout::OutIn,
            ..self
        }
    }

    /// A 3-D tensor peft reads [experts, in, out] (transformers' `is_transposed` experts).
    pub fn adapted_in_out(self) -> Self {
        Param {
            adapter_layout: ExpertLayout::InOut,
            ..self
        }
    }

    /// The same parameter split along `dim` as a row-parallel layer's input is.
    pub fn split_row(mut self, dim: usize) -> Self {
        self.split = Some((TpStyle::Row, dim));
        self
    }

    /// Its whole value as a tensor of the graph (a sharded one gathered, its gradient going
    /// back to the unit), with its adapter's change when it has one.
    pub fn value(&self) -> Result<Tensor> {
        let w = match &self.weight {
            Weight::Local(t) => t.clone(),
            Weight::Sharded(w) => sharded::whole(w)?,
        };
        match &self.lora {
            Some(lora) => {
                let delta = lora.weight_delta(w.dims(), self.adapter_layout)?;
                let delta = delta.to_dtype(w.dtype())?;
                w + delta
            }
            None => Ok(w),
        }
    }

    /// Holds the adapter as trainable variables, cut to this rank's slices once split over
    /// tp.
    fn split_lora(&mut self, name: &str) -> TrlResult<()> {
        match &mut self.lora {
            Some(lora) => {
                let rank = self.weight.dims().len();
                let dims = lora_split_dims(self.split, adapter_in_dim(rank, self.adapter_layout));
                // The sections go with whichever of A's inputs and B's outputs is split.
                let sections = match dims {
                    (Some(_), _) => (self.sections, Sections::WHOLE),
                    _ => (Sections::WHOLE, self.sections),
                };
                split_lora(lora, name, dims, sections, self.tp)
            }
            None => Ok(()),
        }
    }

    /// Holds the weight as a constant (no gradient): a LoRA base.
    fn freeze(&mut self) {
        if let Weight::Local(t) = &mut self.weight {
            if t.is_variable() {
                *t = t.detach();
            }
        }
    }
}

/// A parameter's adapter shape as peft's ParamWrapper sees the parameter's `full` shape:
/// (experts, in, out) for a 3-D one read as `layout` says, (1, in, out) for a 2-D [out, in]
/// one; None for any other rank.
pub fn lora_shape(full: &[usize], layout: ExpertLayout) -> Option<(usize, usize, usize)> {
    match (full, layout) {
        (&[e, i, o], ExpertLayout::InOut) => Some((e, i, o)),
        (&[e, o, i], ExpertLayout::OutIn) => Some((e, i, o)),
        (&[o, i], _) => Some((1, i, o)),
        _ => None,
    }
}

/// The dimension of a parameter of `rank` whose features are its adapter's inputs (`A`'s
/// columns), as peft reads it (`layout`, for 3-D ones).
pub fn adapter_in_dim(rank: usize, layout: ExpertLayout) -> usize {
    match (rank, layout) {
        (3, ExpertLayout::OutIn) => 2,
        _ => 1,
    }
}

/// The dimensions of a parameter's adapter `A` and `B` split over tp under `split`: a split
/// of the parameter's input features (dimension `in_dim`, [`adapter_in_dim`]) is `A`'s dim
/// 1, one of its output features `B`'s dim 0.
pub fn lora_split_dims(
    split: Option<(TpStyle, usize)>,
    in_dim: usize,
) -> (Option<usize>, Option<usize>) {
    match split {
        Some((_, d)) if d == in_dim => (Some(1), None),
        Some(_) => (None, Some(0)),
        None => (None, None),
    }
}

impl LoraTarget for Param {
    /// peft's ParamWrapper: a 2-D [out, in] parameter gets `A` [r, in] and `B` [out, r]; a
    /// 3-D one, in and out as peft reads them, `A` [experts x r, in] and `B` [out, r x experts] (see
    /// [`Lora::expert_stacks`]), at its full size, then cut as its tp split requires. peft
    /// adapts parameters without dropout or DoRA (adapter_plan refuses them).
    fn add_lora(&mut self, name: &str, config: &LoraConfig) -> TrlResult<()> {
        let Weight::Local(w) = &self.weight else {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: "add LoRA adapters before sharding the model for FSDP".into(),
            });
        };
        let mut full = w.dims().to_vec();
        if let (Some((_, d)), Some((_, size))) = (self.split, self.tp) {
            full[d] *= size;
        }
        let Some((experts, inp, out)) = lora_shape(&full, self.adapter_layout) else {
            return Err(Error::config(
                "training arguments",
                "lora_target_parameters",
                format!("{name} has shape {full:?}: peft adapts 2-D and 3-D parameters only"),
            ));
        };
        let stacked = LoraConfig {
            r: config.r * experts,
            ..config.clone()
        };
        let mut lora = Lora::init(name, (out, inp), &stacked, (w.dtype(), w.device()))?;
        // Each expert's adapter has rank r: peft scales by alpha / r.
        lora.scale = config.scale();
        self.lora = Some(lora);
        self.split_lora(name)?;
        self.freeze();
        Ok(())
    }

    fn lora_mut(&mut self) -> Option<&mut Lora> {
        self.lora.as_mut()
    }

    fn is_parameter(&self) -> bool {
        true
    }

    fn adapter_layout(&self) -> ExpertLayout {
        self.adapter_layout
    }
}

impl Parallelize for Param {
    fn parallelize(&mut self, name: &str, tp: &TpContext) -> TrlResult<()> {
        let Some((_, dim)) = self.split else {
            return Ok(());
        };
        let Weight::Local(t) = &self.weight else {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: "already sharded by FSDP: split tensor-parallel layers before wrapping"
                    .into(),
            });
        };
        self.weight = Weight::Local(tp.shard(name, t, dim, self.sections)?);
        self.tp = Some((tp.rank(), tp.size()));
        self.split_lora(name)
    }

    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        if let Weight::Local(t) = &self.weight {
            let split = match self.split {
                Some((style, dim)) => Split {
                    sections: self.sections,
                    ..Split::on(style, Some(dim))
                },
                None => Split::REPLICATED,
            };
            f(name, t, split)
        }
        if let Some(lora) = &self.lora {
            // The half not split sees this rank's share of the features: its gradient is
            // partial (as a split linear layer's adapter).
            let in_dim = adapter_in_dim(self.weight.dims().len(), self.adapter_layout);
            let sectioned = |style, d| Split {
                sections: self.sections,
                ..Split::on(style, d)
            };
            let (a, b) = match (self.split, lora_split_dims(self.split, in_dim)) {
                (None, _) => (Split::REPLICATED, Split::REPLICATED),
                (Some((style, _)), (Some(d), _)) => (sectioned(style, Some(d)), Split::PARTIAL),
                (Some((style, _)), (_, d)) => (Split::PARTIAL, sectioned(style, d)),
            };
            f(&child_name(name, "lora_A.weight"), &lora.a, a);
            f(&child_name(name, "lora_B.weight"), &lora.b, b);
        }
    }

    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> TrlResult<()> {
        f(name, &mut self.weight)
    }

    /// An expert stack keeps this rank's experts' rows (a copy owning only them).
    fn shard_experts(&mut self, name: &str, ep: EpShard, f: &mut ExpertFn) -> TrlResult<()> {
        if !self.experts {
            return Ok(());
        }
        let Weight::Local(t) = &self.weight else {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: "already sharded by ZeRO-3 / FSDP: keep each rank's experts first".into(),
            });
        };
        if self.lora.is_some() {
            return Err(Error::TensorParallel {
                name: name.into(),
                message: "a LoRA adapter on the experts (target_parameters) does not train under \
                          expert parallelism yet: target the attention and dense layers, or \
                          set parallelism_config_ep_size to 1"
                    .into(),
            });
        }
        let range = ep.range(name, t.dim(0)?)?;
        let kept = t.narrow(0, range.start, range.len())?.force_contiguous()?;
        self.weight = Weight::Local(kept.detach());
        f(
            name,
            ExpertHold::Stack {
                per_rank: range.len(),
            },
        );
        Ok(())
    }

    /// A 2-D or 3-D parameter can take an adapter (`target_parameters`).
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> TrlResult<()> {
        match self.weight.dims().len() {
            2 | 3 => f(name, self),
            _ => Ok(()),
        }
    }
}
