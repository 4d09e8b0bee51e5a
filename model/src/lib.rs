//! # flux-model
//!
//! Diffusion transformers in Rust on libtorch: FLUX.1 (Primus' Megatron-Core Flux) and DiT, each
//! an [`architecture`] the rest of flux-hpc trains, samples, checkpoints and shards through the
//! [`ModelConfig`] / [`DiffusionModel`] traits.
//!
//! Data flow of one forward pass (batch-first, `D` = hidden width, `Li`/`Lt` image/text tokens):
//!
//! ```text
//! img [B,C,H,W] ─patchify→ [B,Li,C·p²] ─x_embedder→ [B,Li,D] ┐
//! txt [B,Lt,4096] ─context_embedder→ [B,Lt,D]                 ├→ joint layers ×N → cat [B,Lt+Li,D]
//! t [B], y [B,768], guidance [B] → vec [B,D] (conditioning)   ┘   → single layers ×M → image tokens
//!   → norm_out(vec) → proj_out → [B,Li,C·p²] ─unpatchify→ [B,C,H,W] velocity
//! ```
//!
//! Blocks are declared with `#[diffusion_block]` (crate `flux-macros`): their fields say what each
//! weight is and how it is split over a tensor-parallel group ([`tp`]); the macro writes the
//! constructor, the state-dict spec and the parameter count.

// Lets the macro's `::flux_model::…` paths resolve inside this crate too.
extern crate self as flux_model;

pub mod activations;
pub mod architecture;
pub mod attention;
mod block;
mod config_error;
pub mod convert;
pub mod dit;
pub mod embeddings;
pub mod execution;
pub mod float8;
pub mod flops;
pub mod flux;
pub mod flux2;
pub mod layers;
pub mod lora;
pub mod patchify;
mod prediction;
pub mod tensor_memory;
pub mod tp;
mod widths;

pub use architecture::{
    DiffusionBatch, DiffusionModel, InputError, InputSpec, ModelConfig, ModelSpec, Registered,
    ARCHITECTURES,
};
pub use block::Block;
pub use config_error::ConfigError;
pub use flux::{Flux, FluxConfig, FluxTransformer};
pub use prediction::{per_sample, Prediction};
pub use widths::Widths;
