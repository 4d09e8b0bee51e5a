//! `flux-hpc lora merge`: a LoRA run's latest adapters folded into its base weights.

use flux_data::checkpoint;
use flux_model::lora::Adapters;
use flux_model::tp::TpContext;
use tch::{Device, Tensor};

use crate::base_weights::load_base;
use crate::resume::check_architecture;
use crate::RunConfig;

/// The merged weights (native names, logical shapes) of the LoRA run `run`: its `[lora] base`
/// (or the seeded initialisation without one) plus the adapters of its run directory's latest
/// checkpoint. Fails naming what is missing or does not fit.
pub fn merged_lora_weights(run: &RunConfig) -> Result<Vec<(String, Tensor)>, String> {
    let lora = run
        .lora
        .as_ref()
        .ok_or("the config has no [lora] table: there are no adapters to merge")?;
    let dir = &run.checkpoint.dir;
    let latest = checkpoint::latest(dir)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| {
            format!(
                "{} has no checkpoint to take the adapters from",
                dir.display()
            )
        })?;
    let saved = checkpoint::load(&latest).map_err(|e| e.to_string())?;
    check_architecture(&saved, run.model.architecture())?;
    tch::manual_seed(run.training.seed as i64);
    let mut model = run
        .model
        .build(Device::Cpu, TpContext::single())
        .map_err(|e| e.to_string())?;
    if let Some(base) = &lora.base {
        load_base(model.store_mut(), base, run.model.architecture()).map_err(|e| e.to_string())?;
    }
    let mut adapters = Adapters::attach(model.as_ref(), lora.settings(), &lora.targets)
        .map_err(|e| e.to_string())?;
    adapters
        .store_mut()
        .load_logical(&saved.tensors["params"])
        .map_err(|e| {
            format!(
                "{}: {e} (is it a checkpoint of this [lora] run?)",
                latest.display()
            )
        })?;
    Ok(adapters.merged(model.store()))
}
