//! `flux-hpc train`: flow-matching training on one process or many (under mpirun or srun), with
//! checkpoints and resume.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use flux_cluster::StopSignals;
use flux_train::logging::metrics::StepRecord;
use flux_train::{Launch, Outcome, Progress, RunConfig, RunOptions, TrainingRun};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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

/// Train, resuming from `[checkpoint] dir`'s `latest` when there is one; writes checkpoints,
/// `metrics.jsonl`, `loss_curve.png`, `config.toml` and `final.safetensors` (under `[lora]`:
/// `final_lora.safetensors`) into that directory.
pub fn run(args: TrainArgs) -> Result<()> {
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let signals = StopSignals::install(&run.slurm.signal).context("installing signal handlers")?;
    let p = &run.parallelism;
    let launch = Launch::join(p, args.device.device, p.group_sizes(), None)?;
    let leader = launch.world.world.rank() == 0;
    let options = RunOptions {
        stop_after: args.stop_after,
        force: args.force,
    };
    let training = TrainingRun::start(&run, &launch, &signals, options)?;
    let mut bar = Bar::new(leader)?;
    match training.run(&mut bar)? {
        Outcome::Finished {
            weights,
            records,
            seconds,
        } if leader => summarize(&records, seconds, &weights, &run.checkpoint.dir),
        Outcome::Paused { step, total_steps } if leader => {
            println!(
                "stopped at step {step} of {total_steps}; run the same command again to resume"
            )
        }
        // Logged by the run before it asked Slurm: the job may end at any moment after.
        Outcome::Requeued { .. } | Outcome::Finished { .. } | Outcome::Paused { .. } => {}
    }
    Ok(())
}

/// The leader's progress bar on stderr (hidden on the other ranks).
struct Bar(ProgressBar);

impl Bar {
    fn new(leader: bool) -> Result<Self> {
        if !leader {
            return Ok(Self(ProgressBar::hidden()));
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps {msg} [{elapsed} < {eta}]",
        )?);
        Ok(Self(bar))
    }
}

impl Progress for Bar {
    fn started(&mut self, first_step: u64, total_steps: u64) {
        self.0.set_length(total_steps);
        self.0.set_position(first_step);
    }

    fn stepped(&mut self, _step: u64, loss: f64) {
        self.0.inc(1);
        self.0.set_message(format!("loss {loss:.4}"));
    }

    fn ended(&mut self) {
        self.0.finish_and_clear();
    }
}

fn summarize(records: &[StepRecord], seconds: f64, weights: &[PathBuf], dir: &Path) {
    let eval: Vec<f64> = records.iter().filter_map(|r| r.eval_loss).collect();
    let (first, last) = (
        eval.first().copied().unwrap_or(f64::NAN),
        eval.last().copied().unwrap_or(f64::NAN),
    );
    let steps = records.last().map_or(0, |r| r.step);
    println!("steps             {steps} ({seconds:.1} s in this process)");
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
