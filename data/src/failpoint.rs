//! Fault injection for the reliability tests: with `FLUX_HPC_FAILPOINT=name` (or `name:step`)
//! in its environment, a process aborts (SIGABRT, as a crash would end it) when it reaches the
//! named point (at that step). Unset, a failpoint costs one environment lookup.
//!
//! Points: `checkpoint-file` — after tensor-parallel rank 0 wrote its file of a sharded
//! checkpoint, before the other files are known to be complete and before `latest` moves.

/// The environment variable naming the armed failpoint.
pub const ENV: &str = "FLUX_HPC_FAILPOINT";

/// Abort the process when `FLUX_HPC_FAILPOINT` arms `point` (at `step`, if it names one).
pub fn hit(point: &str, step: u64) {
    let Ok(armed) = std::env::var(ENV) else {
        return;
    };
    let (name, at) = match armed.split_once(':') {
        Some((name, at)) => (name, at.parse::<u64>().ok()),
        None => (armed.as_str(), None),
    };
    if name == point && at.is_none_or(|at| at == step) {
        eprintln!("{ENV}: failpoint `{point}` reached at step {step}; aborting");
        std::process::abort();
    }
}
