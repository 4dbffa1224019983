//! `#[context_parallel]` on a training-step function: the body runs on this rank's part of
//! the batch with attention routed to ring / Ulysses attention (see
//! `trl_runtime::context_parallel`), and the returned loss counts the whole rows' tokens.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, Ident, ItemFn, Pat, ReturnType, Type};

/// The name of the argument whose type's last path segment is `name` (`&Batch`, `Batch`).
fn argument_of_type(f: &ItemFn, name: &str) -> Option<Ident> {
    f.sig.inputs.iter().find_map(|arg| {
        let FnArg::Typed(t) = arg else { return None };
        let mut ty = &*t.ty;
        while let Type::Reference(r) = ty {
            ty = &r.elem;
        }
        let Type::Path(p) = ty else { return None };
        if p.path.segments.last()?.ident != name {
            return None;
        }
        match &*t.pat {
            Pat::Ident(i) => Some(i.ident.clone()),
            _ => None,
        }
    })
}

pub fn expand(attr: TokenStream, item: TokenStream) -> TokenStream {
    // On a mistake the item is kept as written beside the error, so that nothing else
    // (unused imports, missing names) is reported after it.
    let fail = |e: syn::Error| {
        let e = e.to_compile_error();
        quote! { #item #e }
    };
    if !attr.is_empty() {
        return fail(syn::Error::new(
            attr.span(),
            "#[context_parallel] takes no arguments",
        ));
    }
    let f: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(_) => {
            return fail(syn::Error::new(
                item.span(),
                "#[context_parallel] goes on a training-step function: \
                 `fn step(model: &M, batch: &Batch, ctx: &DistContext) -> Result<LossSum>`",
            ))
        }
    };
    let mut errors = Vec::new();
    if let Some(a) = &f.sig.asyncness {
        errors.push(syn::Error::new(
            a.span(),
            "#[context_parallel] steps cannot be async",
        ));
    }
    let batch = argument_of_type(&f, "Batch");
    if batch.is_none() {
        errors.push(syn::Error::new(
            f.sig.inputs.span(),
            "#[context_parallel] cannot find the batch: add an argument of type \
             `&Batch` (trl_runtime::data::Batch), which it cuts along the sequence",
        ));
    }
    let ctx = argument_of_type(&f, "DistContext");
    if ctx.is_none() {
        errors.push(syn::Error::new(
            f.sig.inputs.span(),
            "#[context_parallel] needs the process's groups: add an argument of type \
             `&DistContext` (trl_runtime::dist::DistContext)",
        ));
    }
    let ret = match &f.sig.output {
        ReturnType::Type(_, t) => Some(t.clone()),
        ReturnType::Default => {
            errors.push(syn::Error::new(
                f.sig.ident.span(),
                "#[context_parallel] steps return the loss: `-> Result<LossSum, E>`",
            ));
            None
        }
    };
    if let Some(all) = errors.into_iter().reduce(|mut a, b| {
        a.combine(b);
        a
    }) {
        return fail(all);
    }
    let (batch, ctx, ret) = (batch.unwrap(), ctx.unwrap(), ret.unwrap());
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = f;
    let finish = quote_spanned! {ret.span()=> __trl_scope.finish(__trl_out) };
    quote! {
        #(#attrs)*
        #vis #sig {
            let __trl_scope = ::trl_runtime::context_parallel::StepScope::enter(
                #ctx,
                <_ as ::core::borrow::Borrow<::trl_runtime::data::Batch>>::borrow(&#batch),
            )?;
            #[allow(unused_variables)]
            let #batch: &::trl_runtime::data::Batch = __trl_scope.batch();
            #[allow(clippy::redundant_closure_call)]
            let __trl_out = (|| -> #ret #block)();
            #finish
        }
    }
}
