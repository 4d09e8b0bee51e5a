//! Tensor parallelism (Megatron-style) for blocks declared with `#[diffusion_block]`.
//!
//! - [`Collective`]: the sums and gathers a group needs (MPI lives in `flux-cluster`).
//! - [`TpContext`]: a rank's group, the column/row region boundaries as autograd nodes, counters.
//! - [`ParamSpec`]: logical name, shape and split of every parameter; shard and unshard.
//! - [`Linear`], [`RmsNorm`]: the layers the macro's `#[linear]` and `#[norm]` fields build.
//! - [`ShardedStore`]: a rank's parameters with gather, load and gradient completion.

mod collective;
mod context;
mod grads;
mod linear;
mod norm;
mod spec;
mod store;

pub use collective::{Collective, SingleRank};
pub use context::{CollectiveCounts, TpContext};
pub use grads::{all_reduce_grads, BUCKET_ELEMENTS};
pub use linear::{Linear, LinearDecl, LinearInit};
pub use norm::{NormDecl, RmsNorm};
pub use spec::{join_name, parts, GradSync, ParamSpec, Shard};
pub use store::{check_tp_size, LogicalLoadError, ShardedStore};
