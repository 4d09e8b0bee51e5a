//! What FLUX.1 saves for backward ([`crate::activations`]).

use crate::activations::{
    diffusion_io, joint_layer, single_stream_layer, Activations, StreamLinears,
};
use crate::activations::{Saved, Width};
use crate::flops::Rows;
use crate::{FluxConfig, FluxTransformer};

/// The joint layers' image stream.
const IMAGE: StreamLinears = StreamLinears {
    modulation: "adaln.linear",
    qkv: "self_attention.linear_qkv",
    proj: "self_attention.linear_proj",
    fc1: "mlp.linear_fc1",
    fc2: "mlp.linear_fc2",
};

/// The joint layers' text stream.
const TEXT: StreamLinears = StreamLinears {
    modulation: "adaln_context.linear",
    qkv: "self_attention.added_linear_qkv",
    proj: "self_attention.added_linear_proj",
    fc1: "context_mlp.linear_fc1",
    fc2: "context_mlp.linear_fc2",
};

/// Joint layers with the MLP's hidden width before GELU (`m`, and after it the output
/// projection's input); single layers with the fused input projection `3d + m`, rotated queries
/// and keys `2d`, the attention output `d` and the `[attention | GELU(mlp)]` input of the output
/// projection `d + m`. Every layer keeps its own modulation per sample: SiLU of the conditioning
/// and its `3d` per (shift, scale, gate).
pub fn activations(config: &FluxConfig) -> Activations {
    let d = config.hidden_size as f64;
    let m = config.mlp_hidden() as f64;
    let heads = config.num_attention_heads as f64;
    let modulation = |triples: f64| {
        vec![Saved::new(
            Rows::Sample,
            (3.0 * triples + 1.0) * d,
            Width::Gathered,
        )]
    };
    let joint = (0..config.num_joint_layers).map(|i| {
        joint_layer(
            FluxTransformer::layer_name(i),
            (d, m, heads),
            [&IMAGE, &TEXT],
            m,
            modulation(4.0),
        )
    });
    let single = (0..config.num_single_layers).map(|j| {
        single_stream_layer(
            FluxTransformer::layer_name(config.num_joint_layers + j),
            (d, heads),
            ["adaln.linear", "linear_qkv_fc1", "linear_proj_fc2"],
            (6.0 * d + m, d + m),
            modulation(1.0),
        )
    });
    let embedders = if config.guidance_embed { 3.0 } else { 2.0 };
    Activations {
        layers: joint.chain(single).collect(),
        outside: diffusion_io(
            d,
            config.token_channels() as f64,
            config.context_dim as f64,
            config.vec_in_dim as f64,
            embedders,
            Rows::Tokens,
        ),
        stem_regathered_for: Some(0),
    }
}
