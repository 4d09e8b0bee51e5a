//! Building blocks shared by every model: MLP, affine-free LayerNorm and adaptive modulation.

mod mlp;
mod modulation;
mod norm;

pub use mlp::{dropout, Mlp, MlpDims};
pub use modulation::{
    adaln, adaln_continuous, modulation_params, split_modulations, Halves, Modulation,
};
pub use norm::layer_norm;
