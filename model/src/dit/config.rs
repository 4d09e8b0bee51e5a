//! `DitConfig`: the shape of a DiT (Peebles & Xie) with vector conditioning, as the `[model]`
//! table of a run config with `architecture = "dit"`.

use serde::{Deserialize, Serialize};

use crate::widths::{positive_width, MAX_LAYERS};
use crate::{ConfigError, ModelConfig};

/// Hyper-parameters of a DiT with vector conditioning. Defaults are DiT-XL/2's shape (28 blocks,
/// hidden 1152, 16 heads, patch 2 over 4 latent channels) conditioned on a CLIP-L pooled vector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DitConfig {
    /// Number of DiT blocks.
    pub depth: usize,
    /// Model width `D`.
    pub hidden_size: i64,
    /// Attention heads `H`.
    pub num_attention_heads: i64,
    /// MLP width as a multiple of `D`.
    pub mlp_ratio: f64,
    /// Latent channels `C` of the `[B, C, H, W]` input.
    pub in_channels: i64,
    /// Side of the square patch folded into one token.
    pub patch_size: i64,
    /// Width of the conditioning vector (a pooled text embedding).
    pub cond_dim: i64,
    /// Width of the sinusoidal timestep features.
    pub frequency_embedding_size: i64,
    /// LayerNorm epsilon.
    pub layernorm_epsilon: f64,
}

impl Default for DitConfig {
    fn default() -> Self {
        Self {
            depth: 28,
            hidden_size: 1152,
            num_attention_heads: 16,
            mlp_ratio: 4.0,
            in_channels: 4,
            patch_size: 2,
            cond_dim: 768,
            frequency_embedding_size: 256,
            layernorm_epsilon: 1e-6,
        }
    }
}

impl DitConfig {
    /// Check the shape rules; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::check((1..=MAX_LAYERS).contains(&self.depth), "depth", || {
            format!("must be in 1..={MAX_LAYERS}, got {}", self.depth)
        })?;
        self.widths().validate()?;
        ConfigError::check(self.hidden_size % 4 == 0, "hidden_size", || {
            format!(
                "2D sin-cos positions need a multiple of 4, got {}",
                self.hidden_size
            )
        })?;
        positive_width("cond_dim", self.cond_dim)?;
        positive_width("frequency_embedding_size", self.frequency_embedding_size)?;
        ConfigError::check(
            self.frequency_embedding_size % 2 == 0,
            "frequency_embedding_size",
            || format!("must be even, got {}", self.frequency_embedding_size),
        )?;
        ConfigError::check(self.layernorm_epsilon > 0.0, "layernorm_epsilon", || {
            format!("must be positive, got {}", self.layernorm_epsilon)
        })
    }
}
