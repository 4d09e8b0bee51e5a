//! Code generation: the `flux_model::Block` impl (`new`, `param_specs`) of a `#[diffusion_block]`
//! struct, generics included, and the check that it has a `forward`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::{Error, Expr, GenericArgument, ItemStruct, LitStr, PathArguments, Result, Type};

use crate::attrs::{
    BlockArgs, BlockField, EmbeddingAttr, Errors, FieldKind, LinearAttr, NormAttr, ParamAttr,
    ParamInit, ShardKind, FIELD_ATTRS,
};

/// The state-dict name of a field: its `name = "..."` or the field's identifier.
fn state_name(field: &BlockField, explicit: &Option<LitStr>) -> String {
    explicit
        .as_ref()
        .map(LitStr::value)
        .unwrap_or_else(|| field.ident.to_string())
}

/// `p.sub("a").sub("b")` for the dotted name `a.b`.
fn sub_path(name: &str) -> TokenStream {
    let segments = name.split('.').filter(|s| !s.is_empty());
    quote!(p #(.sub(#segments))*)
}

/// The `T` of `Option<T>` / `Vec<T>`.
fn inner_type(ty: &Type) -> Option<&Type> {
    let Type::Path(path) = ty else { return None };
    let PathArguments::AngleBracketed(args) = &path.path.segments.last()?.arguments else {
        return None;
    };
    args.args.iter().find_map(|a| match a {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    })
}

fn linear_decl(attr: &LinearAttr) -> TokenStream {
    let sum_of_parts = || {
        let sizes = attr
            .parts
            .iter()
            .flat_map(|(_, parts)| parts.iter().map(|p| &p.size));
        quote!(0 #(+ (#sizes))*)
    };
    let in_dim = attr
        .in_dim
        .as_ref()
        .map(|e| quote!(#e))
        .unwrap_or_else(sum_of_parts);
    let out_dim = attr
        .out_dim
        .as_ref()
        .map(|e| quote!(#e))
        .unwrap_or_else(sum_of_parts);
    let bias = or_default(&attr.bias, quote!(true));
    let shard = match attr.shard {
        ShardKind::Replicated => quote!(::flux_model::tp::Shard::Replicated),
        ShardKind::Column => quote!(::flux_model::tp::Shard::Column),
        ShardKind::Row => quote!(::flux_model::tp::Shard::Row),
    };
    let parts = attr.parts.iter().flat_map(|(_, parts)| {
        parts.iter().map(|p| {
            let (name, size) = (p.name.to_string(), &p.size);
            quote!((#name, #size))
        })
    });
    let init = if attr.zero_init {
        quote!(Zeros)
    } else {
        quote!(Xavier)
    };
    quote! {
        ::flux_model::tp::LinearDecl {
            in_dim: #in_dim,
            out_dim: #out_dim,
            bias: #bias,
            shard: #shard,
            parts: ::flux_model::tp::parts(&[#(#parts),*]),
            init: ::flux_model::tp::LinearInit::#init,
        }
    }
}

/// `expr`, or `default` when the attribute left it out.
fn or_default(expr: &Option<Expr>, default: TokenStream) -> TokenStream {
    expr.as_ref().map(|e| quote!(#e)).unwrap_or(default)
}

/// RMSNorm: eps 1e-6 (FLUX's), no bias; LayerNorm: eps 1e-5 and a bias (torch's defaults).
fn norm_decl(attr: &NormAttr) -> TokenStream {
    let dim = &attr.dim;
    let (eps, bias) = if attr.layer {
        (quote!(1e-5), quote!(true))
    } else {
        (quote!(1e-6), quote!(false))
    };
    let eps = or_default(&attr.eps, eps);
    let bias = or_default(&attr.bias, bias);
    let on_shards = attr.on_shards;
    quote!(::flux_model::tp::NormDecl { dim: #dim, eps: #eps, bias: #bias, on_shards: #on_shards })
}

fn embedding_decl(attr: &EmbeddingAttr) -> TokenStream {
    let (num, dim, vocab_parallel) = (&attr.num, &attr.dim, attr.vocab_parallel);
    quote!(::flux_model::tp::EmbeddingDecl { num: #num, dim: #dim, vocab_parallel: #vocab_parallel })
}

fn param_decl(attr: &ParamAttr) -> TokenStream {
    let shape = &attr.shape;
    let split = match attr.split {
        Some(d) => quote!(::std::option::Option::Some(#d)),
        None => quote!(::std::option::Option::None),
    };
    let init = match &attr.init {
        ParamInit::Zeros => quote!(Zeros),
        ParamInit::Ones => quote!(Ones),
        ParamInit::Normal(std) => quote!(Normal(#std)),
    };
    let on_shards = attr.on_shards;
    quote! {
        ::flux_model::tp::ParamDecl {
            shape: ::std::vec![#(#shape),*],
            split: #split,
            init: ::flux_model::tp::ParamInit::#init,
            on_shards: #on_shards,
        }
    }
}

/// A layer field (`Linear`, a norm, `Embedding`): `Ty::new(&p.name, &decl, tp)` in `new`, the
/// declaration's specs under `prefix.name` in `param_specs`.
fn layer_code(ty: &Type, name: &str, decl: TokenStream) -> (TokenStream, TokenStream) {
    let path = sub_path(name);
    (
        quote!(#ty::new(&#path, &#decl, tp)),
        quote!(specs.extend(#decl.param_specs(&::flux_model::tp::join_name(prefix, #name), tp_size));),
    )
}

/// One field's part of `visit_linears`: the layer itself, or the child blocks' linears.
fn visit_code(field: &BlockField) -> TokenStream {
    let ident = &field.ident;
    match &field.kind {
        FieldKind::Linear(_) => quote!(f(&self.#ident);),
        FieldKind::Module(attr) if attr.when.is_some() => quote! {
            if let ::std::option::Option::Some(child) = &self.#ident {
                ::flux_model::Block::visit_linears(child, f);
            }
        },
        FieldKind::Module(_) => quote!(::flux_model::Block::visit_linears(&self.#ident, f);),
        FieldKind::Layers(_) => quote! {
            for layer in self.#ident.iter() {
                ::flux_model::Block::visit_linears(layer, f);
            }
        },
        FieldKind::Norm(_)
        | FieldKind::Embedding(_)
        | FieldKind::Param(_)
        | FieldKind::Value(_) => {
            quote!()
        }
    }
}

/// The initialiser of one field in `new` and its contribution to `param_specs`.
fn field_code(field: &BlockField) -> Result<(TokenStream, TokenStream)> {
    let ty = &field.ty;
    let module_config = |c: &Option<Expr>| {
        c.as_ref()
            .map(|e| quote!(&(#e)))
            .unwrap_or_else(|| quote!(config))
    };
    Ok(match &field.kind {
        FieldKind::Linear(attr) => {
            layer_code(ty, &state_name(field, &attr.name), linear_decl(attr))
        }
        FieldKind::Norm(attr) => layer_code(ty, &state_name(field, &attr.name), norm_decl(attr)),
        FieldKind::Embedding(attr) => {
            layer_code(ty, &state_name(field, &attr.name), embedding_decl(attr))
        }
        FieldKind::Param(attr) => {
            let name = state_name(field, &attr.name);
            let (parent, leaf) = name.rsplit_once('.').unwrap_or(("", &name));
            let (path, decl) = (sub_path(parent), param_decl(attr));
            (
                quote!(#decl.create(&#path, #leaf, tp)),
                quote!(specs.extend(#decl.param_specs(&::flux_model::tp::join_name(prefix, #name), tp_size));),
            )
        }
        FieldKind::Module(attr) => {
            let name = state_name(field, &attr.name);
            let path = sub_path(&name);
            let cfg = module_config(&attr.config);
            match &attr.when {
                None => (
                    quote!(<#ty as ::flux_model::Block>::new(&#path, #cfg, tp)),
                    quote!(specs.extend(<#ty as ::flux_model::Block>::param_specs(&::flux_model::tp::join_name(prefix, #name), #cfg, tp_size));),
                ),
                Some(when) => {
                    let inner = inner_type(ty)
                        .ok_or_else(|| Error::new_spanned(ty, "expected `Option<Block>`"))?;
                    (
                        quote!((#when).then(|| <#inner as ::flux_model::Block>::new(&#path, #cfg, tp))),
                        quote! {
                            if #when {
                                specs.extend(<#inner as ::flux_model::Block>::param_specs(&::flux_model::tp::join_name(prefix, #name), #cfg, tp_size));
                            }
                        },
                    )
                }
            }
        }
        FieldKind::Layers(attr) => {
            let name = state_name(field, &attr.name);
            let path = sub_path(&name);
            let cfg = module_config(&attr.config);
            let inner =
                inner_type(ty).ok_or_else(|| Error::new_spanned(ty, "expected `Layers<Block>`"))?;
            let count = &attr.count;
            let start = attr
                .start
                .as_ref()
                .map(|e| quote!(#e))
                .unwrap_or_else(|| quote!(0));
            (
                quote! {{
                    let layers = #path;
                    let start = #start;
                    ::flux_model::execution::Layers::new(tp, (start..start + #count).map(|i| {
                        let block = <#inner as ::flux_model::Block>::new(&layers.sub(i.to_string()), #cfg, tp);
                        (::std::format!("{}.{i}", #name), block)
                    }))
                }},
                quote! {
                    let start = #start;
                    for i in start..start + #count {
                        let layer = ::flux_model::tp::join_name(prefix, &format!("{}.{i}", #name));
                        specs.extend(<#inner as ::flux_model::Block>::param_specs(&layer, #cfg, tp_size));
                    }
                },
            )
        }
        FieldKind::Value(expr) => (quote!(#expr), quote!()),
    })
}

/// Expand `#[diffusion_block(config = C)] struct S { .. }`: parse every field, run the
/// cross-field checks on the fields that parsed, generate the `Block` impl. On any error the
/// struct is still emitted (without the macro's attributes) with a dummy `Block` impl next to
/// every error found, so one mistake does not cascade into errors wherever the struct is used.
pub fn expand(args: Result<BlockArgs>, mut item: ItemStruct) -> TokenStream {
    let mut errors = Errors::default();
    if let Err(e) = &args {
        errors.push(e.clone());
    }
    // Fields whose attribute failed, by attribute: the cross-field checks must not take them
    // for absent.
    let mut failed: Vec<String> = Vec::new();
    let fields = match &item.fields {
        syn::Fields::Named(named) => {
            let mut fields = Vec::new();
            for field in &named.named {
                match crate::attrs::parse_field(field) {
                    Ok(f) => fields.push(f),
                    Err(e) => {
                        errors.push(e);
                        failed.extend(crate::attrs::field_attr(field));
                    }
                }
            }
            fields
        }
        _ => {
            let e = Error::new_spanned(
                &item.ident,
                "#[diffusion_block] needs a struct with named fields",
            );
            errors.push(e);
            Vec::new()
        }
    };
    // Cross-field checks run on the fields that parsed.
    for e in crate::checks::check(&fields, &failed) {
        errors.push(e);
    }
    let mut code = Vec::new();
    for field in &fields {
        match field_code(field) {
            Ok(c) => code.push(c),
            Err(e) => errors.push(e),
        }
    }
    for field in item.fields.iter_mut() {
        field
            .attrs
            .retain(|a| !FIELD_ATTRS.iter().any(|n| a.path().is_ident(n)));
    }
    match (errors.finish(), args) {
        (Ok(()), Ok(args)) => generate(&args, &item, &fields, code),
        (Err(errors), args) => {
            let errors = errors.into_compile_error();
            let dummy = args.ok().map(|args| dummy_impl(&args, &item));
            quote!(#item #dummy #errors)
        }
        (Ok(()), Err(_)) => unreachable!("an argument error is collected"),
    }
}

/// A `Block` impl that compiles but is never run, emitted beside the errors (clap_derive's
/// dummies): a parent block that uses this one gets no follow-on error.
fn dummy_impl(args: &BlockArgs, item: &ItemStruct) -> TokenStream {
    let (ident, config) = (&item.ident, &args.config);
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    quote! {
        impl #impl_generics ::flux_model::Block for #ident #ty_generics #where_clause {
            type Config = #config;

            fn new(_: &::tch::nn::Path<'_>, _: &#config, _: &::flux_model::tp::TpContext) -> Self {
                ::std::unreachable!("#[diffusion_block] reported errors for this block")
            }

            fn param_specs(_: &str, _: &#config, _: i64) -> ::std::vec::Vec<::flux_model::tp::ParamSpec> {
                ::std::unreachable!("#[diffusion_block] reported errors for this block")
            }

            fn visit_linears<'s>(&'s self, _: &mut dyn FnMut(&'s ::flux_model::tp::Linear)) {}
        }
    }
}

/// The struct and its `Block` impl, from the parsed fields and each field's `(init, specs)`.
fn generate(
    args: &BlockArgs,
    item: &ItemStruct,
    fields: &[BlockField],
    code: Vec<(TokenStream, TokenStream)>,
) -> TokenStream {
    let (ident, config) = (&item.ident, &args.config);
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    let names = fields.iter().map(|f| &f.ident);
    let (inits, specs): (Vec<_>, Vec<_>) = code.into_iter().unzip();
    let visits: Vec<TokenStream> = fields.iter().map(visit_code).collect();
    // A block without linears ignores the callback.
    let f = if visits.iter().all(TokenStream::is_empty) {
        quote!(_f)
    } else {
        quote!(f)
    };
    let requires_forward = quote_spanned!(ident.span()=> let _ = Self::forward;);
    let stacks: Vec<_> = fields
        .iter()
        .filter(|f| matches!(f.kind, FieldKind::Layers(_)))
        .map(|f| &f.ident)
        .collect();
    // A block without `#[layers]` fields keeps the trait's empty default.
    let visit_layers = (!stacks.is_empty()).then(|| {
        quote! {
            fn visit_layers<'s>(&'s self, f: &mut dyn FnMut(&'s dyn ::flux_model::execution::LayerStack)) {
                #(f(&self.#stacks);)*
            }
        }
    });

    quote! {
        #item

        impl #impl_generics ::flux_model::Block for #ident #ty_generics #where_clause {
            type Config = #config;

            fn new(p: &::tch::nn::Path<'_>, config: &#config, tp: &::flux_model::tp::TpContext) -> Self {
                Self { #(#names: #inits),* }
            }

            fn param_specs(prefix: &str, config: &#config, tp_size: i64) -> ::std::vec::Vec<::flux_model::tp::ParamSpec> {
                let mut specs = ::std::vec::Vec::new();
                #(#specs)*
                specs
            }

            fn visit_linears<'s>(&'s self, #f: &mut dyn FnMut(&'s ::flux_model::tp::Linear)) {
                #(#visits)*
            }

            #visit_layers
        }

        impl #impl_generics #ident #ty_generics #where_clause {
            #[doc(hidden)]
            #[allow(dead_code)]
            fn __diffusion_block_requires_forward() {
                #requires_forward
            }
        }
    }
}
