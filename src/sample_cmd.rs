//! `flux-hpc sample`: generate latents from trained weights with the flow-matching ODE, conditioned
//! on prompts (encoded by a FLUX.1 folder's text encoders, decoded to PNGs by its VAE) or on the
//! held-out synthetic samples.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use flux_cluster::Placement;
use flux_data::convert::SafetensorsReader;
use flux_data::KeyedRng;
use flux_data::LatentSamples;
use flux_encoders::weights::read_config;
use flux_encoders::{write_png, Autoencoder, AutoencoderConfig, PromptEncoder};
use flux_model::tp::TpContext;
use flux_model::DiffusionBatch;
use flux_train::sampling::guided_velocity;
use flux_train::scheduler::{integrate, FlowMatchEulerDiscreteScheduler};
use flux_train::{synthetic_data, RunConfig, EVAL_BASE};
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
    /// text_encoder_2/ (T5), vae/. Text encoders are freed before the transformer is loaded.
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
    // Prompts are encoded (and the encoders freed) before the transformer is loaded.
    let prompted = match &args.encoders {
        Some(folder) if !args.prompts.is_empty() => {
            let mut prompts = args.prompts.clone();
            prompts.extend(args.negative_prompt.clone());
            let (txt, y) = encode_prompts(folder, &prompts, &run, device)?;
            let grid = latent_grid(folder, &args, &run)?;
            Some((txt, y, grid))
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
    let (cond, negative) = match prompted {
        Some((txt, y, (h, w))) => {
            let b = args.prompts.len() as i64;
            let shape = [b, inputs.latent_channels, h, w];
            let negative = args.negative_prompt.as_ref().map(|_| {
                let last = |t: &Tensor| t.narrow(0, b, 1).expand_as(&t.narrow(0, 0, b));
                (last(&txt), last(&y))
            });
            let samples = LatentSamples {
                latents: Tensor::zeros(shape, (Kind::Float, device)),
                txt: txt.narrow(0, 0, b),
                y: y.narrow(0, 0, b),
                mask: None,
            };
            (samples, negative)
        }
        None => {
            let data = synthetic_data(&run);
            let ids: Vec<u64> = (EVAL_BASE..EVAL_BASE + args.count).collect();
            (data.batch(&ids, device), None)
        }
    };
    let b = cond.latents.size()[0];
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
    let (empty_txt, empty_y) =
        negative.unwrap_or_else(|| (cond.txt.zeros_like(), cond.y.zeros_like()));
    let size = cond.latents.size();
    let image_tokens = inputs.image_tokens(size[2], size[3]);
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
    let out = args.out.unwrap_or_else(|| dir.join("samples.safetensors"));
    println!(
        "samples           {:?} in {} {} steps",
        latents.size(),
        args.steps,
        if args.heun { "Heun" } else { "Euler" }
    );
    if args.prompts.is_empty() {
        let mse = |a: &Tensor| {
            (a - &cond.latents)
                .square()
                .mean(Kind::Float)
                .double_value(&[])
        };
        let written = [
            ("latents".to_string(), latents.shallow_clone()),
            ("reference".to_string(), cond.latents.shallow_clone()),
        ];
        flux_data::convert::write_tensors(&out, &written)?;
        println!(
            "mse vs data       {:.4} (the data's own variance: {:.4})",
            mse(&latents),
            mse(&cond.latents.zeros_like())
        );
    } else {
        flux_data::convert::write_tensors(
            &out,
            &[("latents".to_string(), latents.shallow_clone())],
        )?;
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

/// The T5 states and CLIP pooled vectors of `prompts` from the text encoders in `folder`,
/// checked against the model's input widths.
fn encode_prompts(
    folder: &Path,
    prompts: &[String],
    run: &RunConfig,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    let kind = match device {
        Device::Cpu => Kind::Float,
        _ => Kind::BFloat16,
    };
    let encoder = PromptEncoder::load(folder, run.training.text_len as usize, kind, device)?;
    let inputs = run.model.inputs();
    let (text, pooled) = encoder.widths();
    if inputs.text_dim.is_some_and(|d| d != text) || inputs.pooled_dim.is_some_and(|d| d != pooled)
    {
        bail!(
            "{}: the text encoders give states of width {text} and a pooled vector of width \
             {pooled}, the model takes {:?} and {:?} (model.context_dim, model.vec_in_dim)",
            folder.display(),
            inputs.text_dim,
            inputs.pooled_dim
        );
    }
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let embeddings = encoder.encode(&prompts)?;
    Ok((embeddings.text, embeddings.pooled))
}

/// The model's latent grid `(height, width)` for --height / --width in pixels (each defaults
/// to the config's latent size), through the VAE in `folder/vae`: pixels / its downsampling /
/// 2 for 2×2-packed latents. Fails naming the flag whose value does not divide.
fn latent_grid(folder: &Path, args: &SampleArgs, run: &RunConfig) -> Result<(i64, i64)> {
    let vae: AutoencoderConfig = read_config(&folder.join("vae"))?;
    let packed = run.model.inputs().latent_channels == 4 * vae.latent_channels;
    let factor = vae.downsampling() * if packed { 2 } else { 1 };
    let side = |flag: &str, pixels: Option<i64>, default: i64| match pixels {
        None => Ok(default),
        Some(p) if p > 0 && p % factor == 0 => Ok(p / factor),
        Some(p) => Err(anyhow!(
            "--{flag} {p} is not a positive multiple of {factor} pixels (the VAE's downsampling \
             {}{})",
            vae.downsampling(),
            if packed { " × 2×2 packing" } else { "" }
        )),
    };
    let t = &run.training;
    Ok((
        side("height", args.height, t.latent_height)?,
        side("width", args.width, t.latent_width)?,
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
    let vae = Autoencoder::load(&folder.join("vae"), device)?;
    let vae_channels = vae.config().latent_channels;
    let channels = latents.size()[1];
    let z = if channels == 4 * vae_channels {
        latents.pixel_shuffle(2)
    } else if channels == vae_channels {
        latents.shallow_clone()
    } else {
        bail!(
            "{}: the VAE has {vae_channels} latent channels, the model's {channels} are neither \
             that nor 4× that (2×2-packed)",
            folder.join("vae").display()
        );
    };
    let images = tch::no_grad(|| vae.decode(&vae.denormalize(&z)));
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
