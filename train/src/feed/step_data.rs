//! One micro-batch of training inputs: clean samples, their noise and noise levels, the noisy
//! latents the model sees — every random draw keyed by (seed, sample), so any data-parallel split
//! of a global batch sees the same numbers.

use flux_data::{KeyedRng, LatentSamples};
use flux_model::{per_sample, DiffusionBatch, InputSpec};
use tch::{Device, Kind, Tensor};

use crate::scheduler::{DynamicShift, FlowMatchEulerDiscreteScheduler};
use crate::step::noise::apply_flow_matching_noise;
use crate::step::timesteps::TimestepSampler;

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

/// The random draws of a set of samples, each keyed by (seed, sample): noise, the uniform and
/// normal numbers noise levels are sampled from, and whether classifier-free-guidance dropout
/// keeps its caption. A pure function of its keys, so it can be drawn ahead (the data prefetch
/// thread does) or in place.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleDraws {
    /// Global sample counters (the keys).
    ids: Vec<u64>,
    /// `per_sample` standard normals per sample, end to end.
    noise: Vec<f32>,
    /// One uniform number in `[0, 1)` per sample.
    u: Vec<f32>,
    /// One standard normal per sample.
    z: Vec<f32>,
    /// 1 where the sample keeps its caption, 0 where dropout drops it.
    keep: Vec<f32>,
}

impl SampleDraws {
    /// The draws of samples `ids` under run seed `seed`, with `per_sample` noise values each and
    /// captions dropped with probability `dropout_prob`.
    pub fn new(ids: &[u64], seed: u64, per_sample: usize, dropout_prob: f64) -> Self {
        let mut noise = Vec::with_capacity(ids.len() * per_sample);
        let (mut u, mut z, mut keep) = (Vec::new(), Vec::new(), Vec::new());
        for &id in ids {
            let mut rng = KeyedRng::new(seed, id, NOISE_STREAM);
            noise.extend(rng.normals(per_sample));
            u.push(rng.uniform() as f32);
            z.push(rng.normal() as f32);
            let dropped = KeyedRng::new(seed, id, DROPOUT_STREAM).uniform() < dropout_prob;
            keep.push(if dropped { 0.0 } else { 1.0 });
        }
        Self {
            ids: ids.to_vec(),
            noise,
            u,
            z,
            keep,
        }
    }
}

/// Build the inputs `inputs` declares for clean `samples` with their random `draws`: the text
/// states and pooled vector when the model takes them, the default guidance when it embeds
/// guidance. A sample whose caption the draws drop gets the empty caption's encodings `empty`
/// (text states `[L, D]`, pooled vector `[D_pooled]`; MLPerf's and Primus' rule), or zeros when
/// `None`.
pub fn step_data(
    samples: LatentSamples,
    inputs: &InputSpec,
    draws: SampleDraws,
    levels: NoiseLevels,
    empty: Option<&(Tensor, Tensor)>,
    device: Device,
) -> StepData {
    let x0 = samples.latents;
    assert_eq!(
        draws.noise.len() as i64,
        x0.numel() as i64,
        "draws for the samples' latents"
    );
    let SampleDraws {
        ids,
        noise,
        u,
        z,
        keep,
    } = draws;
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
    // keep · caption + (1 − keep) · empty caption (zeros without one).
    let dropped = |t: &Tensor, empty: Option<&Tensor>| {
        let kept = t * per_sample(&keep, t);
        match empty {
            Some(e) => kept + e.to_device(device) * (1.0 - per_sample(&keep, t)),
            None => kept,
        }
    };
    let batch = DiffusionBatch {
        latents: apply_flow_matching_noise(&x0, &noise, &sigmas),
        timesteps: sigmas.shallow_clone(),
        text: inputs
            .text_dim
            .map(|_| dropped(&samples.txt, empty.map(|e| &e.0))),
        pooled: inputs
            .pooled_dim
            .map(|_| dropped(&samples.y, empty.map(|e| &e.1))),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(b: i64) -> LatentSamples {
        LatentSamples {
            latents: Tensor::ones([b, 4, 2, 2], (Kind::Float, Device::Cpu)),
            txt: Tensor::ones([b, 3, 5], (Kind::Float, Device::Cpu)),
            y: Tensor::ones([b, 6], (Kind::Float, Device::Cpu)),
            mask: None,
        }
    }

    fn inputs() -> InputSpec {
        InputSpec {
            latent_channels: 4,
            patch_size: 1,
            text_dim: Some(5),
            pooled_dim: Some(6),
            guidance: None,
        }
    }

    #[test]
    fn dropped_captions_become_the_empty_captions_encodings_or_zeros() {
        let empty = (
            Tensor::full([3, 5], 7.0, (Kind::Float, Device::Cpu)),
            Tensor::full([6], -2.0, (Kind::Float, Device::Cpu)),
        );
        let ids: Vec<u64> = (0..64).collect();
        let d = |prob, empty| {
            let draws = SampleDraws::new(&ids, 0, 16, prob);
            let levels = NoiseLevels::Equidistant;
            step_data(samples(64), &inputs(), draws, levels, empty, Device::Cpu)
        };
        let with = d(0.5, Some(&empty));
        let (text, pooled) = (with.batch.text.unwrap(), with.batch.pooled.unwrap());
        let (mut kept, mut dropped) = (0, 0);
        for i in 0..64 {
            let (t, p) = (text.get(i), pooled.get(i));
            if t.equal(&Tensor::ones([3, 5], (Kind::Float, Device::Cpu))) {
                assert!(p.equal(&Tensor::ones([6], (Kind::Float, Device::Cpu))));
                kept += 1;
            } else {
                assert!(t.equal(&empty.0) && p.equal(&empty.1), "sample {i}");
                dropped += 1;
            }
        }
        assert!(kept > 10 && dropped > 10, "{kept} kept, {dropped} dropped");
        // Without stored encodings the same samples drop to zeros.
        let zeros = d(0.5, None).batch.text.unwrap();
        for i in 0..64 {
            let was_dropped = !text
                .get(i)
                .equal(&Tensor::ones([3, 5], (Kind::Float, Device::Cpu)));
            assert_eq!(
                was_dropped,
                zeros.get(i).abs().sum(Kind::Float).double_value(&[]) == 0.0
            );
        }
    }
}
