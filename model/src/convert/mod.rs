//! Reference checkpoints (Black Forest Labs' and diffusers' layouts) ⇄ native names, for any
//! architecture that declares its layouts ([`ModelSpec::external_source`]).
//!
//! Each architecture says where its parameters live (`flux/layouts.rs`, `flux2/layouts.rs`);
//! this module moves tensors of any model in both directions. Loading is strict: every native parameter must be
//! found with its exact shape and every external tensor must be used.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use tch::Tensor;

use crate::tp::{ParamSpec, ShardedStore};
use crate::ModelSpec;

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
