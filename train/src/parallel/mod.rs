//! Data parallelism and its sharding levels (ZeRO-1/2/3, HSDP): reduced, sharded and gathered parameters, gradients and optimizer state.

pub(crate) mod data_parallel;
pub(crate) mod grad_hooks;
pub(crate) mod overlapped_reduce;
pub(crate) mod shard_layout;
pub(crate) mod sharded_adamw;
pub(crate) mod sharded_build;
pub(crate) mod sharded_grads;
pub(crate) mod sharded_params;
