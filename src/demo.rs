//! `flux-hpc demo`: build a Flux model and time its forward pass on random inputs.

use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use flux_cluster::Placement;
use flux_model::{DiffusionModel, Flux, FluxConfig, ModelConfig};
use flux_train::RunConfig;

use crate::info::group_digits;
use crate::resolution::Resolution;
use crate::timing::{median, synchronize};
use crate::{ConfigArgs, DeviceArgs};

/// Arguments of `flux-hpc demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Narrow the model to this many heads, keeping the head width (hidden = heads × head width).
    #[arg(long, default_value_t = 4)]
    heads: i64,
    /// Image size in pixels, WIDTHxHEIGHT (multiples of 16; one token per 16×16 pixels).
    #[arg(long, default_value = "512x512")]
    resolution: Resolution,
    /// Text tokens per sample.
    #[arg(long, default_value_t = 128)]
    text_len: i64,
    /// Samples per batch.
    #[arg(long, default_value_t = 1)]
    batch: i64,
    /// Timed forward passes after one warm-up.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Random seed for weights and inputs.
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

/// Build the model, run the forward passes, print shapes, parameter count and timings.
pub fn run(args: DemoArgs) -> Result<()> {
    let placement = Placement::from_env()?;
    tch::set_num_threads(placement.threads() as i32);
    let device = args.device.device.resolve(placement.local_rank)?;

    let mut run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let architecture = run.model.architecture();
    let flux = run.model.get_mut::<FluxConfig>().ok_or_else(|| {
        anyhow!("demo runs FLUX.1 configs; this one's [model] architecture is \"{architecture}\"")
    })?;
    let head_dim = flux.head_dim();
    flux.num_attention_heads = args.heads;
    flux.hidden_size = args.heads * head_dim;
    run.validate().context("the narrowed model is invalid")?;
    let config = run.model.get::<FluxConfig>().expect("checked above");

    tch::manual_seed(args.seed);
    let build = Instant::now();
    let model = Flux::new(config, device)?;
    let build_s = build.elapsed().as_secs_f64();
    let (rows, cols) = args.resolution.tokens();
    let batch = args
        .resolution
        .random_batch(&config.inputs(), args.batch, args.text_len, device);

    println!(
        "device            {device:?} ({} threads)",
        tch::get_num_threads()
    );
    println!(
        "model             {} joint + {} single layers, hidden {} ({} heads × {}), built in {build_s:.2} s",
        config.num_joint_layers, config.num_single_layers, config.hidden_size, config.num_attention_heads, head_dim
    );
    println!(
        "parameters        {} allocated (layout says {})",
        group_digits(model.get_num_params(false)),
        group_digits(config.num_params())
    );
    println!(
        "img               {:?}  ({} image → {rows}×{cols} tokens)",
        batch.latents.size(),
        args.resolution
    );
    let size = |t: &Option<tch::Tensor>| t.as_ref().map(tch::Tensor::size).unwrap_or_default();
    println!("txt               {:?}", size(&batch.text));
    println!("y                 {:?}", size(&batch.pooled));
    println!("timesteps         {:?}", batch.timesteps.size());

    let mut times = Vec::with_capacity(args.repeats);
    let mut out = None;
    for i in 0..=args.repeats {
        let start = Instant::now();
        let y = tch::no_grad(|| model.forward(&batch, false))?;
        synchronize(device);
        let seconds = start.elapsed().as_secs_f64();
        tracing::debug!(pass = i, seconds, "forward");
        if i > 0 {
            times.push(seconds);
        }
        out = Some(y);
    }
    let out = out.expect("at least one pass");
    let median = median(&times);
    println!(
        "velocity          {:?}  (mean {:+.4}, std {:.4})",
        out.size(),
        out.mean(tch::Kind::Float).double_value(&[]),
        out.std(true).double_value(&[])
    );
    println!(
        "forward           {:.1} ms median of {} (after 1 warm-up)",
        median * 1e3,
        times.len()
    );
    Ok(())
}
