//! Float8 training (torchao's `Float8Linear` numerics): a model's linears run their output,
//! input-gradient and weight-gradient GEMMs on float8 operands scaled dynamically, while the
//! weights, activations and everything else stay in their own precision.
//!
//! - [`Float8Recipe`]: tensorwise, rowwise or rowwise with a high-precision weight gradient.
//! - [`Float8Gemm`]: one linear's float8 product, its scales agreed over the tensor-parallel
//!   group (`csrc/fp8_linear.cpp`).
//! - [`convert`]: the framework's swap, once for every model: which linears go to float8.
//! - [`Float8Weight`], [`hold_frozen_in_float8`]: a frozen base held in e4m3 (LoRA's fp8 base).

mod ffi;
mod gemm;
mod recipe;
mod weight;

pub use gemm::Float8Gemm;
pub use recipe::Float8Recipe;
pub use weight::Float8Weight;

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::execution::residency::{HEAD, STEM};
use crate::lora::targets;
use crate::tp::Linear;
use crate::{ConfigError, DiffusionModel};

/// The float8 GEMMs' smallest unit: both sides of a weight (as this rank holds it) must be
/// multiples of it (what `_scaled_mm` needs on GPUs).
pub const ALIGNMENT: i64 = 16;

/// Which linears run in float8, and how: the `[fp8]` table of a run config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Float8Settings {
    /// How their GEMMs scale: `"tensorwise"` (default: one scale per tensor, e5m2 gradients),
    /// `"rowwise"` or `"rowwise_gw_hp"` (rowwise with the weight gradient in bf16), as
    /// torchao's recipes.
    pub recipe: Float8Recipe,
    /// Name patterns of the linears (as `[lora] targets`); empty: every linear inside the
    /// model's `#[layers]` stacks whose sides are multiples of [`ALIGNMENT`], leaving the
    /// embedders and the final layer (the stem and head) in their precision, as torchtitan's
    /// default filter does.
    pub targets: Vec<String>,
}

/// Switch the linears of `model` that `settings` selects to float8 GEMMs; their names, in
/// declaration order. Fails naming `fp8.targets` for a pattern that selects nothing or a chosen
/// linear whose sides are not multiples of [`ALIGNMENT`], and for a linear in float8 already.
pub fn convert(
    model: &dyn DiffusionModel,
    settings: &Float8Settings,
) -> Result<Vec<String>, ConfigError> {
    let mut linears: Vec<&Linear> = Vec::new();
    model.visit_linears(&mut |l| linears.push(l));
    let chosen: Vec<&Linear> = if settings.targets.is_empty() {
        let layers: Vec<String> = model
            .layers()
            .into_iter()
            .filter(|l| l != STEM && l != HEAD)
            .map(|l| format!("{l}."))
            .collect();
        linears
            .into_iter()
            .filter(|l| layers.iter().any(|p| l.name().starts_with(p.as_str())) && aligned(l))
            .collect()
    } else {
        for pattern in &settings.targets {
            if !linears.iter().any(|l| targets::matches(pattern, l.name())) {
                return Err(ConfigError::new(
                    "fp8.targets",
                    format!("`{pattern}` matches no linear layer of this model"),
                ));
            }
        }
        let chosen: Vec<&Linear> = linears
            .into_iter()
            .filter(|l| {
                settings
                    .targets
                    .iter()
                    .any(|p| targets::matches(p, l.name()))
            })
            .collect();
        if let Some(l) = chosen.iter().find(|l| !aligned(l)) {
            return Err(ConfigError::new(
                "fp8.targets",
                format!(
                    "`{}` holds a {:?} weight on each rank; float8 GEMMs need both sides to be \
                     multiples of {ALIGNMENT}",
                    l.name(),
                    l.weight.size()
                ),
            ));
        }
        chosen
    };
    for l in &chosen {
        let gemm = Float8Gemm::new(settings.recipe, l.shard(), l.tp().size());
        if l.use_float8(gemm).is_err() {
            return Err(ConfigError::new(
                "fp8",
                format!("`{}` runs in float8 already", l.name()),
            ));
        }
    }
    Ok(chosen.iter().map(|l| l.name().to_string()).collect())
}

/// Whether both sides of `l`'s local weight are multiples of [`ALIGNMENT`].
fn aligned(l: &Linear) -> bool {
    l.weight.size().iter().all(|s| s % ALIGNMENT == 0)
}

/// Hold the weight of every linear of `model` in e4m3 with per-row scales ([`Float8Weight`]),
/// giving back the memory of the weights themselves: for a frozen base (LoRA), whose weights
/// no optimizer reads. `held` has the weights quantized as they were created, by state-dict
/// name (`….weight`); the others are quantized now. Each forward pass widens a layer's weight
/// to its dtype while it runs. Bytes now held by the float8 weights.
pub fn hold_frozen_in_float8(
    model: &dyn DiffusionModel,
    held: &mut HashMap<String, Float8Weight>,
) -> u64 {
    let mut bytes = 0;
    model.visit_linears(&mut |l| {
        bytes += match held.remove(&format!("{}.weight", l.name())) {
            Some(w) => l.hold_float8(w),
            None => l.hold_in_float8(),
        }
    });
    bytes
}
