//! The frozen base of a LoRA run: weights read from a native checkpoint into the model, one
//! tensor at a time.

use std::path::Path;

use flux_data::checkpoint::{self, Reader};
use flux_model::tp::{ParamSpec, ShardedStore};
use flux_model::ConfigError;
use tch::Tensor;

use crate::run::resume::stored_architecture;

/// A native checkpoint opened as the base of a model: written for its architecture, holding
/// exactly its parameters, read one logical tensor at a time.
pub struct BaseWeights {
    reader: Reader,
    /// The checkpoint, as errors name it.
    shown: String,
    /// The model's parameters (any tensor-parallel size: only logical shapes are compared).
    specs: Vec<ParamSpec>,
}

impl BaseWeights {
    /// Open native checkpoint `path` (a `step_*/` directory, or a run directory whose `latest`
    /// is used) for a model of `architecture` with parameters `specs`. Fails, naming
    /// `lora.base`, the checkpoint and the reason, when it cannot be read, was written for
    /// another architecture, or lacks a parameter or holds one the model does not have.
    pub fn open(path: &Path, architecture: &str, specs: &[ParamSpec]) -> Result<Self, ConfigError> {
        let dir = checkpoint::latest(path)
            .map_err(|e| fail(e.to_string()))?
            .unwrap_or_else(|| path.to_path_buf());
        let reader = Reader::open(&dir).map_err(|e| fail(e.to_string()))?;
        let shown = dir.display().to_string();
        let config = reader.config().map_err(|e| fail(e.to_string()))?;
        let stored = stored_architecture(&config).map_err(|e| fail(format!("{shown}: {e}")))?;
        if stored != architecture {
            return Err(fail(format!(
                "{shown} holds a \"{stored}\" model, but [model] architecture is \"{architecture}\""
            )));
        }
        let names = reader.names("params").map_err(|e| fail(e.to_string()))?;
        if let Some(extra) = names.iter().find(|n| !specs.iter().any(|s| &s.name == *n)) {
            return Err(fail(format!(
                "{shown} holds `{extra}`, which this [model] does not have (is it the right model?)"
            )));
        }
        if let Some(missing) = specs.iter().find(|s| !names.contains(&s.name)) {
            return Err(fail(format!("{shown} has no weight `{}`", missing.name)));
        }
        Ok(Self {
            reader,
            shown,
            specs: specs.to_vec(),
        })
    }

    /// Parameter `name`'s logical (whole) tensor, checked against the model's shape.
    pub fn logical(&self, name: &str) -> Result<Tensor, ConfigError> {
        let spec = self.specs.iter().find(|s| s.name == name).ok_or_else(|| {
            fail(format!(
                "the model has no parameter `{name}` to read from {}",
                self.shown
            ))
        })?;
        let t = self
            .reader
            .logical("params", name)
            .map_err(|e| fail(e.to_string()))?;
        if t.size() != spec.shape {
            return Err(fail(format!(
                "{}: `{name}` has shape {:?}, this [model] needs {:?}",
                self.shown,
                t.size(),
                spec.shape
            )));
        }
        Ok(t)
    }
}

fn fail(message: String) -> ConfigError {
    ConfigError::new("lora.base", message)
}

/// Load the weights of native checkpoint `path` into `store`, a model of `architecture`, one
/// tensor at a time (see [`BaseWeights::open`] for what is refused); each rank keeps its shard.
pub fn load_base(
    store: &mut ShardedStore,
    path: &Path,
    architecture: &str,
) -> Result<(), ConfigError> {
    let specs = store.param_specs().to_vec();
    let base = BaseWeights::open(path, architecture, &specs)?;
    for spec in &specs {
        let t = base.logical(&spec.name)?;
        store
            .load_one(&spec.name, &t)
            .map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}
