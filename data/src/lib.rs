//! # flux-data
//!
//! Data and checkpoints for flux-hpc: HDF5 training checkpoints (sharded or unified, atomic,
//! reshardable), a deterministic synthetic dataset with learnable structure, the
//! counter-keyed random source behind per-sample noise, VAE latent sampling from stored moments,
//! and bf16 decoding.

mod bf16;
pub mod checkpoint;
mod rng;
mod synthetic;
mod vae;

pub use bf16::{bf16_from_bits, bits_from_le_bytes, bits_of};
pub use rng::KeyedRng;
pub use synthetic::{LatentSamples, SyntheticLatents, SyntheticShape};
pub use vae::VaeNorm;
