//! Transformer MLP: `Linear(D, M) → GELU(tanh) → Linear(M, D)`.

use tch::Tensor;

use crate::layers::Linear;
use crate::params::ParamPath;

/// The feed-forward branch of a joint block.
#[derive(Debug)]
pub struct Mlp<P = Tensor> {
    /// `[M, D]`.
    pub linear_fc1: Linear<P>,
    /// `[D, M]`.
    pub linear_fc2: Linear<P>,
}

impl<P> Mlp<P> {
    /// Create `p.linear_fc1` and `p.linear_fc2` for width `dim` and hidden width `hidden`.
    pub fn new<T: ParamPath<Param = P>>(p: &T, dim: i64, hidden: i64) -> Self {
        Self {
            linear_fc1: Linear::new(&p.sub("linear_fc1"), dim, hidden, true),
            linear_fc2: Linear::new(&p.sub("linear_fc2"), hidden, dim, true),
        }
    }
}

impl Mlp {
    /// `x [B, L, D]` → `[B, L, D]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.linear_fc2
            .forward(&self.linear_fc1.forward(x).gelu("tanh"))
    }
}

/// Dropout that is the identity outside training or when `p == 0`.
pub fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}
