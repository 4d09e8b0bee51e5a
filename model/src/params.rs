//! Parameter paths: one constructor per module builds either real weights or a shape-only layout.
//!
//! Every module is generic over the parameter type `P`. Built from a [`tch::nn::Path`] its
//! parameters are tensors in a `VarStore`; built from a [`ShapePath`] they are `()` and the path
//! records each parameter's dotted name and shape. The second form counts Flux 12B's parameters, or
//! lists its state-dict layout, without allocating a byte of weights.

use std::cell::RefCell;
use std::rc::Rc;

use tch::nn::{self, Init};
use tch::Tensor;

/// A position in a parameter tree that can create parameters below it.
pub trait ParamPath: Sized {
    /// What a created parameter is: a [`Tensor`] or `()` for shape-only layouts.
    type Param;

    /// The child path `self.name`.
    fn sub(&self, name: &str) -> Self;

    /// Create the parameter `self.name` with `shape`, initialised by `init`.
    fn param(&self, name: &str, shape: &[i64], init: Init) -> Self::Param;
}

impl<'a> ParamPath for nn::Path<'a> {
    type Param = Tensor;

    fn sub(&self, name: &str) -> Self {
        nn::Path::sub(self, name)
    }

    fn param(&self, name: &str, shape: &[i64], init: Init) -> Tensor {
        self.var(name, shape, init)
    }
}

/// One parameter of a layout: its dotted state-dict name and logical shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamShape {
    /// Dotted name, e.g. `transformer.layers.0.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Logical shape, e.g. `[3 * hidden, hidden]`.
    pub shape: Vec<i64>,
}

impl ParamShape {
    /// Number of elements (product of the shape).
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// A shape-only [`ParamPath`]: records names and shapes, allocates nothing.
#[derive(Debug, Clone, Default)]
pub struct ShapePath {
    prefix: String,
    params: Rc<RefCell<Vec<ParamShape>>>,
}

impl ShapePath {
    /// An empty root path.
    pub fn root() -> Self {
        Self::default()
    }

    /// The parameters recorded so far below any path sharing this root, in creation order.
    pub fn recorded(&self) -> Vec<ParamShape> {
        self.params.borrow().clone()
    }

    fn join(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }
}

impl ParamPath for ShapePath {
    type Param = ();

    fn sub(&self, name: &str) -> Self {
        Self {
            prefix: self.join(name),
            params: Rc::clone(&self.params),
        }
    }

    fn param(&self, name: &str, shape: &[i64], _init: Init) {
        self.params.borrow_mut().push(ParamShape {
            name: self.join(name),
            shape: shape.to_vec(),
        });
    }
}

/// Xavier (Glorot) uniform initialisation for a `[fan_out, fan_in]` weight, as Megatron's
/// parallel linears use: `U(-b, b)` with `b = sqrt(6 / (fan_in + fan_out))`.
pub fn xavier_uniform(fan_in: i64, fan_out: i64) -> Init {
    let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}
