//! Analytic floating-point operations of a Flux forward pass, the numerator of model FLOPs
//! utilisation (MFU): every weight matrix costs `2 · in · out` FLOPs per row it is applied to
//! (an image token, a text token, or one conditioning vector per sample), and attention over `L`
//! tokens costs `4 · L² · D` per sample and layer (`Q·Kᵀ` and `P·V` over all heads). Norms,
//! activations, RoPE and softmax are not counted, as in Megatron's and PaLM's MFU. A training step
//! (forward and backward) counts as three forward passes.

use crate::FluxConfig;

/// What a weight matrix is applied to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Every image token.
    Image,
    /// Every text token.
    Text,
    /// Every token of the joint sequence (single-stream layers).
    Tokens,
    /// One conditioning vector per sample (embedders, modulation).
    Sample,
}

/// Every weight matrix of `config`'s model as `(in · out, rows it is applied to)`.
pub fn weight_matrices(config: &FluxConfig) -> Vec<(f64, Rows)> {
    let d = config.hidden_size as f64;
    let m = config.mlp_hidden() as f64;
    let channels = config.token_channels() as f64;
    let timestep = config.model_channels as f64 * d + d * d;
    let mut out = vec![
        (channels * d, Rows::Image),
        (config.context_dim as f64 * d, Rows::Text),
        (timestep, Rows::Sample),
        (config.vec_in_dim as f64 * d + d * d, Rows::Sample),
    ];
    if config.guidance_embed {
        out.push((timestep, Rows::Sample));
    }
    for _ in 0..config.num_joint_layers {
        for rows in [Rows::Image, Rows::Text] {
            // Modulation, fused QKV, output projection, MLP in and out.
            out.extend([
                (6.0 * d * d, Rows::Sample),
                (3.0 * d * d, rows),
                (d * d, rows),
                (2.0 * d * m, rows),
            ]);
        }
    }
    for _ in 0..config.num_single_layers {
        out.extend([
            (3.0 * d * d, Rows::Sample),
            (d * (3.0 * d + m), Rows::Tokens),
            ((d + m) * d, Rows::Tokens),
        ]);
    }
    out.extend([(2.0 * d * d, Rows::Sample), (d * channels, Rows::Image)]);
    out
}

/// The work of one forward pass, split by where it goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForwardFlops {
    /// Weight matrix multiplications, FLOPs.
    pub linear: f64,
    /// Attention scores and weighted values, FLOPs.
    pub attention: f64,
}

impl ForwardFlops {
    /// Forward FLOPs of `config` on `batch` samples of `img` image tokens and `txt` text tokens.
    pub fn of(config: &FluxConfig, batch: i64, img: i64, txt: i64) -> Self {
        let (b, img, txt) = (batch as f64, img as f64, txt as f64);
        let tokens = img + txt;
        let linear = weight_matrices(config)
            .into_iter()
            .map(|(weights, rows)| {
                weights
                    * match rows {
                        Rows::Image => img,
                        Rows::Text => txt,
                        Rows::Tokens => tokens,
                        Rows::Sample => 1.0,
                    }
            })
            .sum::<f64>();
        let layers = (config.num_joint_layers + config.num_single_layers) as f64;
        Self {
            linear: 2.0 * b * linear,
            attention: layers * b * 4.0 * tokens * tokens * config.hidden_size as f64,
        }
    }

    /// Total forward FLOPs.
    pub fn total(&self) -> f64 {
        self.linear + self.attention
    }

    /// FLOPs of a training step: the forward pass and a backward pass of twice its work.
    pub fn training_step(&self) -> f64 {
        3.0 * self.total()
    }
}
