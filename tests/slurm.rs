//! `flux-hpc sbatch` against a real one-node Slurm (scripts/slurm-local.sh: munged, slurmctld,
//! slurmd on this machine): jobs complete with checkpoints and metrics, hostile values stay inert,
//! a warning signal checkpoints, requeues and resumes with a continuous loss log, sweeps become
//! array jobs, cancel cancels; and `flux-hpc launch` runs the same training under local mpirun.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{flux_hpc, flux_hpc_with, ok, records, temp_dir};
use flux_cluster::slurm::parse_job_records;

/// Start the local cluster if it is not running; its `SLURM_CONF`.
fn cluster() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/slurm-local.sh"))
        .arg("start")
        .output()
        .expect("bash runs");
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .trim()
        .strip_prefix("export SLURM_CONF=")
        .expect("the script prints SLURM_CONF")
        .to_string()
}

/// `checkpoint.dir="<dir>"` as a `--set` value.
fn dir_set(dir: &Path) -> String {
    format!("checkpoint.dir={}", toml_string(&dir.display().to_string()))
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A setting every job of these tests uses: this container lacks the cross-memory attach
/// OpenMPI's shared-memory transport uses by default.
const JOB: [&str; 1] = ["slurm.env.OMPI_MCA_btl_vader_single_copy_mechanism=\"none\""];

/// `flux-hpc sbatch` with `sets` as overrides (the launcher is `srun --mpi=pmix` unless a test
/// sets another); returns the job id.
fn submit(conf: &str, sets: &[&str]) -> String {
    let mut args = vec!["sbatch", "configs/flux_tiny.toml", "--parsable"];
    for s in JOB.iter().chain(sets) {
        args.extend(["--set", s]);
    }
    let out = flux_hpc_with(&args, &[("SLURM_CONF", conf)]);
    ok(&out);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Field `key` of the job's `scontrol show job` record.
fn job_field(conf: &str, job: &str, key: &str) -> String {
    let out = Command::new("scontrol")
        .args(["show", "job", "-o", job])
        .env("SLURM_CONF", conf)
        .output()
        .expect("scontrol runs");
    let records = parse_job_records(&String::from_utf8_lossy(&out.stdout));
    records
        .first()
        .map_or(String::new(), |r| r.get(key).to_string())
}

/// Wait (at most 5 minutes) until `done(state)`; returns the state.
fn wait_for(conf: &str, job: &str, done: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        let state = job_field(conf, job, "JobState");
        if done(&state) {
            return state;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "job {job} still {state} after 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn finished(state: &str) -> bool {
    matches!(
        state,
        "COMPLETED" | "FAILED" | "CANCELLED" | "TIMEOUT" | "NODE_FAIL" | "OUT_OF_MEMORY"
    )
}

#[test]
fn the_dry_run_script_quotes_every_value_and_parses_as_bash() {
    let pwned = temp_dir("pwned-dry");
    let hostile = format!("$(touch {})", pwned.display());
    let name = format!("slurm.job_name={}", toml_string(&hostile));
    let greeting = format!("`touch {0}`; '$(touch {0})' \\", pwned.display());
    let env = format!("slurm.env.GREETING={}", toml_string(&greeting));
    let out = flux_hpc(&[
        "sbatch",
        "configs/flux_tiny.toml",
        "--dry-run",
        "--set",
        &name,
        "--set",
        &env,
        "--set",
        "slurm.partition=\"gpu\"",
        "--set",
        "slurm.gpus_per_node=8",
    ]);
    ok(&out);
    let script = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        script.contains(&format!("#SBATCH --job-name='{hostile}'")),
        "{script}"
    );
    // bash reads the exported value back unchanged, and running the line runs nothing.
    let export = script
        .lines()
        .find(|l| l.starts_with("export GREETING="))
        .unwrap();
    let echoed = Command::new("bash")
        .arg("-c")
        .arg(format!("{export}; printf %s \"$GREETING\""))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&echoed.stdout), greeting);
    let directives: Vec<&str> = script
        .lines()
        .filter(|l| l.starts_with("#SBATCH"))
        .collect();
    let mut sorted = directives.clone();
    sorted.sort();
    assert_eq!(directives, sorted, "options are sorted");
    assert!(directives.contains(&"#SBATCH --gpus-per-node=8"));
    assert!(directives.contains(&"#SBATCH --signal=B:USR1@120"));
    let file = temp_dir("dry-script");
    std::fs::write(&file, &script).unwrap();
    let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    ok(&check);
    assert!(!pwned.exists());
    std::fs::remove_file(file).unwrap();
}

#[test]
fn a_newline_in_a_value_is_refused_naming_the_field() {
    let out = flux_hpc(&[
        "sbatch",
        "configs/flux_tiny.toml",
        "--dry-run",
        "--set",
        "slurm.job_name=\"a\\nb\"",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("slurm.job_name: \"a\\nb\" contains a newline"),
        "{stderr}"
    );
}

#[test]
fn a_layout_the_jobs_ranks_cannot_take_is_refused_before_submitting() {
    // One node of 8 GPUs at TP 8 leaves one replica for the distributed optimizer.
    let out = flux_hpc(&[
        "sbatch",
        "configs/flux_12b.toml",
        "--dry-run",
        "--set",
        "slurm.nodes=1",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the job's 8 ranks (slurm.nodes × slurm.ntasks_per_node) cannot run it: parallelism.sharding"),
        "{stderr}"
    );
    // Its 16 nodes can; the plan's peak is reported beside the script.
    let out = flux_hpc(&["sbatch", "configs/flux_12b.toml", "--dry-run"]);
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("planned peak of each rank's tensors 30.80 GiB"),
        "{stderr}"
    );
}

#[test]
fn a_missing_slurm_command_is_a_clear_error() {
    let dir = temp_dir("no-sbatch");
    let set = dir_set(&dir);
    let out = flux_hpc_with(
        &["sbatch", "configs/flux_tiny.toml", "--set", &set],
        &[("PATH", "/nonexistent")],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("`sbatch` was not found on PATH"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_job_trains_to_completion_and_hostile_values_stay_inert() {
    let conf = cluster();
    let base = temp_dir("slurm-job");
    let pwned: Vec<PathBuf> = (0..3).map(|i| base.join(format!("pwned{i}"))).collect();
    // A run directory whose name is a command substitution and holds quotes and a space.
    let run_dir = base.join(format!("run $(touch {}) 'x'", pwned[0].display()));
    let name = format!(
        "slurm.job_name={}",
        toml_string(&format!("$(touch {})", pwned[1].display()))
    );
    let env = format!(
        "slurm.env.NOTE={}",
        toml_string(&format!("`touch {}`", pwned[2].display()))
    );
    let job = submit(
        &conf,
        &[
            &dir_set(&run_dir),
            &name,
            &env,
            "slurm.ntasks_per_node=2",
            "slurm.launcher=\"mpirun\"",
            "training.total_steps=12",
            "training.log_interval=1",
            "checkpoint.interval=6",
        ],
    );
    assert_eq!(wait_for(&conf, &job, finished), "COMPLETED");
    assert!(run_dir.join("step_000000012").is_dir());
    assert!(run_dir.join("step_000000006").is_dir());
    let rs = records(&run_dir);
    assert_eq!(rs.last().unwrap()["step"], 12);
    for p in &pwned {
        assert!(
            !p.exists(),
            "{} was created: a value ran as a command",
            p.display()
        );
    }
    assert_eq!(
        job_field(&conf, &job, "JobName"),
        format!("$(touch {})", pwned[1].display())
    );
    let set = dir_set(&run_dir);
    let logs = flux_hpc_with(
        &["logs", "configs/flux_tiny.toml", "--set", &set],
        &[("SLURM_CONF", &conf)],
    );
    ok(&logs);
    let text = String::from_utf8_lossy(&logs.stdout);
    assert!(
        text.contains(&format!("[flux-hpc] job {job} (restart 0) on")),
        "{text}"
    );
    assert!(text.contains("2 task(s)"), "{text}");
    let status = flux_hpc_with(
        &["status", "configs/flux_tiny.toml", "--set", &set],
        &[("SLURM_CONF", &conf)],
    );
    ok(&status);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("COMPLETED") && text.contains("step_000000012"),
        "{text}"
    );
    std::fs::remove_dir_all(base).unwrap();
}

#[test]
fn a_warning_signal_checkpoints_requeues_and_resumes_with_a_continuous_log() {
    let conf = cluster();
    let run_dir = temp_dir("slurm-preempt");
    let job = submit(
        &conf,
        &[
            &dir_set(&run_dir),
            "slurm.ntasks_per_node=2",
            "training.total_steps=400",
            "training.log_interval=1",
        ],
    );
    // Wait until training is under way, then send what Slurm sends before a time limit.
    let metrics = run_dir.join("metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 20 {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "training never started"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let signal = Command::new("scancel")
        .args(["--signal=USR1", "--batch", &job])
        .env("SLURM_CONF", &conf)
        .output()
        .unwrap();
    ok(&signal);
    assert_eq!(wait_for(&conf, &job, finished), "COMPLETED");
    assert_eq!(job_field(&conf, &job, "Restarts"), "1");
    let log = std::fs::read_to_string(run_dir.join(format!("slurm/{job}.out"))).unwrap();
    assert!(log.contains("requeueing Slurm job"), "{log}");
    assert!(
        log.contains(&format!("[flux-hpc] job {job} (restart 1)")),
        "{log}"
    );
    // The resumed run continued from the checkpoint: every step logged exactly once.
    let steps: Vec<u64> = records(&run_dir)
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..=400).collect::<Vec<_>>());
    std::fs::remove_dir_all(run_dir).unwrap();
}

#[test]
fn a_sweep_runs_one_array_task_per_override_list() {
    let conf = cluster();
    let run_dir = temp_dir("slurm-sweep");
    let job = submit(
        &conf,
        &[
            &dir_set(&run_dir),
            "training.total_steps=3",
            "slurm.sweep=[[\"optimization.learning_rate=1e-3\"], [\"optimization.learning_rate=3e-3\"]]",
        ],
    );
    for task in 0..2 {
        let id = format!("{job}_{task}");
        assert_eq!(wait_for(&conf, &id, finished), "COMPLETED", "task {task}");
        let dir = run_dir.join(format!("sweep_{task}"));
        let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
        let lr = if task == 0 { "0.001" } else { "0.003" };
        assert!(
            config.contains(&format!("learning_rate = {lr}")),
            "{config}"
        );
        assert!(dir.join("step_000000003").is_dir());
        assert!(run_dir.join(format!("slurm/{job}_{task}.out")).exists());
    }
    std::fs::remove_dir_all(run_dir).unwrap();
}

#[test]
fn cancel_stops_the_runs_job() {
    let conf = cluster();
    let run_dir = temp_dir("slurm-cancel");
    let set = dir_set(&run_dir);
    let job = submit(&conf, &[&set, "training.total_steps=100000"]);
    wait_for(&conf, &job, |s| s == "RUNNING");
    let env = [("SLURM_CONF", conf.as_str())];
    let dry = flux_hpc_with(
        &[
            "cancel",
            "configs/flux_tiny.toml",
            "--set",
            &set,
            "--dry-run",
        ],
        &env,
    );
    ok(&dry);
    assert!(String::from_utf8_lossy(&dry.stdout).contains(&format!("would run: scancel {job}")));
    assert_eq!(job_field(&conf, &job, "JobState"), "RUNNING");
    ok(&flux_hpc_with(
        &["cancel", "configs/flux_tiny.toml", "--set", &set],
        &env,
    ));
    assert_eq!(wait_for(&conf, &job, finished), "CANCELLED");
    std::fs::remove_dir_all(run_dir).unwrap();
}

#[test]
fn launch_runs_the_same_training_under_local_mpirun() {
    let run_dir = temp_dir("launch");
    let set = dir_set(&run_dir);
    let args = [
        "launch",
        "-n",
        "2",
        "configs/flux_tiny.toml",
        "--set",
        &set,
        "--set",
        "training.total_steps=3",
    ];
    let dry = flux_hpc(&[&args[..], &["--dry-run"]].concat());
    ok(&dry);
    let line = String::from_utf8_lossy(&dry.stdout).to_string();
    assert!(line.starts_with("mpirun -np 2 "), "{line}");
    let env = [("OMPI_MCA_btl_vader_single_copy_mechanism", "none")];
    ok(&flux_hpc_with(&args, &env));
    assert_eq!(records(&run_dir).last().unwrap()["step"], 3);
    std::fs::remove_dir_all(run_dir).unwrap();
}
