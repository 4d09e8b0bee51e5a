//! `flux-hpc check-collectives`: under mpirun, every collective of the backend a config names,
//! on tensors of each dtype on the run's device, checked against the values every rank can
//! compute alone, with the bytes staged through host memory and the time of each.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use flux_cluster::GroupSizes;
use flux_model::tp::{staging, Collective};
use flux_train::Launch;
use tch::{Device, Kind, Tensor};

use crate::{ConfigArgs, DeviceArgs};

/// Arguments of `flux-hpc check-collectives`.
#[derive(Debug, Args)]
pub struct CheckCollectivesArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Elements of each rank's tensor (of the block each keeps, for reduce-scatter).
    #[arg(long, default_value_t = 1 << 16)]
    elements: i64,
}

/// One collective's outcome on this rank.
struct Outcome {
    op: &'static str,
    kind: Kind,
    /// Largest absolute difference from the expected values.
    error: f64,
    /// Bytes staged through host memory.
    staged: u64,
    seconds: f64,
}

/// `[n]` elements of `value` on `device`.
fn filled(n: i64, value: f64, kind: Kind, device: Device) -> Tensor {
    Tensor::full([n], value, (kind, device))
}

/// The largest difference of `got` from `expected` (both any dtype and device).
fn error(got: &Tensor, expected: &Tensor) -> f64 {
    (got.to_kind(Kind::Double).to_device(Device::Cpu) - expected.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// Run `op` on `group` and measure it. Rank `r` contributes `r + 1` everywhere (block `b` of a
/// reduce-scatter input: `(r + 1)(b + 1)`), so every expected value is a small integer, exact in
/// bf16.
fn check(group: &dyn Collective, op: &'static str, n: i64, kind: Kind, device: Device) -> Outcome {
    let (rank, size) = (group.rank() as i64, group.size() as i64);
    let mine = (rank + 1) as f64;
    let total = (size * (size + 1) / 2) as f64;
    let blocks =
        || Tensor::arange(size, (Kind::Double, Device::Cpu)).repeat_interleave_self_int(n, 0, None);
    let staged = staging::host_staged_bytes();
    let start = Instant::now();
    let (got, expected) = match op {
        "all_reduce" => {
            let t = filled(n, mine, kind, device);
            group.all_reduce(&t);
            (t, Tensor::full([n], total, (Kind::Double, Device::Cpu)))
        }
        "all_gather" => {
            let out = filled(n * size, 0.0, kind, device);
            group.all_gather_into(&filled(n, mine, kind, device), &out);
            (out, blocks() + 1.0)
        }
        "reduce_scatter" => {
            let input = ((blocks() + 1.0) * mine).to_kind(kind).to_device(device);
            let out = filled(n, 0.0, kind, device);
            group.reduce_scatter_into(&input, &out);
            (
                out,
                Tensor::full([n], (rank + 1) as f64 * total, (Kind::Double, Device::Cpu)),
            )
        }
        "broadcast" => {
            let t = filled(n, mine, kind, device);
            group.broadcast(&t, (size - 1) as usize);
            (
                t,
                Tensor::full([n], size as f64, (Kind::Double, Device::Cpu)),
            )
        }
        "start_all_reduce" => {
            let sum = group.start_all_reduce(filled(n, mine, kind, device)).wait();
            (sum, Tensor::full([n], total, (Kind::Double, Device::Cpu)))
        }
        "start_all_gather" => {
            let all = group.start_all_gather(filled(n, mine, kind, device)).wait();
            (all, blocks() + 1.0)
        }
        "start_reduce_scatter" => {
            let input = ((blocks() + 1.0) * mine).to_kind(kind).to_device(device);
            let block = group.start_reduce_scatter(input).wait();
            let expected = (rank + 1) as f64 * total;
            (
                block,
                Tensor::full([n], expected, (Kind::Double, Device::Cpu)),
            )
        }
        "start_broadcast" => {
            let t = group.start_broadcast(filled(n, mine, kind, device), (size - 1) as usize);
            (
                t.wait(),
                Tensor::full([n], size as f64, (Kind::Double, Device::Cpu)),
            )
        }
        other => unreachable!("no collective {other}"),
    };
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
    let seconds = start.elapsed().as_secs_f64();
    Outcome {
        op,
        kind,
        error: error(&got, &expected),
        staged: staging::host_staged_bytes() - staged,
        seconds,
    }
}

/// Run every collective in f32 and bf16 on the world group; fails on any wrong value.
pub fn run(args: CheckCollectivesArgs) -> Result<()> {
    let run = flux_train::RunConfig::load(&args.config.config, &args.config.overrides)?;
    let sizes = GroupSizes {
        tensor_parallel: 1,
        shard_group: 0,
        sequence_parallel: false,
    };
    let launch = Launch::join(&run.parallelism, args.device.device, sizes, None)?;
    let (world, device, transport) = (&launch.world, launch.device, launch.transport);
    let group = world.world.as_ref();
    let leader = group.rank() == 0;
    if leader {
        println!(
            "{} rank(s), backend {}, device {device:?}, {} elements per rank",
            group.size(),
            transport.backend.name(),
            args.elements
        );
        println!(
            "{:<22} {:<9} {:>10} {:>12} {:>10}",
            "collective", "dtype", "max |err|", "host staged", "ms"
        );
    }
    let mut wrong = Vec::new();
    for kind in [Kind::Float, Kind::BFloat16] {
        for op in [
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "start_all_reduce",
            "start_all_gather",
            "start_reduce_scatter",
            "start_broadcast",
        ] {
            let o = check(group, op, args.elements, kind, device);
            if leader {
                println!(
                    "{:<22} {:<9} {:>10.1e} {:>10} B {:>10.3}",
                    o.op,
                    format!("{:?}", o.kind),
                    o.error,
                    o.staged,
                    o.seconds * 1e3
                );
            }
            if o.error > 0.0 {
                wrong.push(format!("{} {:?}: max |err| {}", o.op, o.kind, o.error));
            }
        }
    }
    if leader {
        println!("host staged in all: {} B", staging::host_staged_bytes());
    }
    let failed = group.count_failures(!wrong.is_empty());
    if !wrong.is_empty() {
        bail!("rank {}: wrong results: {}", group.rank(), wrong.join("; "));
    }
    if failed > 0 {
        bail!("{failed} rank(s) got wrong results; see their errors");
    }
    Ok(())
}
