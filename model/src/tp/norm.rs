//! The learnable norms `#[norm(..)]` builds, replicated over the group: `RmsNorm` (a scale;
//! FLUX's QK-norm) and `LayerNorm` (a scale and, unless `bias = false`, a shift).

use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::tp::linear::shard_var;
use crate::tp::{GradSync, ParamSpec, TpContext};

/// Everything `#[norm(..)]` says about one norm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormDecl {
    /// Normalised width.
    pub dim: i64,
    /// Added to the variance (LayerNorm) or mean square (RMSNorm).
    pub eps: f64,
    /// A learnable shift besides the scale (LayerNorm only).
    pub bias: bool,
    /// Applied to sharded activations (each rank's heads): gradients are summed over the group.
    pub on_shards: bool,
}

impl NormDecl {
    /// Specs of `name.weight` and, with a bias, `name.bias` (whole on each of `tp_size` ranks).
    pub fn param_specs(&self, name: &str, tp_size: i64) -> Vec<ParamSpec> {
        let leaves: &[&str] = if self.bias {
            &["weight", "bias"]
        } else {
            &["weight"]
        };
        leaves
            .iter()
            .map(|leaf| {
                let mut spec =
                    ParamSpec::replicated(format!("{name}.{leaf}"), vec![self.dim], tp_size);
                if self.on_shards {
                    spec.grad_sync = GradSync::SumOverGroup;
                }
                spec
            })
            .collect()
    }

    /// `p.weight` (ones) and, with a bias, `p.bias` (zeros).
    fn create(&self, p: &Path, tp: &TpContext) -> (Tensor, Option<Tensor>) {
        let device = p.device();
        let specs = self.param_specs("", tp.size() as i64);
        let weight = shard_var(p, &specs[0], tp, |s| Tensor::ones(s, (Kind::Float, device)));
        let bias = specs
            .get(1)
            .map(|spec| shard_var(p, spec, tp, |s| Tensor::zeros(s, (Kind::Float, device))));
        (weight, bias)
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
        assert!(!decl.bias, "RMSNorm has no bias");
        let (weight, _) = decl.create(p, tp);
        Self {
            weight,
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

/// LayerNorm `(x − mean) · rsqrt(var + eps) · weight + bias` over the last dimension, with a
/// learnable affine (`torch.nn.LayerNorm(dim, eps, elementwise_affine=True, bias=…)`).
#[derive(Debug)]
pub struct LayerNorm {
    /// Scale `[D]`, initialised to ones.
    pub weight: Tensor,
    /// Shift `[D]`, initialised to zeros (absent with `bias = false`).
    pub bias: Option<Tensor>,
    eps: f64,
}

impl LayerNorm {
    /// Allocate `p.weight` and `p.bias`.
    pub fn new(p: &Path, decl: &NormDecl, tp: &TpContext) -> Self {
        let (weight, bias) = decl.create(p, tp);
        Self {
            weight,
            bias,
            eps: decl.eps,
        }
    }

    /// `x [.., D]` → `[.., D]` in `x`'s dtype (libtorch's fused LayerNorm).
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let dim = *x.size().last().expect("at least one dimension");
        x.layer_norm(
            [dim],
            Some(&self.weight),
            self.bias.as_ref(),
            self.eps,
            true,
        )
    }
}
