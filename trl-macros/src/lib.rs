//! Procedural macros of trl-runtime (use them through `trl_runtime`).
//!
//! `#[derive(Parallelize)]` implements `trl_runtime::nn::Parallelize` for a model struct from
//! `#[parallel(...)]` attributes on its fields: see [`macro@Parallelize`].

mod context_parallel;
mod parallelize;

use proc_macro::TokenStream;

/// Tensor parallelism (and FSDP wrap units) from field annotations.
///
/// ```text
/// #[derive(Parallelize)]
/// struct Attention {
///     #[parallel(tp = "column")] q_proj: Linear,
///     #[parallel(tp = "column")] k_proj: Linear,
///     #[parallel(tp = "column")] v_proj: Linear,
///     #[parallel(tp = "row")] o_proj: Linear,
///     #[parallel(tp = "divide")] num_heads: usize,
///     #[parallel(skip)] rotary: Rotary,
/// }
/// ```
///
/// Field keys: `tp = "column" | "row" | "vocab" | "replicate" | "divide"`, `gather_output`
/// (with column), `name = "hf.path"` (the field's segment in parameter names; `""` adds none),
/// `fsdp_unit` (the field, or each element of a `Vec`, is one FSDP wrap unit), `skip` (holds
/// no parameters). Unannotated fields are visited and replicated. On the struct:
/// `#[parallel(fsdp_unit)]` makes every value of it a wrap unit.
#[proc_macro_derive(Parallelize, attributes(parallel))]
pub fn derive_parallelize(input: TokenStream) -> TokenStream {
    parallelize::expand(input.into()).into()
}

/// Splits a training step along the sequence over the cp group (ring attention) or the sp
/// group (Ulysses), as the launch's parallelism config says; a no-op when cp = sp = 1.
///
/// ```text
/// #[context_parallel]
/// fn step(model: &Model, batch: &Batch, ctx: &DistContext) -> trl_runtime::Result<LossSum> {
///     let logits = model.forward(&batch.input_ids, &batch.position_ids)?; // calls context_parallel::attention
///     Ok(cross_entropy_sum(&logits, &batch.targets()?)?)
/// }
/// ```
///
/// Inside, `batch` is this rank's part of the rows (labels shifted into `targets()` before
/// the cut), `trl_runtime::context_parallel::attention` attends over the whole sequence, and
/// the returned loss's count becomes the whole rows' token count.
#[proc_macro_attribute]
pub fn context_parallel(attr: TokenStream, item: TokenStream) -> TokenStream {
    context_parallel::expand(attr.into(), item.into()).into()
}
