//! # flux-cluster
//!
//! Where a flux-hpc process runs: its rank and node-local rank from the MPI launcher's or
//! Slurm's environment, the device it should use, and how many compute threads it may take.

mod device;
mod placement;

pub use device::{DeviceChoice, DeviceError};
pub use placement::{Placement, PlacementError};
