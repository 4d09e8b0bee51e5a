//! # flux-train
//!
//! Run configuration for flux-hpc: the TOML file a user writes, `--set` overrides, and the checks
//! that name the offending field before any work starts.

mod run_config;

pub use run_config::{ParallelismConfig, RunConfig, RunConfigError};
