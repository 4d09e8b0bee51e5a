//! The ways a careless or hostile user could lose data or wait forever, each tried for real:
//! malformed `latest` pointers, restarting in a used run directory, resuming with a smaller
//! model, ingest inputs that collide, a rank that stops responding, signals, special files and
//! corrupt weights files. docs/reliability.md lists them with what the user sees.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::latents::{sources, tars};
use common::{flip_bit_at, flux_hpc, mkfifo, ok, records, temp_dir, train, train_command};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The checkpoint directories of a run, oldest first.
fn checkpoints(dir: &Path) -> Vec<String> {
    flux_data::checkpoint::list(dir)
        .unwrap()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

const SHORT: [&str; 3] = [
    "training.eval_samples=8",
    "training.log_interval=1",
    "checkpoint.interval=2",
];

/// `flux_tiny` for `steps` steps, checkpointing every 2, in `dir`; `extra` as for [`train`].
fn run(dir: &Path, steps: u64, extra: &[&str]) -> Output {
    let total = format!("training.total_steps={steps}");
    train(None, dir, &[&SHORT[..], &[total.as_str()], extra].concat())
}

#[test]
fn a_malformed_latest_resumes_from_the_newest_checkpoint_instead_of_starting_over() {
    let dir = temp_dir("bad-latest");
    ok(&run(&dir, 4, &[]));
    assert_eq!(checkpoints(&dir), ["step_000000002", "step_000000004"]);
    let absolute = dir.join("step_000000004").display().to_string();
    for (i, pointer) in ["", " \n", absolute.as_str()].into_iter().enumerate() {
        std::fs::write(dir.join("latest"), pointer).unwrap();
        let steps = 5 + i as u64;
        let out = run(&dir, steps, &[]);
        ok(&out);
        let log = stderr(&out);
        assert!(
            log.contains("not the name of a checkpoint directory"),
            "{pointer:?}: {log}"
        );
        assert!(log.contains("resumed from"), "{pointer:?}: {log}");
        // The metrics still hold the first run's records, continued, not restarted.
        let rs = records(&dir);
        let steps_logged: Vec<u64> = rs.iter().map(|r| r["step"].as_u64().unwrap()).collect();
        assert_eq!(
            steps_logged.iter().filter(|&&s| s == 0).count(),
            1,
            "{steps_logged:?}"
        );
        assert_eq!(steps_logged.last(), Some(&steps), "{steps_logged:?}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn restarting_in_a_used_run_directory_needs_force_and_retention_keeps_latest() {
    let dir = temp_dir("restart");
    ok(&run(&dir, 4, &["checkpoint.keep=1"]));
    assert_eq!(checkpoints(&dir), ["step_000000004"]);
    let config = read(&dir.join("config.toml"));

    // total_steps below the checkpoint's step would be dropped: refused, naming both.
    let out = run(&dir, 3, &["checkpoint.keep=1"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("holds step 4 but [training] total_steps = 3"),
        "{}",
        stderr(&out)
    );
    assert_eq!(read(&dir.join("config.toml")), config);

    // resume = false would restart at step 0 and, with keep = 1, delete its own step 2 (older
    // than the earlier run's step 4) right after publishing it: refused, nothing touched.
    let out = run(&dir, 2, &["checkpoint.keep=1", "checkpoint.resume=false"]);
    assert!(!out.status.success());
    let log = stderr(&out);
    assert!(
        log.contains("resume = false") && log.contains("--force"),
        "{log}"
    );
    assert_eq!(checkpoints(&dir), ["step_000000004"]);
    assert_eq!(read(&dir.join("latest")).trim(), "step_000000004");
    assert_eq!(read(&dir.join("config.toml")), config);

    // With --force it starts over on purpose: the old checkpoints go first, `latest` is the new
    // run's, and a resume continues the new run.
    let out = run(
        &dir,
        2,
        &["checkpoint.keep=1", "checkpoint.resume=false", "--force"],
    );
    ok(&out);
    assert!(
        stderr(&out).contains("--force: removed"),
        "{}",
        stderr(&out)
    );
    assert_eq!(checkpoints(&dir), ["step_000000002"]);
    assert_eq!(read(&dir.join("latest")).trim(), "step_000000002");
    let out = run(&dir, 3, &["checkpoint.keep=1"]);
    ok(&out);
    assert!(stderr(&out).contains("step_000000002"), "{}", stderr(&out));
    assert_eq!(read(&dir.join("latest")).trim(), "step_000000003");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn resuming_with_a_model_that_lacks_tensors_is_refused_and_keeps_the_config() {
    let dir = temp_dir("fewer-tensors");
    ok(&run(&dir, 2, &[]));
    let config = read(&dir.join("config.toml"));
    assert!(config.contains("guidance_embed = true"), "{config}");
    let out = run(&dir, 4, &["model.guidance_embed=false"]);
    assert!(!out.status.success(), "a resume dropped tensors");
    let log = stderr(&out);
    assert!(
        log.contains("tensor(s) this model does not have")
            && log.contains("guidance_embedder.linear_1.weight"),
        "{log}"
    );
    assert_eq!(read(&dir.join("config.toml")), config);
    assert_eq!(checkpoints(&dir), ["step_000000002"]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_signal_before_the_last_step_checkpoints_and_exits_non_zero() {
    let dir = temp_dir("sigterm");
    let mut child = train_command(None, &dir, &["training.total_steps=100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !dir.join("metrics.jsonl").exists() && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    // A second run in the same directory meanwhile is refused, naming the holder.
    let second = train(None, &dir, &["training.total_steps=5"]);
    assert!(!second.status.success(), "two runs shared a directory");
    let log = stderr(&second);
    assert!(
        log.contains("is in use by another run") && log.contains(&format!("pid {}", child.id())),
        "{log}"
    );
    ok(&Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .output()
        .unwrap());
    let out = {
        let limit = Instant::now();
        while child.try_wait().unwrap().is_none() {
            assert!(
                limit.elapsed() < Duration::from_secs(120),
                "SIGTERM did not stop it"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        child.wait_with_output().unwrap()
    };
    assert!(!out.status.success(), "an interrupted run reported success");
    let log = stderr(&out);
    assert!(log.contains("stopped by a signal after step"), "{log}");
    assert!(flux_data::checkpoint::latest(&dir).unwrap().is_some());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_rank_that_stops_responding_ends_the_job_with_the_waiting_rank_named() {
    let dir = temp_dir("stalled-rank");
    let start = Instant::now();
    let out = train_command(
        Some(2),
        &dir,
        &[
            "training.total_steps=50",
            "training.eval_samples=8",
            "parallelism.collective_timeout_s=5",
        ],
    )
    .env("FLUX_HPC_FAILPOINT", "stall:2@1")
    .output()
    .unwrap();
    let took = start.elapsed();
    assert!(
        !out.status.success(),
        "the job finished with a stopped rank"
    );
    let log = stderr(&out);
    assert!(
        log.contains("failpoint `stall` reached at step 2 on rank 1"),
        "{log}"
    );
    assert!(
        log.contains("rank 0 of 2: a collective over") && log.contains("stopped responding"),
        "{log}"
    );
    // Not a hang: mpirun's own 600 s limit (train_command) would show as a timeout.
    assert!(took < Duration::from_secs(300), "took {took:?}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn ingest_inputs_that_would_share_a_shard_are_refused_naming_both() {
    let dir = sources("ingest-collide", &[]);
    let tar = tars(&dir).remove(0);
    for sub in ["x", "y"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        std::fs::copy(&tar, dir.join(sub).join("part.tar")).unwrap();
    }
    let (x, y) = (dir.join("x/part.tar"), dir.join("y/part.tar"));
    let out_dir = dir.join("h5");
    let out = flux_hpc(&[
        "data",
        "ingest",
        "--out",
        out_dir.to_str().unwrap(),
        "--tar",
        x.to_str().unwrap(),
        y.to_str().unwrap(),
    ]);
    assert!(!out.status.success(), "one of two inputs was dropped");
    let log = stderr(&out);
    assert!(
        log.contains(x.to_str().unwrap()) && log.contains(y.to_str().unwrap()),
        "{log}"
    );
    assert!(
        !out_dir.exists(),
        "something was written before the refusal"
    );

    // A FIFO given as a tar is refused at once instead of blocking on its open.
    let fifo = dir.join("pipe.tar");
    mkfifo(&fifo);
    let out = flux_hpc(
        &[
            "data",
            "ingest",
            "--out",
            out_dir.to_str().unwrap(),
            "--tar",
        ]
        .into_iter()
        .chain([fifo.to_str().unwrap()])
        .collect::<Vec<_>>(),
    );
    assert!(stderr(&out).contains("FIFO"), "{}", stderr(&out));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn ingest_resumes_by_content_adding_new_inputs_and_refusing_changed_ones() {
    let dir = sources("ingest-content", &[]);
    let all = tars(&dir);
    let out_dir = dir.join("h5");
    let ingest = |tar: &Path| {
        flux_hpc(&[
            "data",
            "ingest",
            "--out",
            out_dir.to_str().unwrap(),
            "--tar",
            tar.to_str().unwrap(),
        ])
    };
    // A tar from another folder under a basename already ingested, with other bytes: refused,
    // naming the tar that holds the shard; the same bytes from elsewhere: already present.
    for (sub, source) in [("x", &all[0]), ("y", &all[1]), ("z", &all[0])] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        std::fs::copy(source, dir.join(sub).join("part.tar")).unwrap();
    }
    ok(&ingest(&dir.join("x/part.tar")));
    let out = ingest(&dir.join("y/part.tar"));
    assert!(
        !out.status.success(),
        "a second part.tar was taken as present"
    );
    assert!(
        stderr(&out).contains("y/part.tar") && stderr(&out).contains("x/part.tar"),
        "{}",
        stderr(&out)
    );
    let out = ingest(&dir.join("z/part.tar"));
    ok(&out);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("wrote 0 shard(s) with 0 samples")
            && String::from_utf8_lossy(&out.stdout).contains("; 1 input(s) already present"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // Directories of samples: keys sorting before the ingested ones, and a second directory,
    // are added in new shards; a key already ingested with other bytes is refused by name.
    let files = dir.join("samples");
    let into = dir.join("from-dirs");
    let ingest_dir = |source: &Path| common::latents::ingest_dir(source, &into, "2", &[]);
    for key in ["k1", "k2"] {
        common::latents::write_npy_sample(&files.join("a"), key, &[16, 8, 8], None);
    }
    ok(&ingest_dir(&files.join("a")));
    common::latents::write_npy_sample(&files.join("b"), "k0", &[16, 8, 8], None);
    let out = ingest_dir(&files.join("b"));
    ok(&out);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("wrote 1 shard(s) with 1 samples"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = ingest_dir(&files.join("a"));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("wrote 0 shard(s) with 0 samples")
            && String::from_utf8_lossy(&out.stdout).contains("; 2 input(s) already present"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let validated = flux_hpc(&["data", "validate", into.to_str().unwrap()]);
    ok(&validated);
    assert!(String::from_utf8_lossy(&validated.stdout).contains("with 3 samples"));
    common::latents::write_npy_sample(&files.join("c"), "k1", &[16, 8, 8], None);
    let out = ingest_dir(&files.join("c"));
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("`k1` is already written into"),
        "{}",
        stderr(&out)
    );

    // Non-finite values are refused at ingest, naming the sample.
    let nan = sources("ingest-nan", &["--nan-sample", "00001_0004"]);
    let nan_tar = tars(&nan).remove(1);
    let out = flux_hpc(&[
        "data",
        "ingest",
        "--out",
        nan.join("h5").to_str().unwrap(),
        "--tar",
        nan_tar.as_str(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("00001_0004") && stderr(&out).contains("NaN"),
        "{}",
        stderr(&out)
    );
    assert!(!nan.join("h5/part_00001.h5.tmp").exists());
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::remove_dir_all(nan).unwrap();
}

#[test]
fn bad_command_lines_and_config_files_are_refused_up_front() {
    let dir = temp_dir("bad-input");
    std::fs::create_dir_all(&dir).unwrap();
    let out = flux_hpc(&["launch", "-n", "0", "configs/flux_tiny.toml", "--dry-run"]);
    assert!(!out.status.success(), "launch -n 0 was accepted");
    assert!(
        stderr(&out).contains("invalid value '0' for '--ranks <RANKS>'"),
        "{}",
        stderr(&out)
    );

    // An empty config is not FLUX.1 [dev] by default.
    let empty = dir.join("empty.toml");
    std::fs::write(&empty, "").unwrap();
    let out = flux_hpc(&["info", empty.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("model: the config has no [model] table"),
        "{}",
        stderr(&out)
    );

    // A config path that is a FIFO fails at once, naming it.
    let fifo = dir.join("config.toml");
    mkfifo(&fifo);
    let out = flux_hpc(&["info", fifo.to_str().unwrap()]);
    assert!(stderr(&out).contains("FIFO"), "{}", stderr(&out));

    // A --set value with a second key after a newline, and the filesystem root as run
    // directory: refused naming them, nothing dropped or written.
    let out = flux_hpc(&[
        "info",
        "configs/flux_tiny.toml",
        "--set",
        "training.total_steps=5\ntraining.seed=3",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("more than one value"),
        "{}",
        stderr(&out)
    );
    let out = flux_hpc(&[
        "info",
        "configs/flux_tiny.toml",
        "--set",
        "checkpoint.dir=\"/\"",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("checkpoint.dir") && stderr(&out).contains("filesystem root"),
        "{}",
        stderr(&out)
    );

    // `data validate` over nothing is a failure, not "0 problems".
    let out = flux_hpc(&["data", "validate", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no latent shards"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_corrupt_final_weights_file_is_refused_by_sample() {
    let dir = temp_dir("final-weights");
    ok(&run(&dir, 2, &[]));
    let weights = dir.join("final.safetensors");
    let config = format!("checkpoint.dir=\"{}\"", dir.display());
    let sample = || {
        flux_hpc(&[
            "sample",
            "configs/flux_tiny.toml",
            "--device",
            "cpu",
            "--count",
            "1",
            "--steps",
            "2",
            "--set",
            &config,
        ])
    };
    ok(&sample());
    // Settings the ODE cannot use, and a request that cannot fit, refused before any work.
    let refused = |extra: &[&str], expect: &str| {
        let mut args = vec![
            "sample",
            "configs/flux_tiny.toml",
            "--device",
            "cpu",
            "--set",
            &config,
        ];
        args.extend(extra);
        let out = flux_hpc(&args);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(stderr(&out).contains(expect), "{extra:?}: {}", stderr(&out));
    };
    refused(&["--guidance", "nan"], "--guidance must be a finite number");
    refused(
        &["--cfg-scale", "inf"],
        "--cfg-scale must be a finite number",
    );
    refused(&["--steps", "0"], "--steps must be at least 1");
    refused(&["--count", "1000000000000"], "GiB for the latents");
    let len = std::fs::metadata(&weights).unwrap().len();
    flip_bit_at(&weights, len - 6);
    let out = sample();
    assert!(!out.status.success(), "sampled from a corrupt file");
    let log = stderr(&out);
    assert!(
        log.contains("final.safetensors") && log.contains("corrupt"),
        "{log}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
