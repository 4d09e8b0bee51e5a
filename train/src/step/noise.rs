//! Forward processes: how clean latents and noise mix at a given time.

use flux_model::per_sample;
use tch::Tensor;

/// Rectified flow: `x_σ = (1 − σ)·x₀ + σ·ε`. `x0`, `noise` `[B, …]`, `sigma` `[B]` in `[0, 1]`.
pub fn apply_flow_matching_noise(x0: &Tensor, noise: &Tensor, sigma: &Tensor) -> Tensor {
    let s = per_sample(sigma, x0);
    (s.ones_like() - &s) * x0 + s * noise
}

/// DDPM: `x_t = √ᾱ·x₀ + √(1 − ᾱ)·ε`. `alpha_bar` `[B]` in `(0, 1]`.
pub fn apply_ddpm_noise(x0: &Tensor, noise: &Tensor, alpha_bar: &Tensor) -> Tensor {
    let a = per_sample(alpha_bar, x0);
    a.sqrt() * x0 + (a.ones_like() - &a).sqrt() * noise
}
