//! Faults end to end, with real processes and real files: a rank killed under mpirun, a crash
//! between checkpoint files, corrupt checkpoints and shards, non-finite losses, a full disk and
//! set-up errors. Each test says what must hold; docs/reliability.md lists the same faults.

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

use common::latents::{ingest_tars, sources};
use common::{
    assert_same_records, flip_bit_in, flux_hpc, flux_hpc_with, ok, python, records, temp_dir,
    train, train_command,
};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The checkpoint `latest` names.
fn latest(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("latest"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The direct children of process `pid`.
fn children(pid: u32) -> Vec<u32> {
    let out = Command::new("pgrep")
        .args(["-P", &pid.to_string()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Wait for `child`; a job still running after `limit` is a hang: kill it and fail.
fn wait_or_fail(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{what}: still running after {limit:?}: the job hangs");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

const LOGGED: [&str; 3] = ["loss", "grad_norm", "eval_loss"];

#[test]
fn a_rank_killed_mid_run_ends_the_job_and_the_rerun_continues_the_same_losses() {
    let settings = [
        "training.total_steps=60",
        "training.log_interval=1",
        "training.eval_interval=20",
        "checkpoint.interval=2",
    ];
    let (reference, killed) = (temp_dir("kill-ref"), temp_dir("kill"));
    ok(&train(Some(2), &reference, &settings));

    let mut job = train_command(Some(2), &killed, &settings).spawn().unwrap();
    let start = Instant::now();
    while latest(&killed).is_empty() {
        assert!(job.try_wait().unwrap().is_none(), "the job ended early");
        assert!(start.elapsed() < Duration::from_secs(300), "no checkpoint");
        std::thread::sleep(Duration::from_millis(10));
    }
    // timeout → mpirun → ranks: SIGKILL the last rank, as the OOM killer or a node failure would.
    let mpirun = children(job.id())[0];
    let rank = *children(mpirun).last().expect("mpirun's ranks");
    let killed_at = Instant::now();
    ok(&Command::new("kill")
        .args(["-KILL", &rank.to_string()])
        .output()
        .unwrap());
    let status = wait_or_fail(&mut job, Duration::from_secs(120), "mpirun after SIGKILL");
    eprintln!(
        "job ended {:.2} s after the SIGKILL, at checkpoint {}",
        killed_at.elapsed().as_secs_f64(),
        latest(&killed)
    );
    assert!(!status.success(), "a job with a killed rank must fail");
    assert_ne!(latest(&killed), "step_000000060", "the kill came too late");

    ok(&train(Some(2), &killed, &settings));
    assert_same_records(&records(&reference), &records(&killed), &LOGGED, 1e-5);
    for dir in [reference, killed] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_crash_between_checkpoint_files_keeps_the_previous_checkpoint_current() {
    let settings = [
        "parallelism.tensor_parallel_size=2",
        "training.total_steps=6",
        "training.log_interval=1",
        "checkpoint.interval=2",
    ];
    let (reference, crashed) = (temp_dir("crash-ref"), temp_dir("crash"));
    ok(&train(Some(2), &reference, &settings));

    // Tensor-parallel rank 0 aborts right after writing its file of step 4.
    let out = train_command(Some(2), &crashed, &settings)
        .env("FLUX_HPC_FAILPOINT", "checkpoint-file:4")
        .output()
        .unwrap();
    assert!(!out.status.success(), "the crash must fail the job");
    assert!(stderr(&out).contains("failpoint `checkpoint-file`"));
    assert_eq!(latest(&crashed), "step_000000002");
    assert!(!crashed.join("step_000000004").exists());
    assert!(crashed.join("step_000000004.partial/tp_00.h5").exists());
    let inspect = flux_hpc(&[
        "ckpt",
        "inspect",
        crashed.join("step_000000002").to_str().unwrap(),
    ]);
    ok(&inspect);

    ok(&train(Some(2), &crashed, &settings));
    assert_same_records(&records(&reference), &records(&crashed), &LOGGED, 1e-5);
    assert!(!crashed.join("step_000000004.partial").exists());
    for dir in [reference, crashed] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_corrupt_latest_checkpoint_is_named_and_resume_falls_back_to_the_previous_one() {
    let settings = [
        "training.total_steps=6",
        "training.log_interval=1",
        "checkpoint.interval=2",
        "checkpoint.keep=3",
    ];
    let reference = temp_dir("corrupt-ref");
    ok(&train(None, &reference, &settings));
    for (fault, damage) in [
        (
            "flip",
            (|file: &Path| flip_bit_in(file, "params/x_embedder.weight")) as fn(&Path),
        ),
        ("truncate", |file: &Path| {
            let len = std::fs::metadata(file).unwrap().len();
            std::fs::File::options()
                .write(true)
                .open(file)
                .unwrap()
                .set_len(len / 2)
                .unwrap();
        }),
    ] {
        let dir = temp_dir(&format!("corrupt-{fault}"));
        ok(&train(
            None,
            &dir,
            &[&settings[..], &["--stop-after 4"]].concat(),
        ));
        let file = dir.join("step_000000004/tp_00.h5");
        damage(&file);

        let inspect = flux_hpc(&["ckpt", "inspect", file.parent().unwrap().to_str().unwrap()]);
        assert!(
            !inspect.status.success(),
            "{fault}: a damaged checkpoint loaded"
        );
        let named = stderr(&inspect);
        assert!(named.contains(file.to_str().unwrap()), "{fault}: {named}");
        if fault == "flip" {
            assert!(
                named.contains("dataset `params/x_embedder.weight` is corrupt (checksum mismatch)"),
                "{named}"
            );
        }

        let resumed = train(None, &dir, &settings);
        ok(&resumed);
        let log = stderr(&resumed);
        assert!(
            log.contains(&format!(
                "checkpoint {} is unusable",
                dir.join("step_000000004").display()
            )),
            "{fault}: {log}"
        );
        assert!(
            log.contains(&format!(
                "falling back to {}",
                dir.join("step_000000002").display()
            )),
            "{fault}: {log}"
        );
        assert_same_records(&records(&reference), &records(&dir), &LOGGED, 1e-5);
        std::fs::remove_dir_all(dir).unwrap();
    }
    std::fs::remove_dir_all(reference).unwrap();
}

#[test]
fn a_corrupt_shard_is_named_by_its_checksum_and_ends_the_job() {
    let dir = sources("corrupt-shard", &[]);
    let (h5, _) = ingest_tars(&dir);
    // Held-out samples from an intact copy, so that the bad sample is met in a training step by
    // one rank alone, which must then end the job for its peers.
    let clean = dir.join("clean");
    std::fs::create_dir_all(&clean).unwrap();
    std::fs::copy(h5.join("part_00001.h5"), clean.join("part_00001.h5")).unwrap();
    let shard = h5.join("part_00001.h5");
    flip_bit_in(&shard, "latents");
    let paths = format!("data.paths=[\"{}\"]", h5.display());
    let eval_paths = format!("data.eval_paths=[\"{}\"]", clean.display());
    let mut job = train_command(
        Some(2),
        &dir.join("run"),
        &[
            "data.source=\"hdf5\"",
            &paths,
            &eval_paths,
            "training.total_steps=6",
        ],
    )
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let status = wait_or_fail(
        &mut job,
        Duration::from_secs(120),
        "training on a bad shard",
    );
    let mut log = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut log).unwrap();
    assert!(!status.success(), "training on a corrupt shard succeeded");
    assert!(
        log.contains(&format!(
            "{}: dataset `latents` is corrupt (checksum mismatch)",
            shard.display()
        )),
        "{log}"
    );
    assert!(log.contains("ending the job"), "{log}");

    // The same shard rewritten without any filter (as another tool's copy may be), then
    // corrupted: no Fletcher-32 guards the reads, so opening it checks its CRC-32s, as
    // `data validate` does, and training refuses it before reading a sample.
    let plain = dir.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let unfiltered = plain.join("part_00001.h5");
    ok(&Command::new("h5repack")
        .args(["-f", "NONE"])
        .arg(clean.join("part_00001.h5"))
        .arg(&unfiltered)
        .output()
        .expect("h5repack (hdf5-tools) runs"));
    flip_bit_in(&unfiltered, "latents");
    let out = train(
        None,
        &dir.join("plain-run"),
        &[
            "data.source=\"hdf5\"",
            &format!("data.paths=[\"{}\"]", plain.display()),
        ],
    );
    assert!(
        !out.status.success(),
        "training read an unchecked corrupt shard"
    );
    let expected = format!(
        "{}: dataset `latents` is corrupt (checksum mismatch)",
        unfiltered.display()
    );
    assert!(stderr(&out).contains(&expected), "{}", stderr(&out));
    let out = flux_hpc(&["data", "validate", plain.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&expected));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_nan_sample_is_skipped_or_stops_the_run_with_a_diagnostic_dump() {
    // Sample 00001_0004 is the 11th of 18; without shuffling, step 2 (samples 8..16) holds it,
    // and the 8 held-out samples (the first 8) do not.
    let dir = sources("nan", &[]);
    let (h5, _) = ingest_tars(&dir);
    let shard = h5.join("part_00001.h5");
    ok(&python(
        "poison_shard.py",
        &[shard.as_os_str(), OsStr::new("4")],
    ));
    let paths = format!("data.paths=[\"{}\"]", h5.display());
    let settings = [
        "data.source=\"hdf5\"",
        "data.shuffle=false",
        paths.as_str(),
        "training.total_steps=3",
        "training.eval_samples=8",
        "training.log_interval=1",
        "checkpoint.interval=1",
    ];

    let skip = dir.join("skip");
    ok(&train(
        Some(2),
        &skip,
        &[&settings[..], &["training.nonfinite=\"skip\""]].concat(),
    ));
    let rs = records(&skip);
    let skipped: Vec<u64> = rs
        .iter()
        .filter(|r| r["skipped"] == true)
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(skipped, [2], "{rs:?}");
    let last = rs.last().unwrap();
    assert!(last["loss"].as_f64().unwrap().is_finite(), "{last}");
    assert!(last["eval_loss"].as_f64().unwrap().is_finite(), "{last}");
    // The skipped step changed no weight: checkpoints 1 and 2 hold the same parameters.
    let (one, two) = (
        flux_data::checkpoint::load(&skip.join("step_000000001")).unwrap(),
        flux_data::checkpoint::load(&skip.join("step_000000002")).unwrap(),
    );
    for (name, t) in &one.tensors["params"] {
        assert!(t.equal(&two.tensors["params"][name]), "{name} changed");
    }

    // Skipping is bounded: past max_consecutive_skips steps in a row the run stops, dumping.
    let bounded = dir.join("bounded");
    let out = train(
        None,
        &bounded,
        &[
            &settings[..],
            &[
                "training.nonfinite=\"skip\"",
                "training.max_consecutive_skips=1",
            ],
        ]
        .concat(),
    );
    assert!(!out.status.success(), "an unbounded run of skips");
    let log = stderr(&out);
    assert!(log.contains("max_consecutive_skips = 1"), "{log}");
    let dump = |run: &Path, rank: usize| -> serde_json::Value {
        let path = run.join(format!("nonfinite_step_000000002.rank_{rank}.json"));
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let nonfinite_grads = |d: &serde_json::Value| d["nonfinite_grads"].as_array().unwrap().len();
    assert!(nonfinite_grads(&dump(&bounded, 0)) > 0);
    assert_eq!(latest(&bounded), "step_000000001");

    // Two replicas with sharded gradients: each holds only its share of the summed gradients,
    // and the NaN one sample put into the sum shows in both.
    let stop = dir.join("stop");
    let sharded = "parallelism.sharding=\"gradients\"";
    let out = train(Some(2), &stop, &[&settings[..], &[sharded]].concat());
    assert!(!out.status.success(), "a NaN loss must stop the run");
    let log = stderr(&out);
    assert!(
        log.contains("step 2: loss NaN and gradient norm NaN are not all finite"),
        "{log}"
    );
    assert_eq!(latest(&stop), "step_000000001");
    let dumps: Vec<serde_json::Value> = (0..2).map(|rank| dump(&stop, rank)).collect();
    assert!(dumps.iter().all(|d| nonfinite_grads(d) > 0));
    let holder = dumps
        .iter()
        .find(|d| {
            d["samples"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s == "00001_0004")
        })
        .expect("one rank's dump names the NaN sample");
    assert_eq!(
        (holder["data_epoch"].as_u64(), holder["data_index"].as_u64()),
        (Some(0), Some(8))
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A tmpfs of `bytes` mounted at `at` (this test runs as root, as CI does), unmounted on drop.
struct Tmpfs<'a>(&'a Path);

impl<'a> Tmpfs<'a> {
    fn mount(at: &'a Path, bytes: u64) -> Self {
        std::fs::create_dir_all(at).unwrap();
        ok(&Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(at)
            .output()
            .unwrap());
        Self(at)
    }
}

impl Drop for Tmpfs<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}

#[test]
fn a_full_disk_during_a_checkpoint_is_a_clear_error_and_the_previous_one_survives() {
    let dir = temp_dir("full-disk");
    let settings = [
        "training.total_steps=4",
        "checkpoint.interval=2",
        "checkpoint.keep=1",
    ];
    // Size the disk from a checkpoint of this config: room for one and a half.
    let sizing = dir.join("sizing");
    ok(&train(
        None,
        &sizing,
        &[&settings[..], &["--stop-after 2"]].concat(),
    ));
    let one = std::fs::metadata(sizing.join("step_000000002/tp_00.h5"))
        .unwrap()
        .len();
    let disk = dir.join("disk");
    let _tmpfs = Tmpfs::mount(&disk, one * 3 / 2);
    let run = disk.join("run");

    let out = train(None, &run, &settings);
    assert!(!out.status.success(), "a checkpoint fit on a full disk");
    let log = stderr(&out);
    assert!(log.contains("No space left on device"), "{log}");
    assert!(log.contains("step_000000004.partial"), "{log}");
    assert_eq!(latest(&run), "step_000000002");
    flux_data::checkpoint::load(&run.join("step_000000002")).unwrap();
    // Nothing half-written is left to hold the space a retry needs.
    assert!(!run.join("step_000000004.partial").exists());
    drop(_tmpfs);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_unwritable_run_directory_fails_on_every_rank_before_any_work() {
    let dir = temp_dir("unwritable");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let run = file.join("run");
    let out = train(Some(2), &run, &[]);
    assert!(!out.status.success());
    let log = stderr(&out);
    let message = format!("run directory {} is not writable", run.display());
    assert_eq!(
        log.matches(&message).count(),
        2,
        "both ranks report it: {log}"
    );
    assert!(!log.contains("training steps"), "work started: {log}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_missing_mpi_launcher_is_a_clear_error() {
    let dir = temp_dir("no-mpirun");
    let set = format!("checkpoint.dir=\"{}\"", dir.display());
    let out = flux_hpc_with(
        &["launch", "-n", "2", "configs/flux_tiny.toml", "--set", &set],
        &[("PATH", "/nonexistent")],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("mpirun was not found on PATH"),
        "{}",
        stderr(&out)
    );
    assert!(
        !dir.exists(),
        "nothing is written before the launcher is found"
    );
}
