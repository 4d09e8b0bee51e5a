//! # flux-train
//!
//! Flow-matching training for flux-hpc, grouped by what each part holds:
//!
//! - [`config`](crate::RunConfig): the run configuration and its tables;
//! - `run`: one training run — joining the job ([`Launch`]), the run directory, resume, cadence
//!   and [`TrainingRun`], which owns every policy of the loop;
//! - [`step`]: the flow-matching step (noise, timesteps, loss, the [`Trainer`]);
//! - [`feed`]: what each step reads;
//! - `parallel`: data parallelism and its sharding levels (ZeRO-1/2/3, HSDP);
//! - [`optimizer`]: AdamW with f32 masters, its fused update, EMA;
//! - [`logging`]: metrics, TensorBoard, the run log, sample grids;
//! - `lora`: LoRA runs, adapter files, base weights;
//! - [`memory_plan`] (`flux-hpc plan`), [`sampling`] and [`scheduler`] (the flow-matching
//!   sampler).

mod config;
pub mod feed;
pub mod logging;
mod lora;
pub mod memory_plan;
pub mod optimizer;
mod parallel;
mod run;
pub mod sampling;
pub mod scheduler;
pub mod step;

pub use config::monitoring::{LoggingConfig, SamplingConfig};
pub use config::run_config::{ParallelismConfig, RunConfig, RunConfigError, Sharding};
pub use config::sections::{
    CheckpointConfig, CheckpointFormat, DataConfig, DataSourceKind, LoraConfig, LrSchedule,
    NonFinitePolicy, OptimizationConfig, Precision, TrainingConfig,
};
pub use feed::data_source::{synthetic_data, DataSource, EVAL_BASE};
pub use logging::run_log::{LogError, RunLog, TENSORBOARD_DIR};
pub use logging::sample_grid::{encode_prompts, latent_size, SampleGrid, SAMPLES_DIR};
pub use lora::adapter_file::{merge_adapter_file, read_adapter_file};
pub use lora::base_weights::load_base;
pub use lora::lora_run::{LoraFormat, LoraRun};
pub use parallel::data_parallel::{dp_optimizer, DpOptimizer, Replicated};
pub use parallel::grad_hooks::OverlapReport;
pub use parallel::overlapped_reduce::OverlappedReduce;
pub use parallel::sharded_adamw::ShardedAdamW;
pub use parallel::sharded_params::weight_gather_bytes;
pub use run::cadence::{AfterStep, Cadence};
pub use run::launch::{Launch, LaunchError};
pub use run::resume::{starting_checkpoint, StartPolicy};
pub use run::run_dir::{RunDir, RunDirError, LOCK_FILE};
pub use run::training_run::{Outcome, Progress, RunError, RunOptions, TrainingRun};
pub use step::trainer::{build_model, NonFiniteReport, StepError, StepStats, Trainer};
