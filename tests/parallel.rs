//! Tensor and data parallelism under real `mpirun`: every layout must reproduce the
//! single-process forward output and every parameter gradient within 1e-5 (f32), with exactly the
//! expected all-reduces. flux_tiny: guidance on, 2 joint + 2 single layers, batch 2, a 3×4 token
//! grid and 5 text tokens; dit_tiny: 4 DiT blocks over 2×2 patches; flux2_tiny: 2 double + 2
//! single FLUX.2 blocks. Sequence parallelism is checked the same way for all three at TP2.
//! The TP2 × DP2 layouts and FLUX.1's sequence-parallel check run over c10d gloo groups
//! (`[parallelism] backend = "gloo"`), the others over MPI.

use std::process::{Command, Output};

const FLUX: &str = "configs/flux_tiny.toml";

/// Collectives through libtorch's c10d gloo groups instead of MPI.
const GLOO: [&str; 2] = ["--set", "parallelism.backend=\"gloo\""];

/// `mpirun -np N flux-hpc check-parallel CONFIG --set tp=... EXTRA`, bounded in time.
fn mpirun(config: &str, np: usize, tp: usize, extra: &[&str]) -> Output {
    // FLUX_TEST_BACKEND=gloo reruns every layout over another backend (a check's own
    // `parallelism.backend` still wins).
    let backend = std::env::var("FLUX_TEST_BACKEND")
        .map(|b| vec!["--set".to_string(), format!("parallelism.backend=\"{b}\"")])
        .unwrap_or_default();
    Command::new("timeout")
        .args([
            "300",
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .arg(env!("CARGO_BIN_EXE_flux-hpc"))
        .args(["check-parallel", config, "--set"])
        .arg(format!("parallelism.tensor_parallel_size={tp}"))
        .args(backend)
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("mpirun runs")
}

fn check_passes(config: &str, np: usize, tp: usize, extra: &[&str]) -> String {
    let out = mpirun(config, np, tp, extra);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "np {np} tp {tp} failed:\n{stdout}\n{stderr}"
    );
    for rank in 0..np {
        assert!(
            stdout.contains(&format!("rank {rank}: parallel check passed")),
            "{stdout}"
        );
    }
    stdout
}

#[test]
fn tensor_parallel_two_ranks_matches_one_process() {
    let out = check_passes(FLUX, 2, 2, &[]);
    // 2 joint layers × 4 + 2 single layers × 1 = 10 each way, one bucket of QK-norm gradients.
    assert!(
        out.contains("all-reduces forward 10 backward 10 grad-sync 1 (expected 10 10 1)"),
        "{out}"
    );
}

#[test]
fn tensor_two_by_data_two_matches_one_process() {
    // The groups are c10d gloo groups here (the other layouts run on MPI).
    let out = check_passes(FLUX, 4, 2, &GLOO);
    assert!(out.contains("(tp 1/2, dp 1/2, flux, gloo)"), "{out}");
}

#[test]
fn sequence_parallel_matches_one_process_for_every_architecture() {
    // Text of 6 tokens (3 per rank). FLUX.1, per pass: no all-reduce forward; backward one per
    // modulation (2 per joint layer, 1 per single layer: 6) and per row-parallel bias (4 per
    // joint layer, 1 per single layer: 10). Along the sequence, 2 per column or row linear
    // (8 per joint layer, 2 per single layer: 40) and the model's own: the two streams sliced
    // (their gradients gathered), gathered and sliced again as one, gathered for the output
    // layer (6).
    let sp = [
        "--set",
        "parallelism.sequence_parallel=true",
        "--text-len",
        "6",
    ];
    let out = check_passes(FLUX, 2, 2, &[&sp[..], &GLOO].concat());
    assert!(out.contains("flux, gloo"), "{out}");
    assert!(
        out.contains(
            "all-reduces forward 0 backward 16 grad-sync 1; sequence gathers and reduce-scatters 46"
        ),
        "{out}"
    );
    // DiT: per block one modulation and two row biases (12), four linears (32), the tokens
    // sliced and gathered (2). FLUX.2: its three shared modulations; 16 per double block, 4 per
    // single block and the model's 6.
    for (config, counts) in [
        (
            "configs/dit_tiny.toml",
            "backward 12 grad-sync 0; sequence gathers and reduce-scatters 34",
        ),
        (
            "configs/flux2_tiny.toml",
            "backward 3 grad-sync 1; sequence gathers and reduce-scatters 46",
        ),
    ] {
        let out = check_passes(config, 2, 2, &sp);
        assert!(out.contains(counts), "{config}: {out}");
    }
    // A stream that does not split is refused on both ranks, naming it.
    let out = mpirun(FLUX, 2, 2, &sp[..2]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("model input `text`").count(), 2, "{stderr}");
    assert!(stderr.contains("got 5 tokens"), "{stderr}");
}

#[test]
fn data_parallel_two_ranks_matches_one_process() {
    let out = check_passes(FLUX, 2, 1, &[]);
    assert!(
        out.contains("all-reduces forward 0 backward 0 grad-sync 0"),
        "{out}"
    );
}

#[test]
fn an_indivisible_layout_fails_on_every_rank_without_hanging() {
    let out = mpirun(FLUX, 3, 2, &[]);
    assert!(!out.status.success());
    assert_ne!(out.status.code(), Some(124), "timed out: a rank hung");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("world size 3 is not divisible by tensor_parallel_size 2"),
        "{stderr}"
    );
}

#[test]
fn dit_tensor_two_by_data_two_matches_one_process() {
    // 4 DiT blocks, two row outputs and two column inputs each; no partial gradients.
    let out = check_passes("configs/dit_tiny.toml", 4, 2, &GLOO);
    assert!(out.contains("(tp 1/2, dp 1/2, dit, gloo)"), "{out}");
    assert!(
        out.contains("all-reduces forward 8 backward 8 grad-sync 0 (expected 8 8 0)"),
        "{out}"
    );
}

#[test]
fn flux2_on_two_ranks_and_on_tp2_by_dp2_matches_one_process() {
    // Per double block 4 column inputs (fused q, k, v and SwiGLU in, per stream) and 4 row
    // outputs; per single block one fused column and one fused row linear; QK-norm scales summed
    // in one bucket.
    let expected = "all-reduces forward 10 backward 10 grad-sync 1 (expected 10 10 1)";
    for np in [2, 4] {
        let out = check_passes("configs/flux2_tiny.toml", np, 2, &[]);
        assert!(out.contains(expected), "{out}");
    }
}
