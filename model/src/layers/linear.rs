//! `Linear`: `y = x Wᵀ + b` with Megatron's initialisation (Xavier-uniform weight, zero bias).

use tch::nn::Init;
use tch::Tensor;

use crate::params::{xavier_uniform, ParamPath};

/// A dense layer with weight `[out, in]` and optional bias `[out]`.
#[derive(Debug)]
pub struct Linear<P = Tensor> {
    /// `[out, in]`.
    pub weight: P,
    /// `[out]`.
    pub bias: Option<P>,
}

impl<P> Linear<P> {
    /// Create `p.weight` `[out_dim, in_dim]` and, if `bias`, `p.bias` `[out_dim]`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, in_dim: i64, out_dim: i64, bias: bool) -> Self {
        Self {
            weight: p.param(
                "weight",
                &[out_dim, in_dim],
                xavier_uniform(in_dim, out_dim),
            ),
            bias: bias.then(|| p.param("bias", &[out_dim], Init::Const(0.0))),
        }
    }
}

impl Linear {
    /// `x [.., in]` → `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }
}
