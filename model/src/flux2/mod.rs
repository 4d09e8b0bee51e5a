//! FLUX.2 (Black Forest Labs, 2025; diffusers' `Flux2Transformer2DModel`): double- and
//! single-stream blocks without biases, modulation computed once per model and shared by every
//! block, SwiGLU feed-forwards, 4-axis RoPE. `architecture = "flux2"`; state-dict names are
//! diffusers' (its fused attention projections); weights load from diffusers' and BFL's layouts.

mod architecture;
mod blocks;
mod config;
pub mod layouts;
mod model;

pub use blocks::{
    FeedForward, Flux2Attention, Flux2ParallelSelfAttention, Flux2SingleTransformerBlock,
    Flux2TransformerBlock,
};
pub use config::Flux2Config;
pub use model::{Flux2, Flux2Transformer, TimeGuidanceEmbed};
