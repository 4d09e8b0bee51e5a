//! Where this process sits in the job: rank, world size and node-local rank, read from the
//! variables MPI launchers and Slurm set.

/// This process' place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Global rank, `0 ..< world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes on this node (selects the GPU).
    pub local_rank: usize,
    /// Processes on this node.
    pub local_size: usize,
    /// CPU cores Slurm gave each task (`SLURM_CPUS_PER_TASK`), if set.
    pub cpus_per_task: Option<usize>,
    /// Which launcher's variables were read (`"openmpi"`, `"slurm"`, `"pmi"`, or `"single"`).
    pub source: &'static str,
}

/// A launcher variable that is present but not a valid number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable {name}={value:?} is not a valid {what}")]
pub struct PlacementError {
    /// The variable.
    pub name: String,
    /// Its value.
    pub value: String,
    /// What it should be.
    pub what: &'static str,
}

/// Variables of one launcher: (source, rank, size, local rank, local size).
const LAUNCHERS: &[(&str, &str, &str, &str, &str)] = &[
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "slurm",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
    ),
    (
        "pmi",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    ),
];

impl Placement {
    /// Read the placement from this process' environment.
    pub fn from_env() -> Result<Self, PlacementError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Read the placement through `var` (a lookup of environment variables). The first launcher
    /// whose rank variable is set wins; without any, the process is rank 0 of 1.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, PlacementError> {
        let number = |name: &str, what: &'static str| -> Result<Option<usize>, PlacementError> {
            match var(name) {
                None => Ok(None),
                // Slurm writes per-node task counts like "2(x3)"; the leading count is this node's.
                Some(value) => value
                    .split('(')
                    .next()
                    .and_then(|v| v.trim().parse().ok())
                    .map(Some)
                    .ok_or(PlacementError {
                        name: name.to_string(),
                        value,
                        what,
                    }),
            }
        };
        let cpus_per_task = number("SLURM_CPUS_PER_TASK", "CPU count")?;
        for &(source, rank_var, size_var, local_var, local_size_var) in LAUNCHERS {
            let Some(rank) = number(rank_var, "rank")? else {
                continue;
            };
            let world_size = number(size_var, "process count")?.unwrap_or(rank + 1);
            let local_rank = number(local_var, "local rank")?.unwrap_or(rank);
            let local_size = number(local_size_var, "local process count")?.unwrap_or(world_size);
            if rank >= world_size {
                return Err(PlacementError {
                    name: rank_var.to_string(),
                    value: rank.to_string(),
                    what: "rank below the world size",
                });
            }
            return Ok(Self {
                rank,
                world_size,
                local_rank,
                local_size,
                cpus_per_task,
                source,
            });
        }
        Ok(Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_size: 1,
            cpus_per_task,
            source: "single",
        })
    }

    /// Compute threads this rank should use: Slurm's CPUs per task, else the machine's cores
    /// shared evenly among the ranks on this node (at least 1).
    pub fn threads(&self) -> usize {
        self.cpus_per_task.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism()
                .map(usize::from)
                .unwrap_or(1);
            (cores / self.local_size.max(1)).max(1)
        })
    }
}
