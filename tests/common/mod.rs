//! Helpers shared by the end-to-end tests: run `flux-hpc train` as one process or under mpirun.
#![allow(dead_code)] // each test binary uses its own subset

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub mod fault_server;
pub mod latents;

/// A fresh directory path under the system temp dir (not created).
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flux-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The config [`train`] runs.
pub const FLUX_TINY: &str = "configs/flux_tiny.toml";

/// `flux-hpc train configs/flux_tiny.toml` writing into `dir`, as one process (`np = None`) or
/// under `mpirun -np N`. Each `extra` item is a `--set` override, or, when it starts with `--`,
/// raw arguments (`"--stop-after 3"`).
pub fn train(np: Option<usize>, dir: &Path, extra: &[&str]) -> Output {
    train_config(FLUX_TINY, np, dir, extra)
}

/// As [`train`], with the run config `config` (relative to the repository root).
pub fn train_config(config: &str, np: Option<usize>, dir: &Path, extra: &[&str]) -> Output {
    train_command_for(config, np, dir, extra)
        .output()
        .expect("flux-hpc runs")
}

/// The command [`train`] runs, to spawn, add environment to, or signal. Under mpirun it is
/// `timeout 600 mpirun … flux-hpc train …`.
pub fn train_command(np: Option<usize>, dir: &Path, extra: &[&str]) -> Command {
    train_command_for(FLUX_TINY, np, dir, extra)
}

/// As [`train_command`], with the run config `config`.
pub fn train_command_for(config: &str, np: Option<usize>, dir: &Path, extra: &[&str]) -> Command {
    let bin = env!("CARGO_BIN_EXE_flux-hpc");
    let mut cmd = match np {
        None => Command::new(bin),
        Some(n) => {
            let mut c = Command::new("timeout");
            c.args([
                "600",
                "mpirun",
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                &n.to_string(),
            ])
            .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
            .arg(bin);
            c
        }
    };
    cmd.args(["train", config, "--device", "cpu", "--set"])
        .arg(format!("checkpoint.dir=\"{}\"", dir.display()));
    // FLUX_TEST_BACKEND=gloo reruns every training test over another collective backend (a
    // run's own `parallelism.backend` below still wins).
    if let Ok(backend) = std::env::var("FLUX_TEST_BACKEND") {
        cmd.arg("--set")
            .arg(format!("parallelism.backend=\"{backend}\""));
    }
    cmd.args(extra.iter().flat_map(|e| match e.strip_prefix("--") {
        Some(_) => e.split_whitespace().collect::<Vec<_>>(),
        None => vec!["--set", e],
    }))
    .current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

/// The held-out losses of a run's first and last metrics records.
pub fn first_and_last_eval(dir: &Path) -> (f64, f64) {
    let rs = records(dir);
    let eval = |r: &Value| r["eval_loss"].as_f64().expect("an evaluated record");
    (eval(&rs[0]), eval(rs.last().expect("records")))
}

/// `flux-hpc sample CONFIG` from the weights trained into `dir` (16 Euler steps) must land closer
/// to the data's latents than the data's own spread.
pub fn assert_samples_beat_the_data(config: &str, dir: &Path) {
    let set_dir = format!("checkpoint.dir=\"{}\"", dir.display());
    let sample = flux_hpc(&[
        "sample", config, "--device", "cpu", "--steps", "16", "--set", &set_dir,
    ]);
    ok(&sample);
    let text = String::from_utf8_lossy(&sample.stdout);
    let line = text.lines().find(|l| l.starts_with("mse vs data")).unwrap();
    let nums: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|s| s.parse().ok())
        .collect();
    assert!(nums[0] < nums[1], "{line}");
}

/// `flux-hpc ARGS` run from the repository root.
pub fn flux_hpc(args: &[&str]) -> Output {
    flux_hpc_with(args, &[])
}

/// `flux-hpc ARGS` run from the repository root with extra environment variables.
pub fn flux_hpc_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flux-hpc"))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("flux-hpc runs")
}

/// `.venv/bin/python SCRIPT ARGS` (a script under tests/fixtures) run from the repository root.
pub fn python(script: &str, args: &[&OsStr]) -> Output {
    let root = env!("CARGO_MANIFEST_DIR");
    Command::new(format!("{root}/.venv/bin/python"))
        .arg(format!("{root}/tests/fixtures/{script}"))
        .args(args)
        .current_dir(root)
        .output()
        .expect("the venv's python runs")
}

/// Flip one bit in the middle of the stored bytes of dataset `name` of the HDF5 file `path`
/// (of its first chunk, when chunked), as a bad disk or a bad copy would.
pub fn flip_bit_in(path: &Path, name: &str) {
    let (at, len) = {
        let file = hdf5::File::open(path).unwrap();
        let ds = file.dataset(name).unwrap();
        match ds.offset() {
            Some(offset) => (offset, ds.storage_size()),
            None => {
                let chunk = ds.chunk_info(0).expect("a contiguous or chunked dataset");
                (chunk.addr, chunk.size)
            }
        }
    };
    flip_bit_at(path, at + len / 2);
}

/// Flip the lowest bit of the byte at `offset` of `path`.
pub fn flip_bit_at(path: &Path, offset: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset as usize] ^= 1;
    std::fs::write(path, bytes).unwrap();
}

/// The run's metrics records.
pub fn records(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `flux-hpc convert --from native --to diffusers INPUT OUTPUT --dtype f32`, asserted to succeed:
/// a native run or checkpoint as a diffusers folder its Python forward scripts load.
pub fn convert_to_diffusers(input: &Path, output: &Path) {
    let (input, output) = (input.to_str().unwrap(), output.to_str().unwrap());
    ok(&flux_hpc(&[
        "convert",
        "--from",
        "native",
        "--to",
        "diffusers",
        input,
        output,
        "--dtype",
        "f32",
    ]));
}

/// Assert the process succeeded, showing its output otherwise.
pub fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Assert that two runs logged the same `keys` at every step, within `rel` (relative to the
/// value, absolute below 1).
pub fn assert_same_records(a: &[Value], b: &[Value], keys: &[&str], rel: f64) {
    assert_eq!(
        a.len(),
        b.len(),
        "the runs logged different numbers of records"
    );
    for (ra, rb) in a.iter().zip(b) {
        for key in keys {
            if let (Some(x), Some(y)) = (ra[key].as_f64(), rb[key].as_f64()) {
                assert!(
                    (x - y).abs() <= rel * x.abs().max(1.0),
                    "step {}: {key} {x} vs {y}",
                    ra["step"]
                );
            }
        }
    }
}

/// A named pipe at `path` (`mkfifo`).
pub fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", path.display());
}
