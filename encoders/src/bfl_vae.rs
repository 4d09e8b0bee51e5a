//! BFL's single-file autoencoder: the `ae.safetensors` of the FLUX.1 releases, in the layout of
//! BFL's reference code (latent diffusion's): `encoder.down.{i}.block.{j}`, `mid.block_{1,2}`,
//! `mid.attn_1.{norm,q,k,v,proj_out}` with 1×1-conv weights `[C, C, 1, 1]`, `norm_out`,
//! `nin_shortcut`, and decoder `up.{i}` numbered from the output end (diffusers' `up_blocks.0`
//! is BFL's last `up`). The file holds no config: widths, ResNets per block and channels come
//! from the weights' shapes; what shapes cannot tell is BFL's (32 norm groups, no quant convs)
//! and FLUX.1's latent normalisation (scale 0.3611, shift 0.1159).

use std::collections::BTreeMap;
use std::path::Path;

use flux_data::convert::{SafetensorsReader, TensorInfo};

use crate::vae_config::AutoencoderConfig;
use crate::weights::{LoadError, Stored};

/// GroupNorm groups of BFL's autoencoder (fixed in its code, not stored).
const GROUPS: i64 = 32;
/// FLUX.1's latent normalisation (BFL's `AutoEncoderParams` for every FLUX.1 model).
const SCALE: f64 = 0.3611;
const SHIFT: f64 = 0.1159;

/// The configuration the weights of `reader` describe, with BFL's fixed groups and FLUX.1's
/// normalisation. Fails naming the file and the tensor it looked for.
pub(crate) fn infer_config(reader: &SafetensorsReader) -> Result<AutoencoderConfig, LoadError> {
    let tensors = reader.tensors();
    let path = reader.path();
    let shape = |name: &str| -> Result<Vec<i64>, LoadError> {
        tensors
            .get(name)
            .map(|t: &TensorInfo| t.shape.iter().map(|&d| d as i64).collect())
            .ok_or_else(|| {
                LoadError::new(
                    path,
                    format!("no `{name}`: not an autoencoder in BFL's layout"),
                )
            })
    };
    let count = |prefix: &str| {
        (0..)
            .take_while(|i| {
                let p = format!("{prefix}.{i}.");
                tensors.keys().any(|k| k.starts_with(&p))
            })
            .count()
    };
    let conv_in = shape("encoder.conv_in.weight")?;
    let blocks = count("encoder.down");
    let block_out_channels = (0..blocks)
        .map(|i| Ok(shape(&format!("encoder.down.{i}.block.0.conv1.weight"))?[0]))
        .collect::<Result<Vec<_>, LoadError>>()?;
    let latent_channels = shape("decoder.conv_in.weight")?[1];
    let moments = shape("encoder.conv_out.weight")?[0];
    if moments != 2 * latent_channels {
        return Err(LoadError::new(
            path,
            format!(
                "the encoder gives {moments} channels, not twice the decoder's {latent_channels} \
                 latent channels"
            ),
        ));
    }
    Ok(AutoencoderConfig {
        in_channels: conv_in[1],
        out_channels: shape("decoder.conv_out.weight")?[0],
        latent_channels,
        block_out_channels,
        layers_per_block: count("encoder.down.0.block") as i64,
        norm_num_groups: GROUPS,
        scaling_factor: SCALE,
        shift_factor: Some(SHIFT),
        use_quant_conv: tensors.contains_key("quant_conv.weight"),
        use_post_quant_conv: tensors.contains_key("post_quant_conv.weight"),
        mid_block_add_attention: tensors.contains_key("encoder.mid.attn_1.q.weight"),
        act_fn: "silu".into(),
    })
}

/// Every tensor of the file under its diffusers name, attention weights as linear `[C, C]`.
/// A name outside BFL's layout is kept as it is, for the strict loader to refuse.
pub(crate) fn diffusers_tensors(
    reader: &SafetensorsReader,
    blocks: usize,
) -> Result<Vec<Stored>, LoadError> {
    let path = reader.path();
    let all: BTreeMap<String, tch::Tensor> = reader
        .read_all()
        .map_err(|e| LoadError::new(path, e))?
        .into_iter()
        .collect();
    Ok(all
        .into_iter()
        .map(|(stored, tensor)| {
            let name = diffusers_name(&stored, blocks).unwrap_or_else(|| stored.clone());
            let linear = name.contains(".attentions.") && tensor.dim() == 4;
            let tensor = match linear {
                true => tensor.flatten(1, 3),
                false => tensor,
            };
            Stored {
                stored,
                name,
                tensor,
                file: path.to_path_buf(),
            }
        })
        .collect())
}

/// The diffusers name of BFL weight `name` in an autoencoder of `blocks` down (and up) blocks,
/// or `None` for a name outside BFL's layout.
fn diffusers_name(name: &str, blocks: usize) -> Option<String> {
    let parts: Vec<&str> = name.split('.').collect();
    let (side, rest) = parts.split_first()?;
    if !matches!(*side, "encoder" | "decoder") {
        return matches!(*side, "quant_conv" | "post_quant_conv").then(|| name.to_string());
    }
    let mut out: Vec<String> = vec![side.to_string()];
    let tail = |from: usize| rest[from..].iter().map(|s| s.to_string());
    match rest {
        ["down" | "up", i, kind, ..] => {
            let i: usize = i.parse().ok()?;
            let (stage, index) = match rest[0] {
                "down" => ("down_blocks", i),
                _ => ("up_blocks", blocks.checked_sub(i + 1)?),
            };
            out.extend([stage.to_string(), index.to_string()]);
            match *kind {
                "block" => {
                    out.push("resnets".into());
                    out.extend(tail(3));
                }
                "downsample" => {
                    out.extend(["downsamplers".into(), "0".into()]);
                    out.extend(tail(3));
                }
                "upsample" => {
                    out.extend(["upsamplers".into(), "0".into()]);
                    out.extend(tail(3));
                }
                _ => return None,
            }
        }
        ["mid", "attn_1", layer, param] => {
            let layer = match *layer {
                "norm" => "group_norm",
                "q" => "to_q",
                "k" => "to_k",
                "v" => "to_v",
                "proj_out" => "to_out.0",
                _ => return None,
            };
            out.push(format!("mid_block.attentions.0.{layer}.{param}"));
        }
        ["mid", block, ..] => {
            let k: usize = block.strip_prefix("block_")?.parse().ok()?;
            out.push(format!("mid_block.resnets.{}", k.checked_sub(1)?));
            out.extend(tail(2));
        }
        ["norm_out", ..] => {
            out.push("conv_norm_out".into());
            out.extend(tail(1));
        }
        _ => out.extend(tail(0)),
    }
    Some(out.join(".").replace("nin_shortcut", "conv_shortcut"))
}

/// Whether `path` names a single-file autoencoder (rather than a diffusers folder).
pub(crate) fn is_single_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

#[cfg(test)]
mod tests {
    use super::diffusers_name;

    #[test]
    fn names_map_to_diffusers() {
        let cases = [
            (
                "encoder.down.1.block.0.nin_shortcut.weight",
                "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
            ),
            (
                "encoder.down.2.downsample.conv.bias",
                "encoder.down_blocks.2.downsamplers.0.conv.bias",
            ),
            (
                "decoder.up.3.block.2.norm1.weight",
                "decoder.up_blocks.0.resnets.2.norm1.weight",
            ),
            (
                "decoder.up.1.upsample.conv.weight",
                "decoder.up_blocks.2.upsamplers.0.conv.weight",
            ),
            (
                "decoder.mid.block_2.conv1.weight",
                "decoder.mid_block.resnets.1.conv1.weight",
            ),
            (
                "encoder.mid.attn_1.proj_out.bias",
                "encoder.mid_block.attentions.0.to_out.0.bias",
            ),
            (
                "encoder.mid.attn_1.norm.weight",
                "encoder.mid_block.attentions.0.group_norm.weight",
            ),
            ("encoder.norm_out.bias", "encoder.conv_norm_out.bias"),
            ("decoder.conv_in.weight", "decoder.conv_in.weight"),
        ];
        for (bfl, diffusers) in cases {
            assert_eq!(diffusers_name(bfl, 4).as_deref(), Some(diffusers), "{bfl}");
        }
    }

    #[test]
    fn names_outside_the_layout_are_not_mapped() {
        for name in [
            "model.diffusion_model.x",
            "decoder.up.4.block.0.conv1.weight",
            "encoder.mid.attn_1.out.weight",
            "encoder.mid.block_0.conv1.weight",
        ] {
            assert_eq!(diffusers_name(name, 4), None, "{name}");
        }
    }
}
