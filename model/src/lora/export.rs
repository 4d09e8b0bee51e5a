//! Adapters in the layouts other tools load:
//!
//! - diffusers / PEFT: `transformer.{module}.lora_A.weight` / `lora_B.weight` under the model's
//!   diffusers module names, `α / r` folded into `B` (what `load_lora_weights` reads);
//! - kohya / ComfyUI: `lora_unet_{module}.lora_down.weight` / `lora_up.weight` / `alpha` under
//!   BFL's module names with dots as underscores (`lora_unet_double_blocks_0_img_attn_qkv`).

use std::collections::HashMap;

use tch::Tensor;

use crate::convert::Layout;
use crate::lora::Adapters;
use crate::ModelSpec;

/// Why adapters could not be exported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    /// The architecture has no external layout to name the modules in.
    #[error("architecture \"{architecture}\" has no {layout:?} layout to export adapters in")]
    NoLayout {
        /// The model's architecture.
        architecture: String,
        /// The layout asked for.
        layout: Layout,
    },
}

/// One adapter under an external module name: `(module, A [r, in], B [out_part, r])`.
type ExternalAdapter = (String, Tensor, Tensor);

/// Adapter values `logical` (logical tensors under the native names of `adapters`' store) per
/// external module of `layout`, `B` scaled by `b_scale`. A fused native module becomes one
/// adapter per external module: the same `A`, `B`'s rows of that part (halves swapped where the
/// layout swaps the weight's).
fn external_adapters(
    adapters: &Adapters,
    logical: &HashMap<String, Tensor>,
    model: &ModelSpec,
    layout: Layout,
    b_scale: f64,
) -> Result<Vec<ExternalAdapter>, ExportError> {
    if !model.weight_layouts().contains(&layout) {
        return Err(ExportError::NoLayout {
            architecture: model.architecture().to_string(),
            layout,
        });
    }
    let bases: HashMap<String, _> = model
        .param_specs(1)
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
    let mut out = Vec::new();
    for module in adapters.modules() {
        let weight = format!("{module}.weight");
        let src = model
            .external_source(&weight, layout)
            .expect("every native parameter has an external name");
        let a = &logical[&format!("{module}.lora_A.weight")];
        let b = &logical[&format!("{module}.lora_B.weight")] * b_scale;
        for (key, b) in src.keys.iter().zip(src.split(&bases[&weight], b)) {
            let external = key.strip_suffix(".weight").expect("weights end in .weight");
            out.push((external.to_string(), a.copy(), b));
        }
    }
    Ok(out)
}

/// Adapter values `logical` (logical tensors under the native names of `adapters`' store: its
/// weights, gathered with `gather_logical`, or their EMA) on a model of `model`, as diffusers'
/// LoRA state dict. `α / r` is folded into `B`, so loaders that assume `α = r` (diffusers
/// without an adapter config) compute the same update.
pub fn diffusers_state_dict(
    adapters: &Adapters,
    logical: &HashMap<String, Tensor>,
    model: &ModelSpec,
) -> Result<Vec<(String, Tensor)>, ExportError> {
    let scale = adapters.settings().scale();
    let per_module = external_adapters(adapters, logical, model, Layout::Diffusers, scale)?;
    Ok(per_module
        .into_iter()
        .flat_map(|(module, a, b)| {
            [
                (format!("transformer.{module}.lora_A.weight"), a),
                (format!("transformer.{module}.lora_B.weight"), b),
            ]
        })
        .collect())
}

/// The same adapters in kohya's / ComfyUI's layout: BFL module names, `lora_down` = `A`,
/// `lora_up` = `B` and the scalar `alpha` (loaders scale by `alpha / r` themselves).
pub fn kohya_state_dict(
    adapters: &Adapters,
    logical: &HashMap<String, Tensor>,
    model: &ModelSpec,
) -> Result<Vec<(String, Tensor)>, ExportError> {
    let alpha = adapters.settings().alpha;
    let per_module = external_adapters(adapters, logical, model, Layout::Bfl, 1.0)?;
    Ok(per_module
        .into_iter()
        .flat_map(|(module, a, b)| {
            let stem = format!("lora_unet_{}", module.replace('.', "_"));
            [
                (format!("{stem}.lora_down.weight"), a),
                (format!("{stem}.lora_up.weight"), b),
                (format!("{stem}.alpha"), Tensor::from(alpha as f32)),
            ]
        })
        .collect())
}
