//! Slurm: the `[slurm]` config table, the batch script, and Slurm's commands.

mod commands;
mod config;
mod script;

pub use commands::{cancel, parse_job_records, requeue, show_job, submit, JobInfo, SlurmError};
pub use config::{Launcher, SlurmConfig};
pub use script::{quote, render, JobSpec};
