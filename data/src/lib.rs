//! # flux-data
//!
//! Data and checkpoints for flux-hpc: HDF5 training checkpoints (sharded or unified, atomic,
//! reshardable), pre-encoded latent datasets in HDF5 (writer, shuffling DP-aware reader with a
//! prefetch thread, validation), ingest from MLPerf tar shards, safetensors and npy files and
//! streaming HTTP sources, streaming conversion between FLUX.1 reference checkpoints and native
//! ones, a deterministic synthetic dataset with learnable structure, the counter-keyed random
//! source behind per-sample noise, VAE latent sampling from stored moments, and bf16 decoding.

mod bf16;
pub mod checkpoint;
pub mod convert;
pub mod dataset;
mod error;
pub mod failpoint;
pub mod files;
mod h5attr;
pub mod ingest;
mod rng;
mod synthetic;
mod vae;

pub use bf16::{bf16_from_bits, bits_from_le_bytes, bits_of};
pub use error::DataError;
pub use rng::KeyedRng;
pub use synthetic::{LatentSamples, SyntheticLatents, SyntheticShape};
pub use vae::VaeNorm;
