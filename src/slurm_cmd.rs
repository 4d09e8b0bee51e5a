//! `flux-hpc sbatch | status | logs | cancel`: a run as a Slurm job, and `flux-hpc launch`: the
//! same run under a local `mpirun`.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use flux_cluster::slurm::{self, render, JobSpec};
use flux_data::checkpoint;
use flux_model::activations::Kernels;
use flux_train::logging::units;
use flux_train::memory_plan::{predict, Layout};
use flux_train::RunConfig;
use serde::{Deserialize, Serialize};

use crate::ConfigArgs;

/// One submitted job, as recorded in `<run dir>/slurm/jobs.jsonl`.
#[derive(Debug, Serialize, Deserialize)]
struct JobRecord {
    job_id: String,
    script: PathBuf,
    submitted_unix: u64,
}

/// Arguments of `flux-hpc sbatch`.
#[derive(Debug, Args)]
pub struct SbatchArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Print the batch script instead of writing and submitting it.
    #[arg(long)]
    dry_run: bool,
    /// Print only the job id (for scripts).
    #[arg(long)]
    parsable: bool,
}

/// Arguments of `flux-hpc status`, `logs` and `cancel`.
#[derive(Debug, Args)]
pub struct JobArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// The job (default: the run's latest submission).
    #[arg(long)]
    job: Option<String>,
}

/// Arguments of `flux-hpc logs`.
#[derive(Debug, Args)]
pub struct LogsArgs {
    #[command(flatten)]
    job: JobArgs,
    /// Lines from the end of each log (0: all).
    #[arg(short = 'n', long, default_value_t = 40)]
    lines: usize,
}

/// Arguments of `flux-hpc cancel`.
#[derive(Debug, Args)]
pub struct CancelArgs {
    #[command(flatten)]
    job: JobArgs,
    /// Say what would be cancelled without cancelling.
    #[arg(long)]
    dry_run: bool,
}

/// Arguments of `flux-hpc launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// MPI ranks (at least 1).
    #[arg(short = 'n', long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    ranks: u32,
    /// Print the mpirun command instead of running it.
    #[arg(long)]
    dry_run: bool,
}

fn absolute(path: &Path) -> Result<PathBuf> {
    Ok(if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    })
}

fn load(config: &ConfigArgs) -> Result<(RunConfig, PathBuf)> {
    let run = RunConfig::load(&config.config, &config.overrides)?;
    let run_dir = absolute(&run.checkpoint.dir)?;
    Ok((run, run_dir))
}

/// `checkpoint.dir=<path>` as a `--set` override (a TOML string).
fn dir_override(dir: &Path) -> String {
    let text = toml::Value::String(dir.display().to_string()).to_string();
    format!("checkpoint.dir={text}")
}

/// Refuse, before the job waits in the queue, a run whose layout its ranks cannot take (a TP size
/// that does not divide them, sharding with one replica, a batch that does not split), and report the planned peak of each
/// rank's tensors (`flux-hpc plan`). `what` names the run (a sweep task).
fn check_layout(run: &RunConfig, what: &str) -> Result<()> {
    let ranks = (run.slurm.nodes * run.slurm.ntasks_per_node) as usize;
    let layout = Layout::of(run, ranks).map_err(|e| {
        anyhow!(
            "{what}: the job's {ranks} ranks (slurm.nodes × slurm.ntasks_per_node) cannot run \
             it: {e}"
        )
    })?;
    let kernels = Kernels::on_gpu(run.slurm.gpus_per_node > 0);
    if let Ok(memory) = predict(run, &layout, kernels) {
        eprintln!(
            "{what}: planned peak of each rank's tensors {:.2} GiB, during the {} (flux-hpc plan)",
            units::gib(memory.peak()),
            memory.peak_phase().phase.name()
        );
    }
    Ok(())
}

/// Render, write and submit the run's batch script.
pub fn sbatch(args: SbatchArgs) -> Result<()> {
    let (run, run_dir) = load(&args.config)?;
    if run.slurm.sweep.is_empty() {
        check_layout(&run, "the run")?;
    }
    for (i, task) in run.slurm.sweep.iter().enumerate() {
        let mut overrides = args.config.overrides.clone();
        overrides.extend(task.iter().cloned());
        let task_run = RunConfig::load(&args.config.config, &overrides)?;
        check_layout(&task_run, &format!("sweep task {i}"))?;
    }
    let config = absolute(&args.config.config)?;
    let workdir = std::env::current_dir()?;
    let binary = match &run.slurm.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.display().to_string(),
    };
    let array_tasks: Vec<Vec<String>> = run
        .slurm
        .sweep
        .iter()
        .enumerate()
        .map(|(i, task)| {
            let mut task = task.clone();
            task.push(dir_override(&run_dir.join(format!("sweep_{i}"))));
            task
        })
        .collect();
    let submitted = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let origin = format!(
        "written by `flux-hpc sbatch {}` at unix time {submitted}",
        config.display()
    );
    let job = JobSpec {
        slurm: &run.slurm,
        config: &config,
        overrides: &args.config.overrides,
        run_dir: &run_dir,
        workdir: &workdir,
        binary: &binary,
        array_tasks: &array_tasks,
        origin: &origin,
    };
    let script = render(&job).map_err(|e| anyhow!(e))?;
    if args.dry_run {
        print!("{script}");
        return Ok(());
    }
    let slurm_dir = run_dir.join("slurm");
    std::fs::create_dir_all(&slurm_dir)
        .with_context(|| format!("cannot create {}", slurm_dir.display()))?;
    let path = slurm_dir.join(format!("job_{submitted}.sbatch"));
    std::fs::write(&path, &script)?;
    let job_id = slurm::submit(&path)?;
    let record = JobRecord {
        job_id: job_id.clone(),
        script: path.clone(),
        submitted_unix: submitted,
    };
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(slurm_dir.join("jobs.jsonl"))?;
    writeln!(log, "{}", serde_json::to_string(&record)?)?;
    if args.parsable {
        println!("{job_id}");
    } else {
        println!("submitted job {job_id}");
        println!("script            {}", path.display());
        println!("run directory     {}", run_dir.display());
        println!(
            "follow with       flux-hpc status {0}   /   flux-hpc logs {0}",
            args.config.config.display()
        );
    }
    Ok(())
}

fn records(run_dir: &Path) -> Result<Vec<JobRecord>> {
    let path = run_dir.join("slurm/jobs.jsonl");
    let file = std::fs::File::open(&path).with_context(|| {
        format!(
            "no jobs were submitted for {} (no {})",
            run_dir.display(),
            path.display()
        )
    })?;
    std::io::BufReader::new(file)
        .lines()
        .map(|l| Ok(serde_json::from_str(&l?)?))
        .collect()
}

/// The job ids `args` selects: `--job`, or the run's latest submission.
fn selected(args: &JobArgs, run_dir: &Path) -> Result<String> {
    match &args.job {
        Some(j) => Ok(j.clone()),
        None => records(run_dir)?
            .pop()
            .map(|r| r.job_id)
            .ok_or_else(|| anyhow!("no jobs recorded for {}", run_dir.display())),
    }
}

/// Print the state of the run's jobs and its progress.
pub fn status(args: JobArgs) -> Result<()> {
    let (run, run_dir) = load(&args.config)?;
    let ids: Vec<String> = match &args.job {
        Some(j) => vec![j.clone()],
        None => records(&run_dir)?.into_iter().map(|r| r.job_id).collect(),
    };
    println!(
        "{:<12} {:<12} {:>11} {:>8}  REASON",
        "JOB", "STATE", "RUNTIME", "RESTARTS"
    );
    for id in ids.iter().rev().take(5).rev() {
        match slurm::show_job(id) {
            Ok(jobs) => {
                for j in jobs {
                    println!(
                        "{:<12} {:<12} {:>11} {:>8}  {}",
                        j.get("JobId"),
                        j.get("JobState"),
                        j.get("RunTime"),
                        j.get("Restarts"),
                        j.get("Reason")
                    );
                }
            }
            Err(e) => println!("{id:<12} unknown: {e}"),
        }
    }
    let latest = checkpoint::latest(&run_dir)?;
    println!(
        "checkpoint        {}",
        latest.map_or("none yet".into(), |p| p.display().to_string())
    );
    let metrics = run_dir.join("metrics.jsonl");
    if let Ok(text) = std::fs::read_to_string(&metrics) {
        if let Some(last) = text.lines().last() {
            let v: serde_json::Value = serde_json::from_str(last)?;
            println!(
                "progress          step {} of {}",
                v["step"], run.training.total_steps
            );
        }
    }
    Ok(())
}

/// Print the end of the job's output files.
pub fn logs(args: LogsArgs) -> Result<()> {
    let (_, run_dir) = load(&args.job.config)?;
    let id = selected(&args.job, &run_dir)?;
    let jobs = slurm::show_job(&id)?;
    if jobs.is_empty() {
        bail!("slurmctld knows no job {id}");
    }
    for job in jobs {
        let mut paths = vec![job.get("StdOut").to_string()];
        if job.get("StdErr") != job.get("StdOut") {
            paths.push(job.get("StdErr").to_string());
        }
        for path in paths.iter().filter(|p| !p.is_empty()) {
            println!("==> {path} (job {}) <==", job.get("JobId"));
            let text =
                std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
            let lines: Vec<&str> = text.lines().collect();
            let from = match args.lines {
                0 => 0,
                n => lines.len().saturating_sub(n),
            };
            for line in &lines[from..] {
                println!("{line}");
            }
        }
    }
    Ok(())
}

/// Cancel the job (`scancel`).
pub fn cancel(args: CancelArgs) -> Result<()> {
    let (_, run_dir) = load(&args.job.config)?;
    let id = selected(&args.job, &run_dir)?;
    if args.dry_run {
        println!("would run: scancel {id}");
        return Ok(());
    }
    slurm::cancel(&id, None)?;
    println!("cancelled job {id}");
    Ok(())
}

/// Run the training under a local `mpirun -np N`.
pub fn launch(args: LaunchArgs) -> Result<()> {
    RunConfig::load(&args.config.config, &args.config.overrides)?;
    let exe = std::env::current_exe()?;
    let mut cmd: Vec<String> = vec!["mpirun".into(), "-np".into(), args.ranks.to_string()];
    if is_root() {
        cmd.push("--allow-run-as-root".into());
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.ranks as usize > cores {
        cmd.push("--oversubscribe".into());
    }
    cmd.extend([exe.display().to_string(), "train".into()]);
    cmd.push(args.config.config.display().to_string());
    for o in &args.config.overrides {
        cmd.extend(["--set".into(), o.clone()]);
    }
    if args.dry_run {
        let quoted: Vec<String> = cmd
            .iter()
            .map(|c| slurm::quote(c, "argument").map_err(|e| anyhow!(e)))
            .collect::<Result<_>>()?;
        println!("{}", quoted.join(" "));
        return Ok(());
    }
    let status = Command::new(&cmd[0])
        .args(&cmd[1..])
        .status()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => anyhow!(
                "mpirun was not found on PATH: install OpenMPI (scripts/setup.sh installs openmpi-bin)"
            ),
            _ => anyhow!("starting mpirun: {e}"),
        })?;
    if !status.success() {
        bail!("mpirun exited with {status}");
    }
    Ok(())
}

/// Whether this process runs as root (`/proc/self` belongs to the process's user).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}
