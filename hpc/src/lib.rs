//! # flux-cluster
//!
//! Where a flux-hpc process runs: the MPI world split into tensor- and data-parallel groups, its
//! rank and node-local rank from the MPI launcher's or Slurm's environment, the device it should
//! use, and how many compute threads it may take.

mod device;
mod mpi_groups;
mod placement;

pub use device::{DeviceChoice, DeviceError};
pub use mpi_groups::{LayoutError, MpiGroup, ParallelWorld};
pub use placement::{Placement, PlacementError};
