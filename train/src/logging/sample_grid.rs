//! Sample grids while training (`[sampling]`): the prompts are encoded once, at the start, by
//! the first rank (the text encoders are then freed) and shared with the others through
//! `<run dir>/samples/prompts.safetensors`; at each due step the ranks of the first
//! data-parallel replica integrate one image per prompt and seed together (as tensor
//! parallelism needs), and the first rank decodes them with the autoencoder into a grid.

use std::path::{Path, PathBuf};

use flux_encoders::{grid, Autoencoder, AutoencoderConfig, PromptEncoder};
use flux_model::tp::Collective;
use image::RgbImage;
use tch::{Device, Kind, Tensor};

use crate::sampling::{start_noise, Conditioning};
use crate::{RunConfig, SamplingConfig, Trainer};

/// Where, under the run directory, the grids and the shared prompt encodings go.
pub const SAMPLES_DIR: &str = "samples";
const PROMPTS_FILE: &str = "prompts.safetensors";

/// The prompts' encodings and what turns them into grids.
pub struct SampleGrid {
    config: SamplingConfig,
    cond: Conditioning,
    /// The model's latent `[C, h, w]` of one image.
    shape: [i64; 3],
    /// On the rank that draws the grids.
    vae: Option<Autoencoder>,
}

/// The T5 states `[P, text_len, D]` and CLIP pooled vectors `[P, D']` of `prompts` from the
/// text encoders of the FLUX.1 folder `folder` (bf16 T5 on a GPU), checked against the model's
/// input widths (the error names the model's fields).
pub fn encode_prompts(
    folder: &Path,
    prompts: &[String],
    run: &RunConfig,
    device: Device,
) -> Result<Conditioning, String> {
    let kind = match device {
        Device::Cpu => Kind::Float,
        _ => Kind::BFloat16,
    };
    let encoder = PromptEncoder::load(folder, run.training.text_len as usize, kind, device)
        .map_err(|e| e.to_string())?;
    let inputs = run.model.inputs();
    let (text, pooled) = encoder.widths();
    if inputs.text_dim.is_some_and(|d| d != text) || inputs.pooled_dim.is_some_and(|d| d != pooled)
    {
        return Err(format!(
            "{}: the text encoders give states of width {text} and a pooled vector of width \
             {pooled}, the model takes {:?} and {:?} (model.context_dim, model.vec_in_dim)",
            folder.display(),
            inputs.text_dim,
            inputs.pooled_dim
        ));
    }
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let embeddings = encoder.encode(&prompts).map_err(|e| e.to_string())?;
    Ok(Conditioning {
        text: embeddings.text,
        pooled: embeddings.pooled,
    })
}

impl SampleGrid {
    /// Set up `run`'s `[sampling]` on every rank of `world` together (`None` when it samples
    /// nothing). Rank 0 encodes the prompts into the run directory; ranks that `take_part` in
    /// sampling read them; rank 0 keeps the autoencoder. Every rank fails together, rank 0
    /// with the reason, when rank 0 cannot.
    pub fn prepare(
        run: &RunConfig,
        world: &dyn Collective,
        take_part: bool,
        device: Device,
    ) -> Result<Option<Self>, String> {
        let config = &run.sampling;
        if !config.enabled() {
            return Ok(None);
        }
        let folder = config.encoders.as_deref().expect("validated");
        let file = run.checkpoint.dir.join(SAMPLES_DIR).join(PROMPTS_FILE);
        let leader = world.rank() == 0;
        let encoded = match leader {
            true => encode_and_share(folder, run, &file, device),
            false => Ok(()),
        };
        let failed = world.count_failures(encoded.is_err());
        encoded.map_err(|e| format!("[sampling]: {e}"))?;
        if failed > 0 {
            return Err(
                "[sampling]: rank 0 could not encode the prompts (its error says why)".into(),
            );
        }
        if !take_part {
            return Ok(None);
        }
        let vae_path = Autoencoder::find(folder).map_err(|e| e.to_string())?;
        let vae_config = AutoencoderConfig::read(&vae_path).map_err(|e| e.to_string())?;
        let shape = latent_shape(run, &vae_config)?;
        let tensors = flux_data::convert::SafetensorsReader::open(&file)
            .and_then(|r| r.read_all())
            .map_err(|e| e.to_string())?;
        let part = |name: &str| {
            tensors
                .get(name)
                .map(|t| t.to_device(device))
                .ok_or_else(|| format!("{}: no `{name}`", file.display()))
        };
        let cond = Conditioning {
            text: part("text")?,
            pooled: part("pooled")?,
        };
        let vae = match leader {
            true => Some(Autoencoder::load(&vae_path, device).map_err(|e| e.to_string())?),
            false => None,
        };
        Ok(Some(Self {
            config: config.clone(),
            cond,
            shape,
            vae,
        }))
    }

    /// Sample every prompt at every seed with `trainer`'s current weights (all taking ranks
    /// together); on the rank holding the autoencoder, the decoded grid (rows: prompts,
    /// columns: seeds).
    pub fn render(&self, trainer: &Trainer) -> Result<Option<RgbImage>, String> {
        let prompts = self.cond.text.size()[0];
        let device = self.cond.text.device();
        let settings = self.config.ode();
        let [c, h, w] = self.shape;
        // One batch per seed: every prompt from that seed's noise.
        let columns: Vec<Tensor> = self
            .config
            .seeds
            .iter()
            .map(|&seed| {
                let start = start_noise(seed, &[1, c, h, w], device).repeat([prompts, 1, 1, 1]);
                trainer.sample(start, &self.cond, None, &settings)
            })
            .collect();
        let Some(vae) = &self.vae else {
            return Ok(None);
        };
        // [P, S, C, h, w] → row-major cells.
        let latents = Tensor::stack(&columns, 1).flatten(0, 1);
        let images = vae.decode_model_latents(&latents)?;
        grid(&images, self.config.seeds.len()).map(Some)
    }

    /// The grid file of `step` under `run_dir`.
    pub fn path(run_dir: &Path, step: u64) -> PathBuf {
        run_dir
            .join(SAMPLES_DIR)
            .join(format!("step_{step:09}.png"))
    }
}

/// Encode the prompts and write them to `file` (atomically, checksummed).
fn encode_and_share(
    folder: &Path,
    run: &RunConfig,
    file: &Path,
    device: Device,
) -> Result<(), String> {
    // Check the image size first: it needs only the autoencoder's config.
    let vae = Autoencoder::find(folder)
        .and_then(|p| AutoencoderConfig::read(&p))
        .map_err(|e| e.to_string())?;
    latent_shape(run, &vae)?;
    let cond = encode_prompts(folder, &run.sampling.prompts, run, device)?;
    std::fs::create_dir_all(file.parent().expect("a file under the run dir"))
        .map_err(|e| format!("{}: {e}", file.display()))?;
    let tensors = [
        ("text".to_string(), cond.text.to_kind(Kind::Float)),
        ("pooled".to_string(), cond.pooled.to_kind(Kind::Float)),
    ];
    flux_data::convert::write_tensors(file, &tensors).map_err(|e| e.to_string())
}

/// The model's latent `[C, h, w]` of one sampled image: `[sampling] width × height` pixels
/// through `vae`, or the training latent size.
fn latent_shape(run: &RunConfig, vae: &AutoencoderConfig) -> Result<[i64; 3], String> {
    let sampling = &run.sampling;
    let (h, w) = latent_size(run, vae, sampling.height, sampling.width)
        .map_err(|(side, e)| format!("sampling.{side}: {e}"))?;
    Ok([run.model.inputs().latent_channels, h, w])
}

/// The model's latent `(height, width)` for images of `height × width` pixels through `vae`
/// (each side defaults to `run`'s training latent size). Fails naming the side (`"height"` or
/// `"width"`) whose pixels the autoencoder and packing do not divide.
pub fn latent_size(
    run: &RunConfig,
    vae: &AutoencoderConfig,
    height: Option<i64>,
    width: Option<i64>,
) -> Result<(i64, i64), (&'static str, String)> {
    let channels = run.model.inputs().latent_channels;
    let t = &run.training;
    let side = |name: &'static str, pixels: Option<i64>, default: i64| match pixels {
        None => Ok(default),
        Some(p) => vae.latent_side(p, channels).map_err(|e| (name, e)),
    };
    Ok((
        side("height", height, t.latent_height)?,
        side("width", width, t.latent_width)?,
    ))
}
