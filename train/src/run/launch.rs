//! `Launch`: this process in its job — where the launcher placed it, its device and threads, and
//! the process groups of the run's layout. What `train`, `bench` and the `check-*` commands set
//! up first, the same way.

use std::time::Duration;

use flux_cluster::{
    BackendError, DeviceChoice, DeviceError, GroupSizes, LayoutError, ParallelWorld, Placement,
    PlacementError, Transport,
};
use tch::Device;

use crate::ParallelismConfig;

/// This process's place in the job and its process groups.
pub struct Launch {
    /// Rank, local rank and threads, as the launcher (mpirun, srun) set them.
    pub placement: Placement,
    /// The device this rank computes on.
    pub device: Device,
    /// What moves the collectives, and their timeout.
    pub transport: Transport,
    /// The world and its tensor-, data-parallel and shard groups.
    pub world: ParallelWorld,
}

/// Why a process could not join its job.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

impl Launch {
    /// Join the job: read the placement, use `threads` intra-op threads (default: this rank's
    /// share of the node's cores), resolve `device` for the local rank, and build the groups of
    /// `sizes` over `parallelism`'s backend (one process without a launcher, else MPI), every
    /// collective wait bounded by `collective_timeout_s`.
    pub fn join(
        parallelism: &ParallelismConfig,
        device: DeviceChoice,
        sizes: GroupSizes,
        threads: Option<usize>,
    ) -> Result<Self, LaunchError> {
        let placement = Placement::from_env()?;
        tch::set_num_threads(threads.unwrap_or_else(|| placement.threads()) as i32);
        let device = device.resolve(placement.local_rank)?;
        let transport = parallelism.transport(device)?;
        let world = ParallelWorld::from_launch(&placement, sizes, transport)?;
        world.bound_collective_waits(Duration::from_secs(parallelism.collective_timeout_s));
        Ok(Self {
            placement,
            device,
            transport,
            world,
        })
    }
}
