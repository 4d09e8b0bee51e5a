//! `Cadence`: what the training loop does after each step — evaluate, log, checkpoint — from the
//! run config's intervals and the step the run stops at.

use crate::RunConfig;

/// The run's intervals and its last step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cadence {
    log_interval: u64,
    eval_interval: u64,
    checkpoint_interval: u64,
    last_step: u64,
}

/// What follows one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AfterStep {
    /// The run's last step in this process (`total_steps` or `--stop-after`).
    pub last: bool,
    /// Compute the held-out loss: every `eval_interval` steps and at the last.
    pub evaluate: bool,
    /// Write a metrics record: every `log_interval` steps, at evaluations, at the last step and
    /// for every skipped update.
    pub log: bool,
    /// Write a checkpoint: every `[checkpoint] interval` steps and at the last.
    pub checkpoint: bool,
}

impl Cadence {
    /// The cadence of `run` when this process stops after step `last_step`.
    pub fn new(run: &RunConfig, last_step: u64) -> Self {
        Self {
            log_interval: run.training.log_interval,
            eval_interval: run.training.eval_interval,
            checkpoint_interval: run.checkpoint.interval,
            last_step,
        }
    }

    /// What follows `step` (1-based), given whether its update was `skipped`.
    pub fn after(&self, step: u64, skipped: bool) -> AfterStep {
        let every = |interval: u64| interval > 0 && step.is_multiple_of(interval);
        let last = step == self.last_step;
        let evaluate = last || every(self.eval_interval);
        AfterStep {
            last,
            evaluate,
            log: last || evaluate || skipped || every(self.log_interval),
            checkpoint: last || every(self.checkpoint_interval),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cadence(log: u64, eval: u64, checkpoint: u64, last: u64) -> Cadence {
        Cadence {
            log_interval: log,
            eval_interval: eval,
            checkpoint_interval: checkpoint,
            last_step: last,
        }
    }

    #[test]
    fn intervals_and_the_last_step() {
        let c = cadence(10, 50, 100, 120);
        let at = |step, skipped| c.after(step, skipped);
        assert_eq!(
            at(7, false),
            AfterStep {
                last: false,
                evaluate: false,
                log: false,
                checkpoint: false
            }
        );
        assert!(at(10, false).log && !at(10, false).evaluate);
        assert!(at(50, false).evaluate && at(50, false).log && !at(50, false).checkpoint);
        assert!(at(100, false).checkpoint);
        assert!(at(7, true).log, "a skipped update is always logged");
        let last = at(120, false);
        assert!(last.last && last.evaluate && last.log && last.checkpoint);
    }

    #[test]
    fn zero_intervals_mean_only_at_the_last_step() {
        let c = cadence(0, 0, 0, 5);
        let before = c.after(4, false);
        assert!(!before.log && !before.evaluate && !before.checkpoint);
        assert!(c.after(5, false).checkpoint);
    }
}
