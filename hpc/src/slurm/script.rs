//! The batch script `flux-hpc sbatch` submits: `#SBATCH` options sorted by name, the environment,
//! one `flux-hpc train` per task through the configured launcher, and the signal forwarding that
//! turns Slurm's warning into a checkpoint and a requeue.
//!
//! Every value from the config or the command line is shell-quoted (`shlex`), and values with a
//! newline or NUL are refused, so no value can run as a command however it is written.

use std::path::Path;

use crate::slurm::config::{Launcher, SlurmConfig};

/// Everything the script needs besides `[slurm]`.
#[derive(Debug, Clone)]
pub struct JobSpec<'a> {
    /// The `[slurm]` table.
    pub slurm: &'a SlurmConfig,
    /// The run config, absolute.
    pub config: &'a Path,
    /// `--set` overrides given at submission, passed on to every task.
    pub overrides: &'a [String],
    /// The run directory (`checkpoint.dir`), absolute; default logs go to `<run dir>/slurm/`.
    pub run_dir: &'a Path,
    /// Directory the tasks start in, absolute.
    pub workdir: &'a Path,
    /// The `flux-hpc` binary the tasks run.
    pub binary: &'a str,
    /// Extra overrides per array task (empty: not an array job).
    pub array_tasks: &'a [Vec<String>],
    /// A line saying where the script came from (a comment).
    pub origin: &'a str,
}

/// `value` quoted for bash; fails naming `what` when it holds a newline or NUL.
pub fn quote(value: &str, what: &str) -> Result<String, String> {
    if value.contains(['\n', '\r', '\0']) {
        return Err(format!(
            "{what}: {value:?} contains a newline or NUL, which cannot go into a batch script"
        ));
    }
    shlex::try_quote(value)
        .map(|q| q.into_owned())
        .map_err(|e| format!("{what}: {e}"))
}

fn path_str<'p>(path: &'p Path, what: &str) -> Result<&'p str, String> {
    path.to_str()
        .ok_or_else(|| format!("{what}: {} is not UTF-8", path.display()))
}

/// The `#SBATCH` options, sorted by name.
fn directives(job: &JobSpec) -> Result<Vec<String>, String> {
    let s = job.slurm;
    let run_dir = path_str(job.run_dir, "checkpoint.dir")?;
    let pattern = if job.array_tasks.is_empty() {
        "%j"
    } else {
        "%A_%a"
    };
    let output = s
        .output
        .clone()
        .unwrap_or_else(|| format!("{run_dir}/slurm/{pattern}.out"));
    let mut options: Vec<(&str, Option<String>)> = vec![
        ("cpus-per-task", Some(s.cpus_per_task.to_string())),
        ("job-name", Some(s.job_name.clone())),
        ("nodes", Some(s.nodes.to_string())),
        ("ntasks-per-node", Some(s.ntasks_per_node.to_string())),
        ("open-mode", Some("append".into())),
        ("output", Some(output)),
        (
            "signal",
            Some(format!("B:{}@{}", s.signal, s.signal_lead_s)),
        ),
        ("time", Some(s.time.clone())),
    ];
    let optional = s
        .passthrough_options()
        .map(|(field, value)| (field.replace('_', "-"), value));
    options.extend(
        optional
            .iter()
            .filter_map(|(k, v)| (*v).clone().map(|v| (k.as_str(), Some(v)))),
    );
    if s.gpus_per_node > 0 {
        options.push(("gpus-per-node", Some(s.gpus_per_node.to_string())));
    }
    if s.exclusive {
        options.push(("exclusive", None));
    }
    options.push(if s.requeue {
        ("requeue", None)
    } else {
        ("no-requeue", None)
    });
    if !job.array_tasks.is_empty() {
        let mut range = format!("0-{}", job.array_tasks.len() - 1);
        if s.array_parallelism > 0 {
            range += &format!("%{}", s.array_parallelism);
        }
        options.push(("array", Some(range)));
    }
    options.sort_by(|a, b| a.0.cmp(b.0));
    // `None` marks a flag without a value.
    options
        .into_iter()
        .map(|(name, value)| match value {
            Some(v) => Ok(format!(
                "#SBATCH --{name}={}",
                quote(&v, &format!("slurm {name}"))?
            )),
            None => Ok(format!("#SBATCH --{name}")),
        })
        .collect()
}

/// The command that starts the ranks (without the train arguments).
fn launcher(s: &SlurmConfig) -> Result<Vec<String>, String> {
    let mut cmd: Vec<String> = match s.launcher {
        Launcher::SrunPmix | Launcher::SrunPmi2 => {
            let mpi = if s.launcher == Launcher::SrunPmix {
                "pmix"
            } else {
                "pmi2"
            };
            vec![
                "srun".into(),
                format!("--mpi={mpi}"),
                "--kill-on-bad-exit=1".into(),
                "--wait=60".into(),
            ]
        }
        Launcher::Mpirun => vec![
            "mpirun".into(),
            "-np".into(),
            "\"$SLURM_NTASKS\"".into(),
            "--bind-to".into(),
            "none".into(),
        ],
    };
    if let Some(image) = &s.container_image {
        cmd.push(format!(
            "--container-image={}",
            quote(image, "slurm.container_image")?
        ));
    }
    Ok(cmd)
}

/// Render the batch script of `job`.
pub fn render(job: &JobSpec) -> Result<String, String> {
    let s = job.slurm;
    let mut out = vec![
        "#!/bin/bash".to_string(),
        format!("# {}", job.origin.replace(['\n', '\r', '\0'], " ")),
        "# Submit again with: sbatch <this file>".to_string(),
    ];
    out.extend(directives(job)?);
    out.push(String::new());
    out.push("set -uo pipefail".into());
    for m in &s.modules {
        out.push(format!("module load {}", quote(m, "slurm.modules")?));
    }
    if s.launcher == Launcher::Mpirun {
        out.push("export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1".into());
    }
    for (k, v) in &s.env {
        out.push(format!(
            "export {k}={}",
            quote(v, &format!("slurm.env.{k}"))?
        ));
    }
    out.push("export OMP_NUM_THREADS=\"${SLURM_CPUS_PER_TASK:-1}\"".into());
    out.push(format!(
        "cd {} || exit 1",
        quote(
            path_str(job.workdir, "working directory")?,
            "working directory"
        )?
    ));
    out.push(String::new());
    out.push("overrides=()".into());
    if !job.array_tasks.is_empty() {
        out.push("case \"${SLURM_ARRAY_TASK_ID:-}\" in".into());
        for (i, task) in job.array_tasks.iter().enumerate() {
            let sets = task
                .iter()
                .map(|o| quote(o, &format!("slurm.sweep[{i}]")).map(|q| format!("--set {q}")))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(format!("    {i}) overrides=({}) ;;", sets.join(" ")));
        }
        out.push("esac".into());
    }
    let mut train = launcher(s)?;
    train.push(quote(job.binary, "slurm.binary")?);
    train.push("train".into());
    train.push(quote(path_str(job.config, "config")?, "config")?);
    for o in job.overrides {
        train.push("--set".into());
        train.push(quote(o, "--set")?);
    }
    train.push("${overrides[@]+\"${overrides[@]}\"}".into());
    let signal = &s.signal;
    out.extend([
        "echo \"[flux-hpc] job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}: ${SLURM_NTASKS} task(s)\"".to_string(),
        format!("{} &", train.join(" ")),
        "child=$!".into(),
        format!("# Slurm sends SIG{signal} to this shell before the time limit or on preemption; the ranks"),
        "# take it from here: finish the step, checkpoint, requeue the job, exit.".into(),
        format!("trap 'echo \"[flux-hpc] SIG{signal}: asking the ranks to checkpoint\"; kill -{signal} \"$child\" 2>/dev/null' {signal}"),
        "while true; do".into(),
        "    wait \"$child\"".into(),
        "    status=$?".into(),
        "    kill -0 \"$child\" 2>/dev/null || break  # still running: the wait was cut short by the trap".into(),
        "done".into(),
        "exit \"$status\"".into(),
    ]);
    Ok(out.join("\n") + "\n")
}
