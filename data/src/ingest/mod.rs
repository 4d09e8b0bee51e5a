//! Ingest pre-encoded samples into latent shards (`flux-hpc data ingest`): from WebDataset tar
//! shards in MLPerf's pre-encoded format (`.bytes` entries holding npy uint16 = bf16), from
//! directories of per-sample npy / safetensors files, and streamed from an HTTP server with a
//! manifest and MD5 list.

mod http;
mod local;
mod npy;
mod record;
mod shard;
mod sources;
mod stream;

pub use http::{parse_manifest, parse_md5_list, Client, RetryPolicy};
pub use local::{convert_tar, ingest_dir, ingest_tars, plan_shards, shard_path};
pub use npy::{parse_npy, NpyArray};
pub use record::{split_key, LayoutChoice, Record};
pub use shard::{ShardBuilder, ShardSummary};
pub use sources::{Source, Sources, Standing, SOURCES_FILE};
pub use stream::{ingest_http, read_failed, write_failed, FailedFile, HttpSource};

use crate::dataset::ShardLayout;

/// How ingested samples are stored.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Storage type, normalisation and encoder names recorded in every shard.
    pub layout: LayoutChoice,
    /// Deflate level (1–9) or none.
    pub deflate: Option<u8>,
    /// Samples per shard when the source is a directory of per-sample files.
    pub samples_per_shard: usize,
}

/// What an ingest did.
#[derive(Debug, Clone, Default)]
pub struct IngestSummary {
    /// Shards written by this run.
    pub written: u64,
    /// Inputs already written (resume): tars, or samples of a directory.
    pub skipped: u64,
    /// Samples written by this run.
    pub samples: u64,
    /// The layout of the shards written.
    pub layout: Option<ShardLayout>,
    /// Files skipped after failing (streaming ingest).
    pub failed: Vec<FailedFile>,
}

impl IngestSummary {
    /// Count a written shard.
    pub fn add(&mut self, shard: ShardSummary) {
        self.written += 1;
        self.samples += shard.samples;
        self.layout.get_or_insert(shard.layout);
    }
}

/// Progress reporting of an ingest (a progress bar in the CLI).
pub trait Progress {
    /// `total` inputs will be processed.
    fn start(&self, total: u64);
    /// `n` inputs were already done (resume).
    fn skip(&self, n: u64);
    /// One input finished.
    fn advance(&self, name: &str);
    /// All done.
    fn finish(&self);
}
