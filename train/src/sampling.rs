//! Sampling from a trained model with classifier-free guidance.

use tch::Tensor;

/// Classifier-free guidance in two passes: `v_uncond + w·(v_cond − v_uncond)`.
pub fn guided_velocity(v_cond: &Tensor, v_uncond: &Tensor, scale: f64) -> Tensor {
    v_uncond + (v_cond - v_uncond) * scale
}

/// How guidance enters each model evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Guidance {
    /// The model embeds the strength itself (guidance-distilled FLUX.1 [dev]): one pass.
    Embedded(f64),
    /// Two passes, conditional and unconditional, combined with this scale.
    TwoPass(f64),
    /// One conditional pass.
    None,
}
