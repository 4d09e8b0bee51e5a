//! Slurm's own commands (`sbatch`, `scontrol`, `squeue`, `scancel`), run as processes with their
//! failures turned into errors that say which command and why.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Why a Slurm command failed.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// The command is not installed.
    #[error("`{0}` was not found on PATH: run this on a Slurm login node (or start one with scripts/slurm-local.sh)")]
    Missing(String),
    /// It ran and failed.
    #[error("`{command}` failed: {message}")]
    Failed {
        /// The command line.
        command: String,
        /// Its stderr (or exit status).
        message: String,
    },
}

/// Run `program args`, returning stdout.
fn run(program: &str, args: &[&str]) -> Result<String, SlurmError> {
    let output = Command::new(program).args(args).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            SlurmError::Missing(program.into())
        } else {
            SlurmError::Failed {
                command: program.into(),
                message: e.to_string(),
            }
        }
    })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_string();
        return Err(SlurmError::Failed {
            command: format!("{program} {}", args.join(" ")),
            message: if stderr.is_empty() {
                output.status.to_string()
            } else {
                stderr
            },
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Submit `script` with `sbatch --parsable`; returns the job id.
pub fn submit(script: &Path) -> Result<String, SlurmError> {
    let out = run("sbatch", &["--parsable", &script.to_string_lossy()])?;
    // `--parsable` prints `jobid` or `jobid;cluster`.
    let id = out.trim().split(';').next().unwrap_or("").to_string();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
        return Err(SlurmError::Failed {
            command: "sbatch --parsable".into(),
            message: format!("unexpected output {out:?}"),
        });
    }
    Ok(id)
}

/// A job as `scontrol show job` describes it: `Key=Value` fields (`JobState`, `RunTime`,
/// `Restarts`, `StdOut`, `ExitCode`, …).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobInfo {
    /// The fields.
    pub fields: BTreeMap<String, String>,
}

impl JobInfo {
    /// Field `key`, or `""`.
    pub fn get(&self, key: &str) -> &str {
        self.fields.get(key).map_or("", String::as_str)
    }
}

/// Parse `scontrol show job -o` output (one line of space-separated `Key=Value` per job).
pub fn parse_job_records(text: &str) -> Vec<JobInfo> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut fields = BTreeMap::new();
            let mut last: Option<String> = None;
            for token in line.split_whitespace() {
                match token.split_once('=') {
                    Some((k, v))
                        if !k.is_empty()
                            && k.chars()
                                .all(|c| c.is_ascii_alphanumeric() || c == ':' || c == '/') =>
                    {
                        fields.insert(k.to_string(), v.to_string());
                        last = Some(k.to_string());
                    }
                    // A value with spaces (e.g. a command with arguments) continues.
                    _ => {
                        if let Some(k) = &last {
                            let v: &mut String = fields.get_mut(k).expect("inserted");
                            v.push(' ');
                            v.push_str(token);
                        }
                    }
                }
            }
            JobInfo { fields }
        })
        .collect()
}

/// `scontrol show job -o ID`: every record of the job (one per array task).
pub fn show_job(job: &str) -> Result<Vec<JobInfo>, SlurmError> {
    Ok(parse_job_records(&run(
        "scontrol",
        &["show", "job", "-o", job],
    )?))
}

/// `scancel [--signal=SIG --batch] ID`.
pub fn cancel(job: &str, signal: Option<&str>) -> Result<(), SlurmError> {
    let flag = signal.map(|s| format!("--signal={s}"));
    let mut args: Vec<&str> = Vec::new();
    if let Some(f) = &flag {
        args.extend([f.as_str(), "--batch"]);
    }
    args.push(job);
    run("scancel", &args).map(drop)
}

/// `scontrol requeue ID`: the job goes back to the queue and restarts from its script.
pub fn requeue(job: &str) -> Result<(), SlurmError> {
    run("scontrol", &["requeue", job]).map(drop)
}
