//! A synthetic latent dataset with learnable structure: each sample's clean latent is a fixed
//! linear function of its pooled conditioning vector (one level per channel, constant over the
//! image), so a model that learns the function drives the flow-matching loss down and samples the
//! right latent for a conditioning. Text states are unrelated noise, except that for a model that
//! reads text but no pooled vector the first text state starts with the pooled vector.

use tch::{Device, Kind, Tensor};

use crate::rng::KeyedRng;

/// Shapes of the synthetic samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticShape {
    /// Latent channels `C`.
    pub channels: i64,
    /// Latent height `H`.
    pub height: i64,
    /// Latent width `W`.
    pub width: i64,
    /// Text tokens `S`.
    pub text_len: i64,
    /// Text state width.
    pub context_dim: i64,
    /// Pooled vector width.
    pub vec_dim: i64,
    /// Copy the pooled vector into the start of the first text state, as much as fits (for
    /// models that take no pooled vector, so the latents still follow from what they see).
    pub factors_in_text: bool,
}

/// One batch of clean samples, all f32 on the requested device.
#[derive(Debug)]
pub struct LatentSamples {
    /// Clean latents `[B, C, H, W]`.
    pub latents: Tensor,
    /// Text states `[B, S, context_dim]`.
    pub txt: Tensor,
    /// Pooled vectors `[B, vec_dim]`.
    pub y: Tensor,
    /// Per-element loss weights broadcastable to `latents` (`[B, 1, H, W]`, or `[B, C, H, W]`
    /// for packed latents), when the data has loss masks.
    pub mask: Option<Tensor>,
}

impl LatentSamples {
    /// The same samples on `device`.
    pub fn to_device(self, device: Device) -> Self {
        Self {
            latents: self.latents.to_device(device),
            txt: self.txt.to_device(device),
            y: self.y.to_device(device),
            mask: self.mask.map(|m| m.to_device(device)),
        }
    }
}

/// The dataset: an unbounded, deterministic sequence of samples indexed by `u64`.
#[derive(Debug)]
pub struct SyntheticLatents {
    seed: u64,
    shape: SyntheticShape,
    /// `[C, vec_dim]` row-major, scaled so latents have unit variance.
    projection: Vec<f64>,
}

impl SyntheticLatents {
    /// The dataset for `seed` and `shape`.
    pub fn new(seed: u64, shape: SyntheticShape) -> Self {
        let scale = 1.0 / (shape.vec_dim as f64).sqrt();
        let mut rng = KeyedRng::new(seed, u64::MAX, 0);
        let projection = (0..shape.channels * shape.vec_dim)
            .map(|_| rng.normal() * scale)
            .collect();
        Self {
            seed,
            shape,
            projection,
        }
    }

    /// Sample shapes.
    pub fn shape(&self) -> SyntheticShape {
        self.shape
    }

    /// Samples `indices`, stacked, on `device`.
    pub fn batch(&self, indices: &[u64], device: Device) -> LatentSamples {
        let s = self.shape;
        let (text_n, vec_n) = ((s.text_len * s.context_dim) as usize, s.vec_dim as usize);
        let (channels, plane) = (s.channels as usize, (s.height * s.width) as usize);
        let mut txt = Vec::with_capacity(indices.len() * text_n);
        let mut y = Vec::with_capacity(indices.len() * vec_n);
        let mut latents = Vec::with_capacity(indices.len() * channels * plane);
        for &i in indices {
            let mut rng = KeyedRng::new(self.seed, i, 1);
            let yi = rng.normals(vec_n);
            for row in self.projection.chunks(vec_n) {
                let level: f64 = row.iter().zip(&yi).map(|(p, &v)| p * v as f64).sum();
                latents.extend(std::iter::repeat_n(level as f32, plane));
            }
            let mut ti = rng.normals(text_n);
            if s.factors_in_text {
                let first_state = ti.iter_mut().take(s.context_dim as usize);
                for (t, v) in first_state.zip(&yi) {
                    *t = *v;
                }
            }
            y.extend(yi);
            txt.extend(ti);
        }
        let b = indices.len() as i64;
        let y = Tensor::from_slice(&y).view([b, s.vec_dim]);
        let latents = Tensor::from_slice(&latents).view([b, s.channels, s.height, s.width]);
        let txt = Tensor::from_slice(&txt).view([b, s.text_len, s.context_dim]);
        let to = |t: Tensor| t.to_kind(Kind::Float).to_device(device);
        LatentSamples {
            latents: to(latents),
            txt: to(txt),
            y: to(y),
            mask: None,
        }
    }
}
