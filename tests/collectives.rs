//! The collective backends under real mpirun (`flux-hpc check-collectives`): every collective
//! over c10d gloo groups and over MPI, on f32 and bf16 CPU tensors, exact against the values
//! each rank computes alone; gloo moves bf16 as it is where MPI stages it through f32 host
//! buffers, and says so in bytes. A backend that cannot serve the run's device, and a
//! rendezvous store that cannot be reached, fail every rank with the reason within the bound.

use std::process::{Command, Output};

/// `mpirun -np 2 [-x ENV] flux-hpc check-collectives configs/flux_tiny.toml --device cpu
/// --set parallelism.backend="BACKEND" EXTRA`, bounded in time.
fn check(backend: &str, env: &[&str], extra: &[&str]) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.args([
        "120",
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
    ])
    .args(["--mca", "btl_vader_single_copy_mechanism", "none"]);
    for var in env {
        cmd.args(["-x", var]);
    }
    cmd.arg(env!("CARGO_BIN_EXE_flux-hpc"))
        .args([
            "check-collectives",
            "configs/flux_tiny.toml",
            "--device",
            "cpu",
        ])
        .args(["--elements", "1000", "--set"])
        .arg(format!("parallelism.backend=\"{backend}\""))
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("mpirun runs")
}

/// check-collectives' table: `(collective, dtype, host-staged bytes)` per row.
fn rows(stdout: &str) -> Vec<(String, String, u64)> {
    stdout
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let staged = cols.get(3)?.parse().ok()?;
            (cols.len() == 6 && cols[4] == "B").then(|| (cols[0].into(), cols[1].into(), staged))
        })
        .collect()
}

#[test]
fn every_collective_is_exact_over_gloo_and_mpi_and_only_mpi_stages_bf16() {
    for backend in ["gloo", "mpi"] {
        let out = check(backend, &[], &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{backend}:\n{stdout}\n{stderr}");
        assert!(stdout.contains(&format!("backend {backend}")), "{stdout}");
        let rows = rows(&stdout);
        // Four collectives, blocking and non-blocking, × two dtypes.
        assert_eq!(rows.len(), 16, "{stdout}");
        for (op, dtype, staged) in rows {
            match (backend, dtype.as_str()) {
                ("gloo", _) | (_, "Float") => assert_eq!(staged, 0, "{backend} {op} {dtype}"),
                // An all-gather only moves data: MPI sends bf16 as its bytes, unconverted.
                _ if op.ends_with("all_gather") => assert_eq!(staged, 0, "MPI bf16 {op}"),
                // At least 1000 elements converted to or from f32 (4 bytes each): the input,
                // the result, or both.
                _ => assert!(staged >= 4000, "{op}: MPI staged only {staged} B"),
            }
        }
    }
}

#[test]
fn a_backend_the_device_cannot_use_or_an_unreachable_store_fails_every_rank() {
    let out = check("nccl", &[], &[]);
    assert!(!out.status.success());
    // Each rank refuses alone, before MPI starts.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refusal = "backend = \"nccl\" moves CUDA tensors, but this run's device is cpu";
    assert_eq!(stderr.matches(refusal).count(), 2, "{stderr}");

    // TEST-NET-3: no host answers there, so rank 0 cannot reach its own store; both ranks fail
    // after the 3 s bound (two connection attempts) with the reason, neither hangs.
    let out = check(
        "gloo",
        &["MASTER_ADDR=203.0.113.1"],
        &["--set", "parallelism.collective_timeout_s=3"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 0: could not open the store at 203.0.113.1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rank 1: rank 0 could not open the rendezvous store"),
        "{stderr}"
    );
}
