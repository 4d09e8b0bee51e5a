//! `[slurm]`: the resources a job asks for and how it launches its ranks.

use std::collections::BTreeMap;

use flux_model::ConfigError;
use serde::{Deserialize, Serialize};

/// How the batch script starts one `flux-hpc train` per task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Launcher {
    /// `srun --mpi=pmix` (Slurm's PMIx plugin; the usual choice with OpenMPI ≥ 4 and Slurm ≥ 20).
    SrunPmix,
    /// `srun --mpi=pmi2`.
    SrunPmi2,
    /// OpenMPI's `mpirun`, which reads the allocation from Slurm's environment.
    Mpirun,
}

/// `[slurm]`: sbatch options, environment and launch of a run. Every string is written into the
/// batch script shell-quoted; newlines and NULs are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmConfig {
    /// `--job-name`.
    pub job_name: String,
    /// `--partition`.
    pub partition: Option<String>,
    /// `--account`.
    pub account: Option<String>,
    /// `--qos`.
    pub qos: Option<String>,
    /// `--nodes`.
    pub nodes: u32,
    /// `--ntasks-per-node`: MPI ranks per node (one per GPU on GPU nodes).
    pub ntasks_per_node: u32,
    /// `--gpus-per-node` (0: not requested).
    pub gpus_per_node: u32,
    /// `--cpus-per-task`; also each rank's compute threads.
    pub cpus_per_task: u32,
    /// `--mem` (e.g. `"0"` for all of the node's memory, `"64G"`).
    pub mem: Option<String>,
    /// `--time` limit (`MM`, `HH:MM:SS`, `D-HH:MM:SS`, …).
    pub time: String,
    /// `--output` path (Slurm patterns like `%j` allowed); default `<run dir>/slurm/%j.out`
    /// (`%A_%a.out` for sweeps).
    pub output: Option<String>,
    /// `--error` path; default: with the output.
    pub error: Option<String>,
    /// `--constraint`.
    pub constraint: Option<String>,
    /// `--exclusive`.
    pub exclusive: bool,
    /// `--mail-type` (e.g. `"END,FAIL"`).
    pub mail_type: Option<String>,
    /// `--mail-user`.
    pub mail_user: Option<String>,
    /// `--dependency` (e.g. `"afterok:1234"`).
    pub dependency: Option<String>,
    /// One list of `--set` overrides per array task; non-empty makes the job an array
    /// `0-(n-1)`, each task writing into `<checkpoint.dir>/sweep_<i>`.
    pub sweep: Vec<Vec<String>>,
    /// Array tasks running at once (`%k`; 0: no limit).
    pub array_parallelism: u32,
    /// Signal Slurm sends before the time limit or on preemption: `USR1` or `USR2` (NCCL and
    /// some MPIs catch one of them; pick the other).
    pub signal: String,
    /// Seconds before the time limit the signal arrives (enough for one step and a checkpoint).
    pub signal_lead_s: u32,
    /// On the signal: checkpoint, `scontrol requeue`, and resume when the job restarts — also how a
    /// run longer than the time limit continues until `total_steps`.
    pub requeue: bool,
    /// Environment variables exported in the batch script.
    pub env: BTreeMap<String, String>,
    /// Environment modules loaded first (`module load …`).
    pub modules: Vec<String>,
    /// Container image for every task (pyxis `srun --container-image`; srun launchers only).
    pub container_image: Option<String>,
    /// How tasks are started.
    pub launcher: Launcher,
    /// The `flux-hpc` binary the tasks run (default: the one that submits, by absolute path).
    pub binary: Option<String>,
}

impl Default for SlurmConfig {
    fn default() -> Self {
        Self {
            job_name: "flux-hpc".into(),
            partition: None,
            account: None,
            qos: None,
            nodes: 1,
            ntasks_per_node: 1,
            gpus_per_node: 0,
            cpus_per_task: 1,
            mem: None,
            time: "01:00:00".into(),
            output: None,
            error: None,
            constraint: None,
            exclusive: false,
            mail_type: None,
            mail_user: None,
            dependency: None,
            sweep: Vec::new(),
            array_parallelism: 0,
            signal: "USR1".into(),
            signal_lead_s: 120,
            requeue: true,
            env: BTreeMap::new(),
            modules: Vec::new(),
            container_image: None,
            launcher: Launcher::SrunPmix,
            binary: None,
        }
    }
}

/// Whether `time` is one of sbatch's time formats.
fn valid_time(time: &str) -> bool {
    let (days, rest) = match time.split_once('-') {
        Some((d, r)) => (Some(d), r),
        None => (None, time),
    };
    let numbers = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
    let parts: Vec<&str> = rest.split(':').collect();
    days.is_none_or(numbers) && parts.len() <= 3 && parts.iter().all(|p| numbers(p))
}

impl SlurmConfig {
    /// The optional settings written as `#SBATCH --<field with dashes>=value` when set.
    pub(crate) fn passthrough_options(&self) -> [(&'static str, &Option<String>); 9] {
        [
            ("account", &self.account),
            ("constraint", &self.constraint),
            ("dependency", &self.dependency),
            ("error", &self.error),
            ("mail_type", &self.mail_type),
            ("mail_user", &self.mail_user),
            ("mem", &self.mem),
            ("partition", &self.partition),
            ("qos", &self.qos),
        ]
    }

    /// Every string value with its field name, for the newline/NUL check.
    fn strings(&self) -> Vec<(String, &str)> {
        let mut out: Vec<(String, &str)> = vec![
            ("job_name".into(), &self.job_name),
            ("time".into(), &self.time),
            ("signal".into(), &self.signal),
        ];
        let optional = self.passthrough_options().into_iter().chain([
            ("output", &self.output),
            ("container_image", &self.container_image),
            ("binary", &self.binary),
        ]);
        out.extend(optional.filter_map(|(k, v)| v.as_deref().map(|v| (k.to_string(), v))));
        for (k, v) in &self.env {
            out.push((format!("env.{k}"), v));
        }
        for (i, m) in self.modules.iter().enumerate() {
            out.push((format!("modules[{i}]"), m));
        }
        for (i, task) in self.sweep.iter().enumerate() {
            for (j, o) in task.iter().enumerate() {
                out.push((format!("sweep[{i}][{j}]"), o));
            }
        }
        out
    }

    /// Check the table; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in self.strings() {
            ConfigError::check(!value.contains(['\n', '\r', '\0']), &field, || {
                format!("{value:?} contains a newline or NUL, which cannot go into a batch script")
            })?;
        }
        ConfigError::check(!self.job_name.is_empty(), "job_name", || {
            "must not be empty".into()
        })?;
        ConfigError::check(
            self.nodes >= 1 && self.ntasks_per_node >= 1 && self.cpus_per_task >= 1,
            "nodes",
            || "nodes, ntasks_per_node and cpus_per_task must be at least 1".into(),
        )?;
        ConfigError::check(
            self.nodes.checked_mul(self.ntasks_per_node).is_some(),
            "ntasks_per_node",
            || {
                format!(
                    "{} nodes × {} tasks overflows",
                    self.nodes, self.ntasks_per_node
                )
            },
        )?;
        ConfigError::check(valid_time(&self.time), "time", || {
            format!(
                "{:?} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)",
                self.time
            )
        })?;
        ConfigError::check(
            matches!(self.signal.as_str(), "USR1" | "USR2"),
            "signal",
            || format!("{:?}: use USR1 or USR2", self.signal),
        )?;
        ConfigError::check(self.signal_lead_s <= 65535, "signal_lead_s", || {
            "Slurm accepts at most 65535 s".into()
        })?;
        for key in self.env.keys() {
            let ok = key
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            ConfigError::check(ok, &format!("env.{key}"), || {
                "is not a valid environment variable name".into()
            })?;
        }
        ConfigError::check(
            self.container_image.is_none() || self.launcher != Launcher::Mpirun,
            "container_image",
            || "needs an srun launcher (pyxis adds --container-image to srun)".into(),
        )?;
        for (i, task) in self.sweep.iter().enumerate() {
            for o in task {
                ConfigError::check(o.contains('='), &format!("sweep[{i}]"), || {
                    format!("{o:?} is not a KEY=VALUE override")
                })?;
            }
        }
        Ok(())
    }

    /// Total MPI ranks of the job.
    pub fn tasks(&self) -> u32 {
        self.nodes * self.ntasks_per_node
    }
}
