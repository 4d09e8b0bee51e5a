//! `flux-hpc data encode`: a folder of images with captions → the latent shards training reads.
//!
//! Images (JPEG, PNG, WebP, found under the folder in path order, each file once:
//! [`crate::image_files`]) are turned upright by their EXIF orientation, read as 8-bit RGB (16-bit,
//! grey, alpha and CMYK inputs converted), sent to the aspect-ratio bucket nearest their own and
//! fitted to it ([`crate::buckets`]), encoded in batches by the VAE (the posterior's mean and
//! log-variance) and their captions by CLIP and T5, and written per bucket into shards of
//! `samples_per_shard` (`{W}x{H}_{NNNNN}.h5`, each one bucket, written atomically).
//!
//! A run resumes by content: `sources.jsonl` ([`Sources`]) records the images of every shard with
//! their size and CRC-32, so a rerun encodes exactly the images not yet there into new shards, and
//! refuses an image that changed since it was encoded. Unreadable images, images smaller than
//! `min_side`, special files, captions that are not UTF-8 text and captions the text encoders
//! refuse are skipped and listed with the reason in `failed_files.json`; the run goes on.
//! `empty_prompt.safetensors` holds the encodings of the empty caption (`t5` `[L, D]`, `clip`
//! `[D_pooled]`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flux_data::dataset::{
    sample_ids, Sample, ShardLayout, ShardWriter, StorageDtype, EMPTY_PROMPT,
};
use flux_data::ingest::{write_failed, FailedFile, Progress, Source, Sources, Standing};
use flux_data::VaeNorm;
use image::RgbImage;
use tch::{Kind, Tensor};

use crate::buckets::{fit, nearest, Bucket};
use crate::captions::Captions;
use crate::image_files::{find_images, open_upright, upright_dimensions, Image};
use crate::{Autoencoder, PromptEmbeddings, PromptEncoder};

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
    /// Images already encoded by an earlier run (found by content in `sources.jsonl`).
    pub skipped: u64,
    /// Samples written by this run.
    pub samples: u64,
    /// Images skipped, with the reason.
    pub failed: Vec<FailedFile>,
    /// Images this run encodes, per bucket.
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

/// The longest bucket side encoded, in pixels: 16× FLUX.1's native 1024. An image fitted to a
/// larger bucket would take tens of GiB before the VAE sees it, and its allocation would abort
/// the process rather than fail.
pub const MAX_BUCKET_SIDE: u32 = 16384;

/// Check that every bucket's sides are multiples of `multiple` pixels (the VAE's factor times
/// the 2×2 packing) and at most [`MAX_BUCKET_SIDE`], naming the first that is not.
pub fn check_buckets(buckets: &[Bucket], multiple: u32) -> Result<(), String> {
    if buckets.is_empty() {
        return Err("no buckets".into());
    }
    if let Some(b) = buckets
        .iter()
        .find(|b| b.width.max(b.height) > MAX_BUCKET_SIDE)
    {
        return Err(format!(
            "bucket {b}: sides above {MAX_BUCKET_SIDE} pixels are not encoded (one such image \
             alone would need {:.1} GiB of pixels at f32)",
            f64::from(b.width) * f64::from(b.height) * 3.0 * 4.0 / f64::from(1u32 << 30)
        ));
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

/// Encode the images under `images_dir` with `captions` into shards in `out_dir`: those not
/// already there (by content), into new shards.
pub fn encode_folder(
    images_dir: &Path,
    captions: &Captions,
    out_dir: &Path,
    encoders: &Encoders,
    options: &EncodeOptions,
    progress: &dyn Progress,
) -> Result<EncodeSummary, String> {
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let found = find_images(images_dir)?;
    let mut summary = EncodeSummary::default();
    summary
        .failed
        .extend(found.skipped.into_iter().map(|(f, why)| failed(&f, why)));
    let mut sources = Sources::open(out_dir, sample_ids).map_err(|e| e.to_string())?;
    let mut by_bucket: BTreeMap<Bucket, Vec<Input>> = BTreeMap::new();
    for (path, relative) in found.images {
        let source = match Source::of_files(&relative, std::slice::from_ref(&path)) {
            Ok(source) => source,
            Err(e) => {
                summary
                    .failed
                    .push(failed(&relative, format!("unreadable: {e}")));
                continue;
            }
        };
        let shown = path.display().to_string();
        if let Standing::Done(_) = sources
            .standing(&source, &shown)
            .map_err(|e| e.to_string())?
        {
            summary.skipped += 1;
            continue;
        }
        match upright_dimensions(&path) {
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
                .push(((path, relative), source)),
        }
    }
    let per_shard = options.samples_per_shard.max(1);
    let shards: Vec<(Bucket, usize, &[Input])> = by_bucket
        .iter()
        .flat_map(|(&bucket, images)| {
            let first = sources.next_index(&format!("{bucket}_"));
            images
                .chunks(per_shard)
                .enumerate()
                .map(move |(i, chunk)| (bucket, first + i, chunk))
        })
        .collect();
    summary.per_bucket = by_bucket.iter().map(|(b, v)| (*b, v.len())).collect();
    progress.start(shards.len() as u64);
    for (bucket, index, chunk) in shards {
        let shard = format!("{bucket}_{index:05}.h5");
        let target = Target {
            bucket,
            out: out_dir.join(&shard),
            shard,
        };
        let written = encode_shard(
            &target,
            chunk,
            captions,
            encoders,
            options,
            &mut sources,
            &mut summary,
        )?;
        if written > 0 {
            summary.written += 1;
            summary.samples += written;
        }
        progress.advance(&target.out.display().to_string());
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

/// An image to encode, with its record for `sources.jsonl`.
type Input = (Image, Source);

/// The shard one chunk of a bucket is written to.
struct Target {
    bucket: Bucket,
    /// Its file name in the output directory.
    shard: String,
    out: PathBuf,
}

/// The captions' encodings, one row each, with the captions the text encoders refuse taken
/// out: the positions kept, their embeddings, and `(position, error)` for each refused. A batch
/// that fails is encoded caption by caption to find the ones at fault.
fn encode_captions(
    encoder: &PromptEncoder,
    texts: &[String],
) -> (Vec<usize>, Option<PromptEmbeddings>, Vec<(usize, String)>) {
    let prompts: Vec<&str> = texts.iter().map(String::as_str).collect();
    if let Ok(all) = encoder.encode(&prompts) {
        return ((0..texts.len()).collect(), Some(all), Vec::new());
    }
    let (mut kept, mut rows, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    for (i, prompt) in prompts.iter().enumerate() {
        match encoder.encode(&[prompt]) {
            Ok(one) => {
                kept.push(i);
                rows.push(one);
            }
            Err(e) => refused.push((i, format!("caption refused by the text encoders: {e}"))),
        }
    }
    let joined = (!rows.is_empty()).then(|| {
        let cat = |part: fn(&PromptEmbeddings) -> &Tensor| {
            Tensor::cat(&rows.iter().map(part).collect::<Vec<_>>(), 0)
        };
        PromptEmbeddings {
            text: cat(|e| &e.text),
            pooled: cat(|e| &e.pooled),
        }
    });
    (kept, joined, refused)
}

/// Encode the images `chunk` into `target`'s shard; images that fail to decode, or whose
/// caption cannot be read or encoded, are added to `summary.failed`. The shard's images are
/// recorded in `sources` just before it is published. Returns the samples written (0: no shard).
fn encode_shard(
    target: &Target,
    chunk: &[Input],
    captions: &Captions,
    encoders: &Encoders,
    options: &EncodeOptions,
    sources: &mut Sources,
    summary: &mut EncodeSummary,
) -> Result<u64, String> {
    let mut writer: Option<ShardWriter> = None;
    let mut written = Vec::new();
    for batch in chunk.chunks(options.batch.max(1)) {
        let started = std::time::Instant::now();
        let mut images = Vec::new();
        let mut kept = Vec::new();
        let mut texts = Vec::new();
        for ((path, relative), source) in batch {
            let caption = captions.of(path, relative);
            match (open_upright(path), caption) {
                (Ok(im), Ok(caption)) => {
                    images.push(fit(&im.to_rgb8(), target.bucket));
                    kept.push((relative, source));
                    texts.push(caption);
                }
                (Err(e), _) => summary
                    .failed
                    .push(failed(relative, format!("unreadable image: {e}"))),
                (_, Err(e)) => summary.failed.push(failed(relative, e)),
            }
        }
        if texts.is_empty() {
            continue;
        }
        let read = started.elapsed().as_secs_f64();
        let (encodable, text, refused) = encode_captions(encoders.prompts, &texts);
        for (i, why) in refused {
            summary.failed.push(failed(kept[i].0, why));
        }
        let Some(text) = text else {
            continue;
        };
        let images: Vec<RgbImage> = encodable.iter().map(|&i| images[i].clone()).collect();
        let kept: Vec<_> = encodable.iter().map(|&i| kept[i]).collect();
        let texts: Vec<String> = encodable.iter().map(|&i| texts[i].clone()).collect();
        let encoded = started.elapsed().as_secs_f64();
        let vae = encoders.vae;
        let images_t = pixels(&images).to_device(vae.device());
        let posterior = tch::no_grad(|| vae.encode(&images_t.to_kind(vae.kind())));
        tracing::debug!(
            images = kept.len(),
            read_s = read,
            text_s = encoded - read,
            vae_s = started.elapsed().as_secs_f64() - encoded,
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
                ShardWriter::create(&target.out, &layout, options.deflate)
                    .map_err(|e| e.to_string())?,
            );
        }
        let w = writer.as_mut().expect("created above");
        for (i, (relative, source)) in kept.iter().enumerate() {
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
            written.push((*source).clone());
        }
    }
    let count = written.len() as u64;
    if let Some(w) = writer {
        sources
            .record(&target.shard, written)
            .map_err(|e| e.to_string())?;
        w.finish().map_err(|e| e.to_string())?;
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_must_divide_and_fit() {
        let bucket = |width, height| Bucket { width, height };
        assert!(check_buckets(&[bucket(1024, 768)], 16).is_ok());
        assert!(check_buckets(&[], 16).unwrap_err().contains("no buckets"));
        let err = check_buckets(&[bucket(1000, 768)], 16).unwrap_err();
        assert!(
            err.contains("1000x768") && err.contains("multiples of 16"),
            "{err}"
        );
        let err = check_buckets(&[bucket(100_000, 100_000)], 16).unwrap_err();
        assert!(err.contains("sides above 16384"), "{err}");
    }
}
