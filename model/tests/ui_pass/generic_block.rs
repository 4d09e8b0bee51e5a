//! A generic block: `Residual<B>` wraps any block whose config is `MlpDims`; the macro's `Block`
//! impl carries the generics and their bounds, and calls the child through the trait.

use flux_macros::diffusion_block;
use flux_model::layers::{Mlp, MlpDims};
use flux_model::tp::ParamSpec;
use flux_model::Block;
use tch::Tensor;

/// What the residual wraps: a block with a forward pass of one tensor.
pub trait Branch {
    fn branch(&self, x: &Tensor) -> Tensor;
}

impl Branch for Mlp {
    fn branch(&self, x: &Tensor) -> Tensor {
        self.forward(x)
    }
}

#[diffusion_block(config = MlpDims)]
pub struct Residual<B: Block<Config = MlpDims> + Branch> {
    #[module(name = "")]
    inner: B,
}

impl<B: Block<Config = MlpDims> + Branch> Residual<B> {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x + self.inner.branch(x)
    }
}

fn main() {
    let dims = MlpDims { dim: 8, hidden: 32 };
    let specs: Vec<ParamSpec> = <Residual<Mlp> as Block>::param_specs("res", &dims, 2);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["res.linear_fc1.weight", "res.linear_fc1.bias", "res.linear_fc2.weight", "res.linear_fc2.bias"]
    );
    assert_eq!(<Residual<Mlp> as Block>::num_params(&dims), 8 * 32 + 32 + 32 * 8 + 8);
}
