//! `flux-hpc sample`: generate latents from trained weights with the flow-matching ODE.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use flux_data::convert::SafetensorsReader;
use flux_data::KeyedRng;
use flux_model::tp::TpContext;
use flux_model::DiffusionBatch;
use flux_train::sampling::guided_velocity;
use flux_train::scheduler::{integrate, FlowMatchEulerDiscreteScheduler};
use flux_train::{synthetic_data, RunConfig, EVAL_BASE};
use tch::{Kind, Tensor};

use crate::{ConfigArgs, DeviceArgs};

/// Arguments of `flux-hpc sample`.
#[derive(Debug, Args)]
pub struct SampleArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Native weights (default: <run dir>/final.safetensors, written by `train`).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Use the run's moving average of the weights (<run dir>/final_ema.safetensors, written
    /// by `train` under `[training] ema_decay`).
    #[arg(long, conflicts_with = "weights")]
    ema: bool,
    /// Output file (default: <run dir>/samples.safetensors).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Samples to generate, conditioned on the held-out synthetic samples' text and vectors.
    #[arg(long, default_value_t = 4)]
    count: u64,
    /// ODE steps (FLUX.1's schedule with resolution-dependent shift).
    #[arg(long, default_value_t = 28)]
    steps: usize,
    /// Heun's second-order steps instead of Euler's.
    #[arg(long)]
    heun: bool,
    /// Guidance strength given to a guidance-embedding model (default: [model] guidance_scale).
    #[arg(long)]
    guidance: Option<f64>,
    /// Two-pass classifier-free guidance scale (conditional vs empty conditioning).
    #[arg(long)]
    cfg_scale: Option<f64>,
    /// Seed of the starting noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Sample, compare with the synthetic data's clean latents, and save both.
pub fn run(args: SampleArgs) -> Result<()> {
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let device = args.device.device.resolve(0)?;
    let inputs = run.model.inputs();
    let t = &run.training;
    let dir = &run.checkpoint.dir;
    let default = match args.ema {
        true => "final_ema.safetensors",
        false => "final.safetensors",
    };
    let weights = args.weights.unwrap_or_else(|| dir.join(default));
    let mut model = run.model.build(device, TpContext::single())?;
    let reader = SafetensorsReader::open(&weights)?;
    if !reader.verify_checksum()? {
        tracing::warn!(
            "{} carries no flux-hpc checksum; its header was checked, its bytes cannot be",
            weights.display()
        );
    }
    let tensors = reader.read_all()?;
    model
        .store_mut()
        .load_logical(&tensors)
        .with_context(|| format!("{} does not fit this config", weights.display()))?;

    let data = synthetic_data(&run);
    let ids: Vec<u64> = (EVAL_BASE..EVAL_BASE + args.count).collect();
    let cond = data.batch(&ids, device);
    let b = args.count as i64;
    let size = cond.latents.size();
    let noise = KeyedRng::new(args.seed, 0, 0).normals(cond.latents.numel());
    let start = Tensor::from_slice(&noise)
        .view(size.as_slice())
        .to_device(device);
    let guidance = |g: f64| Tensor::full([b], args.guidance.unwrap_or(g), (Kind::Float, device));
    let conditioned = |txt: &Tensor, y: &Tensor, x: &Tensor, timesteps: Tensor| DiffusionBatch {
        latents: x.shallow_clone(),
        timesteps,
        text: inputs.text_dim.map(|_| txt.shallow_clone()),
        pooled: inputs.pooled_dim.map(|_| y.shallow_clone()),
        guidance: inputs.guidance.map(guidance),
    };
    let (empty_txt, empty_y) = (cond.txt.zeros_like(), cond.y.zeros_like());
    let image_tokens = inputs.image_tokens(t.latent_height, t.latent_width);
    let schedule =
        FlowMatchEulerDiscreteScheduler::flux().flux_schedule(args.steps, image_tokens as f64);

    let latents = tch::no_grad(|| {
        integrate(start, &schedule.sigmas, args.heun, |x, sigma| {
            let timesteps = || Tensor::full([b], sigma, (Kind::Float, device));
            let predict = |txt: &Tensor, y: &Tensor| {
                let batch = conditioned(txt, y, x, timesteps()).to_kind(model.kind());
                model
                    .forward(&batch, false)
                    .expect("inputs follow the model's input spec")
                    .to_kind(Kind::Float)
            };
            let v = predict(&cond.txt, &cond.y);
            match args.cfg_scale {
                Some(scale) => guided_velocity(&v, &predict(&empty_txt, &empty_y), scale),
                None => v,
            }
        })
    });
    let mse = |a: &Tensor| {
        (a - &cond.latents)
            .square()
            .mean(Kind::Float)
            .double_value(&[])
    };
    let out = args.out.unwrap_or_else(|| dir.join("samples.safetensors"));
    let written = [
        ("latents".to_string(), latents.shallow_clone()),
        ("reference".to_string(), cond.latents.shallow_clone()),
    ];
    flux_data::convert::write_tensors(&out, &written)?;
    println!(
        "samples           {:?} in {} {} steps",
        latents.size(),
        args.steps,
        if args.heun { "Heun" } else { "Euler" }
    );
    println!(
        "mse vs data       {:.4} (the data's own variance: {:.4})",
        mse(&latents),
        mse(&cond.latents.zeros_like())
    );
    println!("written           {}", out.display());
    Ok(())
}
