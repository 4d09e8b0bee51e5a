//! `flux-hpc lora`: a LoRA run's adapters merged into its base or exported for other tools
//! (`final_lora.safetensors` already is diffusers' LoRA layout).

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand, ValueEnum};
use flux_train::{merge_adapter_file, LoraFormat, LoraRun, RunConfig};

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
    /// Examples: flux-hpc lora merge configs/my_lora.toml
    ///           flux-hpc lora merge configs/my_lora.toml --adapter pytorch_lora_weights.safetensors
    Merge {
        #[command(flatten)]
        which: Which,
        /// Take the adapters from this file instead of the run's checkpoint: diffusers / PEFT
        /// (`transformer.….lora_A.weight`) or kohya / ComfyUI (`lora_unet_…`) names, as other
        /// tools write them; separately trained `to_q`/`to_k`/`to_v` adapters merge exactly.
        #[arg(long, value_name = "FILE", conflicts_with = "ema")]
        adapter: Option<PathBuf>,
    },
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
    let (which, format, adapter) = match args.command {
        LoraCommand::Merge { which, adapter } => (which, None, adapter),
        LoraCommand::Export { which, format } => (which, Some(format), None),
    };
    let run = RunConfig::load(&which.config.config, &which.config.overrides)?;
    let (default, tensors) = match (format, &adapter) {
        (None, Some(file)) => (
            "merged.safetensors",
            merge_adapter_file(&run, file).map_err(|e| anyhow!(e))?,
        ),
        (None, None) => ("merged.safetensors", open(&run, &which, true)?.merged()),
        (Some(format), _) => {
            let format = match format {
                FormatArg::Diffusers => LoraFormat::Diffusers,
                FormatArg::Kohya => LoraFormat::Kohya,
            };
            let tensors = open(&run, &which, false)?
                .export(format)
                .map_err(|e| anyhow!(e))?;
            (format.default_file(), tensors)
        }
    };
    let out = which
        .out
        .unwrap_or_else(|| run.checkpoint.dir.join(default));
    flux_data::convert::write_tensors(&out, &tensors)?;
    println!("wrote {} tensors to {}", tensors.len(), out.display());
    Ok(())
}

/// The adapters of the run's latest checkpoint (with its base weights when `base`).
fn open(run: &RunConfig, which: &Which, base: bool) -> Result<LoraRun> {
    LoraRun::open(run, which.ema, base).map_err(|e| anyhow!(e))
}
