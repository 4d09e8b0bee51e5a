//! `DitConfig`: the shape of a DiT (Peebles & Xie) and its training objective.

use crate::{ConfigError, FluxConfig, Widths};

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
    /// Width, heads, MLP ratio, latent channels and patch side.
    pub widths: Widths,
    /// Width of the conditioning vector (a pooled text embedding or class embedding table row).
    pub cond_dim: i64,
    /// Width of the sinusoidal timestep features.
    pub frequency_embedding_size: i64,
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
            widths: flux.widths(),
            cond_dim: flux.vec_in_dim,
            frequency_embedding_size: flux.model_channels,
            layernorm_epsilon: flux.layernorm_epsilon,
            objective,
        }
    }

    /// Check the shape rules; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Widths {
            hidden_size,
            num_attention_heads,
            ..
        } = self.widths;
        let bad = |field: &str, message: String| Err(ConfigError::new(field, message));
        if self.depth == 0 {
            return bad("depth", "must be at least 1".into());
        }
        if num_attention_heads <= 0 || hidden_size % num_attention_heads != 0 {
            return bad(
                "num_attention_heads",
                format!("must divide hidden_size {hidden_size}"),
            );
        }
        if hidden_size % 4 != 0 {
            return bad(
                "hidden_size",
                format!("2D sin-cos positions need a multiple of 4, got {hidden_size}"),
            );
        }
        Ok(())
    }
}
