//! Pre-encoded latent datasets in HDF5 (format in docs/formats.md).
//!
//! A dataset is a set of shard files. Each shard holds `latents` `[N, C, H, W]` (optionally with
//! `latents_logvar`, the VAE posterior, so training draws a fresh latent per step), `t5`
//! `[N, S, D_text]`, `clip` `[N, D_pooled]`, `ids` and optional `captions`; numeric datasets are
//! bf16 (as `u16`), f16 or f32, chunked one sample per chunk, optionally deflated, each with a
//! CRC-32 attribute. Readers shuffle per epoch with a seed, split deterministically across
//! data-parallel ranks and prefetch on a thread.

mod batch;
mod checksum;
mod layout;
mod order;
mod prefetch;
mod reader;
mod validate;
mod values;
mod writer;

pub use batch::{latent_samples, LatentDraw};
pub use layout::{
    ShardLayout, CAPTIONS, CLIP, EMPTY_PROMPT, FORMAT_VERSION, IDS, LATENTS, LATENTS_LOGVAR, T5,
};
pub use order::{BatchPlan, DataPosition, SampleOrder};
pub use prefetch::{Fetched, Prefetcher};
pub use reader::{shard_files, LatentDataset};
pub use validate::{sample_ids, validate, validate_shard, ValidationReport};
pub use values::{StorageDtype, Values};
pub use writer::{Sample, ShardWriter};
