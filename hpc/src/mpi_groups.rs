//! The MPI world split into tensor- and data-parallel groups (ranks placed TP-contiguous).

use flux_model::tp::{Collective, DpGroups, SingleRank, TpContext};

use crate::backend::{Backend, BackendError, Transport};
use crate::c10d::{C10dGroup, Store};
use crate::mpi_group::MpiGroup;
use crate::{watchdog, Placement};
use mpi::environment::Universe;
use mpi::topology::{Color, Communicator, SimpleCommunicator};

/// How many ranks the groups of a [`ParallelWorld`] hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSizes {
    /// Consecutive ranks per tensor-parallel group (a divisor of the world size).
    pub tensor_parallel: usize,
    /// Consecutive data-parallel replicas per shard group (a divisor of the data-parallel size;
    /// 0: all of them).
    pub shard_group: usize,
    /// Whether the tensor-parallel group splits activations along the sequence
    /// ([`TpContext::with_sequence_parallel`]).
    pub sequence_parallel: bool,
}

impl GroupSizes {
    /// The data-parallel replicas and the shard-group size a world of `world` ranks makes with
    /// these sizes; refused when the tensor-parallel size does not divide the world or the shard
    /// group the replicas. Pure arithmetic: every rank, and a planner with no MPI, reaches the
    /// same verdict.
    pub fn split(&self, world: usize) -> Result<(usize, usize), LayoutError> {
        let tp = self.tensor_parallel;
        if tp == 0 || !world.is_multiple_of(tp) {
            return Err(LayoutError::Indivisible { world, tp });
        }
        let dp = world / tp;
        Ok((dp, shard_group(dp, self.shard_group)?))
    }
}

/// The size of the shard groups of a data-parallel group of `dp` replicas asked for as
/// `requested` (0: all of them).
fn shard_group(dp: usize, requested: usize) -> Result<usize, LayoutError> {
    match requested {
        0 => Ok(dp),
        g if dp.is_multiple_of(g) => Ok(g),
        group => Err(LayoutError::ShardGroup { dp, group }),
    }
}

/// Why the parallel layout cannot be built. Every rank reaches the same verdict from the same
/// numbers, before any collective, so a bad layout fails everywhere instead of hanging.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// MPI was initialised already in this process (or could not be).
    #[error("MPI could not be initialised (already initialised in this process?)")]
    Init,
    /// The tensor-parallel size is not a positive divisor of the world size.
    #[error("world size {world} is not divisible by tensor_parallel_size {tp}: world = tp × dp must hold")]
    Indivisible {
        /// Ranks launched.
        world: usize,
        /// Requested tensor-parallel size.
        tp: usize,
    },
    /// The backend's groups could not be set up.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The shard group size is not a divisor of the data-parallel size.
    #[error("shard_group_size {group} does not divide the {dp} data-parallel replicas (world / tensor_parallel_size)")]
    ShardGroup {
        /// Data-parallel replicas.
        dp: usize,
        /// Requested shard group size.
        group: usize,
    },
}

/// This process' world and its groups. Drop models built on [`ParallelWorld::tp`] before this
/// value: dropping it finalises MPI.
pub struct ParallelWorld {
    /// Tensor-parallel group: ranks `d·tp ..< (d+1)·tp` for data-parallel index `d`.
    pub tp: TpContext,
    /// Data-parallel group: the ranks with this rank's tensor-parallel index.
    pub dp: Box<dyn Collective>,
    /// Shard group: `shard_group_size` consecutive data-parallel ranks (all of `dp` when the
    /// size is 0 or `dp`'s).
    pub dp_shard: Box<dyn Collective>,
    /// The data-parallel ranks at this rank's position in every shard group.
    pub dp_across: Box<dyn Collective>,
    /// Every rank.
    pub world: Box<dyn Collective>,
    /// The rendezvous of c10d groups (none under MPI), dropped after them.
    _store: Option<Store>,
    // Last: dropping the universe finalises MPI, after the communicators are freed.
    universe: Option<Universe>,
}

impl std::fmt::Debug for ParallelWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ParallelWorld(rank {} of {}, {:?}, dp {} of {})",
            self.world.rank(),
            self.world.size(),
            self.tp,
            self.dp.rank(),
            self.dp.size()
        )
    }
}

impl ParallelWorld {
    /// Initialise MPI and split the world into tensor-parallel groups and each data-parallel
    /// group into shard groups, as `sizes` says; under a c10d backend, each group also becomes a
    /// c10d process group (rendezvoused through a store world rank 0 opens).
    pub fn init(sizes: GroupSizes, transport: Transport) -> Result<Self, LayoutError> {
        let universe = mpi::initialize().ok_or(LayoutError::Init)?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let (tp_size, sequence_parallel) = (sizes.tensor_parallel, sizes.sequence_parallel);
        let (_, group) = sizes.split(size)?;
        let split = |comm: &SimpleCommunicator, color: usize| {
            let comm = comm
                .split_by_color(Color::with_value(color as i32))
                .expect("every rank has a color");
            MpiGroup { comm }
        };
        let (tp_color, dp_color) = (rank / tp_size, rank % tp_size);
        let tp = split(&world, tp_color);
        let dp = split(&world, dp_color);
        let dp_rank = dp.rank();
        let (shard_color, across_color) = (dp_rank / group, dp_rank % group);
        let dp_shard = split(&dp.comm, shard_color);
        let dp_across = split(&dp.comm, across_color);
        let everyone = split(&world, 0);
        let store = match transport.backend {
            Backend::Gloo | Backend::Nccl => Some(Store::rendezvous(
                &world,
                transport.backend,
                transport.timeout,
            )?),
            _ => None,
        };
        // Every rank names its groups alike and creates them in the same order.
        let make = |name: String, mpi: MpiGroup| -> Result<Box<dyn Collective>, LayoutError> {
            Ok(match &store {
                None => Box::new(mpi),
                Some(store) => Box::new(C10dGroup::new(
                    store,
                    &world,
                    &name,
                    mpi,
                    transport.backend,
                    transport.timeout,
                )?),
            })
        };
        let tp = make(format!("tp/{tp_color}"), tp)?;
        let dp = make(format!("dp/{dp_color}"), dp)?;
        let dp_shard = make(format!("dp_shard/{dp_color}/{shard_color}"), dp_shard)?;
        let dp_across = make(format!("dp_across/{dp_color}/{across_color}"), dp_across)?;
        let everyone = make("world".into(), everyone)?;
        Ok(Self {
            tp: TpContext::new(tp).with_sequence_parallel(sequence_parallel),
            dp,
            dp_shard,
            dp_across,
            world: everyone,
            _store: store,
            universe: Some(universe),
        })
    }

    /// One process without MPI (no launcher variables were found): every group has one rank.
    pub fn single(sizes: GroupSizes) -> Result<Self, LayoutError> {
        sizes.split(1)?;
        Ok(Self {
            tp: TpContext::single(),
            dp: Box::new(SingleRank),
            dp_shard: Box::new(SingleRank),
            dp_across: Box::new(SingleRank),
            world: Box::new(SingleRank),
            _store: None,
            universe: None,
        })
    }

    /// MPI when this process was started by a launcher (`placement.source` is not `"single"`),
    /// else [`ParallelWorld::single`].
    pub fn from_launch(
        placement: &Placement,
        sizes: GroupSizes,
        transport: Transport,
    ) -> Result<Self, LayoutError> {
        if placement.source == "single" {
            Self::single(sizes)
        } else {
            Self::init(sizes, transport)
        }
    }

    /// The data-parallel group and its shard groups.
    pub fn dp_groups(&self) -> DpGroups<'_> {
        DpGroups {
            all: self.dp.as_ref(),
            shard: self.dp_shard.as_ref(),
            across: self.dp_across.as_ref(),
        }
    }

    /// End every rank of the job now with exit status `code` (`MPI_Abort` on the world), for an
    /// error on this rank that its peers cannot learn of because they may already wait in a
    /// collective. Without MPI, exits the process.
    pub fn abort(&self, code: i32) -> ! {
        match &self.universe {
            Some(universe) => universe.world().abort(code),
            None => std::process::exit(code),
        }
    }

    /// Bound every collective's wait for its peers by `timeout`: past it, this process ends with
    /// an error naming its rank (see [`crate::watchdog`]), and the launcher ends the others.
    /// Nothing to watch without MPI.
    pub fn bound_collective_waits(&self, timeout: std::time::Duration) {
        if self.universe.is_some() {
            watchdog::start(timeout, self.world.rank(), self.world.size());
        }
    }

    /// This rank's index in the data-parallel group.
    pub fn dp_rank(&self) -> usize {
        self.dp.rank()
    }

    /// Number of data-parallel replicas.
    pub fn dp_size(&self) -> usize {
        self.dp.size()
    }
}
