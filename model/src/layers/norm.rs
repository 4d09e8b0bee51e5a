//! Normalisations: affine-free LayerNorm and RMSNorm with a learnable scale (Flux's QK-norm).

use tch::nn::Init;
use tch::{Kind, Tensor};

use crate::params::ParamPath;

/// LayerNorm over the last dimension without weight or bias: `(x - mean) / sqrt(var + eps)`.
///
/// `x [.., D]` → `[.., D]`.
pub fn layer_norm(x: &Tensor, eps: f64) -> Tensor {
    let width = *x
        .size()
        .last()
        .expect("layer_norm needs at least one dimension");
    x.layer_norm([width], None::<Tensor>, None::<Tensor>, eps, true)
}

/// RMSNorm `x · rsqrt(mean(x²) + eps) · weight`, computed in f32 and cast back, as FLUX.1 does.
#[derive(Debug)]
pub struct RmsNorm<P = Tensor> {
    /// Learnable scale `[D]`, initialised to ones.
    pub weight: P,
    eps: f64,
}

impl<P> RmsNorm<P> {
    /// Create `p.weight` `[dim]`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, dim: i64, eps: f64) -> Self {
        Self {
            weight: p.param("weight", &[dim], Init::Const(1.0)),
            eps,
        }
    }
}

impl RmsNorm {
    /// `x [.., D]` → `[.., D]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let xf = x.to_kind(Kind::Float);
        let rrms = (xf.square().mean_dim(-1, true, Kind::Float) + self.eps).rsqrt();
        (xf * rrms).to_kind(x.kind()) * &self.weight
    }
}
