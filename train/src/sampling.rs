//! Sampling from a trained model with classifier-free guidance.

use tch::Tensor;

/// Classifier-free guidance in two passes: `v_uncond + w·(v_cond − v_uncond)`.
pub fn guided_velocity(v_cond: &Tensor, v_uncond: &Tensor, scale: f64) -> Tensor {
    v_uncond + (v_cond - v_uncond) * scale
}
