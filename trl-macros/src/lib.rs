//! Procedural macros of trl-runtime (use them through `trl_runtime`).
//!
//! `#[derive(Parallelize)]` implements `trl_runtime::tp::Parallelize` for a model struct from
//! `#[parallel(...)]` attributes on its fields: see [`macro@Parallelize`].

mod parallelize;

use proc_macro::TokenStream;

/// Tensor parallelism (and FSDP wrap units) from field annotations.
///
/// ```ignore
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
