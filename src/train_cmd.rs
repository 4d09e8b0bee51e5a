//! `flux-hpc train`: flow-matching training on one process or many (under mpirun or srun).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use flux_cluster::{ParallelWorld, Placement};
use flux_train::metrics::{plot_loss_curve, MetricsWriter, StepRecord};
use flux_train::{RunConfig, Trainer};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tch::Tensor;

use crate::{ConfigArgs, DeviceArgs};

/// Arguments of `flux-hpc train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Train, writing `metrics.jsonl`, `loss_curve.png`, `config.toml` and `final.safetensors` into
/// the run directory (`[checkpoint] dir`).
pub fn run(args: TrainArgs) -> Result<()> {
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let placement = Placement::from_env()?;
    let world =
        ParallelWorld::from_launch(&placement, run.parallelism.tensor_parallel_size as usize)?;
    tch::set_num_threads(placement.threads() as i32);
    let device = args.device.device.resolve(placement.local_rank)?;
    let leader = world.world.rank() == 0;
    let dir = &run.checkpoint.dir;
    if leader {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create run directory {}", dir.display()))?;
        std::fs::write(dir.join("config.toml"), toml::to_string(&run)?)?;
    }

    let mut trainer = Trainer::new(&run, device, world.tp.clone(), world.dp.as_ref())?;
    let t = &run.training;
    if leader {
        tracing::info!(
            world = world.world.size(),
            tp = world.tp.size(),
            dp = world.dp.size(),
            ?device,
            params = run.model.num_params(),
            "training {} steps of {} samples",
            t.total_steps,
            t.global_batch_size
        );
    }
    let mut metrics = if leader {
        Some(MetricsWriter::create(&dir.join("metrics.jsonl"))?)
    } else {
        None
    };
    let mut records = Vec::new();
    let start = Instant::now();
    let first_eval = trainer.eval_loss();
    let mut record = |r: StepRecord, metrics: &mut Option<MetricsWriter>| -> Result<()> {
        if let Some(m) = metrics {
            m.write(&r)?;
        }
        records.push(r);
        Ok(())
    };
    record(
        step_record(&trainer, 0, None, Some(first_eval), start, 0.0),
        &mut metrics,
    )?;

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
    }
    let tokens = trainer.tokens_per_sample() as f64;
    let mut last_eval = first_eval;
    for step in 1..=t.total_steps {
        let stats = trainer.train_step();
        let last = step == t.total_steps;
        let eval = if last || (t.eval_interval > 0 && step % t.eval_interval == 0) {
            last_eval = trainer.eval_loss();
            Some(last_eval)
        } else {
            None
        };
        bar.inc(1);
        bar.set_message(format!("loss {:.4}", stats.loss));
        if last || step % t.log_interval == 0 || eval.is_some() {
            let samples_per_s = t.global_batch_size as f64 / stats.seconds;
            let mut r = step_record(&trainer, step, Some(stats.loss), eval, start, samples_per_s);
            (r.lr, r.grad_norm, r.tokens_per_s) =
                (stats.lr, stats.grad_norm, samples_per_s * tokens);
            tracing::debug!(
                step,
                loss = stats.loss,
                lr = stats.lr,
                grad_norm = stats.grad_norm,
                "step"
            );
            record(r, &mut metrics)?;
        }
    }
    bar.finish_and_clear();

    let weights: Vec<(String, Tensor)> = trainer.model().store.gather_logical(false);
    if leader {
        plot_loss_curve(&records, &dir.join("loss_curve.png")).map_err(anyhow::Error::msg)?;
        Tensor::write_safetensors(&weights, dir.join("final.safetensors"))?;
        summarize(&records, first_eval, last_eval, start, dir);
    }
    Ok(())
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
        peak_memory_mib: trainer.peak_memory_mib(),
        elapsed_s: start.elapsed().as_secs_f64(),
    }
}

fn summarize(records: &[StepRecord], first: f64, last: f64, start: Instant, dir: &Path) {
    let steps = records.last().map_or(0, |r| r.step);
    let change = 100.0 * (last - first) / first;
    println!(
        "steps             {steps} in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    println!("held-out loss     {first:.4} → {last:.4} ({change:+.1}%)");
    let eval: Vec<f64> = records.iter().filter_map(|r| r.eval_loss).collect();
    println!("held-out curve    {}", sparkline(&eval));
    println!("metrics           {}", dir.join("metrics.jsonl").display());
    println!("loss curve        {}", dir.join("loss_curve.png").display());
    println!(
        "weights           {}",
        dir.join("final.safetensors").display()
    );
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
