//! Flux's transformer blocks: joint (double-stream, MMDiT) and single-stream layers.

mod double;
mod single;

pub use double::{DoubleBlock, JointAttention};
pub use single::SingleBlock;

use crate::FluxConfig;

/// The per-block scalars every block needs from the config.
#[derive(Debug, Clone, Copy)]
pub struct BlockOptions {
    /// Head width `Dh`.
    pub head_dim: i64,
    /// LayerNorm / RMSNorm epsilon.
    pub eps: f64,
    /// Dropout on branch outputs in training.
    pub hidden_dropout: f64,
    /// Dropout on attention probabilities in training.
    pub attention_dropout: f64,
}

impl BlockOptions {
    /// The options `config` sets.
    pub fn from_config(config: &FluxConfig) -> Self {
        Self {
            head_dim: config.head_dim(),
            eps: config.layernorm_epsilon,
            hidden_dropout: config.hidden_dropout,
            attention_dropout: config.attention_dropout,
        }
    }

    /// Attention dropout in effect (none outside training).
    pub fn attention_dropout(&self, train: bool) -> f64 {
        if train {
            self.attention_dropout
        } else {
            0.0
        }
    }
}
