//! y = x W^T + b with W stored [out_features, in_features], as in PyTorch and HF checkpoints.
//! A drop-in for `candle_nn::Linear` (same constructor, `Module`) that can also be split over a
//! tensor-parallel group (column, row or vocab; see [`crate::tp`]) and hold ZeRO-3 / FSDP
//! sharded weights.

use super::chain::Chain;
use super::embedding_adapter::EmbeddingAdapter;
use super::lora::{Lora, LoraConfig};
use super::module::{
    child_name, split_lora, ColumnParallel, LoraTarget, Parallelize, RowParallel, Sections, Split,
    TpContext, TpLayer, TpStyle, VocabParallel,
};
use super::module::{LinearFn, ParamFn, WeightFn};
use super::sharded;
use super::Weight;
use crate::comm::autograd::{copy_to_group, gather_from_group, reduce_from_group};
use crate::comm::Communicator;
use crate::error::Result as TrlResult;
use candle_core::{Result, Tensor};
use std::sync::Arc;

#[derive(Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Weight>,
    /// A LoRA adapter beside the (then frozen) weight: see [`crate::nn::lora`].
    pub lora: Option<Lora>,
    /// An LM head's adapted table (trainable tokens, or an embedding's LoRA it is tied to):
    /// the layer computes with `table.table(weight)` (see [`crate::nn::embedding_adapter`]).
    pub table: Option<EmbeddingAdapter>,
    /// How this layer is split over the tensor-parallel group, and the group (once split).
    tp: Option<(TpStyle, Arc<dyn Communicator>)>,
    /// A fused projection's output sections (see [`Linear::with_sections`]).
    sections: Sections,
    /// Whether peft sees this layer as an `nn.Linear` (see [`Linear::seen_by_peft`]).
    peft_module: bool,
}

impl Linear {
    /// As `candle_nn::Linear::new`: `weight` [out, in], optional `bias` [out].
    pub fn new(weight: impl Into<Weight>, bias: Option<Tensor>) -> Self {
        Self::from_weights(weight.into(), bias.map(Weight::Local))
    }

    /// From a weight (a tensor, or a layer's weight: `embed.embeddings().clone()` ties a
    /// head to an embedding) and an optional bias.
    pub fn from_weights(weight: impl Into<Weight>, bias: Option<Weight>) -> Self {
        Linear {
            weight: weight.into(),
            bias,
            lora: None,
            table: None,
            tp: None,
            sections: Sections::WHOLE,
            peft_module: true,
        }
    }

    /// Whether peft reaches this layer (true unless said): false for a layer transformers
    /// holds as something other than an `nn.Linear` (a slice of fused experts, a router
    /// module with a bare weight) in a model whose adapters peft does not convert. peft's
    /// `target_modules` (all-linear included) never reach it then, so no adapter goes on it
    /// here either.
    pub fn seen_by_peft(mut self, seen: bool) -> Self {
        self.peft_module = seen;
        self
    }

    /// A fused projection whose output features are sections of these lengths (Phi-3's
    /// `qkv_proj`: q, k, v): column-parallel, each rank takes its share of every section and
    /// its output is its q, its k, its v in turn.
    pub fn with_sections(mut self, lens: &[usize]) -> Self {
        self.sections = Sections::of(lens);
        self
    }

    /// Adds a LoRA adapter (named `name`, this layer's HF name) at this layer's full size,
    /// sliced as its tensor-parallel split requires (a column-parallel layer keeps its rows of
    /// `B`, a row-parallel one its columns of `A`), and freezes the base weight and bias:
    /// they get no gradient from here on.
    pub fn add_lora(&mut self, name: &str, config: &LoraConfig) -> TrlResult<()> {
        let Weight::Local(w) = &self.weight else {
            return Err(crate::Error::TensorParallel {
                name: name.into(),
                message: "add LoRA adapters before sharding the model for FSDP".into(),
            });
        };
        let (out, inp) = w.dims2()?;
        let (dtype, device) = (w.dtype(), w.device().clone());
        let size = self.tp.as_ref().map_or(1, |(_, c)| c.size());
        let dims = Self::lora_split_dims(self.tp.as_ref().map(|(s, _)| *s));
        let full = (
            if dims.1.is_some() { out * size } else { out },
            if dims.0.is_some() { inp * size } else { inp },
        );
        let mut lora = Lora::init(name, full, config, (dtype, &device))?;
        let tp = self.tp.as_ref().map(|(_, c)| (c.rank(), c.size()));
        split_lora(&mut lora, name, dims, (Sections::WHOLE, self.sections), tp)?;
        if config.dora {
            // peft's initial magnitude: the norm of each output row of W (B is zero).
            let norm = self.dora_norm(&lora)?.to_dtype(dtype)?;
            lora.magnitude = Some(candle_core::Var::from_tensor(&norm)?.as_tensor().clone());
        }
        self.freeze();
        self.lora = Some(lora);
        Ok(())
    }

    /// DoRA's weight norm of this rank's output features: `||W + scale B A||` per row, f32,
    /// detached (a row-parallel layer's rows are summed over the group first).
    fn dora_norm(&self, lora: &Lora) -> Result<Tensor> {
        let w = match &self.weight {
            Weight::Local(w) => w.clone(),
            Weight::Sharded(w) => sharded::gathered(w)?,
        };
        let sq = lora.weight_norm_sq(&w)?;
        let sq = match &self.tp {
            Some((TpStyle::Row, comm)) => comm
                .all_reduce(&sq, crate::comm::ReduceOp::Sum)
                .map_err(|e| e.into_candle())?,
            _ => sq,
        };
        sq.sqrt()
    }

    /// The whole weight as a constant (a sharded one gathered): the frozen base of an
    /// adapted table.
    pub fn whole_weight(&self) -> Result<Tensor> {
        match &self.weight {
            Weight::Local(w) => Ok(w.detach()),
            Weight::Sharded(w) => sharded::gathered(w),
        }
    }

    /// Holds the weight and bias as constants (no gradient): a LoRA base.
    pub fn freeze(&mut self) {
        for w in std::iter::once(&mut self.weight).chain(self.bias.as_mut()) {
            if let Weight::Local(t) = w {
                if t.is_variable() {
                    *w = Weight::Local(t.detach());
                }
            }
        }
    }

    /// The dimensions of `A` and `B` split over the tensor-parallel group under `style`.
    pub fn lora_split_dims(style: Option<TpStyle>) -> (Option<usize>, Option<usize>) {
        match style {
            Some(TpStyle::Column { .. } | TpStyle::Vocab) => (None, Some(0)),
            Some(TpStyle::Row) => (Some(1), None),
            _ => (None, None),
        }
    }

    /// `x`: [..., in] -> [..., out]. Leading dims are flattened into one matmul.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(table) = &self.table {
            // A head on an adapted table: the table rebuilt from the frozen weight each call
            // (the adapter's variables move at every step).
            let w = table.table(&self.whole_weight()?)?;
            let mut dims = x.dims().to_vec();
            let rows = x.flatten_to(x.rank() - 2)?;
            let y = rows.matmul(&w.to_dtype(x.dtype())?.t()?)?;
            *dims.last_mut().expect("rank >= 1") = w.dim(0)?;
            return self.add_bias(y.reshape(dims)?);
        }
        // A LoRA layer whose matmul is this rank's alone runs as one op with its adapter
        // (`nn::chain`): the graph keeps the adapter's rank-r hidden rather than the base's
        // output and the adapter's [rows, out] product beside their sum.
        if self.chains_adapter() {
            return self.forward_chain(x, &Chain::default());
        }
        let Some((style, comm)) = &self.tp else {
            return self.local_out(x, true);
        };
        let wrap = |e: crate::Error| e.into_candle();
        match style {
            // Vocab on a linear layer is an LM head: column-split, logits left split.
            TpStyle::Column { .. } | TpStyle::Vocab => {
                let x = copy_to_group(x, comm).map_err(wrap)?;
                // B holds this rank's output rows: the adapter's output is split as y is.
                let y = self.local_out(&x, true)?;
                if matches!(
                    style,
                    TpStyle::Column {
                        gather_output: true
                    }
                ) {
                    let last = y.rank() - 1;
                    gather_from_group(&y, comm, last).map_err(wrap)
                } else {
                    Ok(y)
                }
            }
            TpStyle::Row => {
                // Partial sums of the split input features, summed over the group; the bias
                // (kept whole) is added once, after the sum.
                // The adapter's share, x_i A_i^T B^T (A holds this rank's input columns),
                // joins the partial sum: one all-reduce for both.
                // With DoRA, each rank's share is scaled by the (whole rows') magnitude
                // over norm before the sum.
                let partial = self.local_out(x, false)?;
                let y = reduce_from_group(&partial, comm).map_err(wrap)?;
                self.add_bias(y)
            }
            TpStyle::Replicate | TpStyle::Partial | TpStyle::Auto => self.local_out(x, true),
        }
    }

    /// `x` through `chain` around this layer ([`Chain`]): one op of the graph where the
    /// matmul is this rank's alone (the weight whole or column-split; a LoRA adapter's output
    /// joins the op as an input; ZeRO-3 / FSDP's unit op takes the chain but its residual),
    /// else the same ops recorded one by one (a row split's all-reduce comes between, DoRA).
    pub fn forward_chain(&self, x: &Tensor, chain: &Chain) -> Result<Tensor> {
        let Some(column) = self.chain_comm() else {
            return chain.around(x, |x| self.forward(x));
        };
        if self.lora.as_ref().is_some_and(|l| l.magnitude.is_some()) {
            return chain.around(x, |x| self.forward(x));
        }
        let x = match column {
            Some(comm) => copy_to_group(x, comm).map_err(|e| e.into_candle())?,
            None => x.clone(),
        };
        match (&self.weight, &self.bias, &self.lora) {
            (Weight::Local(w), b, Some(lora)) if !w.track_op() => {
                let b = match b {
                    None => None,
                    Some(Weight::Local(b)) if !b.track_op() => Some(b),
                    Some(_) => return chain.around(&x, |x| self.local_out(x, true)),
                };
                // The adapter reads the merged input: merge in the graph, then chain the rest.
                let (x, rest) = match chain.merge_heads {
                    true => {
                        let (batch, _, seq, _) = x.dims4()?;
                        let merged = chain.rows_in(&x)?.reshape((batch, seq, ()))?;
                        let rest = Chain {
                            merge_heads: false,
                            ..chain.clone()
                        };
                        (merged, rest)
                    }
                    false => (x, chain.clone()),
                };
                let (h, up) = lora.halves(&x)?;
                rest.linear_with_adapter(&x, (w, b), (&h, &up))
            }
            (Weight::Local(w), None, None) => chain.linear(&x, w, None),
            (Weight::Local(w), Some(Weight::Local(b)), None) if chain.residual.is_none() => {
                chain.linear(&x, w, Some(b))
            }
            // A LoRA adapter on a unit's frozen weight: the same one op, from the unit.
            (Weight::Sharded(w), b, Some(lora))
                if !chain.merge_heads && chain.residual.is_none() =>
            {
                let b = match b {
                    None => None,
                    Some(Weight::Sharded(b)) => Some(b),
                    Some(Weight::Local(_)) => candle_core::bail!(
                        "a linear layer's weight and bias must be held the same way"
                    ),
                };
                let (h, up) = lora.halves(&x)?;
                sharded::linear_with_adapter(&x, (w, b), chain, (&h, &up))
            }
            (Weight::Sharded(w), b, None) => {
                let b = match b {
                    None => None,
                    Some(Weight::Sharded(b)) => Some(b),
                    Some(Weight::Local(_)) => candle_core::bail!(
                        "a linear layer's weight and bias must be held the same way"
                    ),
                };
                let inner = Chain {
                    residual: None,
                    ..chain.clone()
                };
                let y = sharded::linear_chain(&x, w, b, &inner)?;
                match &chain.residual {
                    Some(r) => r + y,
                    None => Ok(y),
                }
            }
            _ => chain.around(&x, |x| self.local_out(x, true)),
        }
    }

    /// Where the chain's matmul is this rank's alone: `Some(None)` for a layer not split,
    /// `Some(Some(group))` column-split without a gather (the input enters `group`'s
    /// backward sum); `None` where the layer's own forward must run between the chain's ops.
    fn chain_comm(&self) -> Option<Option<&Arc<dyn Communicator>>> {
        match &self.tp {
            None | Some((TpStyle::Replicate | TpStyle::Partial | TpStyle::Auto, _)) => Some(None),
            Some((
                TpStyle::Column {
                    gather_output: false,
                },
                comm,
            )) => Some(Some(comm)),
            Some(_) => None,
        }
    }

    /// Whether [`Linear::forward`] goes through [`Linear::forward_chain`]: a LoRA adapter
    /// (not DoRA) where the chain's matmul is this rank's alone.
    fn chains_adapter(&self) -> bool {
        self.lora.as_ref().is_some_and(|l| l.magnitude.is_none()) && self.chain_comm().is_some()
    }

    /// This rank's `x W^T` (`+ b` with `bias`) with the adapter's output, if there is one.
    fn local_out(&self, x: &Tensor, bias: bool) -> Result<Tensor> {
        let b = if bias { self.bias.as_ref() } else { None };
        let Some(lora) = &self.lora else {
            return self.compute(x, b);
        };
        let Some(m) = &lora.magnitude else {
            return self.compute(x, b)? + lora.delta(x)?;
        };
        // DoRA (nn::lora's docs): g = m / ||W + scale B A||, the norm detached.
        let g = m
            .to_dtype(candle_core::DType::F32)?
            .div(&self.dora_norm(lora)?)?
            .to_dtype(x.dtype())?;
        let d = lora.dropped(x)?;
        let base = self.compute(x, None)?;
        let y = if lora.dropout_active() {
            let correction = self.compute(&d, None)?.broadcast_mul(&(&g - 1.0)?)?;
            ((base + correction)? + lora.path(&d)?.broadcast_mul(&g)?)?
        } else {
            (base + lora.path(&d)?)?.broadcast_mul(&g)?
        };
        if bias {
            self.add_bias(y)
        } else {
            Ok(y)
        }
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.bias {
            None => Ok(y),
            Some(Weight::Local(b)) => crate::kernels::fused::add_bias(&y, b),
            Some(Weight::Sharded(b)) => sharded::add_bias(&y, b),
        }
    }

    fn compute(&self, x: &Tensor, bias: Option<&Weight>) -> Result<Tensor> {
        match (&self.weight, bias) {
            (Weight::Local(w), None) => local_linear(x, w, None),
            (Weight::Local(w), Some(Weight::Local(b))) => local_linear(x, w, Some(b)),
            (Weight::Sharded(w), None) => sharded::linear(x, w, None),
            (Weight::Sharded(w), Some(Weight::Sharded(b))) => sharded::linear(x, w, Some(b)),
            _ => candle_core::bail!("a linear layer's weight and bias must be held the same way"),
        }
    }

    /// The dimension of the weight and of the bias split under `style` (None: kept whole).
    fn split_dims(style: TpStyle) -> (Option<usize>, Option<usize>) {
        match style {
            TpStyle::Column { .. } | TpStyle::Vocab => (Some(0), Some(0)),
            TpStyle::Row => (Some(1), None),
            TpStyle::Replicate | TpStyle::Partial | TpStyle::Auto => (None, None),
        }
    }
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("weight", &self.weight)
            .field("bias", &self.bias)
            .field(
                "lora_r",
                &self.lora.as_ref().map(|l| l.a.dim(0).unwrap_or(0)),
            )
            .field(
                "tp",
                &self.tp.as_ref().map(|(style, c)| (style.name(), c.size())),
            )
            .finish()
    }
}

impl candle_core::Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Linear::forward(self, x)
    }
}

/// `x W^T + b` on a weight this rank holds; a frozen one (a LoRA base, not a variable) gets
/// no weight gradient computed.
fn local_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    match w.is_variable() {
        true => crate::kernels::fused::linear(x, w, b),
        false => crate::kernels::fused::linear_frozen(x, w, b),
    }
}

fn local(name: &str, w: &Weight) -> TrlResult<Tensor> {
    match w {
        Weight::Local(t) => Ok(t.clone()),
        Weight::Sharded(_) => Err(crate::Error::TensorParallel {
            name: name.into(),
            message: "already sharded by FSDP: split tensor-parallel layers before wrapping".into(),
        }),
    }
}

impl TpLayer for Linear {
    fn shard(&mut self, name: &str, style: TpStyle, tp: &TpContext) -> TrlResult<()> {
        if self.tp.is_some() {
            return Err(crate::Error::TensorParallel {
                name: name.into(),
                message: "this layer is already split (parallelize runs once per model)".into(),
            });
        }
        if !self.sections.is_whole() && !matches!(style, TpStyle::Column { .. }) {
            return Err(crate::Error::TensorParallel {
                name: name.into(),
                message: format!(
                    "a fused projection (output sections) splits only as `column`, not {}",
                    style.name()
                ),
            });
        }
        let (wd, bd) = Self::split_dims(style);
        let sections = self.sections;
        if let Some(d) = wd {
            let (name, w) = (child_name(name, "weight"), &self.weight);
            self.weight = Weight::Local(tp.shard(&name, &local(&name, w)?, d, sections)?);
        }
        if let (Some(d), Some(b)) = (bd, &self.bias) {
            let name = child_name(name, "bias");
            self.bias = Some(Weight::Local(tp.shard(
                &name,
                &local(&name, b)?,
                d,
                sections,
            )?));
        }
        self.tp = Some((style, tp.comm().clone()));
        if let Some(lora) = &mut self.lora {
            let dims = Self::lora_split_dims(Some(style));
            split_lora(
                lora,
                name,
                dims,
                (Sections::WHOLE, sections),
                Some((tp.rank(), tp.size())),
            )?;
        }
        Ok(())
    }

    fn visit_split(&self, name: &str, style: TpStyle, f: &mut ParamFn) {
        let (wd, bd) = Self::split_dims(style);
        // Sections matter only where the output features are split.
        let sectioned = |dim: Option<usize>| Split {
            sections: match dim {
                Some(0) => self.sections,
                _ => Sections::WHOLE,
            },
            ..Split::on(style, dim)
        };
        if let Weight::Local(w) = &self.weight {
            f(&child_name(name, "weight"), w, sectioned(wd));
        }
        if let Some(Weight::Local(b)) = &self.bias {
            f(&child_name(name, "bias"), b, sectioned(bd));
        }
        if let Some(table) = &self.table {
            for (part, t) in table.tensors() {
                f(&child_name(name, part), t, Split::REPLICATED);
            }
        }
        if let Some(lora) = &self.lora {
            // Column: A sees the whole input, and each rank's share of the output sends it a
            // partial gradient. Row: B sees this rank's share of x A^T, so its gradient is
            // partial too.
            let (a, b) = match style {
                TpStyle::Column { .. } | TpStyle::Vocab => (Split::PARTIAL, sectioned(Some(0))),
                TpStyle::Row => (Split::on(style, Some(1)), Split::PARTIAL),
                _ => (Split::whole(style), Split::whole(style)),
            };
            f(&child_name(name, "lora_A.weight"), &lora.a, a);
            f(&child_name(name, "lora_B.weight"), &lora.b, b);
            if let Some(m) = &lora.magnitude {
                // Split as B's rows; a row-parallel rank's share of the output sends it a
                // partial gradient, as B's.
                f(&child_name(name, "lora_magnitude_vector"), m, b);
            }
        }
    }
}

impl ColumnParallel for Linear {}
impl RowParallel for Linear {}
impl VocabParallel for Linear {}

/// Unannotated: replicated on every rank.
impl Parallelize for Linear {
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        self.visit_split(name, TpStyle::Replicate, f)
    }
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> TrlResult<()> {
        f(&child_name(name, "weight"), &mut self.weight)?;
        if let Some(b) = &mut self.bias {
            f(&child_name(name, "bias"), b)?;
        }
        Ok(())
    }
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> TrlResult<()> {
        match self.peft_module {
            true => f(name, self),
            false => Ok(()),
        }
    }
}

impl LoraTarget for Linear {
    fn add_lora(&mut self, name: &str, config: &LoraConfig) -> TrlResult<()> {
        Linear::add_lora(self, name, config)
    }
    fn lora_mut(&mut self) -> Option<&mut Lora> {
        self.lora.as_mut()
    }
    fn add_tokens(&mut self, name: &str, indices: &[u32]) -> TrlResult<()> {
        let w = self.untied_table(name)?;
        let adapter = EmbeddingAdapter::tokens(&w, indices)?;
        self.share_table(name, adapter)
    }
    fn share_table(&mut self, name: &str, adapter: EmbeddingAdapter) -> TrlResult<()> {
        self.untied_table(name)?;
        self.freeze();
        self.table = Some(adapter);
        Ok(())
    }
    fn table_adapter(&self) -> Option<&EmbeddingAdapter> {
        self.table.as_ref()
    }
    fn weight_id(&self) -> Option<candle_core::TensorId> {
        match &self.weight {
            Weight::Local(w) => Some(w.id()),
            Weight::Sharded(_) => None,
        }
    }
}

impl Linear {
    /// The whole weight for a table adapter: refused once split or sharded, or beside LoRA.
    fn untied_table(&self, name: &str) -> TrlResult<Tensor> {
        if self.tp.is_some() {
            return Err(crate::Error::TensorParallel {
                name: name.into(),
                message: "adapters on a vocab-parallel LM head's table (trainable tokens, a tied embedding's LoRA) are not implemented: train it without tensor parallelism".into(),
            });
        }
        if self.lora.is_some() || self.table.is_some() {
            return Err(crate::Error::config(
                "training arguments",
                "trainable_token_indices",
                format!("{name} already has an adapter: one adapter per layer"),
            ));
        }
        match &self.weight {
            Weight::Local(w) => Ok(w.clone()),
            Weight::Sharded(_) => Err(crate::Error::Parallelism(format!(
                "{name}: add adapters before sharding the model for ZeRO-3 / FSDP"
            ))),
        }
    }
}

/// As `candle_nn::linear`: a [out, in] weight and a bias from `vb`.
pub fn linear(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), l.bias().cloned()))
}

/// As `candle_nn::linear_no_bias`.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), None))
}
