//! Parsing of `#[diffusion_block(...)]` and of the per-field attributes.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{
    bracketed, parenthesized, Attribute, Error, Expr, Field, Ident, LitInt, LitStr, Result, Token,
    Type,
};

/// The field attributes this macro owns (removed from the emitted struct).
pub const FIELD_ATTRS: &[&str] = &[
    "linear",
    "norm",
    "embedding",
    "param",
    "module",
    "layers",
    "value",
];

/// How the "needs one of" errors list them.
const FIELD_ATTR_LIST: &str =
    "#[linear], #[norm], #[embedding], #[param], #[module], #[layers] or #[value]";

/// `#[diffusion_block(config = Type)]`.
pub struct BlockArgs {
    pub config: Type,
}

impl Parse for BlockArgs {
    fn parse(input: ParseStream) -> Result<Self> {
        if input.is_empty() {
            return Err(Error::new(
                Span::call_site(),
                "#[diffusion_block] needs the block's config type: #[diffusion_block(config = MyConfig)]",
            ));
        }
        let key: Ident = input.parse()?;
        if key != "config" {
            return Err(Error::new_spanned(
                &key,
                format!("unknown #[diffusion_block] argument `{key}`; expected `config = Type`"),
            ));
        }
        input.parse::<Token![=]>()?;
        let config = input.parse()?;
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after `config = Type`"));
        }
        Ok(Self { config })
    }
}

/// How a linear's weight is split over the tensor-parallel group.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ShardKind {
    Replicated,
    Column,
    Row,
}

/// One named slice of a fused dimension: `q = config.hidden_size`.
pub struct Part {
    pub name: Ident,
    pub size: Expr,
}

impl Parse for Part {
    fn parse(input: ParseStream) -> Result<Self> {
        let name = input.parse()?;
        input.parse::<Token![=]>()?;
        Ok(Self {
            name,
            size: input.parse()?,
        })
    }
}

/// `#[linear(in = .., out = .., bias = .., shard = .., parts = [..], init = .., name = "..")]`.
pub struct LinearAttr {
    pub in_dim: Option<Expr>,
    pub out_dim: Option<Expr>,
    pub bias: Option<Expr>,
    pub shard: ShardKind,
    pub shard_span: Span,
    pub parts: Option<(Span, Vec<Part>)>,
    pub zero_init: bool,
    pub name: Option<LitStr>,
}

/// `#[norm(dim = .., eps = .., bias = .., on_shards, name = "..")]` on an `RmsNorm` or a
/// `LayerNorm`.
pub struct NormAttr {
    pub dim: Expr,
    pub eps: Option<Expr>,
    /// A learnable shift (LayerNorm only).
    pub bias: Option<Expr>,
    /// The field is a `LayerNorm` (else an `RmsNorm`).
    pub layer: bool,
    pub on_shards: bool,
    pub name: Option<LitStr>,
}

/// `#[embedding(num = .., dim = .., shard = replicated | vocab, name = "..")]`.
pub struct EmbeddingAttr {
    pub num: Expr,
    pub dim: Expr,
    pub vocab_parallel: bool,
    pub name: Option<LitStr>,
}

/// How a raw parameter starts.
pub enum ParamInit {
    Zeros,
    Ones,
    Normal(Expr),
}

/// `#[param(shape = [..], init = .., split = N, on_shards, name = "..")]`.
pub struct ParamAttr {
    pub shape: Vec<Expr>,
    pub split: Option<usize>,
    pub init: ParamInit,
    pub on_shards: bool,
    pub name: Option<LitStr>,
}

/// `#[module(config = .., when = .., name = "..")]`.
pub struct ModuleAttr {
    pub config: Option<Expr>,
    pub when: Option<Expr>,
    pub name: Option<LitStr>,
}

/// `#[layers(count = .., start = .., config = .., name = "..")]`.
pub struct LayersAttr {
    pub count: Expr,
    pub start: Option<Expr>,
    pub config: Option<Expr>,
    pub name: Option<LitStr>,
}

/// What one field of the block is.
pub enum FieldKind {
    Linear(LinearAttr),
    Norm(NormAttr),
    Embedding(EmbeddingAttr),
    Param(ParamAttr),
    Module(ModuleAttr),
    Layers(LayersAttr),
    Value(Expr),
}

/// One parsed field.
pub struct BlockField {
    pub ident: Ident,
    pub ty: Type,
    pub kind: FieldKind,
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) => p.path.segments.last(),
        _ => None,
    }
}

fn type_is(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name)
}

/// Parse `key = value` pairs with a callback per key; flags are keys without `= value`. Every
/// bad key is reported, not only the first: after an error the rest of that key's value is
/// skipped and parsing goes on at the next comma. A key given twice is an error at the second.
fn parse_args(
    attr: &Attribute,
    mut on_key: impl FnMut(&Ident, ParseStream) -> Result<()>,
) -> Result<()> {
    attr.parse_args_with(|input: ParseStream| {
        let mut errors = Errors::default();
        let mut seen: Vec<Ident> = Vec::new();
        while !input.is_empty() {
            let parsed = input
                .call(syn::ext::IdentExt::parse_any)
                .and_then(|key: Ident| {
                    if seen.contains(&key) {
                        return Err(Error::new_spanned(&key, format!("`{key}` is given twice")));
                    }
                    seen.push(key.clone());
                    on_key(&key, input)
                });
            if let Err(e) = parsed {
                errors.push(e);
                skip_to_comma(input)?;
            }
            if input.is_empty() {
                break;
            }
            if let Err(e) = input.parse::<Token![,]>() {
                errors.push(e);
                skip_to_comma(input)?;
                let _ = input.parse::<Option<Token![,]>>()?;
            }
        }
        errors.finish()
    })
}

/// Skip the tokens up to the next top-level comma (or the end), after a key that failed.
fn skip_to_comma(input: ParseStream) -> Result<()> {
    input.step(|cursor| {
        let mut rest = *cursor;
        while let Some((tt, next)) = rest.token_tree() {
            if matches!(&tt, proc_macro2::TokenTree::Punct(p) if p.as_char() == ',') {
                break;
            }
            rest = next;
        }
        Ok(((), rest))
    })
}

/// Errors collected while parsing, reported together (serde_derive's `Ctxt`).
#[derive(Default)]
pub struct Errors(Option<Error>);

impl Errors {
    /// Add `e`.
    pub fn push(&mut self, e: Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    /// `Ok` when none was found, else all of them as one error.
    pub fn finish(self) -> Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

fn value<T: Parse>(input: ParseStream) -> Result<T> {
    input.parse::<Token![=]>()?;
    input.parse()
}

fn unknown(key: &Ident, attr: &str, expected: &str) -> Error {
    if key == "parts" {
        return Error::new_spanned(
            key,
            format!("`parts` only apply to #[linear] fields, not #[{attr}]"),
        );
    }
    Error::new_spanned(
        key,
        format!("unknown #[{attr}] argument `{key}`; expected {expected}"),
    )
}

fn parse_linear(attr: &Attribute, field: &Field) -> Result<LinearAttr> {
    if !type_is(&field.ty, "Linear") {
        return Err(Error::new_spanned(
            &field.ty,
            "#[linear] fields must have type `Linear`",
        ));
    }
    let mut out = LinearAttr {
        in_dim: None,
        out_dim: None,
        bias: None,
        shard: ShardKind::Replicated,
        shard_span: attr.span(),
        parts: None,
        zero_init: false,
        name: None,
    };
    parse_args(attr, |key, input| {
        match key.to_string().as_str() {
            "in" => out.in_dim = Some(value(input)?),
            "out" => out.out_dim = Some(value(input)?),
            "bias" => out.bias = Some(value(input)?),
            "name" => out.name = Some(value(input)?),
            "shard" => {
                let kind: Ident = value(input)?;
                out.shard_span = kind.span();
                out.shard = match kind.to_string().as_str() {
                    "replicated" => ShardKind::Replicated,
                    "column" => ShardKind::Column,
                    "row" => ShardKind::Row,
                    other => {
                        return Err(Error::new_spanned(
                            &kind,
                            format!("unknown shard kind `{other}`; expected `column`, `row` or `replicated`"),
                        ))
                    }
                };
            }
            "init" => {
                let init: Ident = value(input)?;
                out.zero_init = match init.to_string().as_str() {
                    "xavier" => false,
                    "zeros" => true,
                    other => {
                        return Err(Error::new_spanned(
                            &init,
                            format!("unknown init `{other}`; expected `xavier` or `zeros`"),
                        ))
                    }
                };
            }
            "parts" => {
                input.parse::<Token![=]>()?;
                let content;
                let brackets = bracketed!(content in input);
                let parts = Punctuated::<Part, Token![,]>::parse_terminated(&content)?;
                out.parts = Some((brackets.span.join(), parts.into_iter().collect()));
            }
            _ => {
                return Err(unknown(
                    key,
                    "linear",
                    "in, out, bias, shard, parts, init or name",
                ))
            }
        }
        Ok(())
    })?;
    let (split_dim, split_name) = match out.shard {
        ShardKind::Row => (&out.in_dim, "in"),
        _ => (&out.out_dim, "out"),
    };
    if let Some((span, parts)) = &out.parts {
        if out.shard == ShardKind::Replicated {
            return Err(Error::new(
                *span,
                "`parts` only apply to column- or row-parallel linears (shard = column | row)",
            ));
        }
        if parts.is_empty() {
            return Err(Error::new(
                *span,
                "`parts` needs at least one `name = size`",
            ));
        }
        if let (Some(total), Some(sizes)) = (
            split_dim.as_ref().and_then(literal),
            parts
                .iter()
                .map(|p| literal(&p.size))
                .collect::<Option<Vec<_>>>(),
        ) {
            let sum: u64 = sizes.iter().sum();
            if sum != total {
                return Err(Error::new(
                    *span,
                    format!("parts sum to {sum} but `{split_name}` is {total}; the parts must tile the split dimension exactly"),
                ));
            }
        }
    }
    let missing = |what: &str| Error::new_spanned(attr, format!("#[linear] needs `{what} = ...`"));
    if out.in_dim.is_none() && !(out.shard == ShardKind::Row && out.parts.is_some()) {
        return Err(missing("in"));
    }
    if out.out_dim.is_none() && !(out.shard == ShardKind::Column && out.parts.is_some()) {
        return Err(missing("out"));
    }
    Ok(out)
}

fn literal(e: &Expr) -> Option<u64> {
    match e {
        Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Int(i),
            ..
        }) => i.base10_parse().ok(),
        _ => None,
    }
}

fn parse_norm(attr: &Attribute, field: &Field) -> Result<NormAttr> {
    let layer = type_is(&field.ty, "LayerNorm");
    if !layer && !type_is(&field.ty, "RmsNorm") {
        return Err(Error::new_spanned(
            &field.ty,
            "#[norm] fields must have type `RmsNorm` or `LayerNorm`",
        ));
    }
    let (mut dim, mut eps, mut bias, mut on_shards, mut name) = (None, None, None, false, None);
    parse_args(attr, |key, input| {
        match key.to_string().as_str() {
            "dim" => dim = Some(value(input)?),
            "eps" => eps = Some(value(input)?),
            "bias" if !layer => {
                return Err(Error::new_spanned(
                    key,
                    "`bias` applies to `LayerNorm` fields; an `RmsNorm` has only a scale",
                ))
            }
            "bias" => bias = Some(value(input)?),
            "name" => name = Some(value(input)?),
            "on_shards" => on_shards = true,
            _ => return Err(unknown(key, "norm", "dim, eps, bias, on_shards or name")),
        }
        Ok(())
    })?;
    let dim = dim.ok_or_else(|| Error::new_spanned(attr, "#[norm] needs `dim = ...`"))?;
    Ok(NormAttr {
        dim,
        eps,
        bias,
        layer,
        on_shards,
        name,
    })
}

fn parse_embedding(attr: &Attribute, field: &Field) -> Result<EmbeddingAttr> {
    if !type_is(&field.ty, "Embedding") {
        return Err(Error::new_spanned(
            &field.ty,
            "#[embedding] fields must have type `Embedding`",
        ));
    }
    let (mut num, mut dim, mut vocab_parallel, mut name) = (None, None, false, None);
    parse_args(attr, |key, input| {
        match key.to_string().as_str() {
            "num" => num = Some(value(input)?),
            "dim" => dim = Some(value(input)?),
            "name" => name = Some(value(input)?),
            "shard" => {
                let kind: Ident = value(input)?;
                vocab_parallel = match kind.to_string().as_str() {
                    "replicated" => false,
                    "vocab" => true,
                    other => {
                        return Err(Error::new_spanned(
                            &kind,
                            format!("unknown embedding shard kind `{other}`; expected `vocab` (rows split over the group) or `replicated`"),
                        ))
                    }
                };
            }
            _ => return Err(unknown(key, "embedding", "num, dim, shard or name")),
        }
        Ok(())
    })?;
    let missing =
        |what: &str| Error::new_spanned(attr, format!("#[embedding] needs `{what} = ...`"));
    Ok(EmbeddingAttr {
        num: num.ok_or_else(|| missing("num"))?,
        dim: dim.ok_or_else(|| missing("dim"))?,
        vocab_parallel,
        name,
    })
}

fn parse_param(attr: &Attribute, field: &Field) -> Result<ParamAttr> {
    if !type_is(&field.ty, "Tensor") {
        return Err(Error::new_spanned(
            &field.ty,
            "#[param] fields must have type `Tensor`",
        ));
    }
    let mut shape: Option<(Span, Vec<Expr>)> = None;
    let (mut split, mut init, mut on_shards, mut name) = (None, ParamInit::Zeros, None, None);
    parse_args(attr, |key, input| {
        match key.to_string().as_str() {
            "shape" => {
                input.parse::<Token![=]>()?;
                let content;
                let brackets = bracketed!(content in input);
                let dims = Punctuated::<Expr, Token![,]>::parse_terminated(&content)?;
                shape = Some((brackets.span.join(), dims.into_iter().collect()));
            }
            "split" => split = Some(value::<LitInt>(input)?),
            "on_shards" => on_shards = Some(key.span()),
            "name" => name = Some(value(input)?),
            "init" => {
                let kind: Ident = value(input)?;
                init = match kind.to_string().as_str() {
                    "zeros" => ParamInit::Zeros,
                    "ones" => ParamInit::Ones,
                    "normal" if input.peek(syn::token::Paren) => {
                        let std;
                        parenthesized!(std in input);
                        ParamInit::Normal(std.parse()?)
                    }
                    "normal" => {
                        return Err(Error::new_spanned(
                            &kind,
                            "`normal` needs its standard deviation: `init = normal(0.02)`",
                        ))
                    }
                    other => {
                        return Err(Error::new_spanned(
                            &kind,
                            format!(
                                "unknown init `{other}`; expected `zeros`, `ones` or `normal(std)`"
                            ),
                        ))
                    }
                };
            }
            _ => {
                return Err(unknown(
                    key,
                    "param",
                    "shape, init, split, on_shards or name",
                ))
            }
        }
        Ok(())
    })?;
    let (shape_span, shape) = shape.ok_or_else(|| {
        Error::new_spanned(
            attr,
            "#[param] needs `shape = [...]`, e.g. `shape = [6, config.dim]`",
        )
    })?;
    if shape.is_empty() {
        return Err(Error::new(
            shape_span,
            "`shape` needs at least one dimension",
        ));
    }
    let split = match split {
        None => None,
        Some(lit) => {
            let dim: usize = lit.base10_parse()?;
            if dim >= shape.len() {
                return Err(Error::new_spanned(
                    &lit,
                    format!(
                        "`split = {dim}` is out of range: the shape has {} dimension(s), so split takes 0..{}",
                        shape.len(),
                        shape.len()
                    ),
                ));
            }
            if let Some(span) = on_shards {
                return Err(Error::new(
                    span,
                    "`on_shards` is for replicated parameters applied to sharded activations; a \
                     `split` parameter's gradient is already this rank's own",
                ));
            }
            Some(dim)
        }
    };
    Ok(ParamAttr {
        shape,
        split,
        init,
        on_shards: on_shards.is_some(),
        name,
    })
}

fn parse_module(attr: &Attribute, field: &Field) -> Result<ModuleAttr> {
    let mut out = ModuleAttr {
        config: None,
        when: None,
        name: None,
    };
    if matches!(attr.meta, syn::Meta::List(_)) {
        parse_args(attr, |key, input| {
            match key.to_string().as_str() {
                "config" => out.config = Some(value(input)?),
                "when" => out.when = Some(value(input)?),
                "name" => out.name = Some(value(input)?),
                _ => return Err(unknown(key, "module", "config, when or name")),
            }
            Ok(())
        })?;
    }
    if out.when.is_some() && !type_is(&field.ty, "Option") {
        return Err(Error::new_spanned(
            &field.ty,
            "#[module(when = ...)] fields must have type `Option<Block>`",
        ));
    }
    Ok(out)
}

fn parse_layers(attr: &Attribute, field: &Field) -> Result<LayersAttr> {
    if !type_is(&field.ty, "Layers") {
        return Err(Error::new_spanned(
            &field.ty,
            "#[layers] fields must have type `Layers<Block>`",
        ));
    }
    let (mut count, mut start, mut config, mut name) = (None, None, None, None);
    parse_args(attr, |key, input| {
        match key.to_string().as_str() {
            "count" => count = Some(value(input)?),
            "start" => start = Some(value(input)?),
            "config" => config = Some(value(input)?),
            "name" => name = Some(value(input)?),
            _ => return Err(unknown(key, "layers", "count, start, config or name")),
        }
        Ok(())
    })?;
    let count = count.ok_or_else(|| Error::new_spanned(attr, "#[layers] needs `count = ...`"))?;
    Ok(LayersAttr {
        count,
        start,
        config,
        name,
    })
}

/// The name of the first of the macro's attributes on `field` (`"linear"`, …), if any.
pub fn field_attr(field: &Field) -> Option<String> {
    field
        .attrs
        .iter()
        .filter_map(|a| a.path().get_ident())
        .map(Ident::to_string)
        .find(|n| FIELD_ATTRS.contains(&n.as_str()))
}

/// Parse one field: exactly one of the macro's attributes.
pub fn parse_field(field: &Field) -> Result<BlockField> {
    let ident = field
        .ident
        .clone()
        .ok_or_else(|| Error::new_spanned(field, "diffusion blocks need named fields"))?;
    let ours: Vec<&Attribute> = field
        .attrs
        .iter()
        .filter(|a| FIELD_ATTRS.iter().any(|n| a.path().is_ident(n)))
        .collect();
    let attr = match ours.as_slice() {
        [one] => *one,
        [] => {
            return Err(Error::new_spanned(
                &ident,
                format!("field `{ident}` needs one of {FIELD_ATTR_LIST}"),
            ))
        }
        [_, second, ..] => {
            return Err(Error::new_spanned(
                second,
                format!("a field takes exactly one of {FIELD_ATTR_LIST}"),
            ))
        }
    };
    let name = attr
        .path()
        .get_ident()
        .map(Ident::to_string)
        .unwrap_or_default();
    let kind = match name.as_str() {
        "linear" => FieldKind::Linear(parse_linear(attr, field)?),
        "norm" => FieldKind::Norm(parse_norm(attr, field)?),
        "embedding" => FieldKind::Embedding(parse_embedding(attr, field)?),
        "param" => FieldKind::Param(parse_param(attr, field)?),
        "module" => FieldKind::Module(parse_module(attr, field)?),
        "layers" => FieldKind::Layers(parse_layers(attr, field)?),
        _ => FieldKind::Value(attr.parse_args()?),
    };
    Ok(BlockField {
        ident,
        ty: field.ty.clone(),
        kind,
    })
}
