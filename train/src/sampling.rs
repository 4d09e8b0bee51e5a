//! Sampling from a model with the flow-matching ODE: FLUX.1's resolution-shifted schedule,
//! Euler or Heun steps, the guidance a guidance-distilled model embeds, and two-pass
//! classifier-free guidance.

use flux_data::KeyedRng;
use flux_model::{ConfigError, DiffusionBatch, DiffusionModel, InputSpec};
use tch::{Device, Kind, Tensor};

use crate::scheduler::{integrate, FlowMatchEulerDiscreteScheduler};

/// What a batch of samples is conditioned on (each part used when the model reads it).
#[derive(Debug)]
pub struct Conditioning {
    /// Per-token text states `[B, S, D]`.
    pub text: Tensor,
    /// Pooled vectors `[B, P]`.
    pub pooled: Tensor,
}

impl Conditioning {
    /// Rows `start..start + len` of both parts.
    pub fn rows(&self, start: i64, len: i64) -> Self {
        Self {
            text: self.text.narrow(0, start, len),
            pooled: self.pooled.narrow(0, start, len),
        }
    }

    /// Zeros of the same shapes: the unconditional input without a negative prompt.
    pub fn zeros_like(&self) -> Self {
        Self {
            text: self.text.zeros_like(),
            pooled: self.pooled.zeros_like(),
        }
    }
}

/// How the ODE is integrated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OdeSettings {
    /// Steps of the schedule.
    pub steps: usize,
    /// Heun's second-order steps instead of Euler's.
    pub heun: bool,
    /// Guidance strength given to a guidance-embedding model (default: the model's own).
    pub guidance: Option<f64>,
    /// Two-pass classifier-free guidance scale: `v_uncond + w·(v_cond − v_uncond)`.
    pub cfg_scale: Option<f64>,
}

impl OdeSettings {
    /// Refuse what the ODE cannot integrate: no steps, or a guidance strength or classifier-free
    /// scale that is not a finite number (NaN or ±∞ turn every latent into NaN, decoded as an
    /// all-black image). The error names the setting: `steps`, `guidance` or `cfg_scale`.
    pub fn check(&self) -> Result<(), ConfigError> {
        ConfigError::check(self.steps >= 1, "steps", || "must be at least 1".into())?;
        for (name, value) in [("guidance", self.guidance), ("cfg_scale", self.cfg_scale)] {
            ConfigError::check(value.is_none_or(f64::is_finite), name, || {
                format!("must be a finite number, got {}", value.unwrap_or_default())
            })?;
        }
        Ok(())
    }
}

/// Bytes the ODE holds at least at once for latents of `shape` (f32), besides the model and its
/// activations: the state and three tensors like it (the velocity, the second velocity of
/// Heun's step or of classifier-free guidance, the update). Saturates rather than overflows.
pub fn ode_bytes(shape: &[i64]) -> u128 {
    let elements = shape
        .iter()
        .fold(1u128, |n, &side| n.saturating_mul(side.max(0) as u128));
    elements.saturating_mul(4 * 4)
}

/// Classifier-free guidance in two passes: `v_uncond + w·(v_cond − v_uncond)`.
pub fn guided_velocity(v_cond: &Tensor, v_uncond: &Tensor, scale: f64) -> Tensor {
    v_uncond + (v_cond - v_uncond) * scale
}

/// Standard normal noise of `shape` (f32, on `device`) from `seed` alone: the same seed gives
/// the same start on every rank, device and run.
pub fn start_noise(seed: u64, shape: &[i64], device: Device) -> Tensor {
    let n: i64 = shape.iter().product();
    let values = KeyedRng::new(seed, 0, 0).normals(n as usize);
    Tensor::from_slice(&values).view(shape).to_device(device)
}

/// Latents `[B, C, H, W]` (f32) integrated from noise `start` of that shape to σ = 0, conditioned
/// on `cond` (`B` rows); under `cfg_scale`, guided away from `negative` (zeros when `None`).
/// Runs without gradients; under tensor parallelism every rank of the group calls it together.
pub fn generate(
    model: &dyn DiffusionModel,
    inputs: &InputSpec,
    start: Tensor,
    cond: &Conditioning,
    negative: Option<&Conditioning>,
    settings: &OdeSettings,
) -> Tensor {
    let size = start.size();
    let (b, device) = (size[0], start.device());
    let image_tokens = inputs.image_tokens(size[2], size[3]);
    let schedule =
        FlowMatchEulerDiscreteScheduler::flux().flux_schedule(settings.steps, image_tokens as f64);
    let zeros;
    let negative = match negative {
        Some(n) => n,
        None => {
            zeros = cond.zeros_like();
            &zeros
        }
    };
    let guidance = |g: f64| {
        let g = settings.guidance.unwrap_or(g);
        Tensor::full([b], g, (Kind::Float, device))
    };
    tch::no_grad(|| {
        integrate(start, &schedule.sigmas, settings.heun, |x, sigma| {
            let predict = |c: &Conditioning| {
                let batch = DiffusionBatch {
                    latents: x.shallow_clone(),
                    timesteps: Tensor::full([b], sigma, (Kind::Float, device)),
                    text: inputs.text_dim.map(|_| c.text.shallow_clone()),
                    pooled: inputs.pooled_dim.map(|_| c.pooled.shallow_clone()),
                    guidance: inputs.guidance.map(guidance),
                };
                model
                    .forward(&batch.to_kind(model.kind()), false)
                    .expect("inputs follow the model's input spec")
                    .to_kind(Kind::Float)
            };
            let v = predict(cond);
            match settings.cfg_scale {
                Some(scale) => guided_velocity(&v, &predict(negative), scale),
                None => v,
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ode_bytes_count_four_f32_latents_and_saturate() {
        assert_eq!(ode_bytes(&[2, 16, 64, 64]), 2 * 16 * 64 * 64 * 16);
        assert_eq!(ode_bytes(&[i64::MAX, i64::MAX, i64::MAX, 2]), u128::MAX);
    }

    #[test]
    fn settings_the_ode_cannot_use_are_refused_by_name() {
        let ok = OdeSettings {
            steps: 4,
            heun: false,
            guidance: Some(3.5),
            cfg_scale: None,
        };
        assert!(ok.check().is_ok());
        let field = |s: OdeSettings| s.check().unwrap_err().field;
        assert_eq!(field(OdeSettings { steps: 0, ..ok }), "steps");
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let guidance = Some(bad);
            assert_eq!(field(OdeSettings { guidance, ..ok }), "guidance");
            let cfg_scale = Some(bad);
            assert_eq!(field(OdeSettings { cfg_scale, ..ok }), "cfg_scale");
        }
    }
}
