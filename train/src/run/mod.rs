//! One training run: joining the job, the run directory, resume, cadence and the loop (`TrainingRun`).

pub(crate) mod cadence;
pub(crate) mod launch;
pub(crate) mod resume;
pub(crate) mod run_dir;
pub(crate) mod training_run;
