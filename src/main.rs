//! `flux-hpc`: train Flux-class diffusion transformers on supercomputers.

mod bench_cmd;
mod check_collectives;
mod check_parallel;
mod ckpt_cmd;
mod convert_cmd;
mod data_cmd;
mod demo;
mod info;
mod lora_cmd;
mod plan_cmd;
mod resolution;
mod sample_cmd;
mod slurm_cmd;
mod timing;
mod train_cmd;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use flux_cluster::DeviceChoice;

/// Train Flux-class diffusion transformers on supercomputers.
///
/// Every command reads a run config (TOML, see configs/) and accepts `--set table.key=value`
/// overrides, checked exactly like the file. Logs go to stderr; set RUST_LOG=debug for more.
#[derive(Debug, Parser)]
#[command(name = "flux-hpc", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build a Flux model and time a forward pass on random inputs.
    ///
    /// By default: the flux_535m shape (1 joint + 1 single layer) narrowed to 4 heads of 128
    /// (hidden 512) so it runs in seconds on a laptop CPU, at 512×512 pixels (32×32 tokens) with
    /// 128 text tokens. Pass `--heads 24` for the full 3072 width.
    ///
    /// Example: flux-hpc demo configs/flux_535m.toml --heads 8 --resolution 512x768
    Demo(demo::DemoArgs),
    /// Check, under mpirun, that a tensor × data parallel layout reproduces one process exactly.
    ///
    /// Every rank builds the single-process model and the parallel one from the same seed, runs a
    /// forward and backward pass, and compares the output and every parameter gradient (gathered
    /// to logical shapes); it also counts the all-reduces the tensor-parallel regions issue.
    /// The tensor-parallel size comes from [parallelism] (or --set); data parallel = world / tp.
    ///
    /// Example: mpirun -np 4 flux-hpc check-parallel configs/flux_tiny.toml \
    ///            --set parallelism.tensor_parallel_size=2
    CheckParallel(check_parallel::CheckParallelArgs),
    /// Check, under mpirun, every collective of [parallelism] backend on the chosen device.
    ///
    /// All-reduce, all-gather, reduce-scatter, broadcast and the non-blocking all-reduce and
    /// all-gather run over all ranks on f32 and bf16 tensors, and each result is compared with
    /// the values every rank can compute alone. Prints each one's error, the bytes it staged
    /// through host memory (0 where the backend moves the tensor where it lies: NCCL on CUDA,
    /// gloo on the CPU; MPI converts bf16 and copies CUDA tensors) and its time. Fails on any
    /// wrong value, on every rank.
    ///
    /// Example: mpirun -np 2 flux-hpc check-collectives configs/flux_tiny.toml --device cpu \
    ///            --set parallelism.backend=\"gloo\"
    CheckCollectives(check_collectives::CheckCollectivesArgs),
    /// Train with flow matching; under mpirun or srun every rank joins (tensor × data parallel).
    ///
    /// Writes metrics.jsonl (step, loss, held-out loss, lr, grad_norm, samples/s, tokens/s, peak
    /// memory), loss_curve.png, config.toml and final.safetensors into [checkpoint] dir.
    ///
    /// Example: mpirun -np 2 flux-hpc train configs/flux_tiny.toml --set training.total_steps=50
    Train(train_cmd::TrainArgs),
    /// Generate from trained weights (Euler or Heun, FLUX.1's shifted schedule, optional two-pass
    /// classifier-free guidance): images from prompts through a FLUX.1 folder's text encoders and
    /// VAE, or latents compared with the synthetic data they should match.
    ///
    /// Examples: flux-hpc sample configs/flux_12b.toml --encoders FLUX.1-dev --prompt "a cat"
    ///           flux-hpc sample configs/flux_tiny.toml --steps 28 --count 4
    Sample(sample_cmd::SampleArgs),
    /// Inspect training checkpoints.
    Ckpt(ckpt_cmd::CkptArgs),
    /// Work with a LoRA run's adapters ([lora] table): merge them into the base weights, or
    /// export them for kohya / ComfyUI or diffusers.
    Lora(lora_cmd::LoraArgs),
    /// Ingest pre-encoded latents into HDF5 shards (tar, npy/safetensors, HTTP) and validate them.
    Data(data_cmd::DataArgs),
    /// Convert FLUX.1 weights between BFL, diffusers and native checkpoints, tensor by tensor.
    ///
    /// The key mapping is the one the parity tests use; conversion is strict (every parameter
    /// found with its shape, every tensor used) and checks headers before writing anything.
    ///
    /// Examples:
    ///   flux-hpc convert --from bfl --to native flux1-dev.safetensors runs/ft \
    ///     --config configs/flux_12b.toml --set model.guidance_embed=true
    ///   flux-hpc convert --from native --to diffusers runs/ft out/transformer --dtype bf16
    Convert(convert_cmd::ConvertArgs),
    /// Submit the run to Slurm: render the batch script ([slurm] table), write it into the run
    /// directory, `sbatch --parsable` it, print the job id.
    ///
    /// The script asks for the warning signal (--signal=B:USR1@lead); training then checkpoints,
    /// requeues the job and resumes from `latest` when it restarts — for preemption, and for runs
    /// longer than the time limit. `[slurm] sweep` makes an array job, one override list per task.
    ///
    /// Example: flux-hpc sbatch configs/flux_12b.toml --set slurm.nodes=16 --dry-run
    Sbatch(slurm_cmd::SbatchArgs),
    /// Show the run's Slurm jobs (state, run time, restarts) and its latest checkpoint and step.
    Status(slurm_cmd::JobArgs),
    /// Print the end of the run's latest job output (or --job ID).
    Logs(slurm_cmd::LogsArgs),
    /// Cancel the run's latest Slurm job (or --job ID); --dry-run says what it would cancel.
    Cancel(slurm_cmd::CancelArgs),
    /// Run the training locally under `mpirun -np N` (laptops, workstations).
    ///
    /// Example: flux-hpc launch -n 2 configs/flux_tiny.toml --set training.total_steps=50
    Launch(slurm_cmd::LaunchArgs),
    /// Time training steps, forward passes, libtorch's matmul rate or the latent reader; prints
    /// one JSON line (samples/s, FLOP/s, peak memory) per measurement.
    ///
    /// benches/side_by_side.sh runs these against PyTorch eager on the same config.
    ///
    /// Example: flux-hpc bench step configs/flux_tiny.toml --steps 10 --threads 2
    Bench(bench_cmd::BenchArgs),
    /// Print a config's model summary and parameter count without allocating weights.
    ///
    /// Example: flux-hpc info configs/flux_12b.toml
    Info(info::InfoArgs),
    /// Predict each rank's peak memory (weights, gradients, optimizer state, EMA, activations
    /// and the step's transients) for the config's layout, the largest micro-batch that fits,
    /// and the same for every tensor × data parallel × sharding × recompute layout of the GPUs.
    ///
    /// Computed from the model's parameter specs and the tensors its layers save, without
    /// allocating; the CUDA context, NCCL and library workspaces are left to --headroom. On the
    /// CPU, `bench step` measures the same quantity as `peak_tensor_mib`.
    ///
    /// Examples: flux-hpc plan configs/flux_12b.toml
    ///           flux-hpc plan configs/flux2_dev.toml --gpus 8 --gpu-memory 141GiB
    Plan(plan_cmd::PlanArgs),
}

/// Options every command shares: the config file and its overrides.
#[derive(Debug, Args)]
struct ConfigArgs {
    /// Run config (TOML): [model], [parallelism].
    #[arg(default_value = "configs/flux_535m.toml")]
    config: PathBuf,
    /// Override a config value, e.g. `--set model.guidance_embed=true` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
}

/// Where to compute.
#[derive(Debug, Args)]
struct DeviceArgs {
    /// auto (CUDA if available, else CPU), cpu, cuda, or cuda:N.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
}

fn main() -> ExitCode {
    flux_cluster::memory::reuse_freed_buffers();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let result: Result<()> = match Cli::parse().command {
        Command::Demo(args) => demo::run(args),
        Command::Info(args) => info::run(args),
        Command::Plan(args) => plan_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::CheckParallel(args) => check_parallel::run(args),
        Command::CheckCollectives(args) => check_collectives::run(args),
        Command::Train(args) => train_cmd::run(args),
        Command::Sample(args) => sample_cmd::run(args),
        Command::Ckpt(args) => ckpt_cmd::run(args),
        Command::Lora(args) => lora_cmd::run(args),
        Command::Convert(args) => convert_cmd::run(args),
        Command::Sbatch(args) => slurm_cmd::sbatch(args),
        Command::Status(args) => slurm_cmd::status(args),
        Command::Logs(args) => slurm_cmd::logs(args),
        Command::Cancel(args) => slurm_cmd::cancel(args),
        Command::Launch(args) => slurm_cmd::launch(args),
        Command::Data(args) => data_cmd::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One write per message: under mpirun the ranks share one stderr, and
            // `eprintln!` writes each formatted piece separately, so two ranks' errors
            // could interleave mid-line.
            let message = format!("error: {error:#}\n");
            let _ = std::io::stderr().write_all(message.as_bytes());
            ExitCode::from(2)
        }
    }
}
