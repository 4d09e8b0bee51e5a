//! `flux-hpc plan`: how much memory each rank of a run needs, and which layouts fit a machine,
//! predicted from the config alone ([`flux_train::memory_plan`]).

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use flux_model::activations::Kernels;
use flux_train::logging::units::gib;
use flux_train::memory_plan::{
    candidate_layouts, largest_micro_batch, predict, Layout, RankMemory,
};
use flux_train::{RunConfig, Sharding};
use serde_json::json;

use crate::ConfigArgs;

/// Arguments of `flux-hpc plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Ranks (GPUs) the run would use; data parallel = gpus / tensor_parallel_size (default:
    /// [slurm] nodes × ntasks_per_node).
    #[arg(long)]
    gpus: Option<usize>,
    /// Memory of each GPU: a number and a unit, e.g. 80GiB, 141GB, 192GiB.
    #[arg(long, default_value = "80GiB", value_parser = parse_bytes)]
    gpu_memory: u64,
    /// Fraction of each GPU's memory kept for what is not a tensor: the CUDA context, NCCL's
    /// buffers, cuBLAS workspaces, the allocator's fragmentation.
    #[arg(long, default_value_t = 0.1)]
    headroom: f64,
    /// The kernels the prediction assumes: cuda (fused RMSNorm) or cpu (composed RMSNorm, which
    /// saves more).
    #[arg(long, value_enum, default_value_t = KernelsArg::Cuda)]
    kernels: KernelsArg,
    /// The largest micro-batch searched for.
    #[arg(long, default_value_t = 256)]
    max_micro_batch: u64,
    /// Print one JSON object (bytes) instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum KernelsArg {
    Cuda,
    Cpu,
}

/// A size such as `80GiB`, `141GB`, `512MiB` or `1024B`, in bytes.
fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("\"{text}\" must start with a number, e.g. 80GiB"))?;
    let scale = match unit.trim() {
        "B" => 1u64,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => {
            return Err(format!(
            "unknown unit \"{other}\" in \"{text}\"; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        ))
        }
    };
    Ok((value * scale as f64) as u64)
}

fn describe(layout: &Layout) -> String {
    let sharding = format!("{:?}", layout.sharding).to_lowercase();
    let group = match (layout.sharding, layout.shard_group) {
        (Sharding::None, _) | (_, 0) => String::new(),
        (_, g) => format!(" in groups of {g}"),
    };
    format!(
        "TP {} × DP {}, sharding {sharding}{group}{}{}, micro-batch {}",
        layout.tp,
        layout.dp,
        if layout.sequence_parallel {
            ", sequence parallel"
        } else {
            ""
        },
        if layout.recompute { ", recompute" } else { "" },
        layout.micro_batch
    )
}

fn memory_json(m: &RankMemory) -> serde_json::Value {
    let phases: Vec<_> = m
        .phases
        .iter()
        .map(|p| {
            json!({
                "phase": p.phase.name(),
                "activations": p.activations,
                "transient": p.transient,
                "total": p.total,
            })
        })
        .collect();
    json!({
        "trained_params": m.trained_params,
        "weights": m.weights,
        "gradients": m.gradients,
        "optimizer": m.optimizer,
        "ema": m.ema,
        "state": m.state(),
        "phases": phases,
        "peak": m.peak(),
        "peak_phase": m.peak_phase().phase.name(),
    })
}

/// The config's own layout in detail.
fn print_own(
    run: &RunConfig,
    layout: &Layout,
    memory: &RankMemory,
    largest: Option<u64>,
    budget: u64,
) {
    println!("\nThis config: {}", describe(layout));
    if let Some(lora) = &run.lora {
        println!(
            "  trains LoRA adapters of rank {} ({} parameters per rank) on a frozen {} base",
            lora.rank,
            memory.trained_params,
            format!("{:?}", lora.base_precision).to_lowercase()
        );
    }
    println!("  state kept between steps");
    for (label, bytes) in [
        ("weights", memory.weights),
        ("gradients", memory.gradients),
        ("optimizer", memory.optimizer),
        ("EMA", memory.ema),
    ] {
        println!("    {label:<20}{:>9.2} GiB", gib(bytes));
    }
    println!("  top of each phase (activations + transient, total)");
    for p in &memory.phases {
        println!(
            "    {:<20}{:>9.2} GiB + {:>6.2} GiB = {:>7.2} GiB",
            p.phase.name(),
            gib(p.activations),
            gib(p.transient),
            gib(p.total)
        );
    }
    let verdict = if memory.peak() <= budget {
        "fits"
    } else {
        "does not fit"
    };
    println!(
        "  peak {:.2} GiB during the {}: {verdict}",
        gib(memory.peak()),
        memory.peak_phase().phase.name()
    );
    match largest {
        Some(b) => println!("  largest micro-batch that fits: {b}"),
        None => println!("  not even a micro-batch of 1 fits"),
    }
}

/// Print the config's own layout in detail, then every layout of the same ranks.
pub fn run(args: PlanArgs) -> Result<()> {
    if !(0.0..1.0).contains(&args.headroom) {
        bail!("--headroom must be in [0, 1), got {}", args.headroom);
    }
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let kernels = match args.kernels {
        KernelsArg::Cuda => Kernels::Fused,
        KernelsArg::Cpu => Kernels::Composite,
    };
    let budget = (args.gpu_memory as f64 * (1.0 - args.headroom)) as u64;
    let ranks = args
        .gpus
        .unwrap_or((run.slurm.nodes * run.slurm.ntasks_per_node) as usize);
    if ranks == 0 {
        bail!("--gpus must be at least 1");
    }
    // The config's own layout, where it can run on these ranks.
    let own = match Layout::of(&run, ranks) {
        Ok(layout) => {
            let memory = predict(&run, &layout, kernels)?;
            let largest =
                largest_micro_batch(&run, &layout, kernels, budget, args.max_micro_batch)?;
            Ok((layout, memory, largest))
        }
        Err(e) => Err(e.to_string()),
    };
    let mut table = Vec::new();
    for layout in candidate_layouts(&run, ranks) {
        let m = predict(&run, &layout, kernels)?;
        let b = largest_micro_batch(&run, &layout, kernels, budget, args.max_micro_batch)?;
        table.push((layout, m, b));
    }
    let params = run.model.num_params();
    if args.json {
        let layouts: Vec<_> = table
            .iter()
            .map(|(l, m, b)| {
                json!({
                    "tp": l.tp,
                    "dp": l.dp,
                    "shard_group": l.shard_group,
                    "sharding": format!("{:?}", l.sharding).to_lowercase(),
                    "sequence_parallel": l.sequence_parallel,
                    "recompute": l.recompute,
                    "memory": memory_json(m),
                    "largest_micro_batch": b,
                })
            })
            .collect();
        println!(
            "{}",
            json!({
                "config": args.config.config.display().to_string(),
                "architecture": run.model.architecture(),
                "params": params,
                "ranks": ranks,
                "gpu_memory": args.gpu_memory,
                "budget": budget,
                "kernels": format!("{:?}", args.kernels).to_lowercase(),
                "layout": own.as_ref().ok().map(|(l, _, _)| describe(l)),
                "layout_error": own.as_ref().err(),
                "memory": own.as_ref().ok().map(|(_, m, _)| memory_json(m)),
                "largest_micro_batch": own.as_ref().ok().and_then(|(_, _, b)| *b),
                "layouts": layouts,
            })
        );
        return Ok(());
    }
    println!(
        "{}: {} model, {:.2} B parameters, {ranks} ranks × {:.0} GiB ({:.1} GiB for tensors after {:.0}% headroom)",
        args.config.config.display(),
        run.model.architecture(),
        params as f64 / 1e9,
        gib(args.gpu_memory),
        gib(budget),
        args.headroom * 100.0
    );
    match &own {
        Ok((layout, memory, largest)) => print_own(&run, layout, memory, *largest, budget),
        Err(e) => println!("\nThis config cannot run on {ranks} ranks: {e}"),
    }
    println!(
        "\nLayouts on {ranks} ranks (peak per rank at micro-batch {}; the largest micro-batch that fits):",
        run.training.micro_batch_size
    );
    println!(
        "  {:>3} {:>4}  {:<10} {:>3} {:>9}  {:>10}  {:>9}",
        "TP", "DP", "sharding", "SP", "recompute", "peak GiB", "max micro"
    );
    for (l, m, b) in &table {
        let sharding = match (l.sharding, l.shard_group) {
            (Sharding::None, _) | (_, 0) => format!("{:?}", l.sharding).to_lowercase(),
            (s, g) => format!("{}/{g}", format!("{s:?}").to_lowercase()),
        };
        println!(
            "  {:>3} {:>4}  {:<10} {:>3} {:>9}  {:>10.1}  {:>9}",
            l.tp,
            l.dp,
            sharding,
            if l.sequence_parallel { "yes" } else { "no" },
            if l.recompute { "yes" } else { "no" },
            gib(m.peak()),
            b.map_or("—".to_string(), |b| b.to_string())
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_read_binary_and_decimal_units() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("141GB"), Ok(141_000_000_000));
        assert_eq!(parse_bytes("1.5 MiB"), Ok(3 << 19));
        assert!(parse_bytes("80").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("GiB")
            .unwrap_err()
            .contains("must start with a number"));
    }
}
