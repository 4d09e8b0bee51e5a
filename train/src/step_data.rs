//! One micro-batch of training inputs: clean samples, their noise and noise levels, the noisy
//! latents the model sees — every random draw keyed by (seed, sample), so any data-parallel split
//! of a global batch sees the same numbers.

use flux_data::{KeyedRng, LatentSamples};
use flux_model::{per_sample, DiffusionBatch, InputSpec};
use tch::{Device, Kind, Tensor};

use crate::noise::apply_flow_matching_noise;
use crate::scheduler::{DynamicShift, FlowMatchEulerDiscreteScheduler};
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
    /// Loss weights broadcastable to `x0`, when the data has loss masks.
    pub mask: Option<Tensor>,
}

/// How noise levels are chosen for a set of samples.
#[derive(Debug, Clone, Copy)]
pub enum NoiseLevels<'a> {
    /// Drawn per sample by a training sampler, then, with a [`DynamicShift`], shifted for the
    /// batch's image token count (FLUX.1's resolution rule).
    Sampled(
        &'a TimestepSampler,
        &'a FlowMatchEulerDiscreteScheduler,
        Option<DynamicShift>,
    ),
    /// Fixed: the sample keyed `k` at `σ = (k mod 8) / 8` (MLPerf's held-out protocol; held-out
    /// sample `i` is keyed `EVAL_BASE + i`, a multiple of 8 plus `i`).
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
        NoiseLevels::Sampled(sampler, scheduler, shift) => {
            let sigmas = sampler
                .sample(&Tensor::from_slice(&u), &Tensor::from_slice(&z), scheduler)
                .1;
            match shift {
                Some(shift) => {
                    let size = x0.size();
                    let tokens = inputs.image_tokens(size[2], size[3]) as f64;
                    let e = shift.mu(tokens).exp();
                    // σ' = e^μ / (e^μ + 1/σ − 1), as `time_shift`.
                    (sigmas.reciprocal() - 1.0 + e).reciprocal() * e
                }
                None => sigmas,
            }
        }
        NoiseLevels::Equidistant => {
            let s: Vec<f32> = ids.iter().map(|k| (k % 8) as f32 / 8.0).collect();
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
        mask: samples.mask,
    }
}
