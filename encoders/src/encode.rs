//! `flux-hpc data encode`: a folder of images with captions → the latent shards training reads.
//!
//! Images (JPEG, PNG, WebP, found under the folder in path order) are read as 8-bit RGB (16-bit,
//! grey, alpha and CMYK inputs converted), sent to the aspect-ratio bucket nearest their own and
//! fitted to it ([`crate::buckets`]), encoded in batches by the VAE (the posterior's mean and
//! log-variance) and their captions by CLIP and T5, and written per bucket into shards of
//! `samples_per_shard` (`{W}x{H}_{NNNNN}.h5`, each one bucket, written atomically). A run resumes:
//! shards that exist are skipped. Unreadable images and images smaller than `min_side` are skipped
//! and listed with the reason in `failed_files.json`. `empty_prompt.safetensors` holds the
//! encodings of the empty caption (`t5` `[L, D]`, `clip` `[D_pooled]`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flux_data::dataset::{Sample, ShardLayout, ShardWriter, StorageDtype, EMPTY_PROMPT};
use flux_data::ingest::{read_failed, write_failed, FailedFile, Progress};
use flux_data::VaeNorm;
use image::RgbImage;
use tch::{Kind, Tensor};

use crate::buckets::{fit, nearest, Bucket};
use crate::captions::Captions;
use crate::{Autoencoder, PromptEncoder};

/// An image file and its path relative to the folder (`/`-separated).
type Image = (PathBuf, String);

/// Image file extensions read (lower case).
const EXTENSIONS: [&str; 4] = ["jpg", "jpeg", "png", "webp"];

/// How to encode.
#[derive(Debug, Clone)]
pub struct EncodeOptions {
    /// The resolutions images are fitted to.
    pub buckets: Vec<Bucket>,
    /// Samples per shard.
    pub samples_per_shard: usize,
    /// Images encoded together.
    pub batch: usize,
    /// Images whose shorter side is below this many pixels are skipped.
    pub min_side: u32,
    /// Storage type of the shards.
    pub dtype: StorageDtype,
    /// Deflate level of the shards, if any.
    pub deflate: Option<u8>,
}

/// What an encode run did.
#[derive(Debug, Default)]
pub struct EncodeSummary {
    /// Shards written by this run.
    pub written: u64,
    /// Shards that existed already (resume).
    pub skipped: u64,
    /// Samples written by this run.
    pub samples: u64,
    /// Images skipped, with the reason.
    pub failed: Vec<FailedFile>,
    /// Samples per bucket over all shards planned.
    pub per_bucket: BTreeMap<Bucket, usize>,
}

/// The models an encode run uses, and the names the shards record for them (VAE, text, pooled).
pub struct Encoders<'a> {
    /// CLIP and T5 with their tokenizers.
    pub prompts: &'a PromptEncoder,
    /// The autoencoder.
    pub vae: &'a Autoencoder,
    /// Encoder names written into the shards.
    pub names: [String; 3],
}

/// Check that every bucket's sides are multiples of `multiple` pixels (the VAE's factor times
/// the 2×2 packing), naming the first that is not.
pub fn check_buckets(buckets: &[Bucket], multiple: u32) -> Result<(), String> {
    if buckets.is_empty() {
        return Err("no buckets".into());
    }
    match buckets
        .iter()
        .find(|b| b.width % multiple != 0 || b.height % multiple != 0)
    {
        Some(b) => Err(format!(
            "bucket {b}: sides must be multiples of {multiple} pixels (the VAE's downsampling \
             × 2 for packing)"
        )),
        None => Ok(()),
    }
}

/// Every image under `dir` with its path relative to `dir` (`/`-separated), in path order.
fn list_images(dir: &Path) -> Result<Vec<Image>, String> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let path = entry.map_err(|e| format!("{}: {e}", d.display()))?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
            {
                let relative = path
                    .strip_prefix(dir)
                    .expect("found under dir")
                    .to_string_lossy()
                    .replace('\\', "/");
                found.push((path, relative));
            }
        }
    }
    found.sort_by(|a, b| a.1.cmp(&b.1));
    Ok(found)
}

fn failed(file: &str, error: String) -> FailedFile {
    FailedFile {
        file: file.to_string(),
        error,
        attempts: 1,
    }
}

/// `images` `[n]` fitted to one bucket → `[n, 3, H, W]` f32 in [-1, 1].
fn pixels(images: &[RgbImage]) -> Tensor {
    let tensors: Vec<Tensor> = images
        .iter()
        .map(|im| {
            let (w, h) = im.dimensions();
            Tensor::from_slice(im.as_raw())
                .view([h as i64, w as i64, 3])
                .permute([2, 0, 1])
        })
        .collect();
    Tensor::stack(&tensors, 0).to_kind(Kind::Float) / 127.5 - 1.0
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    let t = t.to_kind(Kind::Float).to_device(tch::Device::Cpu);
    (0..t.size()[0])
        .map(|i| Vec::<f32>::try_from(t.get(i).flatten(0, -1)).expect("f32 rows"))
        .collect()
}

/// Encode the images under `images_dir` with `captions` into shards in `out_dir`.
pub fn encode_folder(
    images_dir: &Path,
    captions: &Captions,
    out_dir: &Path,
    encoders: &Encoders,
    options: &EncodeOptions,
    progress: &dyn Progress,
) -> Result<EncodeSummary, String> {
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let mut summary = EncodeSummary::default();
    let mut by_bucket: BTreeMap<Bucket, Vec<Image>> = BTreeMap::new();
    for (path, relative) in list_images(images_dir)? {
        match image::image_dimensions(&path) {
            Err(e) => summary
                .failed
                .push(failed(&relative, format!("unreadable image: {e}"))),
            Ok((w, h)) if w.min(h) < options.min_side => summary.failed.push(failed(
                &relative,
                format!(
                    "{w}×{h} is smaller than the minimum side of {} px",
                    options.min_side
                ),
            )),
            Ok((w, h)) => by_bucket
                .entry(nearest(&options.buckets, w, h))
                .or_default()
                .push((path, relative)),
        }
    }
    let per_shard = options.samples_per_shard.max(1);
    let shards: Vec<(Bucket, usize, &[Image])> = by_bucket
        .iter()
        .flat_map(|(&bucket, images)| {
            images
                .chunks(per_shard)
                .enumerate()
                .map(move |(i, chunk)| (bucket, i, chunk))
        })
        .collect();
    summary.per_bucket = by_bucket.iter().map(|(b, v)| (*b, v.len())).collect();
    progress.start(shards.len() as u64);
    // Images a finished shard left out stay listed when a rerun skips that shard.
    let listed_before = read_failed(out_dir);
    for (bucket, index, chunk) in shards {
        let out = out_dir.join(format!("{bucket}_{index:05}.h5"));
        if out.exists() {
            summary.skipped += 1;
            summary.failed.extend(
                listed_before
                    .iter()
                    .filter(|f| chunk.iter().any(|(_, relative)| *relative == f.file))
                    .cloned(),
            );
            progress.skip(1);
            continue;
        }
        let written = encode_shard(
            bucket,
            chunk,
            captions,
            &out,
            encoders,
            options,
            &mut summary,
        )?;
        if written > 0 {
            summary.written += 1;
            summary.samples += written;
        }
        progress.advance(&out.display().to_string());
    }
    progress.finish();
    let empty = encoders.prompts.encode(&[""]).map_err(|e| e.to_string())?;
    flux_data::convert::write_tensors(
        &out_dir.join(EMPTY_PROMPT),
        &[
            ("t5".to_string(), empty.text.get(0)),
            ("clip".to_string(), empty.pooled.get(0)),
        ],
    )
    .map_err(|e| e.to_string())?;
    write_failed(out_dir, &summary.failed).map_err(|e| e.to_string())?;
    Ok(summary)
}

/// Encode the images `chunk` of `bucket` into the shard `out`; images that fail to decode are
/// added to `summary.failed`. Returns the samples written (0: no shard).
fn encode_shard(
    bucket: Bucket,
    chunk: &[Image],
    captions: &Captions,
    out: &Path,
    encoders: &Encoders,
    options: &EncodeOptions,
    summary: &mut EncodeSummary,
) -> Result<u64, String> {
    let mut writer: Option<ShardWriter> = None;
    let mut written = 0;
    for batch in chunk.chunks(options.batch.max(1)) {
        let started = std::time::Instant::now();
        let mut images = Vec::new();
        let mut kept = Vec::new();
        for (path, relative) in batch {
            match image::open(path) {
                Ok(im) => {
                    images.push(fit(&im.to_rgb8(), bucket));
                    kept.push((path, relative));
                }
                Err(e) => summary
                    .failed
                    .push(failed(relative, format!("unreadable image: {e}"))),
            }
        }
        if images.is_empty() {
            continue;
        }
        let read = started.elapsed().as_secs_f64();
        let texts: Vec<String> = kept.iter().map(|(p, r)| captions.of(p, r)).collect();
        let prompts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let vae = encoders.vae;
        let images_t = pixels(&images).to_device(vae.device());
        let posterior = tch::no_grad(|| vae.encode(&images_t.to_kind(vae.kind())));
        let encoded = started.elapsed().as_secs_f64();
        let text = encoders
            .prompts
            .encode(&prompts)
            .map_err(|e| e.to_string())?;
        tracing::debug!(
            images = kept.len(),
            read_s = read,
            vae_s = encoded - read,
            text_s = started.elapsed().as_secs_f64() - encoded,
            "encoded a batch"
        );
        let (means, logvars) = (rows(&posterior.mean), rows(&posterior.logvar));
        let (t5, clip) = (rows(&text.text), rows(&text.pooled));
        if writer.is_none() {
            let [c, h, w] = [1, 2, 3].map(|d| posterior.mean.size()[d] as usize);
            let [l, d] = [1, 2].map(|i| text.text.size()[i] as usize);
            let config = vae.config();
            let layout = ShardLayout {
                latent: [c, h, w],
                text: [l, d],
                pooled: text.pooled.size()[1] as usize,
                dtype: options.dtype,
                logvar: true,
                captions: true,
                mask: false,
                norm: VaeNorm {
                    scaling_factor: config.scaling_factor,
                    shift_factor: config.shift_factor.unwrap_or(0.0),
                },
                encoders: encoders.names.clone(),
            };
            writer = Some(
                ShardWriter::create(out, &layout, options.deflate).map_err(|e| e.to_string())?,
            );
        }
        let w = writer.as_mut().expect("created above");
        for (i, (_, relative)) in kept.iter().enumerate() {
            w.append(&Sample {
                id: relative.to_string(),
                latents: means[i].clone(),
                logvar: Some(logvars[i].clone()),
                t5: t5[i].clone(),
                clip: clip[i].clone(),
                caption: Some(texts[i].clone()),
                mask: None,
            })
            .map_err(|e| e.to_string())?;
            written += 1;
        }
    }
    if let Some(w) = writer {
        w.finish().map_err(|e| e.to_string())?;
    }
    Ok(written)
}
