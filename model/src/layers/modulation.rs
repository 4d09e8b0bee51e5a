//! Adaptive LayerNorm: the conditioning vector sets per-channel shift, scale and gate.

use tch::Tensor;

use crate::layers::{layer_norm, Linear};
use crate::params::ParamPath;

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
        layer_norm(x, eps) * (&self.scale + 1.0) + &self.shift
    }

    /// Gated residual `x + gate · branch`; both `[B, L, D]`.
    pub fn gated_residual(&self, x: &Tensor, branch: &Tensor) -> Tensor {
        x + &self.gate * branch
    }
}

/// `AdaLN`: `SiLU(vec) → Linear(D, 3·n·D)` split into `n` modulation triples (shift, scale, gate).
///
/// Joint blocks use `n = 2` (attention and MLP), single blocks `n = 1`.
#[derive(Debug)]
pub struct AdaLn<P = Tensor> {
    /// `[3·n·D, D]` projection.
    pub linear: Linear<P>,
    triples: i64,
}

impl<P> AdaLn<P> {
    /// Create `p.linear` producing `triples` (shift, scale, gate) triples of width `dim`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, dim: i64, triples: i64) -> Self {
        Self {
            linear: Linear::new(&p.sub("linear"), dim, 3 * triples * dim, true),
            triples,
        }
    }
}

impl AdaLn {
    /// `vec [B, D]` → `n` triples, each tensor `[B, 1, D]`.
    pub fn forward(&self, vec: &Tensor) -> Vec<Modulation> {
        let chunks = self
            .linear
            .forward(&vec.silu())
            .unsqueeze(1)
            .chunk(3 * self.triples, -1);
        chunks
            .chunks_exact(3)
            .map(|c| Modulation {
                shift: c[0].shallow_clone(),
                scale: c[1].shallow_clone(),
                gate: c[2].shallow_clone(),
            })
            .collect()
    }
}

/// `AdaLNContinuous` for the output: `SiLU(vec) → Linear(D, 2D)` = `[shift; scale]`, then
/// `(1 + scale) · LayerNorm(x) + shift`. (diffusers stores the halves as `[scale; shift]`.)
#[derive(Debug)]
pub struct AdaLnContinuous<P = Tensor> {
    /// `[2D, D]` projection, rows `[shift; scale]`.
    pub linear: Linear<P>,
    eps: f64,
}

impl<P> AdaLnContinuous<P> {
    /// Create `p.linear`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, dim: i64, eps: f64) -> Self {
        Self {
            linear: Linear::new(&p.sub("linear"), dim, 2 * dim, true),
            eps,
        }
    }
}

impl AdaLnContinuous {
    /// `x [B, L, D]`, `vec [B, D]` → `[B, L, D]`.
    pub fn forward(&self, x: &Tensor, vec: &Tensor) -> Tensor {
        let chunks = self.linear.forward(&vec.silu()).unsqueeze(1).chunk(2, -1);
        layer_norm(x, self.eps) * (&chunks[1] + 1.0) + &chunks[0]
    }
}
