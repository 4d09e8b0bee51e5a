//! Encoder weights from the folders transformers and diffusers save: `config.json` beside
//! `{stem}.safetensors` (or `{stem}.safetensors.index.json` and its shards; the stem is `model`
//! for transformers, `diffusion_pytorch_model` for diffusers), loaded strictly into a `VarStore`:
//! every variable found at its shape, every stored tensor used.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use tch::nn::VarStore;
use tch::Tensor;

/// Why an encoder could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {why}")]
pub struct LoadError {
    /// The file or folder at fault.
    pub path: PathBuf,
    /// What is wrong with it.
    pub why: String,
}

impl LoadError {
    pub(crate) fn new(path: &Path, why: impl ToString) -> Self {
        Self {
            path: path.to_path_buf(),
            why: why.to_string(),
        }
    }
}

/// `dir/config.json` as `C`.
pub fn read_config<C: DeserializeOwned>(dir: &Path) -> Result<C, LoadError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| LoadError::new(&path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::new(&path, e))
}

/// Every tensor of the weights in `dir`: `{stem}.safetensors`, or the shards its
/// `{stem}.safetensors.index.json` lists.
fn read_tensors(dir: &Path, stem: &str) -> Result<Vec<(String, Tensor, PathBuf)>, LoadError> {
    let single = dir.join(format!("{stem}.safetensors"));
    let index = dir.join(format!("{stem}.safetensors.index.json"));
    let files: Vec<PathBuf> = if single.exists() {
        vec![single]
    } else if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| LoadError::new(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| LoadError::new(&index, e))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| LoadError::new(&index, "has no weight_map"))?;
        let mut shards: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str().map(|s| dir.join(s)))
            .collect();
        shards.sort();
        shards.dedup();
        shards
    } else {
        return Err(LoadError::new(
            dir,
            format!("holds neither {stem}.safetensors nor {stem}.safetensors.index.json"),
        ));
    };
    let mut out = Vec::new();
    for file in files {
        let tensors = Tensor::read_safetensors(&file).map_err(|e| LoadError::new(&file, e))?;
        out.extend(tensors.into_iter().map(|(k, t)| (k, t, file.clone())));
    }
    Ok(out)
}

/// Set every variable of `vs` from the weights `{stem}.safetensors` in `dir`, a stored name mapped
/// to a variable name by dropping the first of `prefixes` it starts with. Stored tensors named in `ignored` (e.g.
/// buffers older files saved) are skipped; any other tensor the model lacks, a variable the
/// files lack or a shape that differs is an error naming the file and tensor.
pub fn load_into(
    vs: &mut VarStore,
    dir: &Path,
    stem: &str,
    prefixes: &[&str],
    ignored: &[&str],
) -> Result<(), LoadError> {
    let named = read_tensors(dir, stem)?
        .into_iter()
        .filter_map(|(stored, tensor, file)| {
            let name = prefixes
                .iter()
                .find_map(|p| stored.strip_prefix(p))
                .unwrap_or(&stored)
                .to_string();
            (!ignored.contains(&name.as_str())).then_some(Stored {
                stored,
                name,
                tensor,
                file,
            })
        })
        .collect();
    assign(vs, named, dir)
}

/// A stored tensor and the variable it sets.
pub(crate) struct Stored {
    /// Its name in the file.
    pub stored: String,
    /// The variable's name.
    pub name: String,
    /// Its values.
    pub tensor: Tensor,
    /// The file holding it.
    pub file: PathBuf,
}

/// Set every variable of `vs` from `tensors`; any tensor the model lacks, a variable none sets
/// (reported against `source`) or a shape that differs is an error naming the file and tensor.
pub(crate) fn assign(
    vs: &mut VarStore,
    tensors: Vec<Stored>,
    source: &Path,
) -> Result<(), LoadError> {
    let mut vars: HashMap<String, Tensor> = vs.variables();
    let mut missing: Vec<String> = vars.keys().cloned().collect();
    for Stored {
        stored,
        name,
        tensor,
        file,
    } in tensors
    {
        let var = vars.get_mut(&name).ok_or_else(|| {
            LoadError::new(
                &file,
                format!("`{stored}` is not a weight of this model (is it another model's?)"),
            )
        })?;
        if var.size() != tensor.size() {
            return Err(LoadError::new(
                &file,
                format!(
                    "`{stored}` has shape {:?}, the config needs {:?}",
                    tensor.size(),
                    var.size()
                ),
            ));
        }
        tch::no_grad(|| var.copy_(&tensor));
        missing.retain(|m| *m != name);
    }
    if let Some(name) = missing.first() {
        return Err(LoadError::new(
            source,
            format!("no weight for `{name}` ({} missing)", missing.len()),
        ));
    }
    Ok(())
}
