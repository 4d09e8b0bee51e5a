//! Adapters in the layouts other tools load: diffusers' LoRA state dict
//! (`transformer.{module}.lora_A.weight` / `lora_B.weight`, PEFT's names, the modules under the
//! model's diffusers names).

use std::collections::HashMap;

use tch::Tensor;

use crate::convert::Layout;
use crate::lora::Adapters;
use crate::ModelSpec;

/// Why adapters could not be exported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    /// The architecture has no diffusers layout to name the modules in.
    #[error("architecture \"{0}\" has no diffusers layout to export adapters in")]
    NoLayout(String),
}

/// Adapter values `logical` (logical tensors under the native names of `adapters`' store: its
/// weights, gathered with `gather_logical`, or their EMA) on a model of `model`, as diffusers'
/// LoRA state dict. A fused native module becomes one adapter per diffusers module: the same
/// `A`, `B`'s rows of that part. `α / r` is folded into `B`, so loaders that assume `α = r`
/// (diffusers without an adapter config) compute the same update.
pub fn diffusers_state_dict(
    adapters: &Adapters,
    logical: &HashMap<String, Tensor>,
    model: &ModelSpec,
) -> Result<Vec<(String, Tensor)>, ExportError> {
    if !model.weight_layouts().contains(&Layout::Diffusers) {
        return Err(ExportError::NoLayout(model.architecture().to_string()));
    }
    let bases: HashMap<String, _> = model
        .param_specs(1)
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
    let scale = adapters.settings().scale();
    let mut out = Vec::new();
    for module in adapters.modules() {
        let weight = format!("{module}.weight");
        let src = model
            .external_source(&weight, Layout::Diffusers)
            .expect("every native parameter has a diffusers name");
        let a = &logical[&format!("{module}.lora_A.weight")];
        let b = &logical[&format!("{module}.lora_B.weight")] * scale;
        // B's rows follow the weight's rows: split into parts, or halves swapped.
        for (key, b) in src.keys.iter().zip(src.split(&bases[&weight], b)) {
            let external = key.strip_suffix(".weight").expect("weights end in .weight");
            out.push((format!("transformer.{external}.lora_A.weight"), a.copy()));
            out.push((format!("transformer.{external}.lora_B.weight"), b));
        }
    }
    Ok(out)
}
