//! `#[diffusion_block]`: write a diffusion-transformer block as a plain struct whose field
//! attributes say what each weight is and how it is split over a tensor-parallel group; the macro
//! writes the constructor that allocates each rank's shard, the state-dict spec checkpoints use to
//! gather and reshard, and the logical parameter count.
//!
//! ```ignore
//! #[diffusion_block(config = MlpConfig)]
//! pub struct Mlp {
//!     /// `[M, D]`, output split over the group.
//!     #[linear(in = config.dim, out = config.hidden, shard = column)]
//!     linear_fc1: Linear,
//!     /// `[D, M]`, input split; outputs all-reduced.
//!     #[linear(in = config.hidden, out = config.dim, shard = row)]
//!     linear_fc2: Linear,
//! }
//! ```
//!
//! Field attributes (each field takes exactly one; attribute expressions see `config`):
//!
//! | Attribute | Field type | Arguments |
//! | --- | --- | --- |
//! | `#[linear(..)]` | `Linear` | `in`, `out`, `bias` (default `true`), `shard = replicated \| column \| row`, `parts = [name = size, ..]` (fused tensors; omit `out`/`in` to take their sum), `init = xavier \| zeros`, `name = "dotted.name"` |
//! | `#[norm(..)]` | `RmsNorm` or `LayerNorm` | `dim`, `eps` (default 1e-6 RMSNorm, 1e-5 LayerNorm), `bias` (LayerNorm only, default `true`), `on_shards` (applied to sharded heads: gradients summed over the group), `name`; replicated |
//! | `#[embedding(..)]` | `Embedding` | `num` rows, `dim` width, `shard = replicated \| vocab` (rows split over the group, partial lookups summed forward), `name` |
//! | `#[param(..)]` | `Tensor` | `shape = [..]`, `init = zeros \| ones \| normal(std)` (default zeros), `split = N` (dimension split over the group; else replicated), `on_shards` (replicated, applied to sharded activations), `name` (the tensor's own dotted name) |
//! | `#[module(..)]` | a block | `config = expr` (default: this block's config), `when = bool` (then `Option<Block>`), `name` |
//! | `#[layers(..)]` | `Layers<Block>` | `count`, `start` (first index, default 0), `config`, `name` (e.g. `"transformer.layers"`) |
//! | `#[value(expr)]` | anything | a non-parameter field computed from `config` (and `tp`) |
//!
//! The block must also have a `forward` method; the macro checks that it exists.
//!
//! The macro implements `flux_model::Block` (generics included). It parses every field, then
//! runs the cross-field checks (`checks`) on the fields that parsed, then generates (`expand`);
//! on errors it reports all of them at their spans (every bad key of an attribute, not only the
//! first) and still emits the struct with a `Block` impl that is never run, so uses of it — a
//! parent block holding it included — do not cascade into more errors.

mod attrs;
mod checks;
mod expand;

use proc_macro::TokenStream;
use syn::parse_macro_input;

/// Declare a diffusion block; see the crate documentation for the attributes.
#[proc_macro_attribute]
pub fn diffusion_block(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = parse_macro_input!(item as syn::ItemStruct);
    expand::expand(syn::parse(attr), item).into()
}
