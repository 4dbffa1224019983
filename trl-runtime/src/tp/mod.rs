//! Tensor parallelism by annotation.
//!
//! `#[derive(Parallelize)]` on a model struct, with `#[parallel(tp = "...")]` on its fields,
//! implements [`Parallelize`]: splitting the annotated layers over the tensor-parallel group
//! (Megatron's layout), a visitor of every parameter under its HF name with how it is split,
//! and the FSDP wrap units the struct marks. The layers carry the communication: a
//! column-parallel [`crate::nn::Linear`] applies Megatron's f (identity forward, all-reduce of
//! the input gradient backward) before its matmul; a row-parallel one applies g (all-reduce of
//! the partial outputs forward) after it and adds its bias once; a vocab-parallel
//! [`crate::nn::Embedding`] looks up only its rows and all-reduces. The user's forward code is
//! unchanged: it sees fewer heads and features per rank (`tp = "divide"` on the counts).
//!
//! Styles:
//! - `column`: output features split (weight dim 0, bias too). Its output stays split unless
//!   `gather_output` is given: a row-parallel layer consumes it.
//! - `row`: input features split (weight dim 1); the bias is kept whole and added once.
//! - `vocab`: embedding rows split (lookup masked to this rank's ids, then all-reduced), or an
//!   LM head's output rows split, producing vocabulary-sharded logits for
//!   [`vocab_parallel_cross_entropy`], which never gathers them.
//! - `replicate`: every rank holds the whole parameter (the default for unannotated fields).
//! - `divide`: an integer count (heads) divided by the group size.

pub(crate) mod loss;
pub mod state;

pub use loss::{vocab_parallel_cross_entropy, vocab_parallel_log_sum_sq, vocab_parallel_token_nll};
pub use state::TpGrads;

// The layer-side vocabulary (the trait the layers implement) lives with the layers.
pub use crate::nn::module::{
    child_name, ColumnParallel, DividedByTp, Parallelize, RowParallel, Sections, Split, TpContext,
    TpLayer, TpStyle, VocabParallel,
};

use crate::error::Result;
use crate::models::Params;
use crate::nn::Weight;
use candle_core::{Tensor, TensorId, Var};
use std::collections::{BTreeMap, HashMap, HashSet};

/// One line of the plan: a parameter's HF name, its split and its full and per-rank shapes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PlanEntry {
    pub name: String,
    pub split: Split,
    pub local_shape: Vec<usize>,
    pub full_shape: Vec<usize>,
}

/// Every parameter with its HF name, each once (a weight tied to another appears under the
/// first name, as HF saves it).
pub fn named_parameters(model: &impl Parallelize) -> Result<Params> {
    let mut tensors = named_tensors(model);
    // A frozen tensor (a LoRA base) is part of the model but not trained.
    tensors.retain(|_, t| t.is_variable());
    Params::from_tensors(tensors)
}

/// Every parameter tensor by HF name (a tied one once, under the first name), trainable or
/// frozen.
pub fn named_tensors(model: &impl Parallelize) -> BTreeMap<String, Tensor> {
    let mut seen = HashSet::new();
    let mut tensors = BTreeMap::new();
    model.visit_params("", &mut |name, t, _| {
        if seen.insert(t.id()) {
            tensors.insert(name.to_string(), t.clone());
        }
    });
    tensors
}

/// The plan as data: every parameter (once) with its split and shapes for a group of `tp`.
/// Works before and after [`Parallelize::parallelize`] (`sharded` says which).
pub fn plan(model: &impl Parallelize, tp: usize, sharded: bool) -> Vec<PlanEntry> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    model.visit_params("", &mut |name, t, split| {
        if !seen.insert(t.id()) {
            return;
        }
        let dims = t.dims().to_vec();
        let (mut local, mut full) = (dims.clone(), dims);
        if let Some(d) = split.dim {
            if sharded {
                full[d] *= tp;
            } else {
                local[d] /= tp.max(1);
            }
        }
        out.push(PlanEntry {
            name: name.to_string(),
            split,
            local_shape: local,
            full_shape: full,
        });
    });
    out
}

/// Makes every weight that is not yet a trainable variable (a view, such as the skeleton a
/// sliced load splits) a variable of its own; a weight shared by two layers stays shared.
pub fn make_variables(model: &mut impl Parallelize) -> Result<()> {
    let mut made: HashMap<TensorId, Tensor> = HashMap::new();
    model.visit_weights_mut("", &mut |_, w| {
        if let Weight::Local(t) = w {
            if !t.is_variable() {
                let var = match made.get(&t.id()) {
                    Some(v) => v.clone(),
                    None => {
                        let v = Var::from_tensor(t)?.as_tensor().clone();
                        made.insert(t.id(), v.clone());
                        v
                    }
                };
                *w = Weight::Local(var);
            }
        }
        Ok(())
    })
}

/// Splits `model` over `tp` (a no-op for a group of one).
pub fn parallelize(model: &mut impl Parallelize, tp: &TpContext) -> Result<()> {
    if tp.size() == 1 {
        return Ok(());
    }
    model.parallelize("", tp)
}
