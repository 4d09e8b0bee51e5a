//! `MLPEmbedder`: `Linear → SiLU → Linear`, lifting a conditioning vector to the model width.

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::tp::Linear;

/// Widths of an [`MlpEmbedder`]: input features and model width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbedderDims {
    /// Input features (768 for CLIP-L pooled, 256 for timestep sinusoids).
    pub in_dim: i64,
    /// Model width `D`.
    pub hidden: i64,
    /// Biases on both linears (FLUX.1, DiT) or none (FLUX.2).
    pub bias: bool,
}

/// Two-layer MLP embedder for pooled text vectors and sinusoidal features (replicated).
#[diffusion_block(config = EmbedderDims)]
#[derive(Debug)]
pub struct MlpEmbedder {
    /// `[D, in]`.
    #[linear(in = config.in_dim, out = config.hidden, bias = config.bias)]
    pub linear_1: Linear,
    /// `[D, D]`.
    #[linear(in = config.hidden, out = config.hidden, bias = config.bias)]
    pub linear_2: Linear,
}

impl MlpEmbedder {
    /// `x [B, in]` → `[B, D]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.linear_2.forward(&self.linear_1.forward(x).silu())
    }
}
