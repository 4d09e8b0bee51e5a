//! `flux-hpc ckpt`: look inside training checkpoints.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use flux_data::checkpoint;

/// Arguments of `flux-hpc ckpt`.
#[derive(Debug, Args)]
pub struct CkptArgs {
    #[command(subcommand)]
    command: CkptCommand,
}

#[derive(Debug, Subcommand)]
enum CkptCommand {
    /// Print a checkpoint's step, files and every parameter's name, logical shape, dtype and
    /// shard layout. PATH is a checkpoint directory or a run directory (its `latest` is used).
    ///
    /// Example: flux-hpc ckpt inspect runs/flux_tiny
    Inspect {
        /// Checkpoint or run directory.
        path: PathBuf,
    },
}

/// Run the subcommand.
pub fn run(args: CkptArgs) -> Result<()> {
    match args.command {
        CkptCommand::Inspect { path } => {
            let dir = match checkpoint::latest(&path)? {
                Some(latest) => latest,
                None if path.is_dir() => path,
                None => bail!("{} is not a directory", path.display()),
            };
            for line in checkpoint::inspect(&dir)? {
                println!("{line}");
            }
            Ok(())
        }
    }
}
