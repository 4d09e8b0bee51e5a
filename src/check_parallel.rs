//! `flux-hpc check-parallel`: run under `mpirun` to prove that a tensor × data parallel layout
//! computes what one process computes — the forward output and every parameter gradient — and
//! that it issues exactly the all-reduces Megatron's layout needs (with sequence parallelism the
//! collectives are reported for the caller to check).

use std::collections::HashMap;

use anyhow::{bail, Result};
use clap::Args;
use flux_cluster::DeviceChoice;
use flux_model::tp::{all_reduce_grads, CollectiveCounts, TpContext, BUCKET_ELEMENTS};
use flux_train::{Launch, RunConfig};
use tch::{Device, Kind, Tensor};

use crate::resolution::Resolution;
use crate::ConfigArgs;

/// Arguments of `flux-hpc check-parallel`.
#[derive(Debug, Args)]
pub struct CheckParallelArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Global batch, split evenly over the data-parallel replicas.
    #[arg(long, default_value_t = 2)]
    batch: i64,
    /// Image size in pixels, WIDTHxHEIGHT (multiples of 16).
    #[arg(long, default_value = "64x48")]
    resolution: Resolution,
    /// Text tokens per sample.
    #[arg(long, default_value_t = 5)]
    text_len: i64,
    /// Largest accepted absolute difference (f32).
    #[arg(long, default_value_t = 1e-5)]
    tolerance: f64,
    /// Random seed for weights and inputs (the same on every rank).
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Mean-squared error against `target`, normalised by the *global* element count so that the sum
/// over data-parallel replicas is the single-process loss.
fn loss(out: &Tensor, target: &Tensor, global_elements: i64) -> Tensor {
    (out - target).square().sum(Kind::Float) / global_elements as f64
}

/// Run the check on this rank; fails if any difference exceeds the tolerance or the collective
/// counts differ from the expected ones.
pub fn run(args: CheckParallelArgs) -> Result<()> {
    let run = RunConfig::load(&args.config.config, &args.config.overrides)?;
    let tp_size = run.parallelism.tensor_parallel_size as usize;
    let p = &run.parallelism;
    let launch = Launch::join(p, DeviceChoice::Cpu, p.group_sizes(), Some(1))?;
    let (world, transport) = (&launch.world, launch.transport);
    let (dp_rank, dp_size) = (world.dp_rank(), world.dp_size());
    if args.batch % dp_size as i64 != 0 {
        bail!(
            "--batch {} is not divisible by the {dp_size} data-parallel replicas",
            args.batch
        );
    }
    let config = &run.model;
    let inputs = config.inputs();

    // Reference: one process, whole batch. Weights are perturbed off their initial values so that
    // zero-initialised layers (adaLN-Zero) carry gradients everywhere.
    tch::manual_seed(args.seed);
    let reference = config.build(Device::Cpu, TpContext::single())?;
    tch::no_grad(|| {
        for mut var in reference.store().vs.trainable_variables() {
            let _ = var.g_add_(&(var.randn_like() * 0.05));
        }
    });
    let batch = args
        .resolution
        .random_batch(&inputs, args.batch, args.text_len, Device::Cpu);
    let target = batch.latents.randn_like();
    let elements = batch.latents.numel() as i64;
    let expected_out = reference.forward(&batch, false)?;
    loss(&expected_out, &target, elements).backward();
    let expected_grads: HashMap<String, Tensor> =
        reference.store().gather_logical(true).into_iter().collect();

    // Parallel: this rank's shard of the weights, its replica's slice of the batch.
    let mut model = config.build(Device::Cpu, world.tp.clone())?;
    model.store_mut().load_logical(
        &reference
            .store()
            .gather_logical(false)
            .into_iter()
            .collect(),
    )?;
    let local = args.batch / dp_size as i64;
    let start = dp_rank as i64 * local;
    let out = model.forward(&batch.narrow(start, local), false)?;
    loss(&out, &target.narrow(0, start, local), elements).backward();
    model.store().finish_grads();
    all_reduce_grads(
        &model.store().vs.trainable_variables(),
        world.dp.as_ref(),
        1.0,
        BUCKET_ELEMENTS,
    );

    let out_diff = max_abs_diff(&out, &expected_out.narrow(0, start, local));
    let (mut grad_diff, mut worst) = (0.0, String::new());
    for (name, grad) in model.store().gather_logical(true) {
        let d = max_abs_diff(&grad, &expected_grads[&name]);
        if d >= grad_diff {
            (grad_diff, worst) = (d, name);
        }
    }

    let counts = world.tp.counts();
    // The all-reduces follow from the parameter specs; under sequence parallelism the layers'
    // collectives move along the sequence and the model's own scatters and gathers join them,
    // so the counts are reported and the tests hold them to the figures they derive.
    let expected = if tp_size == 1 {
        Some(CollectiveCounts::default())
    } else if world.tp.sequence_parallel() {
        None
    } else {
        Some(CollectiveCounts::expected(model.store().param_specs()))
    };
    let expected_text = expected.map_or(String::new(), |e| {
        format!(" (expected {} {} {})", e.forward, e.backward, e.grad_sync)
    });
    println!(
        "rank {} (tp {}/{tp_size}, dp {dp_rank}/{dp_size}, {}, {}): output max|Δ| {out_diff:.2e}, gradients \
         max|Δ| {grad_diff:.2e} (at {worst}); all-reduces forward {} backward {} grad-sync {}{expected_text}; \
         sequence gathers and reduce-scatters {}",
        world.world.rank(),
        world.tp.rank(),
        config.architecture(),
        transport.backend.name(),
        counts.forward,
        counts.backward,
        counts.grad_sync,
        counts.sequence,
    );
    drop(model);
    if out_diff > args.tolerance || grad_diff > args.tolerance {
        bail!("differences above the tolerance {:e}", args.tolerance);
    }
    if let Some(expected) = expected.filter(|e| *e != counts) {
        bail!("unexpected collective counts {counts:?}, expected {expected:?}");
    }
    println!("rank {}: parallel check passed", world.world.rank());
    Ok(())
}
