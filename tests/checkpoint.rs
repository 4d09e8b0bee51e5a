//! Checkpoints under real mpirun: resume reproduces the uninterrupted run (its EMA of the weights
//! included), checkpoints reshard between tensor-parallel sizes, and both layouts load.

mod common;

use std::collections::HashMap;
use std::process::Command;

use common::{flux_hpc, ok, records, temp_dir, train};
use serde_json::Value;

fn loss_by_step(records: &[Value]) -> Vec<(u64, f64)> {
    records
        .iter()
        .filter_map(|r| Some((r["step"].as_u64()?, r["loss"].as_f64()?)))
        .collect()
}

const SIX_STEPS: [&str; 3] = [
    "training.total_steps=6",
    "training.log_interval=1",
    "checkpoint.interval=3",
];

/// An EMA of the weights updated every second step.
const EMA: [&str; 2] = ["training.ema_decay=0.8", "training.ema_every=2"];

#[test]
fn a_resumed_run_continues_with_the_uninterrupted_losses() {
    let (whole, split) = (temp_dir("whole"), temp_dir("split"));
    let six: Vec<&str> = SIX_STEPS.iter().chain(&EMA).copied().collect();
    ok(&train(Some(2), &whole, &six));
    let mut first_half = six.clone();
    first_half.push("--stop-after 3");
    let out = train(Some(2), &split, &first_half);
    ok(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("stopped at step 3 of 6"));
    assert_eq!(
        std::fs::read_to_string(split.join("latest"))
            .unwrap()
            .trim(),
        "step_000000003"
    );
    ok(&train(Some(2), &split, &six));
    let (a, b) = (
        loss_by_step(&records(&whole)),
        loss_by_step(&records(&split)),
    );
    assert_eq!(a.len(), 6);
    assert_eq!(
        a, b,
        "the resumed run's losses, step by step, equal the uninterrupted run's"
    );
    // The EMA went through the checkpoint at step 3 unchanged: the same final average.
    let read = |dir: &std::path::Path, file: &str| -> HashMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(dir.join(file))
            .unwrap()
            .into_iter()
            .collect()
    };
    let ema = read(&whole, "final_ema.safetensors");
    let (resumed, weights) = (
        read(&split, "final_ema.safetensors"),
        read(&whole, "final.safetensors"),
    );
    assert_eq!(ema.len(), weights.len());
    let mut lag = 0.0f64;
    for (name, x) in &ema {
        assert!(
            x.equal(&resumed[name]),
            "EMA of {name} differs after resuming"
        );
        lag = lag.max((x - &weights[name]).abs().max().double_value(&[]));
    }
    assert!(lag > 0.0, "the average lags the weights");
    // `convert --ema` takes the average out of the last checkpoint.
    let converted = split.join("ema-weights");
    let (input, output) = (whole.to_str().unwrap(), converted.to_str().unwrap());
    ok(&flux_hpc(&[
        "convert", "--from", "native", "--ema", "--to", "native", input, output,
    ]));
    let loaded = flux_data::checkpoint::load(&converted.join("step_000000000")).unwrap();
    for (name, x) in &ema {
        assert!(
            x.equal(&loaded.tensors["params"][name]),
            "converted EMA of {name}"
        );
    }
    let set_dir = format!("checkpoint.dir=\"{}\"", whole.display());
    let args = [
        "sample",
        common::FLUX_TINY,
        "--set",
        &set_dir,
        "--ema",
        "--count",
        "1",
        "--steps",
        "2",
    ];
    ok(&flux_hpc(&args));
    for dir in [whole, split] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_tp2_checkpoint_resumes_at_tp1_and_a_unified_one_at_tp2() {
    let (reference, resharded, unified) =
        (temp_dir("ref"), temp_dir("reshard"), temp_dir("unified"));
    ok(&train(None, &reference, &SIX_STEPS));
    let tp2 = "parallelism.tensor_parallel_size=2";
    let mut first = SIX_STEPS.to_vec();
    first.extend([tp2, "--stop-after 3"]);
    ok(&train(Some(2), &resharded, &first));
    // A TP 2 checkpoint with a shard missing is refused, naming what is missing.
    let broken = temp_dir("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for file in ["tp_00.h5", "tp_01.h5"] {
        std::fs::copy(
            resharded.join("step_000000003").join(file),
            broken.join(file),
        )
        .unwrap();
    }
    let full = Command::new(env!("CARGO_BIN_EXE_flux-hpc"))
        .args(["ckpt", "inspect"])
        .arg(&broken)
        .output()
        .unwrap();
    ok(&full);
    assert!(String::from_utf8_lossy(&full.stdout).contains("2 file(s), tensor-parallel size 2"));
    std::fs::remove_file(broken.join("tp_01.h5")).unwrap();
    let missing = Command::new(env!("CARGO_BIN_EXE_flux-hpc"))
        .args(["ckpt", "inspect"])
        .arg(&broken)
        .output()
        .unwrap();
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("written at tensor-parallel size 2 but holds 1 file(s); missing tp_01.h5"),
        "{stderr}"
    );
    std::fs::remove_dir_all(broken).unwrap();
    ok(&train(None, &resharded, &SIX_STEPS)); // TP 2 → TP 1

    let mut first_unified = vec![
        "training.total_steps=6",
        "training.log_interval=1",
        "checkpoint.interval=3",
    ];
    first_unified.extend(["checkpoint.format=\"unified\"", "--stop-after 3"]);
    ok(&train(None, &unified, &first_unified));
    let files: Vec<String> = std::fs::read_dir(unified.join("step_000000003"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files, ["model.h5"]);
    let mut second = SIX_STEPS.to_vec();
    second.push(tp2);
    ok(&train(Some(2), &unified, &second)); // unified TP 1 → TP 2

    let expected = loss_by_step(&records(&reference));
    for dir in [&resharded, &unified] {
        for ((s, x), (_, y)) in expected.iter().zip(loss_by_step(&records(dir))) {
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(1.0),
                "{}: step {s}: {x} vs {y}",
                dir.display()
            );
        }
    }
    let inspect = Command::new(env!("CARGO_BIN_EXE_flux-hpc"))
        .args(["ckpt", "inspect"])
        .arg(&unified)
        .output()
        .unwrap();
    ok(&inspect);
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        text.contains("step 6, 2 file(s), tensor-parallel size 2"),
        "{text}"
    );
    assert!(
        text.contains("transformer.layers.2.linear_qkv_fc1.weight")
            && text.contains("split dim 0 in parts [q=64, k=64, v=64, mlp=256]"),
        "{text}"
    );
    for dir in [reference, resharded, unified] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
