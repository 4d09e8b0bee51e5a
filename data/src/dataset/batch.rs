//! Stored samples → training tensors: a latent drawn from the VAE posterior with per-sample keyed
//! noise (or the stored latent), normalised, and packed 2×2 into channels when the model expects
//! four times the stored channels (FLUX.1: 16 VAE channels → 64 model channels at patch size 1),
//! with the loss masks packed alongside.

use tch::{Device, Kind, Tensor};

use crate::dataset::layout::ShardLayout;
use crate::dataset::writer::Sample;
use crate::rng::KeyedRng;
use crate::synthetic::LatentSamples;

/// Random stream of posterior draws.
const POSTERIOR_STREAM: u64 = 4;

/// How stored latents become the model's clean latents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatentDraw {
    /// Draw `mean + exp(logvar / 2) · ε` with ε keyed by (seed, sample counter) — training.
    Posterior {
        /// The run's seed.
        seed: u64,
    },
    /// Take the posterior mean — evaluation.
    Mean,
}

fn stack(rows: impl Iterator<Item = Vec<f32>>, shape: &[i64]) -> Tensor {
    let flat: Vec<f32> = rows.flatten().collect();
    Tensor::from_slice(&flat).view(shape)
}

/// The training tensors of `samples` (keyed by `counters`) stored with `layout`, on `device`.
/// With `pack`, `[B, C, H, W]` becomes `[B, 4C, H/2, W/2]` (channel `4c + 2dy + dx`, as
/// diffusers' `_pack_latents` and BFL's `rearrange` order them).
pub fn latent_samples(
    samples: &[Sample],
    counters: &[u64],
    layout: &ShardLayout,
    draw: LatentDraw,
    pack: bool,
    device: Device,
) -> LatentSamples {
    let b = samples.len() as i64;
    let [c, h, w] = layout.latent.map(|d| d as i64);
    let latent_shape = [b, c, h, w];
    let mean = stack(samples.iter().map(|s| s.latents.clone()), &latent_shape);
    let latents = match (draw, layout.logvar) {
        (LatentDraw::Posterior { seed }, true) => {
            let numel = (c * h * w) as usize;
            let noise = stack(
                counters
                    .iter()
                    .map(|&k| KeyedRng::new(seed, k, POSTERIOR_STREAM).normals(numel)),
                &latent_shape,
            );
            let logvar = stack(
                samples
                    .iter()
                    .map(|s| s.logvar.clone().expect("the layout has log-variances")),
                &latent_shape,
            );
            layout.norm.sample(&mean, &logvar, &noise)
        }
        _ => layout.norm.mode(&mean),
    };
    let latents = if pack {
        latents.pixel_unshuffle(2)
    } else {
        latents
    };
    // A mask `[B, 1, H, W]` packs like the latents into `[B, 4, H/2, W/2]`; repeating it C times
    // gives packed channel `4c + k` the weight of its source pixel `k`.
    let mask = layout.mask.then(|| {
        let mask = stack(
            samples
                .iter()
                .map(|s| s.mask.clone().expect("the layout has loss masks")),
            &[b, 1, h, w],
        );
        if pack {
            mask.pixel_unshuffle(2).repeat([1, c, 1, 1])
        } else {
            mask
        }
    });
    let [s, d] = layout.text.map(|v| v as i64);
    let to = |t: Tensor| t.to_kind(Kind::Float).to_device(device);
    LatentSamples {
        latents: to(latents),
        txt: to(stack(samples.iter().map(|x| x.t5.clone()), &[b, s, d])),
        y: to(stack(
            samples.iter().map(|x| x.clip.clone()),
            &[b, layout.pooled as i64],
        )),
        mask: mask.map(to),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::values::StorageDtype;
    use crate::vae::VaeNorm;

    /// A sample whose every channel holds its mask's value at each pixel: packed, the latents
    /// must equal the packed mask element for element.
    #[test]
    fn a_packed_mask_weights_each_latent_value_by_its_own_pixel() {
        let (c, h, w) = (3usize, 4usize, 6usize);
        let pixel: Vec<f32> = (0..h * w).map(|i| i as f32 + 1.0).collect();
        let sample = Sample {
            id: "s".into(),
            latents: pixel.repeat(c),
            logvar: None,
            t5: vec![0.0; 2],
            clip: vec![0.0; 1],
            caption: None,
            mask: Some(pixel.clone()),
        };
        let layout = ShardLayout {
            latent: [c, h, w],
            text: [1, 2],
            pooled: 1,
            dtype: StorageDtype::F32,
            logvar: false,
            captions: false,
            mask: true,
            norm: VaeNorm {
                scaling_factor: 1.0,
                shift_factor: 0.0,
            },
            encoders: Default::default(),
        };
        for pack in [false, true] {
            let s = latent_samples(
                std::slice::from_ref(&sample),
                &[0],
                &layout,
                LatentDraw::Mean,
                pack,
                Device::Cpu,
            );
            let mask = s.mask.unwrap().expand_as(&s.latents);
            assert!(s.latents.equal(&mask), "pack {pack}");
        }
    }
}
