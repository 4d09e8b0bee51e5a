//! A linear's product `x Wᵀ` through float8 GEMMs (`csrc/fp8_linear.cpp`), with its scales
//! agreed over the tensor-parallel group.

use tch::Tensor;

use crate::float8::ffi;
use crate::float8::Float8Recipe;
use crate::tp::{Shard, TpContext};

/// How one linear runs its GEMMs in float8: the recipe's casts for the layer's split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Float8Gemm {
    recipe: Float8Recipe,
    casts: [i64; 6],
    flags: i64,
}

impl Float8Gemm {
    /// The GEMMs of a linear split as `shard` over a group of `tp_size` ranks under `recipe`.
    pub fn new(recipe: Float8Recipe, shard: Shard, tp_size: usize) -> Self {
        Self {
            recipe,
            casts: recipe.cast_codes(shard, tp_size),
            flags: recipe.flags(),
        }
    }

    /// The recipe.
    pub fn recipe(&self) -> Float8Recipe {
        self.recipe
    }

    /// `x [.., K] · w [N, K]ᵀ → [.., N]` in `x`'s dtype (which `w` shares), differentiable in
    /// both: the output, input-gradient and weight-gradient GEMMs run on float8 operands scaled
    /// dynamically, each scale a maximum over `tp` where its operand is split there.
    pub fn product(&self, x: &Tensor, w: &Tensor, tp: &TpContext) -> Tensor {
        let (callback, handle) = tp.amax_hook();
        // SAFETY: `x`, `w` and the codes are live for the call; the handle is the group's, kept
        // alive by the model through any backward pass; the result is checked at once.
        unsafe {
            let out = ffi::flux_fp8_linear(
                x.as_ptr(),
                w.as_ptr(),
                self.casts.as_ptr(),
                self.flags,
                callback,
                handle,
            );
            ffi::returned(out, "float8 linear")
        }
    }
}
