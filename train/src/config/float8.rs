//! The `[fp8]` table: which linears train with float8 GEMMs under `[training] precision =
//! "fp8"`, and how they scale.

use flux_model::float8::{Float8Recipe, Float8Settings};
use serde::{Deserialize, Serialize};

/// `[fp8]`: the float8 recipe and the linears it applies to.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Float8Config {
    /// `"tensorwise"` (default: one scale per tensor, e5m2 gradients), `"rowwise"` or
    /// `"rowwise_gw_hp"` (rowwise with the weight gradient in bf16), as torchao's recipes.
    pub recipe: Float8Recipe,
    /// Name patterns of the linears that run in float8 (`*` wildcards, dotted suffixes, as
    /// `[lora] targets`); empty: every linear inside the model's layer stacks whose sides are
    /// multiples of 16, the embedders and the final layer staying in bf16.
    pub targets: Vec<String>,
}

impl Float8Config {
    /// What the framework's swap takes.
    pub fn settings(&self) -> Float8Settings {
        Float8Settings {
            recipe: self.recipe,
            targets: self.targets.clone(),
        }
    }
}
