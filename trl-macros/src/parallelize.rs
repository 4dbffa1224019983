//! `#[derive(Parallelize)]` as serde_derive is built: [`parse`] reads the struct into a typed
//! description ([`Container`]), [`check`] applies every rule to it (all errors of one struct
//! are reported together), then [`generate`] writes the `impl trl_runtime::nn::Parallelize`.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Field, LitStr, Type};

const FIELD_KEYS: &str = "`tp = \"...\"`, `gather_output`, `name = \"...\"`, `fsdp_unit`, `skip`";
const STYLES: &str = "\"column\", \"row\", \"vocab\", \"replicate\", \"partial\", \"divide\"";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Style {
    Column,
    Row,
    Vocab,
    Replicate,
    /// Replicated, but used on features split over tp (per-head q/k norms): each rank
    /// computes part of its gradient, so the gradient is summed over the group.
    Partial,
    Divide,
}

impl Style {
    fn parse(s: &str) -> Option<Style> {
        Some(match s {
            "column" => Style::Column,
            "row" => Style::Row,
            "vocab" => Style::Vocab,
            "replicate" => Style::Replicate,
            "partial" => Style::Partial,
            "divide" => Style::Divide,
            _ => return None,
        })
    }
}

/// What one field's `#[parallel(...)]` attributes say.
#[derive(Default)]
struct FieldAttrs {
    style: Option<(Style, Span)>,
    gather_output: Option<Span>,
    name: Option<LitStr>,
    fsdp_unit: Option<Span>,
    skip: Option<Span>,
}

/// Collects errors so that every mistake of a struct is reported in one compile.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, span: Span, msg: impl std::fmt::Display) {
        let e = syn::Error::new(span, msg);
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }
    fn add(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }
}

fn set_once<T>(slot: &mut Option<T>, value: T, span: Span, key: &str, errors: &mut Errors) {
    if slot.is_some() {
        errors.push(
            span,
            format!("duplicate `{key}` in #[parallel(...)]: give it once"),
        );
    } else {
        *slot = Some(value);
    }
}

fn parse_field_attrs(field: &Field, errors: &mut Errors) -> FieldAttrs {
    let mut out = FieldAttrs::default();
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("parallel")) {
        let res = attr.parse_nested_meta(|meta| {
            let span = meta.path.span();
            let key = meta
                .path
                .get_ident()
                .map(|i| i.to_string())
                .unwrap_or_default();
            match key.as_str() {
                "tp" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    match Style::parse(&lit.value()) {
                        Some(style) => {
                            set_once(&mut out.style, (style, lit.span()), span, "tp", errors)
                        }
                        None => errors.push(
                            lit.span(),
                            format!(
                                "unknown tensor-parallel style \"{}\": use one of {STYLES}",
                                lit.value()
                            ),
                        ),
                    }
                }
                "name" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    set_once(&mut out.name, lit, span, "name", errors);
                }
                "gather_output" => set_once(&mut out.gather_output, span, span, &key, errors),
                "fsdp_unit" => set_once(&mut out.fsdp_unit, span, span, &key, errors),
                "skip" => set_once(&mut out.skip, span, span, &key, errors),
                _ => {
                    // Consume a value if one was given, so parsing goes on to the next key.
                    if meta.input.peek(syn::Token![=]) {
                        let _: syn::Expr = meta.value()?.parse()?;
                    }
                    errors.push(
                        span,
                        format!(
                            "unknown key `{}` in #[parallel(...)] on a field: use {FIELD_KEYS}",
                            meta.path.to_token_stream()
                        ),
                    );
                }
            }
            Ok(())
        });
        if let Err(e) = res {
            errors.add(e);
        }
    }
    out
}

/// The last path segment of a type (`Linear` for `trl_runtime::nn::Linear`), if a path.
fn type_name(ty: &Type) -> Option<String> {
    match ty {
        Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
        _ => None,
    }
}

/// A style on a type the macro can see cannot take it: why, or None (the trait bound on the
/// generated call checks the types it does not know).
fn style_misfit(style: Style, ty: &Type) -> Option<String> {
    let name = type_name(ty)?;
    // An Option takes its layer's style (`impl TpLayer for Option<T>`); a Vec or Box does not.
    let container = matches!(name.as_str(), "Vec" | "Box");
    let norm = name.ends_with("Norm");
    match style {
        Style::Replicate | Style::Partial => None,
        Style::Divide => match name.as_str() {
            "usize" | "u32" | "u64" | "i32" | "i64" => None,
            _ => Some(format!(
                "`tp = \"divide\"` divides a count (such as the number of attention heads) by the \
                 tp size; it needs an integer field, not `{name}`"
            )),
        },
        _ if container => Some(format!(
            "a tensor-parallel style goes on a layer, not on a `{name}`: annotate the layer \
             fields of the element type (deriving Parallelize for it) and leave this field \
             unannotated, or mark it `fsdp_unit`"
        )),
        _ if norm => Some(format!(
            "`{name}` cannot be split over tp ranks: a norm's weight scales every feature of \
             its input, so each rank needs all of it; leave it unannotated (replicated), or mark it `tp = \"partial\"` when it acts on split \
             features (per-head q/k norms)"
        )),
        Style::Column | Style::Row if name == "Embedding" => Some(
            "an embedding is split by vocabulary rows: use `tp = \"vocab\"` (column and row \
             styles apply to Linear layers)"
                .into(),
        ),
        _ if name == "Tensor" || name == "Var" => Some(format!(
            "a bare `{name}` does not know how to split itself or communicate: wrap it in \
             trl_runtime::nn::Linear or Embedding (column, row: Linear; vocab: Linear or \
             Embedding)"
        )),
        _ => None,
    }
}

/// A struct as `#[derive(Parallelize)]` reads it: what `parse` gives `check` and `expand`.
struct Container<'a> {
    input: &'a DeriveInput,
    /// `#[parallel(fsdp_unit)]` on the struct.
    fsdp_unit: bool,
    fields: Vec<FieldDesc<'a>>,
}

/// One field and what its attributes say.
struct FieldDesc<'a> {
    index: usize,
    field: &'a Field,
    attrs: FieldAttrs,
}

impl FieldDesc<'_> {
    /// Its name, or its index in a tuple struct.
    fn label(&self) -> String {
        self.field
            .ident
            .as_ref()
            .map(|x| x.to_string())
            .unwrap_or_else(|| self.index.to_string())
    }
}

pub fn expand(input: TokenStream) -> TokenStream {
    let input = match syn::parse2::<DeriveInput>(input) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error(),
    };
    let mut errors = Errors::default();
    let container = match parse(&input, &mut errors) {
        Ok(c) => c,
        Err(e) => return e.to_compile_error(),
    };
    check(&container, &mut errors);
    match errors.0 {
        Some(e) => e.to_compile_error(),
        None => generate(&container),
    }
}

/// Reads the struct and every `#[parallel(...)]` attribute, collecting what is wrong in
/// `errors`; an enum or a union is refused at once.
fn parse<'a>(input: &'a DeriveInput, errors: &mut Errors) -> syn::Result<Container<'a>> {
    let fields =
        match &input.data {
            Data::Struct(s) => &s.fields,
            Data::Enum(e) => return Err(syn::Error::new(
                e.enum_token.span,
                "#[derive(Parallelize)] applies to structs: a model's layers are the fields of \
                 a struct; derive it on the structs that hold them",
            )),
            Data::Union(u) => {
                return Err(syn::Error::new(
                    u.union_token.span,
                    "#[derive(Parallelize)] applies to structs, not unions",
                ))
            }
        };
    let mut fsdp_unit = false;
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("parallel")) {
        let res = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("fsdp_unit") {
                if fsdp_unit {
                    errors.push(meta.path.span(), "duplicate `fsdp_unit`: give it once");
                }
                fsdp_unit = true;
            } else {
                if meta.input.peek(syn::Token![=]) {
                    let _: syn::Expr = meta.value()?.parse()?;
                }
                errors.push(
                    meta.path.span(),
                    format!(
                        "unknown key `{}` in #[parallel(...)] on a struct: only `fsdp_unit` goes \
                         there (tensor-parallel styles go on fields)",
                        meta.path.to_token_stream()
                    ),
                );
            }
            Ok(())
        });
        if let Err(e) = res {
            errors.add(e);
        }
    }
    let fields = fields
        .iter()
        .enumerate()
        .map(|(index, field)| FieldDesc {
            index,
            field,
            attrs: parse_field_attrs(field, errors),
        })
        .collect();
    Ok(Container {
        input,
        fsdp_unit,
        fields,
    })
}

impl Container<'_> {
    /// Whether a field has style `s` (and, when `gathered` says, gathers its output or not).
    fn has(&self, s: Style, gathered: Option<bool>) -> bool {
        self.fields.iter().any(|f| {
            matches!(f.attrs.style, Some((x, _)) if x == s)
                && gathered.is_none_or(|g| f.attrs.gather_output.is_some() == g)
        })
    }

    /// Column layers feeding a row layer own a region whose activations are split over tp.
    fn split_region(&self) -> bool {
        self.has(Style::Column, Some(false)) && self.has(Style::Row, None)
    }
}

/// Every consistency rule, all of them in one pass: keys that conflict on a field, a style
/// its type cannot take, column layers with nothing row-parallel to consume them (and back).
fn check(c: &Container, errors: &mut Errors) {
    for f in &c.fields {
        check_field(f, errors);
    }
    let struct_name = &c.input.ident;
    if c.has(Style::Column, Some(false)) && !c.has(Style::Row, None) {
        for f in &c.fields {
            if let (Some((Style::Column, span)), None) = (f.attrs.style, f.attrs.gather_output) {
                errors.push(
                    span,
                    format!(
                        "column-parallel `{}` leaves its output split over the tp ranks, and no \
                         field of `{struct_name}` is row-parallel to consume it: mark the layer \
                         that reads this output `tp = \"row\"`, or add `gather_output` here",
                        f.label()
                    ),
                );
            }
        }
    }
    if c.has(Style::Row, None) && !c.has(Style::Column, Some(false)) {
        for f in &c.fields {
            if let Some((Style::Row, span)) = f.attrs.style {
                errors.push(
                    span,
                    format!(
                        "row-parallel `{}` expects its input split over the tp ranks, but no \
                         field of `{struct_name}` is column-parallel (without gather_output) \
                         to produce it: mark the layers that feed it `tp = \"column\"`",
                        f.label()
                    ),
                );
            }
        }
    }
}

/// One field's keys against each other and against its type.
fn check_field(f: &FieldDesc, errors: &mut Errors) {
    let a = &f.attrs;
    if let Some(skip) = a.skip {
        if a.style.is_some() || a.fsdp_unit.is_some() || a.gather_output.is_some() {
            errors.push(
                skip,
                "`skip` conflicts with the other keys on this field: a skipped field holds \
                 no parameters, so it has no style or unit",
            );
        }
    }
    if let (Some(unit), Some((style, _))) = (a.fsdp_unit, a.style) {
        if !matches!(style, Style::Replicate | Style::Partial) {
            errors.push(
                unit,
                "`fsdp_unit` marks a module (or a Vec of modules) as an FSDP wrap unit; a \
                 tensor-parallel style marks a layer: put the style on the layers inside",
            );
        }
    }
    if let Some(g) = a.gather_output {
        if !matches!(a.style, Some((Style::Column, _))) {
            errors.push(
                g,
                "`gather_output` applies to `tp = \"column\"` only (it all-gathers the \
                 column-split output)",
            );
        }
    }
    if let Some((style, span)) = a.style {
        if let Some(why) = style_misfit(style, &f.field.ty) {
            let ty = f.field.ty.span();
            errors.push(ty.join(span).unwrap_or(ty), why);
        }
    }
}

/// The generated code, method by method: each field's part of every method.
#[derive(Default)]
struct Plan {
    parallelize: Vec<TokenStream>,
    visit: Vec<TokenStream>,
    visit_mut: Vec<TokenStream>,
    linears: Vec<TokenStream>,
    units: Vec<TokenStream>,
    /// Fields that may hold experts (expert parallelism keeps this rank's).
    experts: Vec<TokenStream>,
    /// Generic structs: each visited field type must itself be Parallelize.
    bounds: Vec<TokenStream>,
}

/// The `impl Parallelize` of a checked struct.
fn generate(c: &Container) -> TokenStream {
    let mut plan = Plan::default();
    let split_region = c.split_region();
    for f in c.fields.iter().filter(|f| f.attrs.skip.is_none()) {
        plan_field(f, split_region, &mut plan);
    }
    implementation(c, plan)
}

/// Field `f`'s part of each method. In a split region its unannotated parameters may act
/// on split features (per-head q/k norms, partial gradients) or on whole ones (a layer's
/// input norm): they are `auto`, and the first step's gradients tell which.
fn plan_field(f: &FieldDesc, split_region: bool, plan: &mut Plan) {
    let tp = quote!(::trl_runtime::nn::module);
    let a = &f.attrs;
    let member = match &f.field.ident {
        Some(id) => quote!(#id),
        None => {
            let idx = syn::Index::from(f.index);
            quote!(#idx)
        }
    };
    let segment = match &a.name {
        Some(lit) => lit.value(),
        None => f.label(),
    };
    let child = if segment.is_empty() {
        quote!(name.to_string())
    } else {
        quote!(#tp::child_name(name, #segment))
    };
    let ty = &f.field.ty;
    let span = ty.span();
    let style = a.style.map(|(s, _)| s).unwrap_or(Style::Replicate);
    // How the field's whole parameters are marked in the plan.
    let whole = match (a.style, split_region) {
        (Some((Style::Partial, _)), _) => Some(quote!(s.whole_as(#tp::TpStyle::Partial))),
        (Some((Style::Replicate, _)), _) => Some(quote!(s.whole_as(#tp::TpStyle::Replicate))),
        (None, true) => Some(quote!(s.in_split_region())),
        _ => None,
    };
    let tp_style = match style {
        Style::Column => {
            let gather = a.gather_output.is_some();
            Some((
                format_ident!("ColumnParallel"),
                quote!(#tp::TpStyle::Column { gather_output: #gather }),
            ))
        }
        Style::Row => Some((format_ident!("RowParallel"), quote!(#tp::TpStyle::Row))),
        Style::Vocab => Some((format_ident!("VocabParallel"), quote!(#tp::TpStyle::Vocab))),
        Style::Replicate | Style::Partial | Style::Divide => None,
    };
    match (style, tp_style) {
        (Style::Divide, _) => {
            plan.parallelize.push(quote_spanned! {span=>
                #tp::DividedByTp::divide(&mut self.#member, &#child, tp)?;
            });
        }
        (_, Some((marker, style_value))) => {
            plan.parallelize.push(quote_spanned! {span=>
                {
                    fn layer<T: #tp::#marker>(layer: &mut T) -> &mut T { layer }
                    #tp::TpLayer::shard(layer(&mut self.#member), &#child, #style_value, tp)?;
                }
            });
            plan.visit.push(quote! {
                #tp::TpLayer::visit_split(&self.#member, &#child, #style_value, f);
            });
            plan.visit_mut.push(quote! {
                #tp::Parallelize::visit_weights_mut(&mut self.#member, &#child, f)?;
            });
            plan.linears.push(quote! {
                #tp::Parallelize::visit_linears_mut(&mut self.#member, &#child, f)?;
            });
        }
        _ => {
            plan.bounds
                .push(quote_spanned!(span=> #ty: #tp::Parallelize));
            plan.parallelize.push(quote_spanned! {span=>
                #tp::Parallelize::parallelize(&mut self.#member, &#child, tp)?;
            });
            plan.visit.push(match whole {
                Some(mark) => quote! {
                    #tp::Parallelize::visit_params(&self.#member, &#child, &mut |n, t, s: #tp::Split| f(n, t, #mark));
                },
                None => quote! {
                    #tp::Parallelize::visit_params(&self.#member, &#child, f);
                },
            });
            plan.visit_mut.push(quote! {
                #tp::Parallelize::visit_weights_mut(&mut self.#member, &#child, f)?;
            });
            plan.linears.push(quote! {
                #tp::Parallelize::visit_linears_mut(&mut self.#member, &#child, f)?;
            });
            plan.experts.push(quote! {
                #tp::Parallelize::shard_experts(&mut self.#member, &#child, ep, f)?;
            });
            plan.units.push(if a.fsdp_unit.is_some() {
                quote!(#tp::Parallelize::visit_as_unit(&self.#member, &#child, f);)
            } else {
                quote!(#tp::Parallelize::visit_units(&self.#member, &#child, f);)
            });
        }
    }
}

/// The impl block around the fields' parts (arguments a method does not use named `_`).
fn implementation(c: &Container, plan: Plan) -> TokenStream {
    let tp = quote!(::trl_runtime::nn::module);
    let input = c.input;
    let ident = &input.ident;
    let struct_unit = c.fsdp_unit;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let Plan {
        parallelize,
        visit,
        visit_mut,
        linears,
        units,
        experts,
        bounds,
    } = plan;
    let where_clause = if input.generics.params.is_empty() {
        quote!(#where_clause)
    } else {
        let existing = where_clause.map(|w| {
            let preds = &w.predicates;
            quote!(#preds,)
        });
        quote!(where #existing #(#bounds,)*)
    };
    let used = |used: bool, name: TokenStream, unused: TokenStream| match used {
        true => name,
        false => unused,
    };
    let uses_name = !parallelize.is_empty();
    let (p_name, p_tp) = (
        used(uses_name, quote!(name), quote!(_name)),
        used(uses_name, quote!(tp), quote!(_tp)),
    );
    let (v_name, v_f) = (
        used(!visit.is_empty(), quote!(name), quote!(_name)),
        used(!visit.is_empty(), quote!(f), quote!(_f)),
    );
    let (m_name, m_f) = (
        used(!visit_mut.is_empty(), quote!(name), quote!(_name)),
        used(!visit_mut.is_empty(), quote!(f), quote!(_f)),
    );
    let (l_name, l_f) = (
        used(!linears.is_empty(), quote!(name), quote!(_name)),
        used(!linears.is_empty(), quote!(f), quote!(_f)),
    );
    let (u_name, u_f) = (
        used(!units.is_empty(), quote!(name), quote!(_name)),
        used(!units.is_empty(), quote!(f), quote!(_f)),
    );
    // Structs without fields that may hold experts keep the default (nothing to keep).
    let shard_experts = match experts.is_empty() {
        true => quote!(),
        false => quote! {
            fn shard_experts(
                &mut self,
                name: &str,
                ep: #tp::EpShard,
                f: &mut #tp::ExpertFn,
            ) -> ::trl_runtime::Result<()> {
                #(#experts)*
                Ok(())
            }
        },
    };
    quote! {
        #[automatically_derived]
        impl #impl_generics #tp::Parallelize for #ident #ty_generics #where_clause {
            const FSDP_UNIT: bool = #struct_unit;

            fn parallelize(&mut self, #p_name: &str, #p_tp: &#tp::TpContext) -> ::trl_runtime::Result<()> {
                #(#parallelize)*
                Ok(())
            }

            fn visit_params(
                &self,
                #v_name: &str,
                #v_f: &mut #tp::ParamFn,
            ) {
                #(#visit)*
            }

            fn visit_weights_mut(
                &mut self,
                #m_name: &str,
                #m_f: &mut #tp::WeightFn,
            ) -> ::trl_runtime::Result<()> {
                #(#visit_mut)*
                Ok(())
            }

            fn visit_linears_mut(
                &mut self,
                #l_name: &str,
                #l_f: &mut #tp::LinearFn,
            ) -> ::trl_runtime::Result<()> {
                #(#linears)*
                Ok(())
            }

            fn visit_units(&self, #u_name: &str, #u_f: &mut dyn FnMut(&str)) {
                #(#units)*
            }

            #shard_experts
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated code of one annotated attention block, kept in the repository so that a
    /// change to it shows in review. `TRL_BLESS=1 cargo test -p trl-macros` rewrites it.
    #[test]
    fn expansion_snapshot() {
        let input = quote! {
            #[parallel(fsdp_unit)]
            struct Attention {
                #[parallel(tp = "column")]
                q_proj: Linear,
                #[parallel(tp = "row", name = "out")]
                o_proj: Linear,
                #[parallel(tp = "divide")]
                num_heads: usize,
                #[parallel(skip)]
                rotary: Rotary,
                norm: RmsNorm,
            }
        };
        let file: syn::File = syn::parse2(expand(input)).expect("expansion parses");
        let got = prettyplease::unparse(&file);
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/expand/attention.expanded.rs"
        );
        if std::env::var_os("TRL_BLESS").is_some() {
            std::fs::write(path, &got).unwrap();
        }
        let want = std::fs::read_to_string(path).unwrap_or_default();
        assert_eq!(
            got, want,
            "the expansion changed: review it and rerun with TRL_BLESS=1 to accept"
        );
    }
}
