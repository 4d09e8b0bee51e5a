//! Tensor parallelism (Megatron-style) for blocks declared with `#[diffusion_block]`.
//!
//! - [`Collective`]: the sums and gathers a group needs (MPI lives in `flux-cluster`).
//! - [`TpContext`]: a rank's group, the column/row region boundaries as autograd nodes, counters.
//! - [`ParamSpec`]: logical name, shape and split of every parameter; shard and unshard.
//! - [`Linear`], [`RmsNorm`], [`LayerNorm`], [`Embedding`], [`ParamDecl`]: what the macro's
//!   `#[linear]`, `#[norm]`, `#[embedding]` and `#[param]` fields build.
//! - [`ShardedStore`]: a rank's parameters with gather, load and gradient completion.
//! - [`creation`]: a hook on each parameter as a model is built.
//! - [`staging`]: tensor collectives through host `f32` buffers, and the bytes they stage.
//! - [`DpGroups`]: the data-parallel group a rank trains in, and its shard groups (HSDP).

mod collective;
mod context;
pub mod creation;
mod dp_groups;
mod embedding;
mod grads;
mod linear;
mod norm;
mod param;
mod spec;
pub mod staging;
mod store;

pub use collective::{Collective, Finished, Pending, SingleRank};
pub(crate) use context::AmaxFn;
pub use context::{CollectiveCounts, TpContext};
pub use dp_groups::DpGroups;
pub use embedding::{Embedding, EmbeddingDecl, EMBEDDING_INIT_STD};
pub use grads::{all_reduce_grads, pack, unpack, BUCKET_ELEMENTS};
pub(crate) use linear::shard_var;
pub use linear::{Linear, LinearDecl, LinearInit};
pub use norm::{LayerNorm, NormDecl, RmsNorm};
pub use param::{ParamDecl, ParamInit};
pub use spec::{join_name, parts, GradSync, ParamSpec, Pass, Shard};
pub use store::{check_tp_size, LogicalLoadError, ShardedStore};
