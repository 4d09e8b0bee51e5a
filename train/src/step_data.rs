//! One micro-batch of training inputs: clean samples, their noise and noise levels, the noisy
//! latents the model sees — every random draw keyed by (seed, sample), so any data-parallel split
//! of a global batch sees the same numbers.

use flux_data::{KeyedRng, LatentSamples};
use flux_model::{per_sample, DiffusionBatch, InputSpec};
use tch::{Device, Kind, Tensor};

use crate::noise::apply_flow_matching_noise;
use crate::scheduler::FlowMatchEulerDiscreteScheduler;
use crate::timesteps::TimestepSampler;

/// Random streams of one sample.
const NOISE_STREAM: u64 = 2;
const DROPOUT_STREAM: u64 = 3;

/// Model inputs and regression ingredients for a set of samples.
#[derive(Debug)]
pub struct StepData {
    /// What the model sees (noisy latents, conditioning, σ as `timesteps`).
    pub batch: DiffusionBatch,
    /// Clean latents `[B, C, H, W]`.
    pub x0: Tensor,
    /// Noise `[B, C, H, W]`.
    pub noise: Tensor,
    /// Noise levels `[B]`.
    pub sigmas: Tensor,
}

/// How noise levels are chosen for a set of samples.
#[derive(Debug, Clone, Copy)]
pub enum NoiseLevels<'a> {
    /// Drawn per sample by a training sampler.
    Sampled(&'a TimestepSampler, &'a FlowMatchEulerDiscreteScheduler),
    /// Fixed: sample `i` of the set at `σ = (i mod 8) / 8` (MLPerf's held-out protocol).
    Equidistant,
}

/// Build the inputs `inputs` declares for clean `samples` keyed by `ids` (global sample
/// counters): the text states and pooled vector when the model takes them, the default guidance
/// when it embeds guidance. `cfg_dropout` replaces a sample's text and pooled vector by zeros
/// with that probability.
pub fn step_data(
    samples: LatentSamples,
    inputs: &InputSpec,
    ids: &[u64],
    seed: u64,
    levels: NoiseLevels,
    cfg_dropout: f64,
    device: Device,
) -> StepData {
    let x0 = samples.latents;
    let per_sample_numel = x0.numel() / ids.len();
    let mut noise = Vec::with_capacity(x0.numel());
    let (mut u, mut z, mut keep) = (Vec::new(), Vec::new(), Vec::new());
    for &id in ids {
        let mut rng = KeyedRng::new(seed, id, NOISE_STREAM);
        noise.extend(rng.normals(per_sample_numel));
        u.push(rng.uniform() as f32);
        z.push(rng.normal() as f32);
        keep.push(
            if KeyedRng::new(seed, id, DROPOUT_STREAM).uniform() < cfg_dropout {
                0f32
            } else {
                1.0
            },
        );
    }
    let noise = Tensor::from_slice(&noise)
        .view(x0.size().as_slice())
        .to_device(device);
    let sigmas = match levels {
        NoiseLevels::Sampled(sampler, scheduler) => {
            sampler
                .sample(&Tensor::from_slice(&u), &Tensor::from_slice(&z), scheduler)
                .1
        }
        NoiseLevels::Equidistant => {
            let s: Vec<f32> = (0..ids.len()).map(|i| (i % 8) as f32 / 8.0).collect();
            Tensor::from_slice(&s)
        }
    }
    .to_device(device);
    let keep = Tensor::from_slice(&keep).to_device(device);
    let b = ids.len() as i64;
    let dropped = |t: &Tensor| t * per_sample(&keep, t);
    let batch = DiffusionBatch {
        latents: apply_flow_matching_noise(&x0, &noise, &sigmas),
        timesteps: sigmas.shallow_clone(),
        text: inputs.text_dim.map(|_| dropped(&samples.txt)),
        pooled: inputs.pooled_dim.map(|_| dropped(&samples.y)),
        guidance: inputs
            .guidance
            .map(|g| Tensor::full([b], g, (Kind::Float, device))),
    };
    StepData {
        batch,
        x0,
        noise,
        sigmas,
    }
}
