//! What each step reads: synthetic or latent-shard data, split into micro-batches per rank.

pub(crate) mod data_source;
pub mod step_data;
