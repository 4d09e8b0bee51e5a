//! `MLPEmbedder`: `Linear → SiLU → Linear`, lifting a conditioning vector to the model width.

use tch::Tensor;

use crate::layers::Linear;
use crate::params::ParamPath;

/// Two-layer MLP embedder for pooled text vectors and sinusoidal features.
#[derive(Debug)]
pub struct MlpEmbedder<P = Tensor> {
    /// `[D, in]`.
    pub linear_1: Linear<P>,
    /// `[D, D]`.
    pub linear_2: Linear<P>,
}

impl<P> MlpEmbedder<P> {
    /// Create `p.linear_1` `[hidden, in_dim]` and `p.linear_2` `[hidden, hidden]`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, in_dim: i64, hidden: i64) -> Self {
        Self {
            linear_1: Linear::new(&p.sub("linear_1"), in_dim, hidden, true),
            linear_2: Linear::new(&p.sub("linear_2"), hidden, hidden, true),
        }
    }
}

impl MlpEmbedder {
    /// `x [B, in]` → `[B, D]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.linear_2.forward(&self.linear_1.forward(x).silu())
    }
}
