//! `Prediction`: what a diffusion model is trained to output, and the regression target of each
//! choice. One enum for every architecture: the network does not depend on it, the loss does.

use serde::{Deserialize, Serialize};
use tch::Tensor;

/// The regression target (`[training] prediction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prediction {
    /// Velocity of the straight path: `ε − x₀` (Flux, SiT).
    FlowMatching,
    /// The noise `ε` (DDPM, DiT).
    Epsilon,
    /// `σ·ε − (1 − σ)·x₀`: v-prediction on the flow-matching path.
    VPrediction,
}

impl Prediction {
    /// The target for clean `x0` and `noise` (`[B, …]`) at per-sample noise levels
    /// `sigma [B]` in `[0, 1]`.
    pub fn target(&self, x0: &Tensor, noise: &Tensor, sigma: &Tensor) -> Tensor {
        match self {
            Self::FlowMatching => noise - x0,
            Self::Epsilon => noise.shallow_clone(),
            Self::VPrediction => {
                let s = per_sample(sigma, x0);
                &s * noise - (s.ones_like() - &s) * x0
            }
        }
    }
}

/// Reshape per-sample `[B]` values to broadcast over `like`'s trailing dimensions: `[B, 1, 1, …]`.
pub fn per_sample(values: &Tensor, like: &Tensor) -> Tensor {
    let mut shape = vec![values.size()[0]];
    shape.resize(like.dim(), 1);
    values.view(shape.as_slice())
}
