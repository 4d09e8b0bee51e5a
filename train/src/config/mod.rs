//! The run configuration: `RunConfig` and its tables.

pub(crate) mod monitoring;
pub(crate) mod run_config;
pub(crate) mod sections;
