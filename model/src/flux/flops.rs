//! Flux's weight matrices for the FLOPs count of [`crate::flops`].

use crate::flops::{Attention, Rows};
use crate::FluxConfig;

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

/// Every layer attends over the joint text and image sequence.
pub fn attention(config: &FluxConfig) -> Attention {
    Attention {
        layers: config.num_layers(),
        width: config.hidden_size,
        over: Rows::Tokens,
    }
}
