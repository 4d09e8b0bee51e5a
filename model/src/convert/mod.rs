//! Reference checkpoints (Black Forest Labs' and diffusers' layouts) ⇄ native names, for any
//! architecture that declares its layouts ([`ModelSpec::external_source`]).
//!
//! [`table`] holds FLUX.1's key table; this module resolves FLUX.1's per parameter and moves
//! tensors of any model in both directions. Loading is strict: every native parameter must be
//! found with its exact shape and every external tensor must be used.

pub mod table;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use tch::Tensor;

use crate::tp::{ParamSpec, ShardedStore};
use crate::{FluxConfig, ModelSpec};
use table::{Combine, Row, JOINT, SINGLE, TOP};

/// A public key layout of transformer weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Black Forest Labs' reference repositories, `flux` and `flux2`
    /// (`double_blocks.0.img_attn.qkv.weight`, …).
    Bfl,
    /// diffusers' `FluxTransformer2DModel` / `Flux2Transformer2DModel`
    /// (`transformer_blocks.0.attn.to_q.weight`, …).
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

impl Source {
    /// One external key holding the native tensor as it is.
    pub fn same(key: String) -> Self {
        Self {
            keys: vec![key],
            combine: Combine::Same,
        }
    }

    /// The rows (dim 0) each external key holds of native `spec`: the named parts when there is
    /// one key per part, else equal shares.
    pub fn rows(&self, spec: &ParamSpec) -> Vec<i64> {
        let n = self.keys.len();
        if n == 1 {
            vec![spec.shape[0]]
        } else if spec.parts.len() == n {
            spec.parts.iter().map(|(_, size)| *size).collect()
        } else {
            vec![spec.shape[0] / n as i64; n]
        }
    }

    /// The native tensor from the external tensors of `keys`, in order.
    pub fn assemble(&self, parts: Vec<Tensor>) -> Tensor {
        match self.combine {
            Combine::Same | Combine::Stack if parts.len() == 1 => {
                parts.into_iter().next().expect("one part")
            }
            Combine::Same | Combine::Stack => Tensor::cat(&parts, 0),
            Combine::SwapHalves => swap_halves(&parts[0]),
        }
    }

    /// The external tensors, in `keys` order, of the native `value` of `spec`.
    pub fn split(&self, spec: &ParamSpec, value: Tensor) -> Vec<Tensor> {
        match self.combine {
            Combine::SwapHalves => vec![swap_halves(&value)],
            Combine::Same | Combine::Stack => value.split_with_sizes(self.rows(spec), 0),
        }
    }
}

/// `[a; b]` → `[b; a]` along dim 0.
fn swap_halves(t: &Tensor) -> Tensor {
    let halves = t.chunk(2, 0);
    Tensor::cat(&[&halves[1], &halves[0]], 0)
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

/// Read every tensor of a safetensors file.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>, LoadError> {
    Tensor::read_safetensors(path)
        .map(|v| v.into_iter().collect())
        .map_err(|e| LoadError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })
}

/// Copy external `tensors` in `layout` into the parameters of `store`, a model of `model`
/// (strict: all found, all used). Under tensor parallelism each rank keeps its shard of the
/// logical tensors.
pub fn load_into(
    store: &mut ShardedStore,
    model: &ModelSpec,
    tensors: &HashMap<String, Tensor>,
    layout: Layout,
) -> Result<(), LoadError> {
    let mut used = BTreeSet::new();
    let mut logical = HashMap::new();
    for spec in store.param_specs() {
        let native = &spec.name;
        let src = model
            .external_source(native, layout)
            .ok_or_else(|| LoadError::Unmapped {
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
        let value = src.assemble(parts);
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
    store
        .load_logical(&logical)
        .expect("every parameter was assembled with its logical shape");
    Ok(())
}

/// Load a safetensors file in `layout` into `store`, a model of `model`.
pub fn load_file(
    store: &mut ShardedStore,
    model: &ModelSpec,
    path: &Path,
    layout: Layout,
) -> Result<(), LoadError> {
    load_into(store, model, &read_safetensors(path)?, layout)
}

/// The weights of `store`, a model of `model`, under `layout`'s names (stacked tensors split
/// back into their parts), gathered to logical shapes (a collective under tensor parallelism).
pub fn export(store: &ShardedStore, model: &ModelSpec, layout: Layout) -> Vec<(String, Tensor)> {
    let specs: HashMap<&str, &ParamSpec> = store
        .param_specs()
        .iter()
        .map(|s| (s.name.as_str(), s))
        .collect();
    let mut out = Vec::new();
    for (native, value) in store.gather_logical(false) {
        let src = model
            .external_source(&native, layout)
            .expect("every native parameter has an external name");
        let parts = src.split(specs[native.as_str()], value);
        out.extend(src.keys.into_iter().zip(parts));
    }
    out
}
