//! `flux-hpc sample`: generate latents from trained weights with the flow-matching ODE, conditioned
//! on prompts (encoded by a FLUX.1 folder's text encoders, decoded to PNGs by its VAE) or on the
//! held-out synthetic samples.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use clap::Args;
use flux_cluster::Placement;
use flux_data::convert::SafetensorsReader;
use flux_encoders::{write_png, Autoencoder, AutoencoderConfig};
use flux_model::tp::TpContext;
use flux_train::sampling::{generate, ode_bytes, start_noise, Conditioning, OdeSettings};
use flux_train::{encode_prompts, latent_size, synthetic_data, RunConfig, EVAL_BASE};
use tch::{Device, Kind, Tensor};

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
    /// Samples to generate, conditioned on the held-out synthetic samples' text and vectors
    /// (without --prompt).
    #[arg(long, default_value_t = 4)]
    count: u64,
    /// A prompt to sample (repeatable; one image each), encoded by the text encoders of
    /// --encoders as diffusers' FluxPipeline encodes it (CLIP's pooled vector, T5's states at
    /// [training] text_len tokens).
    #[arg(long = "prompt", requires = "encoders")]
    prompts: Vec<String>,
    /// A diffusers FLUX.1 folder: tokenizer/ + text_encoder/ (CLIP), tokenizer_2/ +
    /// text_encoder_2/ (T5), vae/ or BFL's ae.safetensors. Text encoders are freed before the
    /// transformer is loaded.
    #[arg(long)]
    encoders: Option<PathBuf>,
    /// With --prompt: write the latents only, no decoding to PNG.
    #[arg(long)]
    latents_only: bool,
    /// With --prompt and --cfg-scale: what the unconditional pass is conditioned on instead of
    /// zeros.
    #[arg(long, requires = "prompts", requires = "cfg_scale")]
    negative_prompt: Option<String>,
    /// With --prompt: image width in pixels (default: the config's latent_width; a multiple of
    /// the VAE's downsampling × 2 for FLUX.1's packing).
    #[arg(long, requires = "prompts")]
    width: Option<i64>,
    /// With --prompt: image height in pixels (default: the config's latent_height, as --width).
    #[arg(long, requires = "prompts")]
    height: Option<i64>,
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
    // One intra-op thread per core this process may use, as training does.
    tch::set_num_threads(Placement::from_env()?.threads() as i32);
    let device = args.device.device.resolve(0)?;
    let inputs = run.model.inputs();
    let dir = &run.checkpoint.dir;
    let default = match args.ema {
        true => "final_ema.safetensors",
        false => "final.safetensors",
    };
    let weights = args.weights.clone().unwrap_or_else(|| dir.join(default));
    let settings = OdeSettings {
        steps: args.steps,
        heun: args.heun,
        guidance: args.guidance,
        cfg_scale: args.cfg_scale,
    };
    settings
        .check()
        .map_err(|e| anyhow!("--{} {}", e.field.replace('_', "-"), e.message))?;
    let grid = match &args.encoders {
        Some(folder) if !args.prompts.is_empty() => Some(latent_grid(folder, &args, &run)?),
        _ => None,
    };
    fits_in_memory(&args, &run, grid.as_ref(), device)?;
    // Prompts are encoded (and the encoders freed) before the transformer is loaded.
    let prompted = match (&args.encoders, grid) {
        (Some(folder), Some((h, w, _))) => {
            let mut prompts = args.prompts.clone();
            prompts.extend(args.negative_prompt.clone());
            let all = encode_prompts(folder, &prompts, &run, device).map_err(|e| anyhow!(e))?;
            Some((all, (h, w)))
        }
        _ => None,
    };
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

    // The prompts' conditioning and the negative prompt's (the last row, when given).
    // The shape sampled, and the clean latents the conditioning came from (synthetic data only).
    let (cond, negative, shape, clean) = match prompted {
        Some((all, (h, w))) => {
            let b = args.prompts.len() as i64;
            let negative = args.negative_prompt.as_ref().map(|_| {
                let last = all.rows(b, 1);
                Conditioning {
                    text: last.text.expand_as(&all.text.narrow(0, 0, b)),
                    pooled: last.pooled.expand_as(&all.pooled.narrow(0, 0, b)),
                }
            });
            let shape = vec![b, inputs.latent_channels, h, w];
            (all.rows(0, b), negative, shape, None)
        }
        None => {
            let data = synthetic_data(&run);
            let ids: Vec<u64> = (EVAL_BASE..EVAL_BASE + args.count).collect();
            let samples = data.batch(&ids, device);
            let cond = Conditioning {
                text: samples.txt,
                pooled: samples.y,
            };
            (cond, None, samples.latents.size(), Some(samples.latents))
        }
    };
    let start = start_noise(args.seed, &shape, device);
    let latents = generate(
        model.as_ref(),
        &inputs,
        start,
        &cond,
        negative.as_ref(),
        &settings,
    );
    let out = args.out.unwrap_or_else(|| dir.join("samples.safetensors"));
    println!(
        "samples           {:?} in {} {} steps",
        latents.size(),
        args.steps,
        if args.heun { "Heun" } else { "Euler" }
    );
    match &clean {
        Some(clean) => {
            let mse = |a: &Tensor| (a - clean).square().mean(Kind::Float).double_value(&[]);
            let written = [
                ("latents".to_string(), latents.shallow_clone()),
                ("reference".to_string(), clean.shallow_clone()),
            ];
            flux_data::convert::write_tensors(&out, &written)?;
            println!(
                "mse vs data       {:.4} (the data's own variance: {:.4})",
                mse(&latents),
                mse(&clean.zeros_like())
            );
        }
        None => flux_data::convert::write_tensors(
            &out,
            &[("latents".to_string(), latents.shallow_clone())],
        )?,
    }
    println!("written           {}", out.display());
    if let (Some(folder), false) = (&args.encoders, args.prompts.is_empty() || args.latents_only) {
        drop(model);
        for path in decode_to_pngs(folder, &latents, &out, device)? {
            println!("image             {}", path.display());
        }
    }
    Ok(())
}

/// The model's latent grid `(height, width)` for --height / --width in pixels (each defaults
/// to the config's latent size), through the VAE of `folder` (returned beside it). Fails naming
/// the flag whose value does not divide.
fn latent_grid(
    folder: &Path,
    args: &SampleArgs,
    run: &RunConfig,
) -> Result<(i64, i64, AutoencoderConfig)> {
    let vae = AutoencoderConfig::read(&Autoencoder::find(folder)?)?;
    let (h, w) = latent_size(run, &vae, args.height, args.width)
        .map_err(|(side, e)| anyhow!("--{side} {e}"))?;
    Ok((h, w, vae))
}

/// Refuse, before anything is allocated, a request whose latents (and decoded images) alone
/// would not fit in the machine's memory, naming the size it would need (on the CPU, where an
/// allocation that fails aborts the process rather than raising an error).
fn fits_in_memory(
    args: &SampleArgs,
    run: &RunConfig,
    grid: Option<&(i64, i64, AutoencoderConfig)>,
    device: Device,
) -> Result<()> {
    let Some(have) = flux_cluster::memory::physical_bytes().filter(|_| device == Device::Cpu)
    else {
        return Ok(());
    };
    let channels = run.model.inputs().latent_channels;
    let t = &run.training;
    let (count, h, w) = match grid {
        Some((h, w, _)) => (args.prompts.len() as i64, *h, *w),
        None => (
            i64::try_from(args.count).unwrap_or(i64::MAX),
            t.latent_height,
            t.latent_width,
        ),
    };
    let mut need = ode_bytes(&[count, channels, h, w]);
    if let (Some((h, w, vae)), false) = (grid, args.latents_only) {
        let f = vae.downsampling()
            * if vae.packed_for(channels).unwrap_or(false) {
                2
            } else {
                1
            };
        need =
            need.saturating_add(vae.decode_bytes(count, h.saturating_mul(f), w.saturating_mul(f)));
    }
    if need <= have as u128 {
        return Ok(());
    }
    let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
    Err(anyhow!(
        "sampling {count} image(s) of {h}×{w} latents needs at least {:.1} GiB for the latents \
         and decoded images alone, more than this machine's {:.1} GiB: lower --count, --width or \
         --height",
        gib(need),
        gib(have as u128)
    ))
}

/// Decode sampled `latents` with the VAE in `folder/vae` (unpacking 2×2-packed latents,
/// undoing the latent normalisation) and write one PNG per sample beside `out`
/// (`samples.safetensors` → `samples_0.png`, …). Returns the files written.
fn decode_to_pngs(
    folder: &Path,
    latents: &Tensor,
    out: &Path,
    device: Device,
) -> Result<Vec<PathBuf>> {
    let vae_path = Autoencoder::find(folder)?;
    let vae = Autoencoder::load(&vae_path, device)?;
    let images = vae
        .decode_model_latents(latents)
        .map_err(|e| anyhow!("{}: {e}", vae_path.display()))?;
    let stem = out.with_extension("");
    let stem = stem.to_string_lossy();
    (0..images.size()[0])
        .map(|i| {
            let path = PathBuf::from(format!("{stem}_{i}.png"));
            write_png(&images, i, &path).map_err(|e| anyhow!(e))?;
            Ok(path)
        })
        .collect()
}
