//! How the framework runs a model: a root block's forward pass reads as the model's math, and
//! everything about *how* its layers run lives here, applied from outside the model.
//!
//! - [`Layers`] (`layers.rs`): a `#[layers]` field; runs its blocks with the parameters gathered,
//!   released and gathered again for backward ([`residency`]), activations recomputed
//!   ([`recompute`]) and streams split under sequence parallelism.
//! - [`Stream`] / [`Conditioning`] (`args.rs`): what blocks pass on and what they read.
//! - [`residency`]: which unit a parameter belongs to, and the hooks a sharding loop installs.
//! - [`recompute`]: the autograd node that runs a block again in backward.
//!
//! This module is where flux-hpc's `unsafe` for running models lives (the FFI of
//! `csrc/recompute.cpp` and `csrc/residency.cpp`), each block with its invariant beside it.

mod args;
mod layers;
pub mod recompute;
pub mod residency;

pub use args::{Conditioning, Stream};
pub(crate) use layers::run_model;
pub use layers::{LayerStack, Layers, Role};
