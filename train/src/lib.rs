//! # flux-train
//!
//! Flow-matching training for flux-hpc: the run configuration, noise and loss utilities, timestep
//! samplers, the flow-matching scheduler and samplers, AdamW with f32 master weights, the
//! data-parallel training loop, and what a run shows while it trains (sample grids,
//! TensorBoard).

mod adapter_file;
mod base_weights;
mod cadence;
mod data_parallel;
mod data_source;
mod ema;
mod fused_adamw;
mod grad_hooks;
mod launch;
mod lora_run;
pub mod loss;
pub mod memory_plan;
pub mod metrics;
mod monitoring;
pub mod noise;
pub mod optim;
mod overlapped_reduce;
mod resume;
mod run_config;
mod run_dir;
mod run_log;
mod sample_grid;
pub mod sampling;
pub mod scheduler;
mod sections;
mod shard_layout;
mod sharded_adamw;
mod sharded_build;
mod sharded_grads;
mod sharded_params;
pub mod step_data;
pub mod tensorboard;
pub mod timesteps;
mod trainer;
mod training_run;
pub mod units;

pub use adapter_file::{merge_adapter_file, read_adapter_file};
pub use base_weights::load_base;
pub use cadence::{AfterStep, Cadence};
pub use data_parallel::{dp_optimizer, DpOptimizer, Replicated};
pub use data_source::{synthetic_data, DataSource, EVAL_BASE};
pub use grad_hooks::OverlapReport;
pub use launch::{Launch, LaunchError};
pub use lora_run::{LoraFormat, LoraRun};
pub use monitoring::{LoggingConfig, SamplingConfig};
pub use overlapped_reduce::OverlappedReduce;
pub use resume::{starting_checkpoint, StartPolicy};
pub use run_config::{ParallelismConfig, RunConfig, RunConfigError, Sharding};
pub use run_dir::{RunDir, RunDirError, LOCK_FILE};
pub use run_log::{LogError, RunLog, TENSORBOARD_DIR};
pub use sample_grid::{encode_prompts, latent_size, SampleGrid, SAMPLES_DIR};
pub use sections::{
    CheckpointConfig, CheckpointFormat, DataConfig, DataSourceKind, LoraConfig, LrSchedule,
    NonFinitePolicy, OptimizationConfig, Precision, TrainingConfig,
};
pub use sharded_adamw::ShardedAdamW;
pub use trainer::{build_model, NonFiniteReport, StepError, StepStats, Trainer};
pub use training_run::{Outcome, Progress, RunError, RunOptions, TrainingRun};
