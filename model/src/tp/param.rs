//! A raw learnable tensor (`#[param(..)]`): a learned modulation table, a class token, a
//! positional table; replicated, or split along one dimension over the group.

use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::tp::linear::shard_var;
use crate::tp::{GradSync, ParamSpec, TpContext};

/// How a raw parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamInit {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// `N(0, std²)`.
    Normal(f64),
}

/// Everything `#[param(..)]` says about one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamDecl {
    /// Logical shape.
    pub shape: Vec<i64>,
    /// Dimension split over the group (the forward pass uses this rank's slice), if any.
    pub split: Option<usize>,
    /// Initial values.
    pub init: ParamInit,
    /// Replicated but applied to sharded activations: gradients are summed over the group.
    pub on_shards: bool,
}

impl ParamDecl {
    /// Spec of the tensor named `name` (no `.weight` leaf: the name is the tensor's).
    pub fn param_specs(&self, name: &str, tp_size: i64) -> Vec<ParamSpec> {
        let mut spec = ParamSpec::replicated(name.to_string(), self.shape.clone(), tp_size);
        spec.split_dim = self.split;
        if self.on_shards {
            spec.grad_sync = GradSync::SumOverGroup;
        }
        vec![spec]
    }

    /// Allocate `p.leaf`: this rank's slice of the initial logical tensor.
    pub fn create(&self, p: &Path, leaf: &str, tp: &TpContext) -> Tensor {
        let device = p.device();
        let spec = &self.param_specs(leaf, tp.size() as i64)[0];
        shard_var(p, spec, tp, |shape| match self.init {
            ParamInit::Zeros => Tensor::zeros(shape, (Kind::Float, device)),
            ParamInit::Ones => Tensor::ones(shape, (Kind::Float, device)),
            ParamInit::Normal(std) => Tensor::empty(shape, (Kind::Float, device)).normal_(0.0, std),
        })
    }
}
