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

/// Mean of the elementwise loss between `prediction` and `target` (equal shapes `[B, …]`), in
/// f32. With `weights` (broadcastable to `[B, …]`, e.g. a loss mask `[B, 1, H, W]`), each
/// sample's loss is its weighted mean `Σ w·e / Σ w` over its elements (0 for an all-zero mask),
/// and the batch's loss is the mean over samples, so that any split of a batch into equal
/// micro-batches averages to the same number; all-ones weights give the plain mean.
pub fn compute_diffusion_loss(
    prediction: &Tensor,
    target: &Tensor,
    reduction: Reduction,
    weights: Option<&Tensor>,
) -> Tensor {
    let diff = prediction.to_kind(Kind::Float) - target.to_kind(Kind::Float);
    let elementwise = match reduction {
        Reduction::Mse => diff.square(),
        Reduction::Mae => diff.abs(),
        Reduction::Huber { delta } => {
            let a = diff.abs();
            let quadratic = a.square() * 0.5;
            let linear = (&a - 0.5 * delta) * delta;
            quadratic.where_self(&a.le(delta), &linear)
        }
    };
    let Some(weights) = weights else {
        return elementwise.mean(Kind::Float);
    };
    let w = weights.to_kind(Kind::Float).expand_as(&elementwise);
    let dims: Vec<i64> = (1..elementwise.dim() as i64).collect();
    let per_sample = (&elementwise * &w).sum_dim_intlist(dims.as_slice(), false, Kind::Float)
        / w.sum_dim_intlist(dims.as_slice(), false, Kind::Float)
            .clamp_min(f32::MIN_POSITIVE as f64);
    per_sample.mean(Kind::Float)
}

/// Flow-matching loss: MSE between `prediction` and `ε − x₀`.
pub fn compute_flow_matching_loss(prediction: &Tensor, x0: &Tensor, noise: &Tensor) -> Tensor {
    compute_diffusion_loss(prediction, &(noise - x0), Reduction::Mse, None)
}
