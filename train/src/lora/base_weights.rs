//! The frozen base of a LoRA run: weights read from a native checkpoint into the model.

use std::path::Path;

use flux_data::checkpoint::{self, Reader};
use flux_model::tp::ShardedStore;
use flux_model::ConfigError;

use crate::run::resume::stored_architecture;

/// Load the weights of native checkpoint `path` (a `step_*/` directory, or a run directory whose
/// `latest` is used) into `store`, a model of `architecture`; each rank keeps its shard. Fails,
/// naming `lora.base`, the checkpoint and the reason, when it cannot be read, was written for
/// another architecture, or does not hold exactly the model's parameters with their shapes.
pub fn load_base(
    store: &mut ShardedStore,
    path: &Path,
    architecture: &str,
) -> Result<(), ConfigError> {
    let fail = |message: String| ConfigError::new("lora.base", message);
    let dir = checkpoint::latest(path)
        .map_err(|e| fail(e.to_string()))?
        .unwrap_or_else(|| path.to_path_buf());
    let reader = Reader::open(&dir).map_err(|e| fail(e.to_string()))?;
    let shown = dir.display();
    let config = reader.config().map_err(|e| fail(e.to_string()))?;
    let stored = stored_architecture(&config).map_err(|e| fail(format!("{shown}: {e}")))?;
    if stored != architecture {
        return Err(fail(format!(
            "{shown} holds a \"{stored}\" model, but [model] architecture is \"{architecture}\""
        )));
    }
    let names = reader.names("params").map_err(|e| fail(e.to_string()))?;
    let specs = store.param_specs().to_vec();
    if let Some(extra) = names.iter().find(|n| !specs.iter().any(|s| &s.name == *n)) {
        return Err(fail(format!(
            "{shown} holds `{extra}`, which this [model] does not have (is it the right model?)"
        )));
    }
    // One tensor at a time: the whole model never exists twice.
    for spec in &specs {
        if !names.contains(&spec.name) {
            return Err(fail(format!("{shown} has no weight `{}`", spec.name)));
        }
        let t = reader
            .logical("params", &spec.name)
            .map_err(|e| fail(e.to_string()))?;
        if t.size() != spec.shape {
            return Err(fail(format!(
                "{shown}: `{}` has shape {:?}, this [model] needs {:?}",
                spec.name,
                t.size(),
                spec.shape
            )));
        }
        store
            .load_one(&spec.name, &t)
            .map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}
