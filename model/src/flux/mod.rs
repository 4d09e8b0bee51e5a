//! FLUX.1 (Black Forest Labs; Primus' Megatron-Core Flux): the MMDiT with joint and single
//! layers, 3-axis RoPE, guidance embedding. `architecture = "flux"`, the default.

pub mod activations;
mod architecture;
pub mod blocks;
mod config;
pub mod flops;
mod layouts;
mod model;

pub use config::FluxConfig;
pub use model::{Flux, FluxTransformer};
