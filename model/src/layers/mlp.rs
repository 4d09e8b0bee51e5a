//! Transformer MLP: `Linear(D, M) → GELU(tanh) → Linear(M, D)`, column- then row-parallel.

use flux_macros::diffusion_block;
use tch::Tensor;

use crate::tp::Linear;

/// Widths of an [`Mlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpDims {
    /// Model width `D`.
    pub dim: i64,
    /// Hidden width `M`.
    pub hidden: i64,
}

/// The feed-forward branch of a transformer block.
#[diffusion_block(config = MlpDims)]
#[derive(Debug)]
pub struct Mlp {
    /// `[M, D]`, output features split over the group.
    #[linear(in = config.dim, out = config.hidden, shard = column)]
    pub linear_fc1: Linear,
    /// `[D, M]`, input features split; outputs all-reduced.
    #[linear(in = config.hidden, out = config.dim, shard = row)]
    pub linear_fc2: Linear,
}

impl Mlp {
    /// `x [B, L, D]` → `[B, L, D]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.linear_fc2
            .forward(&self.linear_fc1.forward(x).gelu("tanh"))
    }
}

/// Dropout that is the identity outside training or when `p == 0`.
pub fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}
