//! `DitConfig`: the shape of a DiT (Peebles & Xie) and its training objective.

use crate::{ConfigError, FluxConfig};

/// What a DiT is trained to predict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// The added noise `ε`.
    Epsilon,
    /// The velocity `v = √ᾱ·ε − √(1−ᾱ)·x₀`.
    V,
}

impl Objective {
    /// The regression target for clean `x0`, `noise` and `alpha_bar` (broadcastable, in `(0, 1]`).
    pub fn target(
        &self,
        x0: &tch::Tensor,
        noise: &tch::Tensor,
        alpha_bar: &tch::Tensor,
    ) -> tch::Tensor {
        match self {
            Self::Epsilon => noise.shallow_clone(),
            Self::V => alpha_bar.sqrt() * noise - (alpha_bar.ones_like() - alpha_bar).sqrt() * x0,
        }
    }
}

/// Hyper-parameters of a DiT with vector conditioning.
#[derive(Debug, Clone, PartialEq)]
pub struct DitConfig {
    /// Number of DiT blocks.
    pub depth: usize,
    /// Model width `D`.
    pub hidden_size: i64,
    /// Attention heads.
    pub num_attention_heads: i64,
    /// Latent channels `C`.
    pub in_channels: i64,
    /// Patch side `p`.
    pub patch_size: i64,
    /// Width of the conditioning vector (a pooled text embedding or class embedding table row).
    pub cond_dim: i64,
    /// Width of the sinusoidal timestep features.
    pub frequency_embedding_size: i64,
    /// MLP width as a multiple of `D`.
    pub mlp_ratio: f64,
    /// LayerNorm epsilon.
    pub layernorm_epsilon: f64,
    /// Training target.
    pub objective: Objective,
}

impl DitConfig {
    /// A DiT as wide as a Flux config, with as many blocks as its joint and single layers.
    pub fn from_flux(flux: &FluxConfig, objective: Objective) -> Self {
        Self {
            depth: flux.num_layers(),
            hidden_size: flux.hidden_size,
            num_attention_heads: flux.num_attention_heads,
            in_channels: flux.in_channels,
            patch_size: flux.patch_size,
            cond_dim: flux.vec_in_dim,
            frequency_embedding_size: flux.model_channels,
            mlp_ratio: flux.mlp_ratio,
            layernorm_epsilon: flux.layernorm_epsilon,
            objective,
        }
    }

    /// Head width.
    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_attention_heads
    }

    /// MLP hidden width.
    pub fn mlp_hidden(&self) -> i64 {
        (self.hidden_size as f64 * self.mlp_ratio).round() as i64
    }

    /// Features per token: `C·p²`.
    pub fn token_channels(&self) -> i64 {
        self.in_channels * self.patch_size * self.patch_size
    }

    /// Check the shape rules; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, message: String| Err(ConfigError::new(field, message));
        if self.depth == 0 {
            return bad("depth", "must be at least 1".into());
        }
        if self.num_attention_heads <= 0 || self.hidden_size % self.num_attention_heads != 0 {
            return bad(
                "num_attention_heads",
                format!("must divide hidden_size {}", self.hidden_size),
            );
        }
        if self.hidden_size % 4 != 0 {
            return bad(
                "hidden_size",
                format!(
                    "2D sin-cos positions need a multiple of 4, got {}",
                    self.hidden_size
                ),
            );
        }
        Ok(())
    }
}
