//! Diffusion losses: how the errors between a prediction and its target are reduced.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

pub use flux_model::Prediction;

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
