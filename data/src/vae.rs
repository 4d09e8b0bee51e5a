//! VAE latent distributions: pre-encoded datasets store the encoder's mean and log-variance, and
//! training draws a fresh latent from them at every step (as MLPerf's Flux reference does).

use tch::{Kind, Tensor};

/// FLUX.1 VAE (16 channels): latents are normalised as `scale · (z − shift)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VaeNorm {
    /// Multiplies the shifted latent (FLUX.1: 0.3611).
    pub scaling_factor: f64,
    /// Subtracted before scaling (FLUX.1: 0.1159).
    pub shift_factor: f64,
}

impl VaeNorm {
    /// The FLUX.1 autoencoder's constants.
    pub const FLUX1: Self = Self {
        scaling_factor: 0.3611,
        shift_factor: 0.1159,
    };

    /// Draw `z = mean + exp(logvar / 2) · ε` and normalise it: `scale · (z − shift)`.
    ///
    /// `mean`, `logvar`, `noise` `[B, 16, H, W]` (any equal shapes) → f32 latents of that shape.
    pub fn sample(&self, mean: &Tensor, logvar: &Tensor, noise: &Tensor) -> Tensor {
        let mean = mean.to_kind(Kind::Float);
        let std = (logvar.to_kind(Kind::Float) * 0.5).exp();
        (mean + std * noise.to_kind(Kind::Float) - self.shift_factor) * self.scaling_factor
    }

    /// The deterministic latent (the distribution's mean), normalised; for validation.
    pub fn mode(&self, mean: &Tensor) -> Tensor {
        (mean.to_kind(Kind::Float) - self.shift_factor) * self.scaling_factor
    }

    /// Undo the normalisation: `z / scale + shift`, before decoding with the VAE.
    pub fn denormalize(&self, latents: &Tensor) -> Tensor {
        latents / self.scaling_factor + self.shift_factor
    }
}
