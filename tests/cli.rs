//! The `flux-hpc` binary end to end: real processes, real config files.

use std::process::{Command, Output};

fn flux_hpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flux-hpc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .expect("flux-hpc runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn demo_runs_a_forward_pass_and_reports_shapes() {
    let out = flux_hpc(&[
        "demo",
        "configs/flux_tiny.toml",
        "--heads",
        "2",
        "--resolution",
        "64x96",
        "--text-len",
        "5",
        "--batch",
        "2",
        "--repeats",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("img               [2, 16, 6, 4]"), "{text}");
    assert!(text.contains("velocity          [2, 16, 6, 4]"), "{text}");
    assert!(text.contains("txt               [2, 5, 32]"), "{text}");
    assert!(text.contains("hidden 32 (2 heads × 16)"), "{text}");
    assert!(text.contains("forward "), "{text}");
}

#[test]
fn info_counts_parameters_without_allocating() {
    let out = flux_hpc(&["info", "configs/flux_12b.toml"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("parameters        11,901,408,320"),
        "{}",
        stdout(&out)
    );
    let out = flux_hpc(&["info", "configs/flux_535m.toml", "--params"]);
    let text = stdout(&out);
    assert!(text.contains("parameters        535,318,336"), "{text}");
    assert!(
        text.contains("transformer.layers.1.linear_qkv_fc1.weight"),
        "{text}"
    );
}

#[test]
fn bad_configs_fail_with_the_field_named() {
    let out = flux_hpc(&[
        "info",
        "configs/flux_tiny.toml",
        "--set",
        "model.axes_dim=[4,6,8]",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out).trim(),
        "error: configs/flux_tiny.toml: model.axes_dim: entries sum to 18 but the head width hidden_size / num_attention_heads is 16"
    );
    let out = flux_hpc(&[
        "info",
        "configs/flux_tiny.toml",
        "--set",
        "parallelism.pipeline_parallel_size=4",
    ]);
    assert!(stderr(&out)
        .contains("parallelism.pipeline_parallel_size: pipeline parallelism is not supported"));
}

#[test]
fn forcing_cuda_without_a_gpu_is_a_clear_error() {
    if tch::Cuda::is_available() {
        return; // the request is satisfiable here; the resolution logic is unit-tested in flux-cluster
    }
    let out = flux_hpc(&["demo", "configs/flux_tiny.toml", "--device", "cuda"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("no CUDA device is available"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn resolutions_must_be_multiples_of_a_token() {
    let out = flux_hpc(&["demo", "configs/flux_tiny.toml", "--resolution", "100x64"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("100 is not a positive multiple of 16 pixels"),
        "{}",
        stderr(&out)
    );
}
