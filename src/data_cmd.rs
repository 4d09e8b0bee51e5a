//! `flux-hpc data`: ingest pre-encoded samples or encode images into HDF5 latent shards, and
//! validate shards.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use clap::{Args, Subcommand, ValueEnum};
use flux_cluster::Placement;
use flux_data::dataset::{validate, StorageDtype};
use flux_data::ingest::{
    ingest_dir, ingest_http, ingest_tars, FailedFile, HttpSource, IngestOptions, IngestSummary,
    LayoutChoice, Progress, RetryPolicy,
};
use flux_data::VaeNorm;
use flux_encoders::{
    check_buckets, encode_folder, Autoencoder, Bucket, Captions, EncodeOptions, Encoders,
    PromptEncoder,
};
use indicatif::{ProgressBar, ProgressStyle};

use flux_train::RunConfig;

use crate::DeviceArgs;

/// Arguments of `flux-hpc data`.
#[derive(Debug, Args)]
pub struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Debug, Subcommand)]
enum DataCommand {
    /// Convert pre-encoded samples into HDF5 latent shards (format: docs/formats.md).
    ///
    /// Sources (exactly one):
    ///   --tar FILES      WebDataset tar shards in MLPerf's pre-encoded format: per sample
    ///                    `{key}.mean.bytes`, `{key}.logvar.bytes`, `{key}.t5.bytes`,
    ///                    `{key}.clip.bytes` (npy, uint16 holding bf16); one .h5 per tar.
    ///   --dir DIR        per-sample files `{key}.{field}.npy` or `{key}.safetensors`
    ///                    (fields mean|latents, logvar, t5, clip; optional `{key}.txt`).
    ///   --url BASE       streamed from HTTP: BASE/MANIFEST lists tar shards, BASE/MD5 their
    ///                    digests; downloads run concurrently with retries and backoff, failures
    ///                    are skipped and listed in OUT/failed_files.json.
    /// Re-running resumes by content: OUT/sources.jsonl records each shard's inputs with their
    /// size and CRC-32, so a rerun writes exactly what is missing, and an input that changed, or
    /// another input under a name already taken, is refused by name.
    ///
    /// Example: flux-hpc data ingest --url https://host/flux --manifest shards.txt \
    ///            --md5 md5sums.txt --out data/train
    Ingest(Box<IngestArgs>),
    /// Encode a folder of images and captions into HDF5 latent shards with a FLUX.1 folder's VAE,
    /// CLIP and T5.
    ///
    /// Images (JPEG, PNG, WebP, found recursively) go to the aspect-ratio bucket nearest their
    /// own, are resized (bicubic) to cover it and center-cropped; captions come from a sidecar
    /// `{stem}.txt` or from --captions (JSONL `{"file", "caption"}` lines or `file,caption` CSV).
    /// Each bucket is written to its own shards `{W}x{H}_{N}.h5`, which training reads as
    /// resolution buckets. Images are turned upright by their EXIF orientation first; directory
    /// links are followed without loops and each file is read once. Unreadable or too-small
    /// images, special files and captions that are not UTF-8 text are skipped and listed in
    /// OUT/failed_files.json; OUT/empty_prompt.safetensors holds the empty caption's encodings.
    /// Re-running resumes by content (OUT/sources.jsonl): new images go into new shards, an image
    /// that changed since it was encoded is refused by name.
    ///
    /// Example: flux-hpc data encode --images photos/ --encoders FLUX.1-dev --out data/photos \
    ///            --buckets 1024x1024,1152x896,896x1152 --text-len 512
    Encode(Box<EncodeArgs>),
    /// Check shards' structure and every dataset's CRC-32; lists each problem with its file.
    ///
    /// Example: flux-hpc data validate data/train
    Validate {
        /// Shard files or directories of them.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
}

#[derive(Debug, Args)]
struct EncodeArgs {
    /// Folder of images.
    #[arg(long)]
    images: PathBuf,
    /// Caption file (.jsonl or .csv); default: a `{stem}.txt` beside each image.
    #[arg(long)]
    captions: Option<PathBuf>,
    /// A FLUX.1 folder as the model repositories ship it: tokenizer/ + text_encoder/ (CLIP),
    /// tokenizer_2/ + text_encoder_2/ (T5), and vae/ (diffusers) or BFL's ae.safetensors.
    #[arg(long)]
    encoders: PathBuf,
    /// Output directory for the shards.
    #[arg(long)]
    out: PathBuf,
    /// The run config the shards are for: its `[data] buckets` and `[training] text_len` are
    /// used (instead of --buckets and --text-len).
    #[arg(long, conflicts_with_all = ["buckets", "text_len"])]
    config: Option<PathBuf>,
    /// With --config: override a config value, e.g. `--set training.text_len=256`.
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "config")]
    overrides: Vec<String>,
    /// Resolution buckets, WIDTHxHEIGHT, comma-separated (sides multiples of the VAE's factor
    /// × 2) [default: 1024x1024].
    #[arg(long, value_delimiter = ',')]
    buckets: Vec<Bucket>,
    /// T5 tokens per caption (FLUX.1 [dev]: 512, [schnell]: 256) [default: 512].
    #[arg(long)]
    text_len: Option<usize>,
    /// Images whose shorter side is below this many pixels are skipped.
    #[arg(long, default_value_t = 256)]
    min_side: u32,
    /// Images encoded together.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Samples per shard.
    #[arg(long, default_value_t = 1024)]
    samples_per_shard: usize,
    /// Storage type of the shards.
    #[arg(long, default_value = "bf16")]
    dtype: StorageDtype,
    /// Deflate level 1–9 (default: uncompressed).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=9))]
    deflate: Option<u8>,
    #[command(flatten)]
    device: DeviceArgs,
}

/// How stored latents are normalised for training.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LatentNorm {
    /// FLUX.1's autoencoder: 0.3611 · (z − 0.1159); for raw VAE outputs (MLPerf's).
    Flux1,
    /// Latents are stored normalised already.
    Identity,
}

#[derive(Debug, Args)]
struct IngestArgs {
    /// Output directory for the shards.
    #[arg(long)]
    out: PathBuf,
    /// WebDataset tar shards to convert.
    #[arg(long, num_args = 1.., group = "source")]
    tar: Vec<PathBuf>,
    /// Directory of per-sample npy / safetensors files.
    #[arg(long, group = "source")]
    dir: Option<PathBuf>,
    /// Base URL to stream tar shards from.
    #[arg(long, group = "source", requires = "manifest")]
    url: Option<String>,
    /// Manifest file name under --url (one tar name per line).
    #[arg(long)]
    manifest: Option<String>,
    /// MD5 list file name under --url (`md5sum` format).
    #[arg(long)]
    md5: Option<String>,
    /// Concurrent downloads.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Downloaded files kept on disk at once (bounds disk use).
    #[arg(long, default_value_t = 8)]
    prefetch: usize,
    /// Attempts per file before it is skipped.
    #[arg(long, default_value_t = 6)]
    attempts: u32,
    /// First retry delay in milliseconds (doubles each retry, at most 60 s).
    #[arg(long, default_value_t = 1000)]
    backoff_ms: u64,
    /// Directory for downloads in flight (default: OUT/.download).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Storage type of the shards.
    #[arg(long, default_value = "bf16")]
    dtype: StorageDtype,
    /// Deflate level 1–9 (default: uncompressed).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=9))]
    deflate: Option<u8>,
    /// Samples per shard (only for --dir).
    #[arg(long, default_value_t = 1024)]
    samples_per_shard: usize,
    /// Normalisation recorded for training.
    #[arg(long, value_enum, default_value = "flux1")]
    latent_norm: LatentNorm,
    /// Name of the VAE recorded in the shards.
    #[arg(long, default_value = "black-forest-labs/FLUX.1-dev:vae")]
    vae_encoder: String,
    /// Name of the text encoder recorded in the shards.
    #[arg(long, default_value = "google/t5-v1_1-xxl")]
    text_encoder: String,
    /// Name of the pooled-text encoder recorded in the shards.
    #[arg(long, default_value = "openai/clip-vit-large-patch14")]
    pooled_encoder: String,
}

/// An indicatif bar over input files.
struct Bar(ProgressBar);

impl Progress for Bar {
    fn start(&self, total: u64) {
        self.0.set_length(total);
    }
    fn skip(&self, n: u64) {
        self.0.inc(n);
    }
    fn advance(&self, name: &str) {
        self.0.set_message(name.to_string());
        self.0.inc(1);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Run the subcommand.
pub fn run(args: DataArgs) -> Result<()> {
    match args.command {
        DataCommand::Ingest(args) => ingest(*args),
        DataCommand::Encode(args) => encode(*args),
        DataCommand::Validate { paths } => {
            let report = validate(&paths)?;
            for (path, samples) in &report.good {
                println!("ok      {} ({samples} samples)", path.display());
            }
            for problem in &report.problems {
                println!("FAILED  {problem}");
            }
            println!(
                "{} shard(s) good with {} samples, {} problem(s)",
                report.good.len(),
                report.samples(),
                report.problems.len()
            );
            if !report.problems.is_empty() {
                bail!("{} shard(s) failed validation", report.problems.len());
            }
            Ok(())
        }
    }
}

fn ingest(args: IngestArgs) -> Result<()> {
    let options = IngestOptions {
        layout: LayoutChoice {
            dtype: args.dtype,
            norm: match args.latent_norm {
                LatentNorm::Flux1 => VaeNorm::FLUX1,
                LatentNorm::Identity => VaeNorm {
                    scaling_factor: 1.0,
                    shift_factor: 0.0,
                },
            },
            encoders: [args.vae_encoder, args.text_encoder, args.pooled_encoder],
        },
        deflate: args.deflate,
        samples_per_shard: args.samples_per_shard,
    };
    let bar = ProgressBar::new(0).with_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} files {msg} [{elapsed} < {eta}]",
    )?);
    let progress = Bar(bar);
    let summary: IngestSummary = if let Some(url) = args.url {
        let source = HttpSource {
            base_url: url,
            manifest: args.manifest.expect("clap requires --manifest with --url"),
            md5: args.md5,
            concurrency: args.concurrency,
            prefetch: args.prefetch,
            retry: RetryPolicy {
                max_attempts: args.attempts.max(1),
                base_delay: Duration::from_millis(args.backoff_ms),
                max_delay: Duration::from_secs(60),
            },
            work_dir: args.work_dir.unwrap_or_else(|| args.out.join(".download")),
        };
        ingest_http(&source, &args.out, &options, &progress)?
    } else if let Some(dir) = args.dir {
        ingest_dir(&dir, &args.out, &options, &progress)?
    } else if !args.tar.is_empty() {
        let mut tars = args.tar;
        tars.sort();
        ingest_tars(&tars, &args.out, &options, &progress)?
    } else {
        bail!("name a source: --tar FILES, --dir DIR or --url BASE (see --help)");
    };
    report(
        &args.out,
        [summary.written, summary.samples, summary.skipped],
        &summary.failed,
        "file(s) after retries",
    );
    Ok(())
}

/// Print what an ingest or encode run into `out` did: `[written, samples, skipped]` shards and
/// samples, and each input skipped (`what` names them) with its reason.
fn report(out: &Path, [written, samples, skipped]: [u64; 3], failed: &[FailedFile], what: &str) {
    println!(
        "wrote {written} shard(s) with {samples} samples to {}; {skipped} input(s) already present",
        out.display()
    );
    if !failed.is_empty() {
        println!(
            "skipped {} {what}, listed in {}:",
            failed.len(),
            out.join("failed_files.json").display()
        );
        for f in failed {
            println!("  {}: {}", f.file, f.error);
        }
    }
}

/// The buckets and T5 tokens per caption to encode with: the run config's `[data] buckets` and
/// `[training] text_len` under --config, else --buckets and --text-len (1024x1024 and 512).
fn buckets_and_text_len(args: &EncodeArgs) -> Result<(Vec<Bucket>, usize)> {
    let Some(path) = &args.config else {
        let buckets = match args.buckets.is_empty() {
            true => vec![Bucket {
                width: 1024,
                height: 1024,
            }],
            false => args.buckets.clone(),
        };
        return Ok((buckets, args.text_len.unwrap_or(512)));
    };
    let run = RunConfig::load(path, &args.overrides)?;
    if run.data.buckets.is_empty() {
        bail!(
            "{}: data.buckets is empty; list the buckets to encode into, e.g. \
             buckets = [\"1024x1024\", \"1152x896\"]",
            path.display()
        );
    }
    Ok((run.data.buckets, run.training.text_len as usize))
}

fn encode(args: EncodeArgs) -> Result<()> {
    // One intra-op thread per core this process may use, as training does.
    tch::set_num_threads(Placement::from_env()?.threads() as i32);
    let device = args.device.device.resolve(0)?;
    let t5_kind = match device {
        tch::Device::Cpu => tch::Kind::Float,
        _ => tch::Kind::BFloat16,
    };
    let (buckets, text_len) = buckets_and_text_len(&args)?;
    let vae_path = Autoencoder::find(&args.encoders)?;
    let vae = Autoencoder::load(&vae_path, device)?;
    check_buckets(&buckets, (vae.downsampling() * 2) as u32).map_err(|e| anyhow!(e))?;
    let prompts = PromptEncoder::load(&args.encoders, text_len, t5_kind, device)?;
    let captions = match &args.captions {
        Some(file) => Captions::read(file).map_err(|e| anyhow!(e))?,
        None => Captions::Sidecar,
    };
    let folder = args.encoders.display().to_string();
    let encoders = Encoders {
        prompts: &prompts,
        vae: &vae,
        names: [
            vae_path.display().to_string(),
            format!("{folder}/text_encoder_2"),
            format!("{folder}/text_encoder"),
        ],
    };
    let options = EncodeOptions {
        buckets,
        samples_per_shard: args.samples_per_shard,
        batch: args.batch,
        min_side: args.min_side,
        dtype: args.dtype,
        deflate: args.deflate,
    };
    let bar = ProgressBar::new(0).with_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} shards {msg} [{elapsed} < {eta}]",
    )?);
    let summary = encode_folder(
        &args.images,
        &captions,
        &args.out,
        &encoders,
        &options,
        &Bar(bar),
    )
    .map_err(|e| anyhow!(e))?;
    for (bucket, n) in &summary.per_bucket {
        println!("bucket {bucket:<12} {n} image(s)");
    }
    report(
        &args.out,
        [summary.written, summary.samples, summary.skipped],
        &summary.failed,
        "image(s)",
    );
    Ok(())
}
