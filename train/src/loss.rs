//! Diffusion losses: what the model predicts, and how errors are reduced.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::noise::per_sample;

/// The regression target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prediction {
    /// Velocity of the straight path: `ε − x₀` (Flux).
    FlowMatching,
    /// The noise `ε` (DDPM).
    Epsilon,
    /// `σ·ε − (1 − σ)·x₀`.
    VPrediction,
}

impl Prediction {
    /// The target for clean `x0`, `noise` and per-sample `sigma [B]`.
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

/// How elementwise errors become one number.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Reduction {
    /// Mean squared error.
    Mse,
    /// Mean absolute error.
    Mae,
    /// Mean Huber loss: quadratic within `delta`, linear beyond.
    Huber {
        /// Switch point between the quadratic and linear parts.
        delta: f64,
    },
}

/// Mean of the elementwise loss between `prediction` and `target` (any equal shapes), in f32.
pub fn compute_diffusion_loss(
    prediction: &Tensor,
    target: &Tensor,
    reduction: Reduction,
) -> Tensor {
    let diff = prediction.to_kind(Kind::Float) - target.to_kind(Kind::Float);
    match reduction {
        Reduction::Mse => diff.square().mean(Kind::Float),
        Reduction::Mae => diff.abs().mean(Kind::Float),
        Reduction::Huber { delta } => {
            let a = diff.abs();
            let quadratic = a.square() * 0.5;
            let linear = (&a - 0.5 * delta) * delta;
            quadratic
                .where_self(&a.le(delta), &linear)
                .mean(Kind::Float)
        }
    }
}

/// Flow-matching loss: MSE between `prediction` and `ε − x₀`.
pub fn compute_flow_matching_loss(prediction: &Tensor, x0: &Tensor, noise: &Tensor) -> Tensor {
    compute_diffusion_loss(prediction, &(noise - x0), Reduction::Mse)
}
