//! `flux-hpc lora`: a LoRA run's adapters merged into its base or exported for other tools
//! (`final_lora.safetensors` already is diffusers' LoRA layout).

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand, ValueEnum};
use flux_train::{LoraFormat, LoraRun, RunConfig};

use crate::ConfigArgs;

/// Arguments of `flux-hpc lora`.
#[derive(Debug, Args)]
pub struct LoraArgs {
    #[command(subcommand)]
    command: LoraCommand,
}

/// Which adapter values to take from the run's latest checkpoint.
#[derive(Debug, Args)]
struct Which {
    #[command(flatten)]
    config: ConfigArgs,
    /// Use the moving average of the adapters (runs with `[training] ema_decay`).
    #[arg(long)]
    ema: bool,
    /// Output file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// An adapter layout on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FormatArg {
    /// diffusers / PEFT (`transformer.….lora_A.weight`): `load_lora_weights` reads it.
    Diffusers,
    /// kohya / ComfyUI (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, `alpha`).
    Kohya,
}

#[derive(Debug, Subcommand)]
enum LoraCommand {
    /// Fold the adapters of a LoRA run's latest checkpoint into its `[lora] base` weights
    /// (`W + (α/r)·B·A`) and write a plain model in native names (default
    /// <run dir>/merged.safetensors), which `flux-hpc sample --weights` reads.
    ///
    /// Example: flux-hpc lora merge configs/my_lora.toml
    Merge(Which),
    /// Write the adapters of a LoRA run's latest checkpoint in another tool's layout (default
    /// <run dir>/lora_<format>.safetensors).
    ///
    /// Example: flux-hpc lora export configs/my_lora.toml --format kohya
    Export {
        #[command(flatten)]
        which: Which,
        /// Layout to write.
        #[arg(long, value_enum)]
        format: FormatArg,
    },
}

/// Run the subcommand.
pub fn run(args: LoraArgs) -> Result<()> {
    let (which, format) = match args.command {
        LoraCommand::Merge(which) => (which, None),
        LoraCommand::Export { which, format } => (which, Some(format)),
    };
    let run = RunConfig::load(&which.config.config, &which.config.overrides)?;
    let lora = LoraRun::open(&run, which.ema, format.is_none()).map_err(|e| anyhow!(e))?;
    let (default, tensors) = match format {
        None => ("merged.safetensors", lora.merged()),
        Some(FormatArg::Diffusers) => (
            "lora_diffusers.safetensors",
            lora.export(LoraFormat::Diffusers).map_err(|e| anyhow!(e))?,
        ),
        Some(FormatArg::Kohya) => (
            "lora_kohya.safetensors",
            lora.export(LoraFormat::Kohya).map_err(|e| anyhow!(e))?,
        ),
    };
    let out = which
        .out
        .unwrap_or_else(|| run.checkpoint.dir.join(default));
    flux_data::convert::write_tensors(&out, &tensors)?;
    println!("wrote {} tensors to {}", tensors.len(), out.display());
    Ok(())
}
