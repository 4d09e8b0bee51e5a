//! Where FLUX.2's native parameters live in the two public layouts.
//!
//! Native names are diffusers' names with its fused attention projections (`attn.to_qkv`,
//! `attn.to_added_qkv`), which diffusers' checkpoints store as separate `to_q`/`to_k`/`to_v` and
//! `add_q_proj`/`add_k_proj`/`add_v_proj`. Black Forest Labs' `flux2` checkpoints use the names
//! below (diffusers reads them with `convert_flux2_transformer_checkpoint_to_diffusers`): fused
//! `qkv`, RMSNorm scales as `scale`, and the output modulation as `[shift; scale]` where diffusers
//! and native hold `[scale; shift]`.

use crate::convert::{Combine, Layout, Source};

/// Modules outside the blocks: (native, BFL).
const TOP: &[(&str, &str)] = &[
    ("x_embedder", "img_in"),
    ("context_embedder", "txt_in"),
    (
        "time_guidance_embed.timestep_embedder.linear_1",
        "time_in.in_layer",
    ),
    (
        "time_guidance_embed.timestep_embedder.linear_2",
        "time_in.out_layer",
    ),
    (
        "time_guidance_embed.guidance_embedder.linear_1",
        "guidance_in.in_layer",
    ),
    (
        "time_guidance_embed.guidance_embedder.linear_2",
        "guidance_in.out_layer",
    ),
    (
        "double_stream_modulation_img.linear",
        "double_stream_modulation_img.lin",
    ),
    (
        "double_stream_modulation_txt.linear",
        "double_stream_modulation_txt.lin",
    ),
    (
        "single_stream_modulation.linear",
        "single_stream_modulation.lin",
    ),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"),
    ("proj_out", "final_layer.linear"),
];

/// Modules of `transformer_blocks.{i}` (BFL `double_blocks.{i}`): (native, BFL).
const DOUBLE: &[(&str, &str)] = &[
    ("attn.to_qkv", "img_attn.qkv"),
    ("attn.norm_q", "img_attn.norm.query_norm"),
    ("attn.norm_k", "img_attn.norm.key_norm"),
    ("attn.to_out.0", "img_attn.proj"),
    ("attn.to_added_qkv", "txt_attn.qkv"),
    ("attn.norm_added_q", "txt_attn.norm.query_norm"),
    ("attn.norm_added_k", "txt_attn.norm.key_norm"),
    ("attn.to_add_out", "txt_attn.proj"),
    ("ff.linear_in", "img_mlp.0"),
    ("ff.linear_out", "img_mlp.2"),
    ("ff_context.linear_in", "txt_mlp.0"),
    ("ff_context.linear_out", "txt_mlp.2"),
];

/// Modules of `single_transformer_blocks.{i}` (BFL `single_blocks.{i}`): (native, BFL).
const SINGLE: &[(&str, &str)] = &[
    ("attn.to_qkv_mlp_proj", "linear1"),
    ("attn.to_out", "linear2"),
    ("attn.norm_q", "norm.query_norm"),
    ("attn.norm_k", "norm.key_norm"),
];

/// diffusers' separate projections of each fused native one, in stacking order.
const UNFUSED: &[(&str, [&str; 3])] = &[
    ("attn.to_qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]),
    (
        "attn.to_added_qkv",
        ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    ),
];

/// Where native parameter `native` (e.g. `transformer_blocks.0.attn.to_qkv.weight`) lives in
/// `layout`; `None` for a name FLUX.2 does not have.
pub fn source(native: &str, layout: Layout) -> Option<Source> {
    let (module, leaf) = native.rsplit_once('.')?;
    let block = |prefix: &str| {
        let rest = module.strip_prefix(prefix)?;
        let (index, local) = rest.split_once('.')?;
        index.parse::<usize>().ok()?;
        Some((&module[..prefix.len() + index.len()], index, local))
    };
    match layout {
        Layout::Diffusers => {
            let Some((stem, _, local)) = block("transformer_blocks.") else {
                return Some(Source::same(native.to_string()));
            };
            Some(match UNFUSED.iter().find(|(fused, _)| *fused == local) {
                Some((_, parts)) => Source {
                    keys: parts.iter().map(|p| format!("{stem}.{p}.{leaf}")).collect(),
                    combine: Combine::Stack,
                },
                None => Source::same(native.to_string()),
            })
        }
        Layout::Bfl => {
            let (bfl_module, norm) = if let Some((_, i, local)) = block("transformer_blocks.") {
                let bfl = lookup(DOUBLE, local)?;
                (format!("double_blocks.{i}.{bfl}"), local.contains("norm_"))
            } else if let Some((_, i, local)) = block("single_transformer_blocks.") {
                let bfl = lookup(SINGLE, local)?;
                (format!("single_blocks.{i}.{bfl}"), local.contains("norm_"))
            } else {
                (lookup(TOP, module)?.to_string(), false)
            };
            let leaf = if norm && leaf == "weight" {
                "scale"
            } else {
                leaf
            };
            let combine = if module == "norm_out.linear" {
                Combine::SwapHalves
            } else {
                Combine::Same
            };
            Some(Source {
                keys: vec![format!("{bfl_module}.{leaf}")],
                combine,
            })
        }
    }
}

fn lookup(table: &[(&str, &'static str)], native: &str) -> Option<&'static str> {
    table.iter().find(|(n, _)| *n == native).map(|(_, b)| *b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(native: &str, layout: Layout) -> (Vec<String>, Combine) {
        let s = source(native, layout).unwrap();
        (s.keys, s.combine)
    }

    #[test]
    fn fused_projections_stack_diffusers_parts_and_map_to_bfl_qkv() {
        let (k, c) = keys(
            "transformer_blocks.1.attn.to_added_qkv.weight",
            Layout::Diffusers,
        );
        assert_eq!(
            k,
            [
                "transformer_blocks.1.attn.add_q_proj.weight",
                "transformer_blocks.1.attn.add_k_proj.weight",
                "transformer_blocks.1.attn.add_v_proj.weight"
            ]
        );
        assert_eq!(c, Combine::Stack);
        let (k, c) = keys("transformer_blocks.1.attn.to_added_qkv.weight", Layout::Bfl);
        assert_eq!(
            (k, c),
            (
                vec!["double_blocks.1.txt_attn.qkv.weight".into()],
                Combine::Same
            )
        );
    }

    #[test]
    fn norms_are_scales_and_the_output_modulation_swaps_halves_in_bfl() {
        let (k, _) = keys(
            "single_transformer_blocks.0.attn.norm_k.weight",
            Layout::Bfl,
        );
        assert_eq!(k, ["single_blocks.0.norm.key_norm.scale"]);
        let (k, c) = keys("norm_out.linear.weight", Layout::Bfl);
        assert_eq!(k, ["final_layer.adaLN_modulation.1.weight"]);
        assert_eq!(c, Combine::SwapHalves);
        let (k, c) = keys("norm_out.linear.weight", Layout::Diffusers);
        assert_eq!(
            (k, c),
            (vec!["norm_out.linear.weight".into()], Combine::Same)
        );
        assert!(source("transformer_blocks.0.attn.to_q.weight", Layout::Bfl).is_none());
    }
}
