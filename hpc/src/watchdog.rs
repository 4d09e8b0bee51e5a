//! A bound on how long any collective may wait for its peers. MPI's blocking collectives wait
//! forever for a rank that hangs, is stopped (SIGSTOP, a debugger, a stalled filesystem) or lost
//! its node without its process dying; then every other rank waits too and the job burns its
//! allocation. Each collective marks when it started; a watchdog thread ends this process with a
//! clear error when one has waited longer than the timeout, and the launcher (mpirun, srun) then
//! ends the job's other ranks. Every waiting rank reports for itself, so each log names it; a
//! wait of a minute or more is reported while it goes on (again each time it doubles), so a job
//! waiting on a stopped peer says so long before it is ended.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The instant the in-flight times are counted from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Milliseconds since [`epoch`] at which this process' current collective started, plus one
/// (0: none in flight).
static IN_FLIGHT: AtomicU64 = AtomicU64::new(0);
/// What the collective in flight is, for the error: the group size.
static GROUP_SIZE: AtomicU64 = AtomicU64::new(0);

/// Marks one collective as in flight until dropped.
pub struct InFlight(());

/// Mark the start of a collective over `group_size` ranks; it counts as waiting until the
/// returned guard is dropped.
pub fn enter(group_size: usize) -> InFlight {
    GROUP_SIZE.store(group_size as u64, Ordering::Relaxed);
    let now = epoch().elapsed().as_millis() as u64 + 1;
    IN_FLIGHT.store(now, Ordering::Release);
    InFlight(())
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.store(0, Ordering::Release);
    }
}

/// How long the collective in flight has waited, if one is.
fn waited() -> Option<Duration> {
    in_flight().map(|(_, waited)| waited)
}

/// The collective in flight, if one is: its start mark and how long it has waited.
fn in_flight() -> Option<(u64, Duration)> {
    match IN_FLIGHT.load(Ordering::Acquire) {
        0 => None,
        start => {
            let now = epoch().elapsed().as_millis() as u64 + 1;
            Some((start, Duration::from_millis(now.saturating_sub(start))))
        }
    }
}

/// How long a collective waits before its rank says so (then again each time the wait doubles).
const FIRST_REPORT: Duration = Duration::from_secs(60);

/// When a wait of `waited` should be reported, given the next report due (`None`: none yet, the
/// first due at [`FIRST_REPORT`]): `Some(next due)` when it should be now.
fn report_due(waited: Duration, due: Option<Duration>) -> Option<Duration> {
    let due = due.unwrap_or(FIRST_REPORT);
    (waited >= due).then(|| due * 2)
}

/// Start the watchdog thread of this process (once; later calls change nothing): when a
/// collective has waited longer than `timeout`, print an error naming `rank` of `world` and exit
/// with status 3 without running MPI's finalisation, which would wait for the peers too.
pub fn start(timeout: Duration, rank: usize, world: usize) {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        epoch();
        let poll = (timeout / 10).clamp(Duration::from_millis(100), Duration::from_secs(5));
        std::thread::Builder::new()
            .name("collective-watchdog".into())
            .spawn(move || {
                // The collective last reported on, and when its next report is due.
                let mut reported: Option<(u64, Duration)> = None;
                loop {
                    std::thread::sleep(poll);
                    if let Some((start, waited)) = in_flight().filter(|(_, w)| *w <= timeout) {
                        let due = reported.filter(|(s, _)| *s == start).map(|(_, d)| d);
                        if let Some(next) = report_due(waited, due) {
                            reported = Some((start, next));
                            eprintln!(
                            "warning: rank {rank} of {world}: a collective over {} rank(s) has \
                             waited {:.0} s for its peers (the job ends at [parallelism] \
                             collective_timeout_s = {} s)",
                            GROUP_SIZE.load(Ordering::Relaxed),
                            waited.as_secs_f64(),
                            timeout.as_secs()
                        );
                        }
                    }
                    if let Some(waited) = waited().filter(|w| *w > timeout) {
                        eprintln!(
                        "error: rank {rank} of {world}: a collective over {} rank(s) has waited \
                         {:.0} s for its peers, longer than [parallelism] collective_timeout_s = \
                         {}: a rank stopped responding (hung, stopped, or its node was lost); \
                         ending the job",
                        GROUP_SIZE.load(Ordering::Relaxed),
                        waited.as_secs_f64(),
                        timeout.as_secs()
                    );
                        // SAFETY: `_exit` ends the process at once; nothing here is left half-done
                        // that a normal exit would complete (the run's files are written atomically).
                        unsafe { libc::_exit(3) };
                    }
                }
            })
            .expect("the watchdog thread starts");
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collective_counts_as_waiting_until_its_guard_drops() {
        assert!(waited().is_none());
        let guard = enter(4);
        std::thread::sleep(Duration::from_millis(20));
        assert!(waited().expect("in flight") >= Duration::from_millis(20));
        drop(guard);
        assert!(waited().is_none());
    }

    #[test]
    fn long_waits_are_reported_as_they_double() {
        let s = Duration::from_secs;
        assert_eq!(report_due(s(59), None), None);
        assert_eq!(report_due(s(60), None), Some(s(120)));
        assert_eq!(report_due(s(100), Some(s(120))), None);
        assert_eq!(report_due(s(130), Some(s(120))), Some(s(240)));
    }
}
