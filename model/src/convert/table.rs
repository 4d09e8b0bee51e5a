//! The key table between native names and the FLUX.1 reference layouts (BFL and diffusers).
//!
//! One row per module; the parameter leaf (`weight`, `bias`) is appended to every column. BFL
//! stores RMSNorm scales as `scale` where native and diffusers say `weight`.

/// How a native tensor is assembled from diffusers tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// One diffusers tensor, unchanged.
    Same,
    /// Rows of several diffusers tensors stacked along dim 0 (fused `[q; k; v]` or `[q; k; v; mlp]`).
    Stack,
    /// The two row halves swapped (diffusers' `norm_out` is `[scale; shift]`, native `[shift; scale]`).
    SwapHalves,
}

/// One module's names in the three layouts.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// Native module path (below the block prefix for block rows).
    pub native: &'static str,
    /// BFL module path.
    pub bfl: &'static str,
    /// diffusers module path(s), in stacking order.
    pub diffusers: &'static [&'static str],
    /// How the diffusers tensors become the native one.
    pub combine: Combine,
}

const fn row(
    native: &'static str,
    bfl: &'static str,
    diffusers: &'static [&'static str],
    combine: Combine,
) -> Row {
    Row {
        native,
        bfl,
        diffusers,
        combine,
    }
}

use Combine::{Same, Stack, SwapHalves};

/// Modules outside the layer stack. Native prefix `""`, BFL `""`, diffusers `""`.
pub const TOP: &[Row] = &[
    row("x_embedder", "img_in", &["x_embedder"], Same),
    row("context_embedder", "txt_in", &["context_embedder"], Same),
    row(
        "time_embedder.linear_1",
        "time_in.in_layer",
        &["time_text_embed.timestep_embedder.linear_1"],
        Same,
    ),
    row(
        "time_embedder.linear_2",
        "time_in.out_layer",
        &["time_text_embed.timestep_embedder.linear_2"],
        Same,
    ),
    row(
        "vector_embedder.linear_1",
        "vector_in.in_layer",
        &["time_text_embed.text_embedder.linear_1"],
        Same,
    ),
    row(
        "vector_embedder.linear_2",
        "vector_in.out_layer",
        &["time_text_embed.text_embedder.linear_2"],
        Same,
    ),
    row(
        "guidance_embedder.linear_1",
        "guidance_in.in_layer",
        &["time_text_embed.guidance_embedder.linear_1"],
        Same,
    ),
    row(
        "guidance_embedder.linear_2",
        "guidance_in.out_layer",
        &["time_text_embed.guidance_embedder.linear_2"],
        Same,
    ),
    row(
        "norm_out.linear",
        "final_layer.adaLN_modulation.1",
        &["norm_out.linear"],
        SwapHalves,
    ),
    row("proj_out", "final_layer.linear", &["proj_out"], Same),
];

/// Joint layers. Native `transformer.layers.{i}.`, BFL `double_blocks.{i}.`,
/// diffusers `transformer_blocks.{i}.`.
pub const JOINT: &[Row] = &[
    row("adaln.linear", "img_mod.lin", &["norm1.linear"], Same),
    row(
        "adaln_context.linear",
        "txt_mod.lin",
        &["norm1_context.linear"],
        Same,
    ),
    row(
        "self_attention.linear_qkv",
        "img_attn.qkv",
        &["attn.to_q", "attn.to_k", "attn.to_v"],
        Stack,
    ),
    row(
        "self_attention.added_linear_qkv",
        "txt_attn.qkv",
        &["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
        Stack,
    ),
    row(
        "self_attention.q_layernorm",
        "img_attn.norm.query_norm",
        &["attn.norm_q"],
        Same,
    ),
    row(
        "self_attention.k_layernorm",
        "img_attn.norm.key_norm",
        &["attn.norm_k"],
        Same,
    ),
    row(
        "self_attention.added_q_layernorm",
        "txt_attn.norm.query_norm",
        &["attn.norm_added_q"],
        Same,
    ),
    row(
        "self_attention.added_k_layernorm",
        "txt_attn.norm.key_norm",
        &["attn.norm_added_k"],
        Same,
    ),
    row(
        "self_attention.linear_proj",
        "img_attn.proj",
        &["attn.to_out.0"],
        Same,
    ),
    row(
        "self_attention.added_linear_proj",
        "txt_attn.proj",
        &["attn.to_add_out"],
        Same,
    ),
    row("mlp.linear_fc1", "img_mlp.0", &["ff.net.0.proj"], Same),
    row("mlp.linear_fc2", "img_mlp.2", &["ff.net.2"], Same),
    row(
        "context_mlp.linear_fc1",
        "txt_mlp.0",
        &["ff_context.net.0.proj"],
        Same,
    ),
    row(
        "context_mlp.linear_fc2",
        "txt_mlp.2",
        &["ff_context.net.2"],
        Same,
    ),
];

/// Single layers. Native `transformer.layers.{J + j}.`, BFL `single_blocks.{j}.`,
/// diffusers `single_transformer_blocks.{j}.`.
pub const SINGLE: &[Row] = &[
    row("adaln.linear", "modulation.lin", &["norm.linear"], Same),
    row(
        "linear_qkv_fc1",
        "linear1",
        &["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
        Stack,
    ),
    row("linear_proj_fc2", "linear2", &["proj_out"], Same),
    row(
        "self_attention.q_layernorm",
        "norm.query_norm",
        &["attn.norm_q"],
        Same,
    ),
    row(
        "self_attention.k_layernorm",
        "norm.key_norm",
        &["attn.norm_k"],
        Same,
    ),
];
