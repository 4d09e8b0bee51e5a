//! Building-block layers shared by every block: dense, MLP, normalisation and adaptive modulation.

mod linear;
mod mlp;
mod modulation;
mod norm;

pub use linear::Linear;
pub use mlp::{dropout, Mlp};
pub use modulation::{AdaLn, AdaLnContinuous, Modulation};
pub use norm::{layer_norm, RmsNorm};
