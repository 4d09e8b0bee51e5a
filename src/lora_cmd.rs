//! `flux-hpc lora`: what to do with a LoRA run's adapters besides loading them into diffusers
//! (`final_lora.safetensors` already is diffusers' LoRA layout).

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use flux_train::{merged_lora_weights, RunConfig};

use crate::ConfigArgs;

/// Arguments of `flux-hpc lora`.
#[derive(Debug, Args)]
pub struct LoraArgs {
    #[command(subcommand)]
    command: LoraCommand,
}

#[derive(Debug, Subcommand)]
enum LoraCommand {
    /// Fold the adapters of a LoRA run's latest checkpoint into its base weights
    /// (`W + (α/r)·B·A`) and write a plain model in native names, which `flux-hpc sample
    /// --weights` reads.
    ///
    /// Example: flux-hpc lora merge configs/flux_tiny.toml --set lora.rank=16 …
    Merge {
        #[command(flatten)]
        config: ConfigArgs,
        /// Output file (default: <run dir>/merged.safetensors).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// Run the subcommand.
pub fn run(args: LoraArgs) -> Result<()> {
    match args.command {
        LoraCommand::Merge { config, out } => {
            let run = RunConfig::load(&config.config, &config.overrides)?;
            let out = out.unwrap_or_else(|| run.checkpoint.dir.join("merged.safetensors"));
            let weights = merged_lora_weights(&run).map_err(|e| anyhow!(e))?;
            flux_data::convert::write_tensors(&out, &weights)?;
            println!("merged {} tensors into {}", weights.len(), out.display());
            Ok(())
        }
    }
}
