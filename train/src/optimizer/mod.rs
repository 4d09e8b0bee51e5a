//! AdamW with f32 master weights, its fused update, and the EMA of the weights.

pub(crate) mod ema;
pub(crate) mod fused_adamw;
pub mod optim;
