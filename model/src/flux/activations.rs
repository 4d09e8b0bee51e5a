//! What FLUX.1 saves for backward ([`crate::activations`]).

use crate::activations::{diffusion_io, modulated_stream, qk_norms, Activations, LayerActivations};
use crate::activations::{Saved, Width};
use crate::flops::Rows;
use crate::{FluxConfig, FluxTransformer};

/// Per joint layer and stream: the modulated stream with attention's fused projection `3d`,
/// rotated queries and keys `2d`, joined values and output `2d`, the output gathered for its
/// projection `d`, and the MLP's hidden width before and after GELU `2m`. Per single layer, over
/// all tokens: one norm, the fused input projection `3d + m`, rotated queries and keys `2d`, the
/// attention output `d`, and the `[attention | GELU(mlp)]` input of the output projection
/// `d + m`. Every layer also keeps its modulation per sample.
pub fn activations(config: &FluxConfig) -> Activations {
    let d = config.hidden_size as f64;
    let m = config.mlp_hidden() as f64;
    let heads = config.num_attention_heads as f64;
    let modulation =
        |triples: f64| Saved::new(Rows::Sample, (3.0 * triples + 1.0) * d, Width::Gathered);
    let mut layers = Vec::new();
    for i in 0..config.num_joint_layers {
        let mut saved = vec![modulation(4.0)];
        for rows in [Rows::Image, Rows::Text] {
            saved.extend(modulated_stream(rows, d, heads, 8.0 * d + 2.0 * m));
            saved.extend(qk_norms(rows, d, heads));
        }
        layers.push(LayerActivations {
            name: FluxTransformer::layer_name(i),
            saved,
            inputs: vec![
                Saved::new(Rows::Image, d, Width::Whole),
                Saved::new(Rows::Text, d, Width::Whole),
            ],
        });
    }
    for j in 0..config.num_single_layers {
        let mut saved = vec![
            modulation(1.0),
            Saved::new(Rows::Tokens, 3.0 * d, Width::Whole),
            Saved::new(Rows::Tokens, d, Width::Gathered),
            Saved::new(Rows::Tokens, 7.0 * d + 2.0 * m, Width::Split),
            Saved::f32(Rows::Tokens, 2.0, Width::Whole),
            Saved::f32(Rows::Tokens, heads, Width::Split),
        ];
        saved.extend(qk_norms(Rows::Tokens, d, heads));
        layers.push(LayerActivations {
            name: FluxTransformer::layer_name(config.num_joint_layers + j),
            saved,
            inputs: vec![Saved::new(Rows::Tokens, d, Width::Whole)],
        });
    }
    let embedders = if config.guidance_embed { 3.0 } else { 2.0 };
    Activations {
        layers,
        outside: diffusion_io(
            d,
            config.token_channels() as f64,
            config.context_dim as f64,
            config.vec_in_dim as f64,
            embedders,
            Rows::Tokens,
        ),
    }
}
