//! The flow-matching training step: noise, timesteps, the loss and the `Trainer` that runs them.

pub mod loss;
pub mod noise;
pub mod timesteps;
pub(crate) mod trainer;
