//! `flux-hpc bench`: time training steps, forward passes, libtorch's matrix-multiplication rate
//! and the latent reader, printing one JSON object per measurement — what
//! `benches/side_by_side.sh` compares with PyTorch, and what a user sizing a run wants to know.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use flux_data::dataset::LatentDataset;
use flux_model::tp::staging;
use flux_model::{tensor_memory, DiffusionBatch, DiffusionModel};
use flux_train::logging::metrics::{peak_rss_mib, rss_mib};
use flux_train::logging::units::mib;
use flux_train::{build_model, Launch, RunConfig, Trainer};
use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::timing::{median, synchronize};
use crate::{ConfigArgs, DeviceArgs};

/// Arguments of `flux-hpc bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Debug, Subcommand)]
enum BenchWhat {
    /// Time training steps (forward, backward, gradient completion, clipping, AdamW) on
    /// synthetic data at the config's [training] shape; under mpirun every rank joins
    /// (tensor × data parallel as [parallelism] says).
    ///
    /// Example: mpirun -np 2 flux-hpc bench step benches/side_by_side.toml --threads 1
    Step(TimedArgs),
    /// Time forward passes without gradients on one rank's micro-batch at the same shape.
    ///
    /// Example: flux-hpc bench forward benches/side_by_side.toml --threads 2
    Forward(TimedArgs),
    /// Measure libtorch's f32 matrix-multiplication rate (n × n by n × n), the denominator of
    /// model FLOPs utilisation.
    Matmul(MatmulArgs),
    /// Read every sample of latent shards once (decoded to f32, checksums verified) and report
    /// samples/s and MiB/s of stored bytes.
    Read(ReadArgs),
}

#[derive(Debug, Args)]
struct TimedArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Timed repetitions.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed repetitions first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Intra-op threads per rank (default: the cores available to the rank).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Debug, Args)]
struct MatmulArgs {
    #[command(flatten)]
    device: DeviceArgs,
    /// Multiply in bfloat16 instead of f32 (the rate bf16 training is measured against).
    #[arg(long)]
    bf16: bool,
    /// Matrix side.
    #[arg(long, default_value_t = 2048)]
    size: i64,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 10)]
    repeats: usize,
    /// Intra-op threads.
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Debug, Args)]
struct ReadArgs {
    /// Shard files or directories of `*.h5`.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
}

/// Run the chosen measurement and print its JSON line (rank 0 only under MPI).
pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        BenchWhat::Step(a) => timed(a, true),
        BenchWhat::Forward(a) => timed(a, false),
        BenchWhat::Matmul(a) => matmul(a),
        BenchWhat::Read(a) => read(a),
    }
}

/// What `bench step` and `bench forward` repeat.
enum Work<'a> {
    /// Training steps.
    Step(Box<Trainer<'a>>),
    /// Forward passes of the model on a fixed batch.
    Forward(Box<dyn DiffusionModel>, DiffusionBatch),
}

fn timed(args: TimedArgs, train: bool) -> Result<()> {
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let p = &run.parallelism;
    let launch = Launch::join(p, args.device.device, p.group_sizes(), args.threads)?;
    let (world, device, transport) = (&launch.world, launch.device, launch.transport);
    let threads = args.threads.unwrap_or_else(|| launch.placement.threads());
    // What the process holds before any weight exists: libtorch, MPI, the binary.
    let baseline_rss = rss_mib();
    // Tensors' own bytes, what `flux-hpc plan` predicts (CUDA's caching allocator counts its own).
    if device == Device::Cpu {
        tensor_memory::count_cpu_tensors();
    }
    let t = &run.training;
    let inputs = run.model.inputs();
    let image_tokens = inputs.image_tokens(t.latent_height, t.latent_width);
    let text_tokens = inputs.text_tokens(t.text_len);
    // Steps take the global batch over all replicas; forward passes one rank's micro-batch.
    let mut work = if train {
        Work::Step(Box::new(Trainer::new(
            &run,
            device,
            world.tp.clone(),
            world.dp_groups(),
        )?))
    } else {
        let model = build_model(&run, device, world.tp.clone())?;
        // The inputs in the weights' dtype, as the trainer feeds them.
        let batch = DiffusionBatch::random(
            &inputs,
            t.micro_batch_size as i64,
            t.latent_height,
            t.latent_width,
            t.text_len,
            device,
        )
        .to_kind(model.kind());
        Work::Forward(model, batch)
    };
    // The top of building the model: before the optimizer and any step (a forward pass's
    // batch included).
    let build_peak = match &work {
        Work::Step(trainer) => trainer.build_peak_bytes(),
        Work::Forward(..) => tensor_memory::tensor_bytes(device).ok().map(|b| b.peak),
    };
    let samples = if train {
        t.global_batch_size
    } else {
        t.micro_batch_size
    };
    let (trained, optimizer_bytes) = match &work {
        Work::Step(trainer) => (
            trainer.trained().num_local_params(true),
            trainer.optimizer_state_bytes(),
        ),
        Work::Forward(model, _) => (model.store().num_local_params(true), 0),
    };
    let mut seconds = Vec::with_capacity(args.steps);
    let (mut staged, mut gathered) = (0, 0);
    for i in 0..args.warmup + args.steps {
        synchronize(device);
        let staged_before = staging::host_staged_bytes();
        let gathered_before = flux_train::weight_gather_bytes();
        let start = Instant::now();
        match &mut work {
            Work::Step(trainer) => {
                trainer.train_step()?;
            }
            Work::Forward(model, batch) => {
                let _ = tch::no_grad(|| model.forward(batch, false))?;
            }
        }
        synchronize(device);
        if i >= args.warmup {
            seconds.push(start.elapsed().as_secs_f64());
            staged += staging::host_staged_bytes() - staged_before;
            gathered += flux_train::weight_gather_bytes() - gathered_before;
        }
    }
    let model_state = match &work {
        Work::Step(trainer) => trainer.model_state_bytes(),
        Work::Forward(model, _) => {
            let weights = model.store().vs.variables().into_values();
            weights
                .map(|w| (w.numel() * w.kind().elt_size_in_bytes()) as u64)
                .sum()
        }
    };
    drop(work);
    if world.world.rank() != 0 {
        return Ok(());
    }
    // The whole model's FLOPs on all `samples`, however the ranks share them.
    let flops = run
        .model
        .forward_flops(samples as i64, image_tokens, text_tokens);
    let per_step = if train {
        flops.training_step()
    } else {
        flops.total()
    };
    let m = median(&seconds);
    let out = json!({
        "impl": "flux-hpc",
        "what": if train { "step" } else { "forward" },
        "device": format!("{device:?}"),
        "precision": format!("{:?}", t.precision).to_lowercase(),
        "threads": threads,
        "ranks": world.world.size(),
        "tp": world.tp.size(),
        "sequence_parallel": world.tp.sequence_parallel(),
        "samples": samples,
        "architecture": run.model.architecture(),
        "lora_rank": run.lora.as_ref().map(|l| l.rank),
        "trained_params_per_rank": trained,
        "sharding": format!("{:?}", run.parallelism.sharding).to_lowercase(),
        "overlap_grad_reduce": run.parallelism.overlap_grad_reduce,
        "backend": transport.backend.name(),
        // Rank 0's bytes staged through host f32 buffers per timed step or pass.
        "host_staged_mib_per_step": mib(staged) / args.steps.max(1) as f64,
        // Rank 0's weights received from sharding = "full"'s all-gathers per timed step.
        "weight_gather_mib_per_step": mib(gathered) / args.steps.max(1) as f64,
        "bucket_mib": run.parallelism.bucket_mib,
        "optimizer_state_mib_per_rank": mib(optimizer_bytes),
        // Weights present, gradients and optimizer state after the last step.
        "model_state_mib_per_rank": mib(model_state),
        "image_tokens": image_tokens,
        "text_tokens": text_tokens,
        "seconds": seconds,
        "median_s": m,
        "samples_per_s": samples as f64 / m,
        "flops": per_step,
        "flops_per_s": per_step / m,
        "peak_rss_mib": peak_rss_mib(),
        "baseline_rss_mib": baseline_rss,
        "peak_tensor_mib": tensor_memory::tensor_bytes(device).ok().map(|b| mib(b.peak)),
        "build_peak_tensor_mib": build_peak.map(mib),
    });
    println!("{out}");
    Ok(())
}

fn matmul(args: MatmulArgs) -> Result<()> {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    tch::set_num_threads(threads as i32);
    let device = args.device.device.resolve(0)?;
    let n = args.size;
    let kind = if args.bf16 {
        Kind::BFloat16
    } else {
        Kind::Float
    };
    let (a, b) = (
        Tensor::randn([n, n], (kind, device)),
        Tensor::randn([n, n], (kind, device)),
    );
    let _ = a.matmul(&b);
    let seconds: Vec<f64> = (0..args.repeats)
        .map(|_| {
            synchronize(device);
            let start = Instant::now();
            let _ = a.matmul(&b);
            synchronize(device);
            start.elapsed().as_secs_f64()
        })
        .collect();
    let m = median(&seconds);
    let flops = 2.0 * (n as f64).powi(3);
    println!(
        "{}",
        json!({
            "impl": "libtorch",
            "what": "matmul",
            "device": format!("{device:?}"),
            "precision": if args.bf16 { "bf16" } else { "fp32" },
            "threads": threads,
            "size": n,
            "median_s": m,
            "flops_per_s": flops / m,
        })
    );
    Ok(())
}

fn read(args: ReadArgs) -> Result<()> {
    let data = LatentDataset::open(&args.paths)?;
    if data.is_empty() {
        bail!("no samples to read");
    }
    let layout = data.layout().clone();
    let per_sample: usize = layout
        .numeric()
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>() * layout.dtype.size())
        .sum();
    let start = Instant::now();
    let mut checksum = 0f64;
    for i in 0..data.len() {
        let sample = data.read(i)?;
        checksum += sample.latents[0] as f64;
    }
    let s = start.elapsed().as_secs_f64();
    let n = data.len() as f64;
    println!(
        "{}",
        json!({
            "impl": "flux-hpc",
            "what": "read",
            "samples": data.len(),
            "seconds": s,
            "samples_per_s": n / s,
            "mib_per_s": n * per_sample as f64 / s / (1 << 20) as f64,
            "checksum": checksum,
        })
    );
    Ok(())
}
