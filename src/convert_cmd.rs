//! `flux-hpc convert`: weights between native checkpoints and the layouts the architecture has
//! (FLUX.1 and FLUX.2: BFL and diffusers; the DiT: none).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use flux_data::checkpoint::{self, Reader};
use flux_data::convert::{convert, Format};
use flux_data::dataset::StorageDtype;
use flux_model::convert::Layout;
use flux_train::logging::metrics::peak_rss_mib;
use flux_train::logging::units;
use flux_train::RunConfig;

/// A checkpoint format on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FormatArg {
    /// Black Forest Labs' `flux` / `flux2` safetensors (`double_blocks.0.img_attn.qkv.weight`, …).
    Bfl,
    /// diffusers' transformer (FluxTransformer2DModel, Flux2Transformer2DModel): a directory
    /// with config.json and the weights.
    Diffusers,
    /// A flux-hpc checkpoint (`step_*/` or a run directory).
    Native,
}

impl From<FormatArg> for Format {
    fn from(f: FormatArg) -> Self {
        match f {
            FormatArg::Bfl => Format::External(Layout::Bfl),
            FormatArg::Diffusers => Format::External(Layout::Diffusers),
            FormatArg::Native => Format::Native,
        }
    }
}

/// Arguments of `flux-hpc convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// Format of INPUT.
    #[arg(long)]
    from: FormatArg,
    /// Format of OUTPUT.
    #[arg(long)]
    to: FormatArg,
    /// Input: a safetensors file (BFL), a diffusers directory or file, or a native checkpoint
    /// or run directory (its `latest`).
    input: PathBuf,
    /// Output: a .safetensors file (BFL), a directory (diffusers: config.json and
    /// diffusion_pytorch_model.safetensors), or a new run directory (native: a weights-only
    /// step_000000000/ that `flux-hpc train` starts from).
    output: PathBuf,
    /// Run config of the model (needed unless INPUT is native, whose checkpoint stores it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a config value, e.g. `--set model.guidance_embed=false` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Read the moving average of a native INPUT's weights (its `ema` group, written under
    /// `[training] ema_decay`) instead of the weights.
    #[arg(long)]
    ema: bool,
    /// Value type of BFL / diffusers output (native output is always f32).
    #[arg(long, default_value = "bf16")]
    dtype: StorageDtype,
}

/// Run the conversion and report what it wrote and the peak resident memory.
pub fn run(args: ConvertArgs) -> Result<()> {
    if args.from == args.to && !args.ema {
        bail!(
            "--from and --to are both {:?}; nothing to convert",
            args.from
        );
    }
    let input = match (args.from, checkpoint::latest(&args.input)?) {
        (FormatArg::Native, Some(latest)) => latest,
        _ => args.input.clone(),
    };
    let run = match (&args.config, args.from) {
        (Some(path), _) => RunConfig::load(path, &args.overrides)?,
        (None, FormatArg::Native) => {
            let text = Reader::open(&input)?.config()?;
            RunConfig::parse(&text, &input.display().to_string(), &args.overrides)?
        }
        (None, _) => bail!("--config is required to read {:?} weights", args.from),
    };
    let stored = toml::to_string(&run).context("serialising the run config")?;
    let from = match (args.from, args.ema) {
        (FormatArg::Native, true) => Format::NativeEma,
        (_, true) => {
            bail!("--ema reads the moving average of a native checkpoint: use --from native")
        }
        (from, false) => from.into(),
    };
    let report = convert(
        from,
        &input,
        args.to.into(),
        &args.output,
        &run.model,
        &stored,
        args.dtype,
    )?;
    let layout = run.model.param_specs(1);
    let largest = layout.iter().map(|p| p.numel()).max().unwrap_or(0);
    let mib = |n: u64| units::mib(n * 4);
    println!("written           {}", report.output.display());
    println!(
        "tensors           {} ({} parameters)",
        report.tensors, report.params
    );
    println!(
        "peak memory       {:.0} MiB (model {:.0} MiB in f32, largest tensor {:.0} MiB)",
        peak_rss_mib(),
        mib(report.params),
        mib(largest)
    );
    Ok(())
}
