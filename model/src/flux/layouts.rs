//! Where FLUX.1's native parameters live in the reference layouts (BFL and diffusers): the key
//! table, one row per module (the parameter leaf, `weight` or `bias`, appended to every column;
//! BFL stores RMSNorm scales as `scale` where native and diffusers say `weight`), and the lookup
//! of one parameter.

use crate::convert::{Combine, Layout, Source};
use crate::FluxConfig;

/// One module's names in the three layouts.
#[derive(Debug, Clone, Copy)]
struct Row {
    /// Native module path (below the block prefix for block rows).
    native: &'static str,
    /// BFL module path.
    bfl: &'static str,
    /// diffusers module path(s), in stacking order.
    diffusers: &'static [&'static str],
    /// How the diffusers tensors become the native one.
    combine: Combine,
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
const TOP: &[Row] = &[
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
const JOINT: &[Row] = &[
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
const SINGLE: &[Row] = &[
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

/// The table section for a native module path, its path within the block, and the block prefixes
/// in BFL and diffusers (empty outside the layer stack).
fn locate<'a>(module: &'a str, config: &FluxConfig) -> (&'static [Row], &'a str, String, String) {
    let block = module.strip_prefix("transformer.layers.").and_then(|rest| {
        let (index, local) = rest.split_once('.')?;
        Some((index.parse::<usize>().ok()?, local))
    });
    match block {
        Some((i, local)) if i < config.num_joint_layers => (
            JOINT,
            local,
            format!("double_blocks.{i}."),
            format!("transformer_blocks.{i}."),
        ),
        Some((i, local)) => {
            let j = i - config.num_joint_layers;
            (
                SINGLE,
                local,
                format!("single_blocks.{j}."),
                format!("single_transformer_blocks.{j}."),
            )
        }
        None => (TOP, module, String::new(), String::new()),
    }
}

/// Where native parameter `native` (e.g. `transformer.layers.3.linear_qkv_fc1.weight`) lives in
/// `layout`, for a model of `config`.
pub fn source(native: &str, layout: Layout, config: &FluxConfig) -> Option<Source> {
    let (module, leaf) = native.rsplit_once('.')?;
    let (rows, local, bfl_prefix, diffusers_prefix) = locate(module, config);
    let row = rows.iter().find(|r| r.native == local)?;
    Some(match layout {
        Layout::Bfl => {
            let leaf = if row.native.ends_with("layernorm") && leaf == "weight" {
                "scale"
            } else {
                leaf
            };
            Source {
                keys: vec![format!("{bfl_prefix}{}.{leaf}", row.bfl)],
                combine: Combine::Same,
            }
        }
        Layout::Diffusers => Source {
            keys: row
                .diffusers
                .iter()
                .map(|m| format!("{diffusers_prefix}{m}.{leaf}"))
                .collect(),
            combine: row.combine,
        },
    })
}
