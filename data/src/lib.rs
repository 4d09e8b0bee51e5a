//! # flux-data
//!
//! Pre-encoded latent data for flux-hpc: turning stored VAE mean/log-variance into training
//! latents, and decoding the bf16 bit patterns that pre-encoded datasets use.

mod bf16;
mod vae;

pub use bf16::{bf16_from_bits, bits_from_le_bytes, bits_of};
pub use vae::VaeNorm;
