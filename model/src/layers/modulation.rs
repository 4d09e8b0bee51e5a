//! Adaptive LayerNorm: a conditioning vector sets per-channel shift, scale and gate.

use tch::Tensor;

use crate::layers::layer_norm;
use crate::tp::Linear;

/// One `(shift, scale, gate)` triple, each `[B, 1, D]` so it broadcasts over tokens.
#[derive(Debug)]
pub struct Modulation {
    /// Added after scaling.
    pub shift: Tensor,
    /// Applied as `1 + scale`.
    pub scale: Tensor,
    /// Multiplies the branch output before the residual add.
    pub gate: Tensor,
}

impl Modulation {
    /// `(1 + scale) · LayerNorm(x) + shift`; `x [B, L, D]`.
    pub fn modulate(&self, x: &Tensor, eps: f64) -> Tensor {
        // One fused multiply-add pass over [B, L, D] (and one in backward) instead of two.
        self.shift
            .addcmul(&layer_norm(x, eps), &(&self.scale + 1.0))
    }

    /// Gated residual `x + gate · branch`; both `[B, L, D]`.
    pub fn gated_residual(&self, x: &Tensor, branch: &Tensor) -> Tensor {
        x.addcmul(&self.gate, branch)
    }
}

/// `AdaLN`: `SiLU(vec [B, D]) → linear [3·N·D, D]` split into `N` (shift, scale, gate) triples.
///
/// Joint blocks use `N = 2` (attention and MLP), single blocks `N = 1`.
///
/// Under sequence parallelism the triples act on this rank's tokens only, so their gradients are
/// summed over the group ([`crate::tp::TpContext::broadcast_over_sequence`]).
pub fn adaln<const N: usize>(linear: &Linear, vec: &Tensor) -> [Modulation; N] {
    split_modulations(&modulation_params(linear, &vec.silu()))
}

/// Modulation parameters `linear(activated)` `[B, 3·N·D]` from an activated conditioning vector
/// `[B, D]`; FLUX.2 computes them once per model for every block to split
/// ([`split_modulations`]). Under sequence parallelism the blocks apply them to this rank's
/// tokens only, so their gradients are summed over the group.
pub fn modulation_params(linear: &Linear, activated: &Tensor) -> Tensor {
    linear
        .tp()
        .broadcast_over_sequence(&linear.forward(activated))
}

/// Split modulation parameters already computed, `[B, 3·N·D]` laid out as `N` (shift, scale,
/// gate) triples (FLUX.2 computes them once per model and hands them to every block).
pub fn split_modulations<const N: usize>(params: &Tensor) -> [Modulation; N] {
    let chunks = params.unsqueeze(1).chunk(3 * N as i64, -1);
    std::array::from_fn(|i| Modulation {
        shift: chunks[3 * i].shallow_clone(),
        scale: chunks[3 * i + 1].shallow_clone(),
        gate: chunks[3 * i + 2].shallow_clone(),
    })
}

/// Which half of an output modulation's rows comes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halves {
    /// `[shift; scale]` (FLUX.1's and DiT's native layout).
    ShiftScale,
    /// `[scale; shift]` (diffusers' `AdaLayerNormContinuous`, FLUX.2's layout).
    ScaleShift,
}

/// `AdaLNContinuous` for the output: `SiLU(vec) → linear [2D, D]` split into shift and scale as
/// `halves` says, then `(1 + scale) · LayerNorm(x) + shift`.
///
/// `x [B, L, D]`, `vec [B, D]` → `[B, L, D]`.
pub fn adaln_continuous(
    linear: &Linear,
    x: &Tensor,
    vec: &Tensor,
    eps: f64,
    halves: Halves,
) -> Tensor {
    let chunks = linear.forward(&vec.silu()).unsqueeze(1).chunk(2, -1);
    let (shift, scale) = match halves {
        Halves::ShiftScale => (&chunks[0], &chunks[1]),
        Halves::ScaleShift => (&chunks[1], &chunks[0]),
    };
    shift.addcmul(&layer_norm(x, eps), &(scale + 1.0))
}
