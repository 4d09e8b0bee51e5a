//! `flux-hpc info`: what a config describes, computed from shapes alone.

use anyhow::Result;
use clap::Args;
use flux_train::logging::units;
use flux_train::RunConfig;

use crate::ConfigArgs;

/// Arguments of `flux-hpc info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Also list every parameter's state-dict name and shape.
    #[arg(long)]
    params: bool,
}

/// Print the model summary (and optionally the parameter layout) of the config.
pub fn run(args: InfoArgs) -> Result<()> {
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let m = &run.model;
    println!("config            {}", args.config.config.display());
    println!("architecture      {}", m.architecture());
    for (label, value) in m.summary() {
        println!("{label:<18}{value}");
    }
    println!(
        "parallelism       tensor {} · pipeline {}",
        run.parallelism.tensor_parallel_size, run.parallelism.pipeline_parallel_size
    );
    let layout = m.param_specs(1);
    let total: u64 = layout.iter().map(|p| p.numel()).sum();
    println!(
        "parameters        {} ({:.3} B, {:.1} GiB in f32)",
        group_digits(total),
        total as f64 / 1e9,
        units::gib(total * 4)
    );
    if args.params {
        for p in &layout {
            println!("  {:<64} {:?}", p.name, p.shape);
        }
    }
    Ok(())
}

/// `1234567` → `"1,234,567"`.
pub fn group_digits(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
