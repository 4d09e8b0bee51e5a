//! Adapters from the files other tools write, matched to a model's native modules:
//!
//! - diffusers / PEFT: `{prefix}{module}.lora_A.weight` / `lora_B.weight` under diffusers' module
//!   names (prefix `transformer.`, `base_model.model.` or none), scaled `α / r` when the file has
//!   `{module}.alpha`, else as the adapter settings in its metadata say ([`PeftConfig`]), else 1
//!   (diffusers' loader without either);
//! - kohya / ComfyUI: `lora_unet_{module}.lora_down.weight` / `lora_up.weight` / `alpha` under
//!   BFL's module names with dots as underscores, scaled `alpha / r`.
//!
//! An external module is one part of a native one (diffusers' `to_q`, `to_k`, `to_v` of a fused
//! `linear_qkv`), so a native module's update is assembled from its parts' updates.

use std::collections::{BTreeMap, HashMap};

use tch::{Kind, Tensor};

use super::peft_config::PeftConfig;
use crate::convert::{Layout, Source};
use crate::tp::ParamSpec;
use crate::ModelSpec;

/// Why an adapter file does not fit a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    /// Neither diffusers' nor kohya's key names.
    #[error("{file}: no LoRA tensors (`….lora_A.weight` or `lora_unet_….lora_down.weight`)")]
    NotLora {
        /// The adapter file.
        file: String,
    },
    /// The architecture has no external layout to read the names in.
    #[error(
        "{file}: architecture \"{architecture}\" has no {layout:?} layout to read adapters in"
    )]
    NoLayout {
        /// The adapter file.
        file: String,
        /// The model's architecture.
        architecture: String,
        /// The layout the file uses.
        layout: Layout,
    },
    /// A tensor that belongs to no module of the model, or is not a LoRA tensor.
    #[error("{file}: `{key}` {why} (is the adapter for another model?)")]
    Foreign {
        /// The adapter file.
        file: String,
        /// The tensor's key.
        key: String,
        /// What is wrong with it.
        why: String,
    },
    /// The adapter settings in the file's metadata are unreadable or not plain LoRA.
    #[error("{file}: {why}")]
    Metadata {
        /// The adapter file.
        file: String,
        /// What is wrong with them.
        why: String,
    },
    /// A module's tensors hold values no update can be made of: NaN or infinite entries, a
    /// rank of 0, an alpha that is not one number, or two differing copies.
    #[error("{file}: `{key}` {why}")]
    Values {
        /// The adapter file.
        file: String,
        /// The tensor's key (or the module's name).
        key: String,
        /// What is wrong with its values.
        why: String,
    },
    /// A module's tensors have shapes that do not fit its weight or each other.
    #[error("{file}: `{module}`: {why} (is the adapter for another model?)")]
    Shape {
        /// The adapter file.
        file: String,
        /// The external module.
        module: String,
        /// What does not fit.
        why: String,
    },
}

/// One external module's adapter: `A [r, in]`, `B [out_part, r]` and its scale.
#[derive(Debug)]
pub struct PartAdapter {
    /// Down-projection.
    pub a: Tensor,
    /// Up-projection.
    pub b: Tensor,
    /// The factor of `B · A`.
    pub scale: f64,
}

/// The adapter a file holds for one native module: one [`PartAdapter`] per external key its
/// weight is assembled from, in that order.
#[derive(Debug)]
pub struct ImportedAdapter {
    /// Native module name (`layers.0.self_attention.linear_qkv`).
    pub module: String,
    /// The native weight's spec (logical shape, parts).
    pub base: ParamSpec,
    /// How the native weight's rows come from the parts.
    pub source: Source,
    /// Each part's adapter.
    pub parts: Vec<PartAdapter>,
}

impl ImportedAdapter {
    /// The rank of each part's update.
    pub fn rank(&self) -> i64 {
        self.parts[0].a.size()[0]
    }

    /// The update `ΔW [out, in]` (f32) the adapter adds to the native weight: each part's
    /// `scale · B · A`, assembled as the weight is.
    pub fn delta(&self) -> Tensor {
        let updates = self
            .parts
            .iter()
            .map(|p| p.b.to_kind(Kind::Float).mm(&p.a.to_kind(Kind::Float)) * p.scale)
            .collect();
        self.source.assemble(updates)
    }

    /// `(A [r, in], B [out, r], scale)` when every part shares one `A` and one scale (as
    /// flux-hpc's own exports do): the update as one native adapter. `None` when the parts were
    /// trained separately (diffusers' `to_q`, `to_k`, `to_v` each with its own `A`).
    pub fn shared(&self) -> Option<(Tensor, Tensor, f64)> {
        let first = &self.parts[0];
        let same = self.parts[1..]
            .iter()
            .all(|p| p.scale == first.scale && p.a.equal(&first.a));
        same.then(|| {
            let bs = self.parts.iter().map(|p| p.b.shallow_clone()).collect();
            (
                first.a.shallow_clone(),
                self.source.assemble(bs),
                first.scale,
            )
        })
    }
}

/// The layout and external module name of an adapter tensor key, with its role (`A`, `B` or
/// `alpha`); `None` for a key that is not a LoRA tensor.
fn parse_key(key: &str) -> Option<(Layout, String, &'static str)> {
    if let Some(stem) = key.strip_prefix("lora_unet_") {
        let (module, leaf) = stem.split_once('.')?;
        let role = match leaf {
            "lora_down.weight" => "A",
            "lora_up.weight" => "B",
            "alpha" => "alpha",
            _ => return None,
        };
        return Some((Layout::Bfl, module.to_string(), role));
    }
    let (module, role) = [
        (".lora_A.weight", "A"),
        (".lora_B.weight", "B"),
        (".alpha", "alpha"),
    ]
    .into_iter()
    .find_map(|(suffix, role)| key.strip_suffix(suffix).map(|m| (m, role)))?;
    let module = ["transformer.", "base_model.model."]
        .iter()
        .find_map(|p| module.strip_prefix(p))
        .unwrap_or(module);
    Some((Layout::Diffusers, module.to_string(), role))
}

/// The external module name of weight key `key` as the file names it: dotted for diffusers,
/// dots as underscores for kohya.
fn file_module(key: &str, layout: Layout) -> String {
    let module = key.strip_suffix(".weight").unwrap_or(key);
    match layout {
        Layout::Diffusers => module.to_string(),
        Layout::Bfl => module.replace('.', "_"),
    }
}

/// The adapters of `tensors` (an adapter file's contents, its safetensors `metadata` beside
/// them, named `file` in errors) on a model of `model`, per native module in the model's order.
/// Strict: every tensor must belong to a module the model has, every module needs its `A` and
/// `B` with shapes that fit its weight, and a fused native module needs all its parts.
pub fn import(
    tensors: Vec<(String, Tensor)>,
    metadata: &BTreeMap<String, String>,
    model: &ModelSpec,
    file: &str,
) -> Result<Vec<ImportedAdapter>, ImportError> {
    let settings = PeftConfig::from_metadata(metadata).map_err(|why| ImportError::Metadata {
        file: file.to_string(),
        why,
    })?;
    let foreign = |key: &str, why: &str| ImportError::Foreign {
        file: file.to_string(),
        key: key.to_string(),
        why: why.to_string(),
    };
    let values = |key: &str, why: String| ImportError::Values {
        file: file.to_string(),
        key: key.to_string(),
        why,
    };
    // Module → role → (the key it was read under, its tensor).
    let mut found: BTreeMap<String, HashMap<&'static str, (String, Tensor)>> = BTreeMap::new();
    let mut layout = None;
    for (key, tensor) in tensors {
        let (this, module, role) =
            parse_key(&key).ok_or_else(|| foreign(&key, "is not a LoRA tensor"))?;
        if *layout.get_or_insert(this) != this {
            return Err(foreign(&key, "mixes kohya and diffusers names"));
        }
        if let Some(why) = non_finite(&tensor) {
            return Err(values(&key, why));
        }
        let roles = found.entry(module).or_default();
        match roles.get(role) {
            // The same module under two prefixes (`transformer.` and `base_model.model.`):
            // one update if the copies agree, no way to choose if they differ.
            Some((first, copy)) if copy.size() != tensor.size() || !copy.equal(&tensor) => {
                return Err(values(
                    &key,
                    format!("differs from `{first}`: the same module twice with other values"),
                ));
            }
            Some(_) => {}
            None => {
                roles.insert(role, (key, tensor));
            }
        }
    }
    let layout = layout.ok_or_else(|| ImportError::NotLora {
        file: file.to_string(),
    })?;
    if !model.weight_layouts().contains(&layout) {
        return Err(ImportError::NoLayout {
            file: file.to_string(),
            architecture: model.architecture().to_string(),
            layout,
        });
    }
    let shape_error = |module: &str, why: String| ImportError::Shape {
        file: file.to_string(),
        module: module.to_string(),
        why,
    };
    let mut out = Vec::new();
    for base in model.param_specs(1) {
        let Some(module) = base.name.strip_suffix(".weight") else {
            continue;
        };
        let Some(source) = model.external_source(&base.name, layout) else {
            continue;
        };
        if base.shape.len() != 2 {
            continue;
        }
        let names: Vec<String> = source.keys.iter().map(|k| file_module(k, layout)).collect();
        if !names.iter().any(|n| found.contains_key(n)) {
            continue;
        }
        let rows = source.rows(&base);
        let mut parts = Vec::new();
        for (name, out_rows) in names.iter().zip(rows) {
            let mut entry = found.remove(name).ok_or_else(|| {
                shape_error(
                    name,
                    format!(
                        "missing, while {} are present: they are parts of one weight",
                        names.join(", ")
                    ),
                )
            })?;
            let mut take = |role: &str, what: &str| {
                entry
                    .remove(role)
                    .map(|(_, t)| t)
                    .ok_or_else(|| shape_error(name, format!("has no {what}")))
            };
            let (a, b) = (take("A", "A (down) matrix")?, take("B", "B (up) matrix")?);
            let (sa, sb) = (a.size(), b.size());
            let fits = sa.len() == 2
                && sb.len() == 2
                && sa[1] == base.shape[1]
                && sb[0] == out_rows
                && sb[1] == sa[0];
            if !fits {
                return Err(shape_error(
                    name,
                    format!(
                        "A {sa:?} and B {sb:?} do not fit a weight of {out_rows} × {} rows × \
                         columns",
                        base.shape[1]
                    ),
                ));
            }
            if sa[0] == 0 {
                return Err(values(name, "has rank 0: an adapter of no update".into()));
            }
            let scale = match (entry.remove("alpha"), layout, &settings) {
                (Some((key, alpha)), ..) => {
                    if alpha.numel() != 1 {
                        return Err(values(
                            &key,
                            format!("holds {:?}, not one number", alpha.size()),
                        ));
                    }
                    alpha.double_value(&vec![0; alpha.dim()]) / sa[0] as f64
                }
                (None, Layout::Diffusers, Some(settings)) => settings.scale(name, sa[0]),
                (None, Layout::Diffusers, None) => 1.0,
                (None, Layout::Bfl, _) => return Err(shape_error(name, "has no alpha".into())),
            };

            parts.push(PartAdapter { a, b, scale });
        }
        out.push(ImportedAdapter {
            module: module.to_string(),
            base,
            source,
            parts,
        });
    }
    if let Some(module) = found.keys().next() {
        return Err(foreign(module, "names no weight of this model"));
    }
    Ok(out)
}

/// Why `t` cannot be part of an update (`None` when every entry is finite).
fn non_finite(t: &Tensor) -> Option<String> {
    let bad = t
        .to_kind(Kind::Float)
        .isfinite()
        .logical_not()
        .sum(Kind::Int64)
        .int64_value(&[]);
    (bad > 0).then(|| format!("holds {bad} NaN or infinite value(s) of {}", t.numel()))
}
