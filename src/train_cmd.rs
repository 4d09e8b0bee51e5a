//! `flux-hpc train`: flow-matching training on one process or many (under mpirun or srun), with
//! checkpoints and resume.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use flux_cluster::{slurm, ParallelWorld, Placement, StopRequest, StopSignals};
use flux_data::checkpoint::{CheckpointLayout, CheckpointWriter};
use flux_data::files;
use flux_model::activations::Kernels;
use flux_train::memory_plan::{predict, Layout};
use flux_train::metrics::{plot_loss_curve, StepRecord};
use flux_train::units;
use flux_train::{
    starting_checkpoint, Cadence, CheckpointFormat, RunConfig, RunDir, RunLog, SampleGrid,
    StartPolicy, StepError, Trainer,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tch::Device;

use crate::{ConfigArgs, DeviceArgs};

/// Arguments of `flux-hpc train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Stop after this step (with a checkpoint) instead of at total_steps; a rerun resumes. For
    /// allocations shorter than the run.
    #[arg(long)]
    stop_after: Option<u64>,
    /// With `[checkpoint] resume = false`: start over in a run directory that holds an earlier
    /// run's checkpoints, deleting them first (without it such a start is refused).
    #[arg(long)]
    force: bool,
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

/// Train, resuming from `[checkpoint] dir`'s `latest` when there is one; writes checkpoints,
/// `metrics.jsonl`, `loss_curve.png`, `config.toml` and `final.safetensors` (under `[lora]`:
/// `final_lora.safetensors`) into that directory.
pub fn run(args: TrainArgs) -> Result<()> {
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let signals = StopSignals::install(&run.slurm.signal).context("installing signal handlers")?;
    let placement = Placement::from_env()?;
    let device = args.device.device.resolve(placement.local_rank)?;
    let transport = run.parallelism.transport(device)?;
    let world = ParallelWorld::from_launch(&placement, run.parallelism.group_sizes(), transport)?;
    world.bound_collective_waits(Duration::from_secs(run.parallelism.collective_timeout_s));
    tch::set_num_threads(placement.threads() as i32);
    let leader = world.world.rank() == 0;
    let dir = &run.checkpoint.dir;
    let run_dir = RunDir::claim(dir, world.world.as_ref())?;

    let mut trainer = Trainer::new(&run, device, world.tp.clone(), world.dp_groups())?;
    trainer.set_run_id(run_dir.fresh_id());
    if let Some(bytes) = trainer.build_peak_bytes() {
        tracing::info!(
            "model built: peak of this rank's tensors {:.1} MiB",
            units::mib(bytes)
        );
    }
    let policy = StartPolicy {
        resume: run.checkpoint.resume,
        force: args.force,
    };
    if let Some(loaded) = starting_checkpoint(dir, policy, world.world.as_ref())? {
        trainer.restore(&loaded).map_err(|e| anyhow!(e))?;
        if leader {
            tracing::info!(step = loaded.step, "resumed from {}", loaded.dir.display());
        }
    }
    // Only once the run is known to start or resume: a refused resume keeps the old config.
    if leader {
        let config = toml::to_string(&run)?;
        files::write_atomic(&dir.join("config.toml"), |w| w.write_all(config.as_bytes()))?;
    }
    let t = &run.training;
    let first_step = trainer.step();
    let stop = args.stop_after.unwrap_or(t.total_steps).min(t.total_steps);
    if leader {
        tracing::info!(
            world = world.world.size(),
            tp = world.tp.size(),
            sequence_parallel = world.tp.sequence_parallel(),
            dp = world.dp.size(),
            backend = transport.backend.name(),
            ?device,
            architecture = run.model.architecture(),
            params = run.model.num_params(),
            trained_on_this_rank = trainer.trained().num_local_params(true),
            "training steps {}..{stop} of {}, {} samples each",
            first_step + 1,
            t.total_steps,
            t.global_batch_size
        );
        log_planned_memory(&run, world.world.size(), device);
    }

    // Before the first step, so that a bad [sampling] table stops the run at once.
    let samples = SampleGrid::prepare(&run, world.world.as_ref(), world.dp.rank() == 0, device)
        .map_err(|e| anyhow!(e))?;
    let mut log = match leader {
        true => Some(RunLog::open(dir, first_step, run.logging.tensorboard)?),
        false => None,
    };
    let start = Instant::now();
    if first_step == 0 {
        let eval = trainer.eval_loss()?;
        if let Some(log) = &mut log {
            log.record(step_record(&trainer, 0, None, Some(eval), start, 0.0))?;
        }
    }

    let layout = match run.checkpoint.format {
        CheckpointFormat::Sharded => CheckpointLayout::Sharded,
        CheckpointFormat::Unified => CheckpointLayout::Unified,
    };
    let writer = CheckpointWriter {
        run_dir: dir,
        layout,
        keep: run.checkpoint.keep,
        tp: &world.tp,
        dp_rank: world.dp.rank(),
        world: world.world.as_ref(),
    };
    // A sharded checkpoint of a sharded optimizer: each rank writes the parts it owns.
    let parts = layout == CheckpointLayout::Sharded;
    let save = |trainer: &Trainer| {
        let state = trainer.checkpoint_state(parts);
        writer.save(&state, trainer.trained().param_specs())
    };

    let bar = if leader {
        ProgressBar::new(t.total_steps)
    } else {
        ProgressBar::hidden()
    };
    if leader {
        bar.set_draw_target(ProgressDrawTarget::stderr());
        bar.set_style(ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps {msg} [{elapsed} < {eta}]",
        )?);
        bar.set_position(first_step);
    }
    let cadence = Cadence::new(&run, stop);
    for step in first_step + 1..=stop {
        flux_data::failpoint::stall("stall", step, world.world.rank());
        let stats = match trainer.train_step() {
            Ok(stats) => stats,
            Err(e @ (StepError::NonFinite(_) | StepError::TooManySkips(..))) => {
                bar.finish_and_clear();
                return Err(stop_for_nonfinite(e, dir, world.world.rank()));
            }
            // A read error on this rank alone: the others may wait in a collective already.
            Err(e @ StepError::Data(_)) => abort_job(&world, e.into()),
        };
        let next = cadence.after(step, stats.skipped);
        let eval = next
            .evaluate
            .then(|| trainer.eval_loss())
            .transpose()
            .unwrap_or_else(|e| abort_job(&world, e.into()));
        bar.inc(1);
        bar.set_message(format!("loss {:.4}", stats.loss));
        if stats.skipped && leader {
            tracing::warn!(
                step,
                loss = stats.loss,
                grad_norm = stats.grad_norm,
                "non-finite loss or gradient norm: update skipped ([training] nonfinite = \"skip\")"
            );
        }
        if next.log {
            let samples_per_s = t.global_batch_size as f64 / stats.seconds;
            let mut r = step_record(&trainer, step, Some(stats.loss), eval, start, samples_per_s);
            (r.lr, r.grad_norm, r.tokens_per_s, r.skipped) = (
                stats.lr,
                stats.grad_norm,
                samples_per_s * stats.tokens_per_sample as f64,
                stats.skipped,
            );
            r.grad_reduce_overlap_s = stats.overlap.map(|o| o.overlapped_s);
            r.host_staged_mib = Some(units::mib(stats.host_staged_bytes));
            tracing::debug!(
                step,
                loss = stats.loss,
                lr = stats.lr,
                grad_norm = stats.grad_norm,
                "step"
            );
            if let Some(log) = &mut log {
                log.record(r)?;
            }
        }
        if let (Some(grid), true) = (&samples, run.sampling.due(step, next.last)) {
            let drawn = grid.render(&trainer).map_err(|e| anyhow!(e))?;
            if let (Some(image), Some(log)) = (drawn, &mut log) {
                log.grid(step, &image, &SampleGrid::path(dir, step))?;
            }
        }
        if next.checkpoint {
            let written = save(&trainer)?;
            tracing::debug!("checkpoint {}", written.display());
        }
        let request = signals.agreed(world.world.as_ref());
        if request != StopRequest::Continue && !next.last {
            bar.finish_and_clear();
            if !next.checkpoint {
                save(&trainer)?;
            }
            return stop_for_signal(request, step, &run, leader);
        }
    }
    bar.finish_and_clear();

    if trainer.step() < t.total_steps {
        if leader {
            println!(
                "stopped at step {} of {}; run the same command again to resume",
                trainer.step(),
                t.total_steps
            );
        }
        return Ok(());
    }
    let finals = trainer.final_weights();
    if let Some(log) = &log {
        let records = log.records();
        plot_loss_curve(records, &dir.join("loss_curve.png")).map_err(anyhow::Error::msg)?;
        for (file, weights) in &finals {
            flux_data::convert::write_tensors(&dir.join(file), weights)?;
        }
        let files: Vec<_> = finals.iter().map(|(f, _)| dir.join(f)).collect();
        summarize(records, start, &files, dir);
    }
    Ok(())
}

/// Report an error only this rank saw and end the whole job (MPI_Abort), since the other ranks
/// may already wait in a collective for this one.
fn abort_job(world: &ParallelWorld, error: anyhow::Error) -> ! {
    eprintln!(
        "error: {error:#} (rank {} of {}; ending the job)",
        world.world.rank(),
        world.world.size()
    );
    world.abort(1)
}

/// Write this rank's diagnostic dump `nonfinite_step_<N>.rank_<R>.json` of a non-finite stop
/// into the run directory and return the error the run stops with.
fn stop_for_nonfinite(error: StepError, dir: &Path, rank: usize) -> anyhow::Error {
    let Some(report) = error.report() else {
        return error.into();
    };
    let path = dir.join(format!(
        "nonfinite_step_{:09}.rank_{rank}.json",
        report.step
    ));
    let written = serde_json::to_string_pretty(report)
        .map_err(anyhow::Error::from)
        .and_then(|json| {
            Ok(files::write_atomic(&path, |w| {
                w.write_all(json.as_bytes())
            })?)
        });
    let error = anyhow::Error::new(error);
    match written {
        Ok(()) => error.context(format!("diagnostics in {}", path.display())),
        Err(e) => error.context(format!("and writing {} failed: {e}", path.display())),
    }
}

/// After the checkpoint of `step`: requeue the Slurm job for the warning signal (when running
/// under Slurm with `[slurm] requeue`; the leader asks Slurm) and end well, or else end with an
/// error (a non-zero exit: the run did not reach `total_steps`) that says how to continue.
fn stop_for_signal(request: StopRequest, step: u64, run: &RunConfig, leader: bool) -> Result<()> {
    let requeue = request == StopRequest::Requeue && run.slurm.requeue;
    if let Some(job) = std::env::var("SLURM_JOB_ID").ok().filter(|_| requeue) {
        if leader {
            println!("signal: checkpoint at step {step} written; requeueing Slurm job {job}");
            slurm::requeue(&job)?;
        }
        return Ok(());
    }
    bail!(
        "stopped by a signal after step {step} of {}; its checkpoint is written: run the same \
         command again to resume",
        run.training.total_steps
    )
}

fn step_record(
    trainer: &Trainer,
    step: u64,
    loss: Option<f64>,
    eval: Option<f64>,
    start: Instant,
    sps: f64,
) -> StepRecord {
    StepRecord {
        step,
        loss,
        eval_loss: eval,
        lr: 0.0,
        grad_norm: 0.0,
        samples_per_s: sps,
        tokens_per_s: 0.0,
        skipped: false,
        peak_memory_mib: trainer.peak_memory_mib(),
        peak_tensor_mib: trainer.peak_tensor_mib(),
        grad_reduce_overlap_s: None,
        host_staged_mib: None,
        elapsed_s: start.elapsed().as_secs_f64(),
    }
}

fn summarize(records: &[StepRecord], start: Instant, weights: &[PathBuf], dir: &Path) {
    let eval: Vec<f64> = records.iter().filter_map(|r| r.eval_loss).collect();
    let (first, last) = (
        eval.first().copied().unwrap_or(f64::NAN),
        eval.last().copied().unwrap_or(f64::NAN),
    );
    let steps = records.last().map_or(0, |r| r.step);
    println!(
        "steps             {steps} ({:.1} s in this process)",
        start.elapsed().as_secs_f64()
    );
    println!(
        "held-out loss     {first:.4} → {last:.4} ({:+.1}%)",
        100.0 * (last - first) / first
    );
    println!("held-out curve    {}", sparkline(&eval));
    println!("metrics           {}", dir.join("metrics.jsonl").display());
    println!("loss curve        {}", dir.join("loss_curve.png").display());
    for file in weights {
        println!("weights           {}", file.display());
    }
}

/// The values as a row of block characters scaled between their minimum and maximum.
fn sparkline(values: &[f64]) -> String {
    const BLOCKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let (lo, hi) = values
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    let span = (hi - lo).max(1e-12);
    values
        .iter()
        .map(|v| BLOCKS[(((v - lo) / span) * 7.0).round() as usize])
        .collect()
}
