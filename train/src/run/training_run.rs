//! `TrainingRun`: one training run from its config to its final weights — every policy between
//! the CLI's set-up and its report: the run directory and its lock, resume, the step loop's
//! cadence (evaluation, logging, sample grids, checkpoints), stop signals and requeue, the
//! non-finite stop and its diagnostics, the final weights and loss curve.

use std::path::{Path, PathBuf};
use std::time::Instant;

use flux_cluster::slurm::{self, SlurmError};
use flux_cluster::{ParallelWorld, StopRequest, StopSignals};
use flux_data::checkpoint::{CheckpointLayout, CheckpointWriter};
use flux_data::{files, DataError};
use flux_model::activations::Kernels;
use flux_model::ConfigError;
use tch::Device;

use crate::logging::metrics::{plot_loss_curve, StepRecord};
use crate::logging::units;
use crate::memory_plan::{predict, Layout};
use crate::{
    starting_checkpoint, Cadence, CheckpointFormat, Launch, LogError, RunConfig, RunDir,
    RunDirError, RunLog, SampleGrid, StartPolicy, StepError, StepStats, Trainer,
};

/// How a run is started beyond its config (the CLI's flags).
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Stop after this step (with a checkpoint) instead of at `total_steps`.
    pub stop_after: Option<u64>,
    /// With `[checkpoint] resume = false`: start over in a directory holding an earlier run's
    /// checkpoints, deleting them first.
    pub force: bool,
}

/// What the run shows while it trains (the CLI draws a progress bar on the leader).
pub trait Progress {
    /// Steps `first_step + 1 ..= total_steps` are about to run.
    fn started(&mut self, first_step: u64, total_steps: u64);
    /// `step` is done with training loss `loss`.
    fn stepped(&mut self, step: u64, loss: f64);
    /// The loop ended (finished, stopped or failed).
    fn ended(&mut self);
}

/// A run that ends without an error.
#[derive(Debug)]
pub enum Outcome {
    /// `total_steps` reached: the final weights, loss curve and records are written (by the
    /// leader: `records` is empty on the other ranks).
    Finished {
        /// The weight files written (`final.safetensors`, `final_ema…`, `final_lora…`).
        weights: Vec<PathBuf>,
        /// Every metrics record of the run (the leader's log).
        records: Vec<StepRecord>,
        /// Wall time of this process's part of the run.
        seconds: f64,
    },
    /// Stopped after `step` (`--stop-after`) with a checkpoint; a rerun resumes.
    Paused { step: u64, total_steps: u64 },
    /// A signal asked for a requeue: checkpoint written after `step` and Slurm job `job`
    /// requeued.
    Requeued { step: u64, job: String },
}

/// Why a run stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The run directory could not be claimed.
    #[error(transparent)]
    Dir(#[from] RunDirError),
    /// The model or trainer could not be built.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Reading or writing checkpoints, data or weights failed.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The checkpoint to resume from does not fit the run.
    #[error("{0}")]
    Resume(String),
    /// `[sampling]` grids could not be prepared or drawn.
    #[error("{0}")]
    Sampling(String),
    /// Metrics or TensorBoard could not be written.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The loss curve could not be drawn.
    #[error("drawing loss_curve.png: {0}")]
    LossCurve(String),
    /// The run's config could not be written beside its checkpoints.
    #[error("writing config.toml: {0}")]
    WriteConfig(String),
    /// The loss or gradient norm was not finite ([`StepError::NonFinite`] or
    /// [`StepError::TooManySkips`]); `diagnostics` says where this rank's dump is.
    #[error("{error} ({diagnostics})")]
    NonFinite {
        error: StepError,
        diagnostics: String,
    },
    /// A stop signal after `step`: its checkpoint is written, the job not requeued.
    #[error(
        "stopped by a signal after step {step} of {total_steps}; its checkpoint is written: run \
         the same command again to resume"
    )]
    Signalled { step: u64, total_steps: u64 },
    /// Requeueing the Slurm job failed.
    #[error(transparent)]
    Slurm(#[from] SlurmError),
}

/// One run of `flux-hpc train` on this rank: the trainer, its run directory and the step the
/// process stops at.
pub struct TrainingRun<'w> {
    run: &'w RunConfig,
    world: &'w ParallelWorld,
    signals: &'w StopSignals,
    trainer: Trainer<'w>,
    device: Device,
    /// The claimed directory: `run.lock` held until the run ends.
    _dir: RunDir,
    /// The last step this process runs (`total_steps` or `--stop-after`).
    stop: u64,
}

impl<'w> TrainingRun<'w> {
    /// Claim `[checkpoint] dir`, build the trainer on `device` and resume from the directory's
    /// newest whole checkpoint when the config says so (a collective: every rank calls it).
    pub fn start(
        run: &'w RunConfig,
        launch: &'w Launch,
        signals: &'w StopSignals,
        options: RunOptions,
    ) -> Result<Self, RunError> {
        let (world, device) = (&launch.world, launch.device);
        let leader = world.world.rank() == 0;
        let dir = &run.checkpoint.dir;
        let run_dir = RunDir::claim(dir, world.world.as_ref())?;
        let mut trainer = Trainer::new(run, device, world.tp.clone(), world.dp_groups())?;
        trainer.set_run_id(run_dir.fresh_id());
        if let Some(bytes) = trainer.build_peak_bytes() {
            tracing::info!(
                "model built: peak of this rank's tensors {:.1} MiB",
                units::mib(bytes)
            );
        }
        let policy = StartPolicy {
            resume: run.checkpoint.resume,
            force: options.force,
        };
        if let Some(loaded) = starting_checkpoint(dir, policy, world.world.as_ref())? {
            trainer.restore(&loaded).map_err(RunError::Resume)?;
            if leader {
                tracing::info!(step = loaded.step, "resumed from {}", loaded.dir.display());
            }
        }
        // Only once the run is known to start or resume: a refused resume keeps the old config.
        if leader {
            let config = toml::to_string(run).map_err(|e| RunError::WriteConfig(e.to_string()))?;
            files::write_atomic(&dir.join("config.toml"), |w| w.write_all(config.as_bytes()))?;
        }
        let t = &run.training;
        let stop = options
            .stop_after
            .unwrap_or(t.total_steps)
            .min(t.total_steps);
        if leader {
            tracing::info!(
                world = world.world.size(),
                tp = world.tp.size(),
                sequence_parallel = world.tp.sequence_parallel(),
                dp = world.dp.size(),
                backend = launch.transport.backend.name(),
                ?device,
                architecture = run.model.architecture(),
                params = run.model.num_params(),
                trained_on_this_rank = trainer.trained().num_local_params(true),
                "training steps {}..{stop} of {}, {} samples each",
                trainer.step() + 1,
                t.total_steps,
                t.global_batch_size
            );
            log_planned_memory(run, world.world.size(), device);
        }
        Ok(Self {
            run,
            world,
            signals,
            trainer,
            device,
            _dir: run_dir,
            stop,
        })
    }

    /// Train from the current step to the stop step, then write the final weights when the run
    /// is complete. A data error seen by this rank alone ends the whole job (the others may
    /// already wait in a collective for this one).
    pub fn run(mut self, progress: &mut dyn Progress) -> Result<Outcome, RunError> {
        progress.started(self.trainer.step(), self.run.training.total_steps);
        let result = self.steps(progress);
        progress.ended();
        result
    }

    /// The step loop and what ends it.
    fn steps(&mut self, progress: &mut dyn Progress) -> Result<Outcome, RunError> {
        let (run, world) = (self.run, self.world);
        let leader = world.world.rank() == 0;
        let dir = run.checkpoint.dir.as_path();
        let first_step = self.trainer.step();
        // Before the first step, so that a bad [sampling] table stops the run at once.
        let samples =
            SampleGrid::prepare(run, world.world.as_ref(), world.dp.rank() == 0, self.device)
                .map_err(RunError::Sampling)?;
        let mut log = match leader {
            true => Some(RunLog::open(dir, first_step, run.logging.tensorboard)?),
            false => None,
        };
        let start = Instant::now();
        if first_step == 0 {
            let eval = self.trainer.eval_loss()?;
            if let Some(log) = &mut log {
                log.record(record(&self.trainer, 0, None, Some(eval), start))?;
            }
        }
        let checkpoints = Checkpoints::new(run, world);
        let cadence = Cadence::new(run, self.stop);
        for step in first_step + 1..=self.stop {
            flux_data::failpoint::stall("stall", step, world.world.rank());
            let stats = match self.trainer.train_step() {
                Ok(stats) => stats,
                Err(e @ StepError::Data(_)) => abort_job(world, &e),
                Err(error) => return Err(nonfinite(error, dir, world.world.rank())),
            };
            let next = cadence.after(step, stats.skipped);
            let eval = next
                .evaluate
                .then(|| self.trainer.eval_loss())
                .transpose()
                .unwrap_or_else(|e| abort_job(world, &e));
            progress.stepped(step, stats.loss);
            if stats.skipped && leader {
                tracing::warn!(
                    step,
                    loss = stats.loss,
                    grad_norm = stats.grad_norm,
                    "non-finite loss or gradient norm: update skipped ([training] nonfinite = \
                     \"skip\")"
                );
            }
            if let (true, Some(log)) = (next.log, &mut log) {
                log.record(step_record(&self.trainer, step, &stats, eval, start, run))?;
            }
            if let (Some(grid), true) = (&samples, run.sampling.due(step, next.last)) {
                let drawn = grid.render(&self.trainer).map_err(RunError::Sampling)?;
                if let (Some(image), Some(log)) = (drawn, &mut log) {
                    log.grid(step, &image, &SampleGrid::path(dir, step))?;
                }
            }
            if next.checkpoint {
                let written = checkpoints.save(&self.trainer)?;
                tracing::debug!("checkpoint {}", written.display());
            }
            let request = self.signals.agreed(world.world.as_ref());
            if let Some(stop) = on_signal(request, next.last, run.slurm.requeue, slurm_job()) {
                if !next.checkpoint {
                    checkpoints.save(&self.trainer)?;
                }
                return stop.outcome(step, run.training.total_steps, leader);
            }
        }
        if self.trainer.step() < run.training.total_steps {
            return Ok(Outcome::Paused {
                step: self.trainer.step(),
                total_steps: run.training.total_steps,
            });
        }
        // A collective (tensor-parallel shards are gathered): every rank takes part.
        let finals = self.trainer.final_weights();
        let mut weights = Vec::new();
        let mut records = Vec::new();
        if let Some(log) = &log {
            plot_loss_curve(log.records(), &dir.join("loss_curve.png"))
                .map_err(RunError::LossCurve)?;
            for (file, tensors) in &finals {
                flux_data::convert::write_tensors(&dir.join(file), tensors)?;
                weights.push(dir.join(file));
            }
            records = log.records().to_vec();
        }
        Ok(Outcome::Finished {
            weights,
            records,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

/// Log what `flux-hpc plan` predicts for this run's layout: each rank's tensors at their peak.
fn log_planned_memory(run: &RunConfig, ranks: usize, device: Device) {
    let kernels = Kernels::on_gpu(device != Device::Cpu);
    let planned = Layout::of(run, ranks).and_then(|layout| predict(run, &layout, kernels));
    match planned {
        Ok(memory) => tracing::info!(
            state_mib = memory.state() >> 20,
            phase = memory.peak_phase().phase.name(),
            "planned peak of each rank's tensors: {:.1} MiB (flux-hpc plan)",
            units::mib(memory.peak())
        ),
        Err(e) => tracing::debug!("no memory plan: {e}"),
    }
}

/// Where and how the run writes its checkpoints.
struct Checkpoints<'w> {
    writer: CheckpointWriter<'w>,
    /// Each rank writes the parts of a sharded optimizer it owns (sharded layout).
    parts: bool,
}

impl<'w> Checkpoints<'w> {
    fn new(run: &'w RunConfig, world: &'w ParallelWorld) -> Self {
        let layout = match run.checkpoint.format {
            CheckpointFormat::Sharded => CheckpointLayout::Sharded,
            CheckpointFormat::Unified => CheckpointLayout::Unified,
        };
        Self {
            writer: CheckpointWriter {
                run_dir: &run.checkpoint.dir,
                layout,
                keep: run.checkpoint.keep,
                tp: &world.tp,
                dp_rank: world.dp.rank(),
                world: world.world.as_ref(),
            },
            parts: layout == CheckpointLayout::Sharded,
        }
    }

    fn save(&self, trainer: &Trainer) -> Result<PathBuf, DataError> {
        let state = trainer.checkpoint_state(self.parts);
        self.writer.save(&state, trainer.trained().param_specs())
    }
}

/// How the run leaves its loop after every rank agreed on a stop request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum SignalStop {
    /// Requeue Slurm job `job`, then end well.
    Requeue(String),
    /// End with an error that says how to continue.
    Stop,
}

/// What the agreed `request` after a step does: nothing when training goes on or the step was
/// the last anyway; else a checkpoint and a requeue of the Slurm job `job` (when the request is
/// the warning signal, `[slurm] requeue` is on and the run is a Slurm job), or a stop.
fn on_signal(
    request: StopRequest,
    last: bool,
    requeue: bool,
    job: Option<String>,
) -> Option<SignalStop> {
    match (request, last) {
        (StopRequest::Continue, _) | (_, true) => None,
        (StopRequest::Requeue, false) if requeue && job.is_some() => job.map(SignalStop::Requeue),
        _ => Some(SignalStop::Stop),
    }
}

impl SignalStop {
    /// Act on the stop after `step`'s checkpoint: the leader asks Slurm to requeue.
    fn outcome(self, step: u64, total_steps: u64, leader: bool) -> Result<Outcome, RunError> {
        match self {
            SignalStop::Requeue(job) => {
                if leader {
                    tracing::info!(
                        "signal: checkpoint at step {step} written; requeueing Slurm job {job}"
                    );
                    slurm::requeue(&job)?;
                }
                Ok(Outcome::Requeued { step, job })
            }
            SignalStop::Stop => Err(RunError::Signalled { step, total_steps }),
        }
    }
}

/// The Slurm job this process belongs to, if any.
fn slurm_job() -> Option<String> {
    std::env::var("SLURM_JOB_ID").ok()
}

/// Report an error only this rank saw and end the whole job (MPI_Abort), since the other ranks
/// may already wait in a collective for this one.
fn abort_job(world: &ParallelWorld, error: &dyn std::error::Error) -> ! {
    eprintln!(
        "error: {error} (rank {} of {}; ending the job)",
        world.world.rank(),
        world.world.size()
    );
    world.abort(1)
}

/// Write this rank's diagnostic dump `nonfinite_step_<N>.rank_<R>.json` of a non-finite stop
/// into the run directory; the error the run stops with says where it is.
fn nonfinite(error: StepError, dir: &Path, rank: usize) -> RunError {
    let Some(report) = error.report() else {
        return RunError::NonFinite {
            error,
            diagnostics: "no diagnostics".into(),
        };
    };
    let path = dir.join(format!(
        "nonfinite_step_{:09}.rank_{rank}.json",
        report.step
    ));
    let written = serde_json::to_string_pretty(report)
        .map_err(|e| e.to_string())
        .and_then(|json| {
            files::write_atomic(&path, |w| w.write_all(json.as_bytes())).map_err(|e| e.to_string())
        });
    let diagnostics = match written {
        Ok(()) => format!("diagnostics in {}", path.display()),
        Err(e) => format!("and writing {} failed: {e}", path.display()),
    };
    RunError::NonFinite { error, diagnostics }
}

/// The metrics record of a step without training statistics (the evaluation before step 1).
fn record(
    trainer: &Trainer,
    step: u64,
    loss: Option<f64>,
    eval: Option<f64>,
    start: Instant,
) -> StepRecord {
    StepRecord {
        step,
        loss,
        eval_loss: eval,
        lr: 0.0,
        grad_norm: 0.0,
        samples_per_s: 0.0,
        tokens_per_s: 0.0,
        skipped: false,
        peak_memory_mib: trainer.peak_memory_mib(),
        peak_tensor_mib: trainer.peak_tensor_mib(),
        grad_reduce_overlap_s: None,
        host_staged_mib: None,
        elapsed_s: start.elapsed().as_secs_f64(),
    }
}

/// The metrics record of training step `step`.
fn step_record(
    trainer: &Trainer,
    step: u64,
    stats: &StepStats,
    eval: Option<f64>,
    start: Instant,
    run: &RunConfig,
) -> StepRecord {
    let samples_per_s = run.training.global_batch_size as f64 / stats.seconds;
    StepRecord {
        lr: stats.lr,
        grad_norm: stats.grad_norm,
        samples_per_s,
        tokens_per_s: samples_per_s * stats.tokens_per_sample as f64,
        skipped: stats.skipped,
        grad_reduce_overlap_s: stats.overlap.map(|o| o.overlapped_s),
        host_staged_mib: Some(units::mib(stats.host_staged_bytes)),
        ..record(trainer, step, Some(stats.loss), eval, start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_goes_on_without_a_request() {
        assert_eq!(
            on_signal(StopRequest::Continue, false, true, Some("7".into())),
            None
        );
    }

    #[test]
    fn a_request_at_the_last_step_changes_nothing() {
        for request in [StopRequest::Stop, StopRequest::Requeue] {
            assert_eq!(on_signal(request, true, true, Some("7".into())), None);
        }
    }

    #[test]
    fn the_warning_signal_requeues_only_a_slurm_job_that_asks_for_it() {
        let job = || Some("7".to_string());
        assert_eq!(
            on_signal(StopRequest::Requeue, false, true, job()),
            Some(SignalStop::Requeue("7".into()))
        );
        assert_eq!(
            on_signal(StopRequest::Requeue, false, false, job()),
            Some(SignalStop::Stop)
        );
        assert_eq!(
            on_signal(StopRequest::Requeue, false, true, None),
            Some(SignalStop::Stop)
        );
        assert_eq!(
            on_signal(StopRequest::Stop, false, true, job()),
            Some(SignalStop::Stop)
        );
    }

    #[test]
    fn a_signal_stop_is_an_error_that_says_how_to_continue() {
        let stop = SignalStop::Stop.outcome(12, 100, true).unwrap_err();
        let message = stop.to_string();
        assert!(message.contains("after step 12 of 100"), "{message}");
        assert!(message.contains("run the same command again"), "{message}");
    }
}
