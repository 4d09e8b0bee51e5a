//! Sinusoidal timestep features and the `TimeStepEmbedder` built on them.

use flux_macros::diffusion_block;
use tch::{Kind, Tensor};

use crate::embeddings::{EmbedderDims, MlpEmbedder};

/// Timesteps arrive in `[0, 1]` and are scaled to the 1000-step range before embedding.
pub const TIME_FACTOR: f64 = 1000.0;

/// Longest period of the sinusoids.
const MAX_PERIOD: f64 = 10_000.0;

/// Sinusoidal features of `t [B]` (in `[0, 1]`): `[cos(1000·t·f_i), sin(1000·t·f_i)]` with
/// `f_i = 10000^(-i / (dim/2))`, `i < dim/2`. Returns `[B, dim]` in f32, cosines first.
pub fn timestep_embedding(t: &Tensor, dim: i64) -> Tensor {
    let half = dim / 2;
    let freqs =
        (Tensor::arange(half, (Kind::Float, t.device())) * (-MAX_PERIOD.ln() / half as f64)).exp();
    let args = (t.to_kind(Kind::Float) * TIME_FACTOR).unsqueeze(1) * freqs.unsqueeze(0);
    let emb = Tensor::cat(&[args.cos(), args.sin()], -1);
    if dim % 2 == 1 {
        Tensor::cat(&[&emb, &emb.narrow(1, 0, 1).zeros_like()], -1)
    } else {
        emb
    }
}

/// Timestep (or guidance-strength) embedder: sinusoids of width `in_dim` → MLP → `[B, D]`.
/// Its parameters sit directly under its name (`linear_1`, `linear_2`).
#[diffusion_block(config = EmbedderDims)]
#[derive(Debug)]
pub struct TimeStepEmbedder {
    /// The MLP on the sinusoidal features.
    #[module(config = *config, name = "")]
    pub mlp: MlpEmbedder,
    /// Width of the sinusoidal features.
    #[value(config.in_dim)]
    channels: i64,
}

impl TimeStepEmbedder {
    /// `t [B]` in `[0, 1]` → `[B, D]`.
    pub fn forward(&self, t: &Tensor) -> Tensor {
        let features =
            timestep_embedding(t, self.channels).to_kind(self.mlp.linear_1.weight.kind());
        self.mlp.forward(&features)
    }
}
