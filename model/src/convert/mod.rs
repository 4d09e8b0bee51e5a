//! Reference checkpoints (BFL `flux` and diffusers `FluxTransformer2DModel`) ⇄ native names.
//!
//! [`table`] holds the key table; this module resolves it per parameter and moves tensors in both
//! directions. Loading is strict: every native parameter must be found with its exact shape and
//! every external tensor must be used.

pub mod table;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use tch::Tensor;

use crate::{Flux, FluxConfig};
use table::{Combine, Row, JOINT, SINGLE, TOP};

/// A public key layout of FLUX.1 transformer weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Black Forest Labs' `flux` repository (`double_blocks.0.img_attn.qkv.weight`, …).
    Bfl,
    /// diffusers' `FluxTransformer2DModel` (`transformer_blocks.0.attn.to_q.weight`, …).
    Diffusers,
}

/// Where one native parameter lives in an external layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// External keys, in stacking order.
    pub keys: Vec<String>,
    /// How they combine into the native tensor.
    pub combine: Combine,
}

/// Why external weights could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read as safetensors.
    #[error("{path}: {message}")]
    Read {
        /// The file.
        path: String,
        /// libtorch's or the OS's message.
        message: String,
    },
    /// A native parameter has no row in the key table.
    #[error("no {layout:?} name is known for native parameter `{native}`")]
    Unmapped {
        /// The layout.
        layout: Layout,
        /// Native name.
        native: String,
    },
    /// A key the native model needs is absent.
    #[error("missing tensor `{key}` (needed for native `{native}`)")]
    Missing {
        /// External key.
        key: String,
        /// Native name it feeds.
        native: String,
    },
    /// Assembled tensor has the wrong shape for the config.
    #[error("`{native}`: expected shape {expected:?}, the checkpoint gives {got:?}")]
    Shape {
        /// Native name.
        native: String,
        /// Shape the config implies.
        expected: Vec<i64>,
        /// Shape assembled from the file.
        got: Vec<i64>,
    },
    /// Tensors in the file that no native parameter uses (a config mismatch, e.g. guidance).
    #[error("{} tensor(s) in the checkpoint are not used by this config, e.g. `{}`", .0.len(), .0[0])]
    Unused(Vec<String>),
}

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

fn assemble(parts: Vec<Tensor>, combine: Combine) -> Tensor {
    match combine {
        Combine::Same | Combine::Stack if parts.len() == 1 => {
            parts.into_iter().next().expect("one part")
        }
        Combine::Same | Combine::Stack => Tensor::cat(&parts, 0),
        Combine::SwapHalves => {
            let halves = parts[0].chunk(2, 0);
            Tensor::cat(&[&halves[1], &halves[0]], 0)
        }
    }
}

/// Read every tensor of a safetensors file.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>, LoadError> {
    Tensor::read_safetensors(path)
        .map(|v| v.into_iter().collect())
        .map_err(|e| LoadError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })
}

/// Copy external `tensors` in `layout` into `model`'s parameters (strict: all found, all used).
/// Under tensor parallelism each rank keeps its shard of the logical tensors.
pub fn load_into(
    model: &mut Flux,
    tensors: &HashMap<String, Tensor>,
    layout: Layout,
) -> Result<(), LoadError> {
    let config = model.config().clone();
    let mut used = BTreeSet::new();
    let mut logical = HashMap::new();
    for spec in model.store.param_specs() {
        let native = &spec.name;
        let src = source(native, layout, &config).ok_or_else(|| LoadError::Unmapped {
            layout,
            native: native.clone(),
        })?;
        let parts = src
            .keys
            .iter()
            .map(|key| {
                used.insert(key.clone());
                tensors
                    .get(key)
                    .map(Tensor::shallow_clone)
                    .ok_or_else(|| LoadError::Missing {
                        key: key.clone(),
                        native: native.clone(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let value = assemble(parts, src.combine);
        if value.size() != spec.shape {
            return Err(LoadError::Shape {
                native: native.clone(),
                expected: spec.shape.clone(),
                got: value.size(),
            });
        }
        logical.insert(native.clone(), value);
    }
    let mut unused: Vec<String> = tensors
        .keys()
        .filter(|k| !used.contains(*k))
        .cloned()
        .collect();
    if !unused.is_empty() {
        unused.sort();
        return Err(LoadError::Unused(unused));
    }
    model
        .store
        .load_logical(&logical)
        .expect("every parameter was assembled with its logical shape");
    Ok(())
}

/// Load a safetensors file in `layout` into `model`.
pub fn load_file(model: &mut Flux, path: &Path, layout: Layout) -> Result<(), LoadError> {
    load_into(model, &read_safetensors(path)?, layout)
}

/// The model's weights under `layout`'s names (stacked tensors split back into their parts),
/// gathered to logical shapes (a collective under tensor parallelism).
pub fn export(model: &Flux, layout: Layout) -> Vec<(String, Tensor)> {
    let config = model.config();
    let mut out = Vec::new();
    for (native, value) in model.store.gather_logical(false) {
        let src = source(&native, layout, config).expect("every native parameter has a table row");
        let parts = match src.combine {
            Combine::Same => vec![value],
            Combine::SwapHalves => vec![assemble(vec![value], Combine::SwapHalves)],
            Combine::Stack => {
                let d = config.hidden_size;
                let mut sizes = vec![d; 3];
                if src.keys.len() == 4 {
                    sizes.push(config.mlp_hidden());
                }
                value.split_with_sizes(&sizes, 0)
            }
        };
        out.extend(src.keys.into_iter().zip(parts));
    }
    out
}
