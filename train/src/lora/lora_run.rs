//! A finished (or paused) LoRA run's adapters, read back for `flux-hpc lora merge` and
//! `flux-hpc lora export`.

use std::collections::HashMap;

use flux_data::checkpoint;
use flux_model::lora::{export, Adapters};
use flux_model::tp::TpContext;
use flux_model::DiffusionModel;
use tch::{Device, Tensor};

use crate::lora::base_weights::load_base;
use crate::run::resume::check_architecture;
use crate::RunConfig;

/// The layouts adapters are exported in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFormat {
    /// diffusers / PEFT (`transformer.….lora_A.weight`), as `final_lora.safetensors`.
    Diffusers,
    /// kohya / ComfyUI (`lora_unet_…lora_down.weight`, `alpha`), under BFL's module names.
    Kohya,
}

impl LoraFormat {
    /// The file `flux-hpc lora export` writes into the run directory.
    pub fn default_file(self) -> &'static str {
        match self {
            Self::Diffusers => "lora_diffusers.safetensors",
            Self::Kohya => "lora_kohya.safetensors",
        }
    }
}

/// The adapters of a LoRA run's latest checkpoint on its model (on this process, CPU).
pub struct LoraRun {
    run: RunConfig,
    model: Box<dyn DiffusionModel>,
    adapters: Adapters,
    values: HashMap<String, Tensor>,
}

impl LoraRun {
    /// Read `run`'s latest checkpoint: its adapters, or with `ema` their moving average; with
    /// `base`, the `[lora] base` weights too (merging needs them, exporting does not). Fails
    /// naming what is missing or does not fit.
    pub fn open(run: &RunConfig, ema: bool, base: bool) -> Result<Self, String> {
        let lora = run
            .lora
            .as_ref()
            .ok_or("the config has no [lora] table: there are no adapters")?;
        let dir = &run.checkpoint.dir;
        let latest = checkpoint::latest(dir)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| {
                format!(
                    "{} has no checkpoint to take the adapters from",
                    dir.display()
                )
            })?;
        let mut saved = checkpoint::load(&latest).map_err(|e| e.to_string())?;
        check_architecture(&saved, run.model.architecture())?;
        let group = if ema { "ema" } else { "params" };
        let values = saved.tensors.remove(group).ok_or_else(|| {
            format!(
                "{} has no `{group}` group (was [training] ema_decay set in the run?)",
                latest.display()
            )
        })?;
        tch::manual_seed(run.training.seed as i64);
        let mut model = run
            .model
            .build(Device::Cpu, TpContext::single())
            .map_err(|e| e.to_string())?;
        if let (true, Some(path)) = (base, &lora.base) {
            load_base(model.store_mut(), path, run.model.architecture())
                .map_err(|e| e.to_string())?;
        }
        let mut adapters = Adapters::attach(model.as_ref(), lora.settings(), &lora.targets)
            .map_err(|e| e.to_string())?;
        adapters.store_mut().load_logical(&values).map_err(|e| {
            format!(
                "{}: {e} (is it a checkpoint of this [lora] run?)",
                latest.display()
            )
        })?;
        Ok(Self {
            run: run.clone(),
            model,
            adapters,
            values,
        })
    }

    /// The base weights with the adapters folded in (native names, logical shapes).
    pub fn merged(&self) -> Vec<(String, Tensor)> {
        self.adapters.merged(self.model.store())
    }

    /// The adapters in `format`.
    pub fn export(&self, format: LoraFormat) -> Result<Vec<(String, Tensor)>, String> {
        let exported = match format {
            LoraFormat::Diffusers => {
                export::diffusers_state_dict(&self.adapters, &self.values, &self.run.model)
            }
            LoraFormat::Kohya => {
                export::kohya_state_dict(&self.adapters, &self.values, &self.run.model)
            }
        };
        exported.map_err(|e| e.to_string())
    }
}
