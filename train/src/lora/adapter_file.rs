//! Adapter files written by other tools (diffusers / PEFT, kohya / ComfyUI) or by flux-hpc, read
//! for a model: to start LoRA training from (`[lora] init`) or to fold into base weights
//! (`flux-hpc lora merge --adapter`).

use std::path::Path;

use flux_data::convert::SafetensorsReader;
use flux_model::lora::{import, ImportedAdapter};
use flux_model::tp::TpContext;
use flux_model::ModelSpec;
use tch::{Device, Kind, Tensor};

use crate::lora::base_weights::load_base;
use crate::RunConfig;

/// The adapters of the safetensors file `path` per native module of a `model` (strict header,
/// its CRC-32 checked when flux-hpc wrote it). Fails naming the file and what does not fit.
pub fn read_adapter_file(path: &Path, model: &ModelSpec) -> Result<Vec<ImportedAdapter>, String> {
    let reader = SafetensorsReader::open(path).map_err(|e| e.to_string())?;
    reader.verify_checksum().map_err(|e| e.to_string())?;
    let tensors = reader.read_all().map_err(|e| e.to_string())?;
    import::import(
        tensors.into_iter().collect(),
        reader.metadata(),
        model,
        &path.display().to_string(),
    )
    .map_err(|e| e.to_string())
}

/// `run`'s base weights (`[lora] base`, or the seeded initialisation without one) with the
/// adapters of the file `path` folded in, `W + ΔW` per adapted module, at logical shapes under
/// native names: a plain model. Separately trained parts of a fused weight (diffusers' `to_q`,
/// `to_k`, `to_v`) merge exactly, each its own update.
pub fn merge_adapter_file(run: &RunConfig, path: &Path) -> Result<Vec<(String, Tensor)>, String> {
    let imported = read_adapter_file(path, &run.model)?;
    tch::manual_seed(run.training.seed as i64);
    let mut model = run
        .model
        .build(Device::Cpu, TpContext::single())
        .map_err(|e| e.to_string())?;
    if let Some(base) = run.lora.as_ref().and_then(|l| l.base.as_ref()) {
        load_base(model.store_mut(), base, run.model.architecture()).map_err(|e| e.to_string())?;
    }
    let mut deltas: std::collections::HashMap<String, Tensor> = imported
        .iter()
        .map(|a| (format!("{}.weight", a.module), a.delta()))
        .collect();
    model
        .store()
        .gather_logical(false)
        .into_iter()
        .map(|(name, weight)| match deltas.remove(&name) {
            Some(delta) => {
                let merged = (weight.to_kind(Kind::Float) + delta).to_kind(weight.kind());
                // Finite factors and scale can still overflow (a huge alpha), and a base
                // weight can hold what an adapter cannot repair: nothing non-finite is written.
                let bad = merged
                    .isfinite()
                    .logical_not()
                    .sum(Kind::Int64)
                    .int64_value(&[]);
                match bad {
                    0 => Ok((name, merged)),
                    n => Err(format!(
                        "{}: merging it into `{name}` gives {n} NaN or infinite value(s) of {} \
                         (is its alpha or scale far too large?)",
                        path.display(),
                        merged.numel()
                    )),
                }
            }
            None => Ok((name, weight)),
        })
        .collect()
}
