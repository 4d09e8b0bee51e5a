//! `FlowMatchEulerDiscreteScheduler`: Flux's noise schedule (training tables, inference sigmas
//! with static or resolution-dependent shift) and the Euler and Heun steps.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Resolution-dependent shift `μ`: linear in the image token count from `base_shift` at
/// `base_seq_len` tokens to `max_shift` at `max_seq_len` (FLUX.1: 0.5 at 256, 1.15 at 4096).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicShift {
    /// μ at `base_seq_len`.
    pub base_shift: f64,
    /// μ at `max_seq_len`.
    pub max_shift: f64,
    /// Token count of `base_shift`.
    pub base_seq_len: f64,
    /// Token count of `max_shift`.
    pub max_seq_len: f64,
}

impl Default for DynamicShift {
    fn default() -> Self {
        Self {
            base_shift: 0.5,
            max_shift: 1.15,
            base_seq_len: 256.0,
            max_seq_len: 4096.0,
        }
    }
}

impl DynamicShift {
    /// μ for `image_seq_len` tokens.
    pub fn mu(&self, image_seq_len: f64) -> f64 {
        let m = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len);
        image_seq_len * m + (self.base_shift - m * self.base_seq_len)
    }
}

/// `σ' = e^μ / (e^μ + (1/σ − 1))`.
pub fn time_shift(mu: f64, sigma: f64) -> f64 {
    mu.exp() / (mu.exp() + (1.0 / sigma - 1.0))
}

/// `σ' = s·σ / (1 + (s − 1)·σ)`.
pub fn static_shift(shift: f64, sigma: f64) -> f64 {
    shift * sigma / (1.0 + (shift - 1.0) * sigma)
}

/// The flow-matching scheduler, with diffusers' semantics.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowMatchEulerDiscreteScheduler {
    /// Training bins (1000).
    pub num_train_timesteps: usize,
    /// Static shift `s` (used when `dynamic` is `None`).
    pub shift: f64,
    /// Resolution-dependent shift, if enabled.
    pub dynamic: Option<DynamicShift>,
    /// Training sigmas, from 1 down to `1/N` (statically shifted when not dynamic).
    pub train_sigmas: Vec<f64>,
    /// `1000 · train_sigmas`.
    pub train_timesteps: Vec<f64>,
}

/// The inference schedule: `sigmas` has one more entry than `timesteps` (a final 0).
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceSchedule {
    /// Model timesteps, `1000·σ`.
    pub timesteps: Vec<f64>,
    /// Noise levels, ending with 0.
    pub sigmas: Vec<f64>,
}

impl FlowMatchEulerDiscreteScheduler {
    /// A scheduler with `num_train_timesteps` bins and either a static `shift` or `dynamic` shift.
    pub fn new(num_train_timesteps: usize, shift: f64, dynamic: Option<DynamicShift>) -> Self {
        let n = num_train_timesteps as f64;
        let train_sigmas: Vec<f64> = (0..num_train_timesteps)
            .map(|i| (n - i as f64) / n)
            .map(|s| {
                if dynamic.is_some() {
                    s
                } else {
                    static_shift(shift, s)
                }
            })
            .collect();
        let train_timesteps = train_sigmas.iter().map(|s| s * n).collect();
        Self {
            num_train_timesteps,
            shift,
            dynamic,
            train_sigmas,
            train_timesteps,
        }
    }

    /// FLUX.1 [dev]'s scheduler: dynamic shift with the default constants.
    pub fn flux() -> Self {
        Self::new(1000, 1.0, Some(DynamicShift::default()))
    }

    fn shifted(&self, sigmas: Vec<f64>, image_seq_len: f64) -> InferenceSchedule {
        let n = self.num_train_timesteps as f64;
        let mut sigmas: Vec<f64> = match &self.dynamic {
            Some(d) => sigmas
                .into_iter()
                .map(|s| time_shift(d.mu(image_seq_len), s))
                .collect(),
            None => sigmas
                .into_iter()
                .map(|s| static_shift(self.shift, s))
                .collect(),
        };
        let timesteps = sigmas.iter().map(|s| s * n).collect();
        sigmas.push(0.0);
        InferenceSchedule { timesteps, sigmas }
    }

    /// diffusers' default `set_timesteps(steps)`: timesteps evenly spaced between the training
    /// table's ends, then shifted (for `image_seq_len` tokens when dynamic).
    pub fn set_timesteps(&self, steps: usize, image_seq_len: f64) -> InferenceSchedule {
        let n = self.num_train_timesteps as f64;
        let (hi, lo) = (
            self.train_sigmas[0] * n,
            self.train_sigmas[self.num_train_timesteps - 1] * n,
        );
        let sigmas = linspace(hi, lo, steps).into_iter().map(|t| t / n).collect();
        self.shifted(sigmas, image_seq_len)
    }

    /// The FLUX.1 pipeline's schedule: `σ = linspace(1, 1/steps, steps)`, then shifted.
    pub fn flux_schedule(&self, steps: usize, image_seq_len: f64) -> InferenceSchedule {
        self.shifted(linspace(1.0, 1.0 / steps as f64, steps), image_seq_len)
    }
}

fn linspace(from: f64, to: f64, n: usize) -> Vec<f64> {
    match n {
        0 => Vec::new(),
        1 => vec![from],
        _ => (0..n)
            .map(|i| from + (to - from) * i as f64 / (n - 1) as f64)
            .collect(),
    }
}

/// One Euler step of the flow ODE in f32: `x + (σ_next − σ)·v`, returned in `sample`'s dtype.
pub fn euler_step(sample: &Tensor, velocity: &Tensor, sigma: f64, sigma_next: f64) -> Tensor {
    let x = sample.to_kind(Kind::Float) + velocity.to_kind(Kind::Float) * (sigma_next - sigma);
    x.to_kind(sample.kind())
}

/// Integrate `dx/dσ = v(x, σ)` over `sigmas` (ending at 0) from `x`, with Euler steps or, when
/// `heun`, Heun's second-order steps (Euler on the final step to σ = 0).
pub fn integrate(
    x: Tensor,
    sigmas: &[f64],
    heun: bool,
    mut velocity: impl FnMut(&Tensor, f64) -> Tensor,
) -> Tensor {
    let mut x = x;
    for w in sigmas.windows(2) {
        let (s, s_next) = (w[0], w[1]);
        let v = velocity(&x, s);
        x = if heun && s_next > 0.0 {
            let predicted = euler_step(&x, &v, s, s_next);
            let v_next = velocity(&predicted, s_next);
            euler_step(&x, &((v + v_next) * 0.5), s, s_next)
        } else {
            euler_step(&x, &v, s, s_next)
        };
    }
    x
}
