//! Sharded data parallelism under real mpirun: `[parallelism] sharding = "optimizer"` (ZeRO-1),
//! `"gradients"` (ZeRO-2) and `"full"` (ZeRO-3) train as plain data parallelism does (gradient
//! clipping active: norms of 4–6 against a clip of 1), in f32 and in bf16 with f32 masters, with
//! tensor parallelism, gradient accumulation, recomputation and shard groups (HSDP); each rank
//! checkpoints the parts of the state it owns, and a run resumes from them at another level or
//! data-parallel size; layouts that cannot shard are refused. Sequence parallelism (norms and
//! modulation on each tensor-parallel rank's slice of the tokens) joins the TP2 × DP2 fully
//! sharded run in f32 and runs alone against plain TP2 × DP2 in bf16.
//! The plain TP2 × DP2 run they are held against overlaps its gradient all-reduces with backward.
//! Three of the runs move their collectives over c10d gloo groups instead of MPI, and report
//! no bytes staged through host buffers where MPI converts bf16.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{assert_same_records, flux_hpc, ok, records, temp_dir, train};
use tch::Tensor;

const STEPS: [&str; 4] = [
    "training.total_steps=5",
    "training.log_interval=1",
    "training.eval_interval=5",
    "training.ema_decay=0.8",
];

const SHARDED: &str = "parallelism.sharding=\"optimizer\"";
const GRADIENTS: &str = "parallelism.sharding=\"gradients\"";
const FULL: &str = "parallelism.sharding=\"full\"";
const SEQUENCE_PARALLEL: &str = "parallelism.sequence_parallel=true";
/// Collectives through libtorch's c10d gloo groups instead of MPI.
const GLOO: &str = "parallelism.backend=\"gloo\"";
/// Collectives over MPI, whatever `FLUX_TEST_BACKEND` says.
const MPI: &str = "parallelism.backend=\"mpi\"";

/// Buckets of 64 Ki elements: flux_tiny's 453,584 parameters reduce in 7 buckets and more.
const SMALL_BUCKETS: &str = "parallelism.bucket_mib=0.25";

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    [&STEPS[..], extra].concat()
}

/// Copy run directory `from` (its metrics, `latest` and checkpoints) to `to`.
fn copy_run(from: &Path, to: &Path) {
    ok(&std::process::Command::new("cp")
        .arg("-r")
        .arg(from)
        .arg(to)
        .output()
        .unwrap());
}

/// Assert that two runs' final weights file `file` holds the same tensors to `tolerance`.
fn assert_same_final(a: &Path, b: &Path, file: &str, tolerance: f64) {
    let read = |d: &Path| -> HashMap<String, Tensor> {
        Tensor::read_safetensors(d.join(file))
            .unwrap()
            .into_iter()
            .collect()
    };
    let (x, y) = (read(a), read(b));
    assert_eq!(x.len(), y.len());
    for (name, t) in &x {
        let d = (t - &y[name]).abs().max().double_value(&[]);
        assert!(d <= tolerance, "{file} {name}: max|Δ| {d:e}");
    }
}

#[test]
fn sharded_optimizer_and_gradients_train_as_plain_data_parallelism_and_resume_unsharded() {
    let dir = temp_dir("sharding");
    let keys = ["loss", "grad_norm", "eval_loss"];
    // f32: one process against two ranks with sharded optimizer, stopped after step 3 (each rank
    // writes the parts of the state it owns) and resumed with everything sharded, and as one
    // process.
    let (one, sharded) = (dir.join("one"), dir.join("sharded"));
    ok(&train(None, &one, &STEPS));
    ok(&train(
        Some(2),
        &sharded,
        &with(&[
            SHARDED,
            SMALL_BUCKETS,
            "checkpoint.interval=3",
            "--stop-after 3",
        ]),
    ));
    let step3 = sharded.join("step_000000003");
    let mut files: Vec<String> = std::fs::read_dir(&step3)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["tp_00_dp_000.h5", "tp_00_dp_001.h5"]);
    let alone = dir.join("alone");
    copy_run(&sharded, &alone);
    // A part missing is refused, naming it.
    let broken = dir.join("broken");
    copy_run(&sharded, &broken);
    std::fs::remove_file(broken.join("step_000000003/tp_00_dp_001.h5")).unwrap();
    let out = flux_hpc(&["ckpt", "inspect", broken.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("missing tp_00_dp_001.h5"), "{stderr}");
    ok(&train(Some(2), &sharded, &with(&[FULL, SMALL_BUCKETS])));
    ok(&train(None, &alone, &STEPS));
    let a = records(&one);
    assert_same_records(&a, &records(&sharded), &keys, 1e-5);
    assert_same_records(&a[4..], &records(&alone)[4..], &keys, 1e-5);
    assert!(a[1..]
        .iter()
        .all(|r| r["grad_norm"].as_f64().unwrap() > 1.0));
    for file in ["final.safetensors", "final_ema.safetensors"] {
        assert_same_final(&one, &sharded, file, 1e-5);
    }

    // f32, gradients sharded at TP2 × DP2, two micro-batches per replica: each backward
    // reduce-scatters its buckets into the f32 shard (the norm weights the tensor-parallel group
    // sums in buckets of their own after it).
    let grads = dir.join("gradients");
    ok(&train(
        Some(4),
        &grads,
        &with(&[
            GRADIENTS,
            SMALL_BUCKETS,
            GLOO,
            "parallelism.tensor_parallel_size=2",
            "training.micro_batch_size=2",
        ]),
    ));
    assert_same_records(&a, &records(&grads), &keys, 1e-5);
    for file in ["final.safetensors", "final_ema.safetensors"] {
        assert_same_final(&one, &grads, file, 1e-5);
    }

    // Weights sharded too, at TP2 × DP2 with layer recomputation and sequence parallelism:
    // each layer's weights are gathered before its forward and again before its (recomputing)
    // backward, and its norms and modulation act on each rank's half of the tokens.
    let full = dir.join("full");
    ok(&train(
        Some(4),
        &full,
        &with(&[
            FULL,
            SMALL_BUCKETS,
            SEQUENCE_PARALLEL,
            GLOO,
            "parallelism.tensor_parallel_size=2",
            "training.recompute=true",
        ]),
    ));
    assert_same_records(&a, &records(&full), &keys, 1e-5);
    for file in ["final.safetensors", "final_ema.safetensors"] {
        assert_same_final(&one, &full, file, 1e-5);
    }

    // HSDP: four replicas in shard groups of two, each level (full sharding with TP2 as well,
    // on 8 ranks); the groups' shares are summed across them (two micro-batches per replica).
    // The TP2 run stops after step 3, where only the first shard group writes its parts
    // (2 × 2 files), and resumes as one process: another tensor-parallel size, data-parallel
    // size and sharding level.
    for (level, tp) in [(SHARDED, 1), (GRADIENTS, 1), (FULL, 2)] {
        let hsdp = dir.join("hsdp");
        let tp_size = format!("parallelism.tensor_parallel_size={tp}");
        let mut args = [
            &STEPS[..],
            &[
                level,
                SMALL_BUCKETS,
                "parallelism.shard_group_size=2",
                "training.micro_batch_size=1",
                &tp_size,
            ],
        ]
        .concat();
        if tp == 2 {
            args.push("--stop-after 3");
        }
        ok(&train(Some(4 * tp), &hsdp, &args));
        if tp == 2 {
            assert_eq!(
                std::fs::read_dir(hsdp.join("step_000000003"))
                    .unwrap()
                    .count(),
                4
            );
            ok(&train(None, &hsdp, &STEPS));
        }
        assert_same_records(&a, &records(&hsdp), &keys, 1e-5);
        assert_same_final(&one, &hsdp, "final.safetensors", 1e-5);
        std::fs::remove_dir_all(hsdp).unwrap();
    }

    // bf16 with f32 masters, TP2 × DP2: sharded against plain at the same layout. The global
    // norm is summed in another order (share by share), which moves it by ~1e-8; the first
    // update's clipped gradients, rounded to bf16, then differ in a few elements, and the
    // rounding of bf16 weights makes such differences grow: the first steps agree to 1e-6, all
    // five to 5e-4 (measured 6e-5), the final bf16 weights to one bf16 step of a weight below 2
    // and their f32 EMA to 1e-4 (measured 2.5e-5).
    let bf16 = [
        "training.precision=\"bf16\"",
        "parallelism.tensor_parallel_size=2",
    ];
    // The plain run sums its gradient buckets during backward (`overlap_grad_reduce`), except
    // those `finish_grads` sums over the tensor-parallel group first.
    let (plain, sharded) = (dir.join("bf16-plain"), dir.join("bf16-sharded"));
    let overlap = [
        "parallelism.overlap_grad_reduce=true",
        "parallelism.bucket_mib=0.01",
    ];
    ok(&train(
        Some(4),
        &plain,
        &with(&[&bf16[..], &overlap].concat()),
    ));
    ok(&train(
        Some(4),
        &sharded,
        &with(&[&bf16[..], &[SHARDED]].concat()),
    ));
    let (a, b) = (records(&plain), records(&sharded));
    assert_same_records(&a[..3], &b[..3], &keys, 1e-6);
    assert_same_records(&a, &b, &keys, 5e-4);
    assert_same_final(&plain, &sharded, "final.safetensors", 1.0 / 128.0);
    assert_same_final(&plain, &sharded, "final_ema.safetensors", 1e-4);

    // Sequence parallelism on the plain layout: the same arithmetic per token (the first loss is
    // equal), but each rank rounds its half of the tokens' modulation and bias gradients to
    // bf16 before the group sums them: the first norms move by 5e-5 to 1.1e-4 (relative,
    // measured on two machines of this project's kind: which elements round the other way
    // differs), five steps by ~3e-4, the f32 EMA by 1.6e-4.
    let sequence = dir.join("bf16-sequence");
    ok(&train(
        Some(4),
        &sequence,
        &with(&[&bf16[..], &[SEQUENCE_PARALLEL]].concat()),
    ));
    let d = records(&sequence);
    assert_same_records(&a[..2], &d[..2], &keys, 3e-4);
    assert_same_records(&a, &d, &keys, 1e-3);
    assert_same_final(&plain, &sequence, "final.safetensors", 1.0 / 128.0);
    assert_same_final(&plain, &sequence, "final_ema.safetensors", 1e-3);

    // Sharded gradients are summed in f32, where plain data parallelism rounds each replica's
    // sum to bf16: the first norm moves by ~3e-5 (relative), five steps by ~4e-4. Over MPI,
    // which converts the bf16 activations of tensor parallelism to f32 (staged, counted).
    let grads = dir.join("bf16-gradients");
    ok(&train(
        Some(4),
        &grads,
        &with(&[&bf16[..], &[GRADIENTS, MPI]].concat()),
    ));
    let c = records(&grads);
    assert_same_records(&a[..2], &c[..2], &keys, 1e-4);
    assert_same_records(&a, &c, &keys, 1e-3);
    assert_same_final(&plain, &grads, "final.safetensors", 1.0 / 128.0);
    assert_same_final(&plain, &grads, "final_ema.safetensors", 1e-3);

    // Weights sharded: the same sums as gradient sharding, the bf16 weights gathered from the
    // f32 master shares; over gloo, which sums the bf16 activations of tensor parallelism as
    // they are where MPI converts them to f32 (with two ranks, the same rounding).
    let full = dir.join("bf16-full");
    ok(&train(
        Some(4),
        &full,
        &with(&[&bf16[..], &[FULL, GLOO]].concat()),
    ));
    let staged = |dir: &Path| records(dir)[1]["host_staged_mib"].as_f64().unwrap();
    assert!(staged(&grads) > 0.0, "MPI converts bf16 activations");
    assert_eq!(staged(&full), 0.0, "gloo moves bf16 tensors as they are");
    assert_same_records(&c, &records(&full), &keys, 1e-6);
    assert_same_final(&grads, &full, "final.safetensors", 0.0);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sharding_layouts_that_cannot_shard_are_refused_on_every_rank() {
    let dir = temp_dir("sharding-one");
    let out = train(None, &dir, &[SHARDED]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("parallelism.sharding: shards state over the data-parallel replicas"),
        "{stderr}"
    );
    assert!(!dir.join("step_000000001").exists());

    // Under [lora] the trained weights are the adapters: nothing for "full" to shard.
    let lora = ["lora.rank=4", "lora.targets=[\"*\"]", FULL];
    let out = train(Some(2), &dir, &lora);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("parallelism.sharding: \"full\" shards the weights a run trains"),
        "{stderr}"
    );

    // Shard groups of 3 over 2 replicas: each rank says so and the job ends (mpirun's timeout
    // would catch a hang).
    let out = train(
        Some(2),
        &dir,
        &[GRADIENTS, "parallelism.shard_group_size=3"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let says = "shard_group_size 3 does not divide the 2 data-parallel replicas";
    assert_eq!(stderr.matches(says).count(), 2, "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}
