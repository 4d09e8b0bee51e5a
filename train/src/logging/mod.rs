//! What a run shows: metrics records, TensorBoard events, the run log, sample grids, byte units.

pub mod metrics;
pub(crate) mod run_log;
pub(crate) mod sample_grid;
pub mod tensorboard;
pub mod units;
