//! Signals that ask a training run to stop cleanly: Slurm's warning signal (`USR1`/`USR2`, sent
//! before the time limit or on preemption) asks for a checkpoint and a requeue; `TERM` and `INT`
//! ask for a checkpoint and an exit. A second `TERM`/`INT` ends the process at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use flux_model::tp::Collective;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::flag;

/// What the caught signals ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopRequest {
    /// Keep training.
    Continue,
    /// Checkpoint, requeue the Slurm job, exit (the warning signal).
    Requeue,
    /// Checkpoint and exit (`TERM`, `INT`).
    Stop,
}

/// Flags set by the signal handlers.
pub struct StopSignals {
    requeue: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl StopSignals {
    /// Install the handlers; `warning` is the Slurm warning signal's name (`USR1` or `USR2`).
    pub fn install(warning: &str) -> std::io::Result<Self> {
        let (requeue, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let warning = if warning == "USR2" { SIGUSR2 } else { SIGUSR1 };
        flag::register(warning, requeue.clone())?;
        for signal in [SIGTERM, SIGINT] {
            // Order matters: the second delivery finds the flag set and terminates.
            flag::register_conditional_shutdown(signal, 1, stop.clone())?;
            flag::register(signal, stop.clone())?;
        }
        Ok(Self { requeue, stop })
    }

    /// What has been asked of this process so far (`Stop` wins over `Requeue`).
    pub fn request(&self) -> StopRequest {
        if self.stop.load(Ordering::Relaxed) {
            StopRequest::Stop
        } else if self.requeue.load(Ordering::Relaxed) {
            StopRequest::Requeue
        } else {
            StopRequest::Continue
        }
    }

    /// The request every rank of `world` agrees on (a collective: every rank calls it at the same
    /// point), so all ranks leave the training loop after the same step even when the signal
    /// reached them at different times. Any rank's `Stop` wins, then any rank's `Requeue`.
    pub fn agreed(&self, world: &dyn Collective) -> StopRequest {
        agree(self.request(), world)
    }
}

/// The request of all ranks of `world`, each contributing `local`.
fn agree(local: StopRequest, world: &dyn Collective) -> StopRequest {
    let mut flags = match local {
        StopRequest::Continue => [0f32, 0.0],
        StopRequest::Requeue => [1.0, 0.0],
        StopRequest::Stop => [0.0, 1.0],
    };
    world.all_reduce_sum(&mut flags);
    if flags[1] > 0.0 {
        StopRequest::Stop
    } else if flags[0] > 0.0 {
        StopRequest::Requeue
    } else {
        StopRequest::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flux_model::tp::SingleRank;

    #[test]
    fn one_rank_agrees_with_itself() {
        for r in [
            StopRequest::Continue,
            StopRequest::Requeue,
            StopRequest::Stop,
        ] {
            assert_eq!(agree(r, &SingleRank), r);
        }
    }
}
