//! Fault injection for the reliability tests: with `FLUX_HPC_FAILPOINT=name[:step][@rank]` in its
//! environment, a process fails the way the point says when it reaches the named point (at that
//! step, on that world rank, where given). Unset, a failpoint costs one environment lookup.
//!
//! Points:
//! - `checkpoint-file` — abort (SIGABRT, as a crash would end it) after tensor-parallel rank 0
//!   wrote its file of a sharded checkpoint, before the other files are known to be complete and
//!   before `latest` moves.
//! - `stall` — stop the process (SIGSTOP, as a hung node or an attached debugger would) at the
//!   start of a training step, so its peers wait for it in their next collective.

/// The environment variable naming the armed failpoint.
pub const ENV: &str = "FLUX_HPC_FAILPOINT";

/// Whether `FLUX_HPC_FAILPOINT` arms `point` at `step` for a process of world rank `rank`
/// (`None`: unknown, matched only by a spec without `@rank`).
fn armed(point: &str, step: u64, rank: Option<usize>) -> bool {
    let Ok(spec) = std::env::var(ENV) else {
        return false;
    };
    let (spec, on) = match spec.split_once('@') {
        Some((spec, on)) => (spec, Some(on.parse::<usize>().ok())),
        None => (spec.as_str(), None),
    };
    let (name, at) = match spec.split_once(':') {
        Some((name, at)) => (name, at.parse::<u64>().ok()),
        None => (spec, None),
    };
    name == point
        && at.is_none_or(|at| at == step)
        && on.is_none_or(|on| on.is_some() && on == rank)
}

/// Abort the process when `FLUX_HPC_FAILPOINT` arms `point` (at `step`, if it names one).
pub fn hit(point: &str, step: u64) {
    if armed(point, step, None) {
        eprintln!("{ENV}: failpoint `{point}` reached at step {step}; aborting");
        std::process::abort();
    }
}

/// Stop the process (SIGSTOP) when `FLUX_HPC_FAILPOINT` arms `point` at `step` on world rank
/// `rank`; it stays stopped until continued or killed.
pub fn stall(point: &str, step: u64, rank: usize) {
    if armed(point, step, Some(rank)) {
        eprintln!("{ENV}: failpoint `{point}` reached at step {step} on rank {rank}; stopping");
        // SAFETY: raising a signal at this process has no memory-safety preconditions.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}
