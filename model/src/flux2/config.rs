//! `Flux2Config`: the shape of FLUX.2's transformer, keys named as diffusers'
//! `Flux2Transformer2DModel` config names them.

use serde::{Deserialize, Serialize};

use crate::widths::{positive_width, MAX_LAYERS};
use crate::{ConfigError, ModelConfig};

/// Hyper-parameters of FLUX.2 (the `[model]` table with `architecture = "flux2"`). Defaults are
/// FLUX.2 [dev]'s: 8 double + 48 single blocks, 48 heads × 128, SwiGLU MLPs of ratio 3, 128
/// latent channels, text states of width 15360, 4-axis RoPE (32, 32, 32, 32) with θ = 2000, no
/// biases, guidance embedding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Flux2Config {
    /// Double-stream blocks (`transformer_blocks`).
    pub num_layers: usize,
    /// Single-stream blocks (`single_transformer_blocks`).
    pub num_single_layers: usize,
    /// Attention heads `H`.
    pub num_attention_heads: i64,
    /// Head width `Dh`; the model width is `H · Dh`.
    pub attention_head_dim: i64,
    /// Latent channels `C` of `[B, C, H, W]` (128 = 32 VAE channels packed 2×2).
    pub in_channels: i64,
    /// Patch side folded into one token.
    pub patch_size: i64,
    /// Width of the text states (Mistral-Small hidden states of three layers: 15360).
    pub joint_attention_dim: i64,
    /// Width of the sinusoidal timestep and guidance features.
    pub timestep_guidance_channels: i64,
    /// SwiGLU hidden width as a multiple of the model width.
    pub mlp_ratio: f64,
    /// RoPE width per position axis (time, row, column, text index); sums to the head width.
    pub axes_dims_rope: Vec<i64>,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Epsilon of every LayerNorm and RMSNorm.
    pub eps: f64,
    /// Embed a guidance strength (guidance-distilled models).
    pub guidance_embeds: bool,
    /// Guidance strength fed by default (training, sampling).
    pub guidance_scale: f64,
}

impl Default for Flux2Config {
    fn default() -> Self {
        Self {
            num_layers: 8,
            num_single_layers: 48,
            num_attention_heads: 48,
            attention_head_dim: 128,
            in_channels: 128,
            patch_size: 1,
            joint_attention_dim: 15360,
            timestep_guidance_channels: 256,
            mlp_ratio: 3.0,
            axes_dims_rope: vec![32, 32, 32, 32],
            rope_theta: 2000.0,
            eps: 1e-6,
            guidance_embeds: true,
            guidance_scale: 4.0,
        }
    }
}

impl Flux2Config {
    /// Model width `D = H · Dh`.
    pub fn hidden_size(&self) -> i64 {
        self.num_attention_heads * self.attention_head_dim
    }

    /// SwiGLU hidden width `M = mlp_ratio · D` (each of its gate and value halves).
    pub fn mlp_hidden(&self) -> i64 {
        self.widths().mlp_hidden()
    }

    /// Features per token entering the model: `C · p²`.
    pub fn token_channels(&self) -> i64 {
        self.widths().token_channels()
    }

    /// Check every rule; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("num_layers", self.num_layers),
            ("num_single_layers", self.num_single_layers),
        ] {
            ConfigError::check((1..=MAX_LAYERS).contains(&value), field, || {
                format!("must be in 1..={MAX_LAYERS}, got {value}")
            })?;
        }
        positive_width("attention_head_dim", self.attention_head_dim)?;
        positive_width("num_attention_heads", self.num_attention_heads)?;
        self.widths().validate()?;
        positive_width("joint_attention_dim", self.joint_attention_dim)?;
        positive_width(
            "timestep_guidance_channels",
            self.timestep_guidance_channels,
        )?;
        ConfigError::check(
            self.timestep_guidance_channels % 2 == 0,
            "timestep_guidance_channels",
            || format!("must be even, got {}", self.timestep_guidance_channels),
        )?;
        ConfigError::check(
            self.axes_dims_rope.iter().all(|&d| d > 0 && d % 2 == 0),
            "axes_dims_rope",
            || {
                format!(
                    "entries must be positive and even, got {:?}",
                    self.axes_dims_rope
                )
            },
        )?;
        ConfigError::check(self.axes_dims_rope.len() == 4, "axes_dims_rope", || {
            format!(
                "needs 4 entries (time, row, column, text index), got {}",
                self.axes_dims_rope.len()
            )
        })?;
        let sum: i64 = self.axes_dims_rope.iter().sum();
        ConfigError::check(sum == self.attention_head_dim, "axes_dims_rope", || {
            format!(
                "entries sum to {sum} but attention_head_dim is {}",
                self.attention_head_dim
            )
        })?;
        ConfigError::check(self.rope_theta > 0.0, "rope_theta", || {
            format!("must be positive, got {}", self.rope_theta)
        })?;
        ConfigError::check(self.eps > 0.0, "eps", || {
            format!("must be positive, got {}", self.eps)
        })?;
        ConfigError::check(self.guidance_scale >= 0.0, "guidance_scale", || {
            format!("must be non-negative, got {}", self.guidance_scale)
        })
    }
}
