//! `RmsNorm` with a learnable scale (FLUX.1's QK-norm), replicated over the group.

use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::tp::linear::shard_var;
use crate::tp::{GradSync, ParamSpec, TpContext};

/// Everything `#[norm(..)]` says about one RMSNorm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormDecl {
    /// Normalised width.
    pub dim: i64,
    /// Added to the mean square.
    pub eps: f64,
    /// Applied to sharded activations (each rank's heads): gradients are summed over the group.
    pub on_shards: bool,
}

impl NormDecl {
    /// Spec of `name.weight`.
    pub fn param_specs(&self, name: &str) -> Vec<ParamSpec> {
        let mut spec = ParamSpec::replicated(format!("{name}.weight"), vec![self.dim], 1);
        if self.on_shards {
            spec.grad_sync = GradSync::SumOverGroup;
        }
        vec![spec]
    }
}

/// RMSNorm `x · rsqrt(mean(x²) + eps) · weight`, reduced in f32, as FLUX.1 does.
#[derive(Debug)]
pub struct RmsNorm {
    /// Scale `[D]`, initialised to ones.
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Allocate `p.weight`.
    pub fn new(p: &Path, decl: &NormDecl, tp: &TpContext) -> Self {
        let spec = &decl.param_specs("")[0];
        let device = p.device();
        Self {
            weight: shard_var(p, spec, tp, |s| Tensor::ones(s, (Kind::Float, device))),
            eps: decl.eps,
        }
    }

    /// `x [.., D]` → `[.., D]` in `x`'s dtype: libtorch's fused RMSNorm, which accumulates in
    /// f32 for reduced-precision inputs (one pass instead of five elementwise ones).
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let dim = *x.size().last().expect("at least one dimension");
        x.rms_norm([dim], Some(&self.weight), self.eps)
    }
}
