//! # flux-cluster
//!
//! Where a flux-hpc process runs: the MPI world split into tensor- and data-parallel groups (moved
//! by MPI, or by libtorch's c10d gloo or NCCL groups rendezvoused over MPI), its
//! rank and node-local rank from the MPI launcher's or Slurm's environment, the device it should
//! use, and how many compute threads it may take; Slurm batch scripts and commands, and the
//! signals that ask a run to checkpoint and stop.

mod backend;
mod c10d;
mod device;
pub mod memory;
mod mpi_group;
mod mpi_groups;
mod placement;
mod signals;
pub mod slurm;
pub mod watchdog;

pub use backend::{has_nccl, Backend, BackendError, Transport};
pub use c10d::C10dGroup;
pub use device::{DeviceChoice, DeviceError};
pub use mpi_group::MpiGroup;
pub use mpi_groups::{GroupSizes, LayoutError, ParallelWorld};
pub use placement::{Placement, PlacementError};
pub use signals::{StopRequest, StopSignals};
