//! Latent data end to end: NumPy/safetensors-written sources ingested by `flux-hpc data ingest`
//! (tar shards, per-sample files, HTTP streaming against a fault-injecting server), validated,
//! and trained on under mpirun with exact resume (two resolution buckets, masked loss); inputs
//! and shards that do not fit are refused naming the sample or field.

mod common;

use std::path::Path;

use common::fault_server::{Fault, FaultServer};
use common::latents::{ingest_dir, ingest_tars, sources, write_npy_sample};
use common::{assert_same_records, flux_hpc, ok, records, train};
use flux_data::dataset::LatentDataset;
use tch::Tensor;

/// Every sample of the shards under `h5` equals the generator's values, in order.
fn assert_matches_expected(h5: &Path, expected: &Path, fields: &[&str], shards: usize) {
    let data = LatentDataset::open(&[h5.to_path_buf()]).unwrap();
    let expected: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(expected)
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(data.len(), 6 * shards as u64);
    for i in 0..data.len() {
        let s = data.read(i).unwrap();
        for field in fields {
            let got = match *field {
                "mean" | "latents" => &s.latents,
                "logvar" => s.logvar.as_ref().unwrap(),
                "t5" => &s.t5,
                _ => &s.clip,
            };
            let want = Vec::<f32>::try_from(expected[*field].get(i as i64)).unwrap();
            assert_eq!(got, &want, "sample {i} field {field}");
        }
    }
}

#[test]
fn mlperf_tar_shards_ingest_bit_exactly_and_validate() {
    let dir = sources("ingest-tar", &[]);
    let (h5, _) = ingest_tars(&dir);
    assert_matches_expected(
        &h5,
        &dir.join("expected_tars.safetensors"),
        &["mean", "logvar", "t5", "clip"],
        3,
    );
    let data = LatentDataset::open(std::slice::from_ref(&h5)).unwrap();
    assert_eq!(
        data.read(7).unwrap().caption.as_deref(),
        Some("caption 00001_0001")
    );
    assert_eq!(data.layout().latent, [4, 16, 16]);
    assert_eq!(
        data.layout().text,
        [8, 32],
        "MLPerf's leading batch dim is dropped"
    );

    // Re-running skips what exists.
    let (_, again) = ingest_tars(&dir);
    assert!(again.contains("wrote 0 shard(s) with 0 samples"), "{again}");

    let validated = flux_hpc(&["data", "validate", h5.to_str().unwrap()]);
    ok(&validated);
    // One flipped bit in a stored value: validate names the file and dataset and fails.
    let victim = h5.join("part_00001.h5");
    let mut bytes = std::fs::read(&victim).unwrap();
    let t5 = {
        let f = hdf5::File::open(&victim).unwrap();
        f.dataset("t5").unwrap().read_raw::<u16>().unwrap()
    };
    let needle: Vec<u8> = t5[100..104].iter().flat_map(|v| v.to_le_bytes()).collect();
    let at = bytes
        .windows(8)
        .position(|w| w == needle)
        .expect("t5 stored raw");
    bytes[at] ^= 0x01;
    std::fs::write(&victim, &bytes).unwrap();
    let out = flux_hpc(&["data", "validate", h5.to_str().unwrap()]);
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("part_00001.h5: dataset `t5` is corrupt"),
        "{stdout}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn npy_and_safetensors_files_ingest_into_fixed_size_shards() {
    let dir = sources("ingest-files", &[]);
    let h5 = dir.join("h5");
    let extra = [
        "--dtype",
        "f32",
        "--deflate",
        "6",
        "--latent-norm",
        "identity",
    ];
    ok(&ingest_dir(&dir.join("files"), &h5, "4", &extra));
    assert!(h5.join("shard_000000.h5").exists() && h5.join("shard_000001.h5").exists());
    assert_matches_expected(
        &h5,
        &dir.join("expected_files.safetensors"),
        &["latents", "t5", "clip"],
        1,
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn streaming_ingest_retries_skips_logs_and_resumes() {
    let dir = sources("ingest-http", &[]);
    let server = FaultServer::start(dir.join("tars"));
    server.queue("/part_00000.tar", &[Fault::Status(429), Fault::Status(503)]);
    server.queue("/part_00001.tar", &[Fault::Corrupt]);
    server.always("/part_00002.tar", Some(Fault::Status(503)));
    let h5 = dir.join("h5");
    let work = dir.join("downloads");
    let ingest = || {
        flux_hpc(&[
            "data",
            "ingest",
            "--url",
            &server.url,
            "--manifest",
            "manifest.txt",
            "--md5",
            "md5sums.txt",
            "--out",
            h5.to_str().unwrap(),
            "--work-dir",
            work.to_str().unwrap(),
            "--attempts",
            "3",
            "--backoff-ms",
            "10",
            "--concurrency",
            "2",
            "--prefetch",
            "2",
        ])
    };
    let first = ingest();
    ok(&first);
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert!(
        stdout.contains("wrote 2 shard(s) with 12 samples"),
        "{stdout}"
    );
    assert_eq!(
        server.requests("/part_00000.tar"),
        3,
        "429, 503, then success"
    );
    assert_eq!(
        server.requests("/part_00001.tar"),
        2,
        "MD5 mismatch, then success"
    );
    assert_eq!(
        server.requests("/part_00002.tar"),
        3,
        "gave up after 3 attempts"
    );
    let failed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(h5.join("failed_files.json")).unwrap())
            .unwrap();
    assert_eq!(failed[0]["file"], "part_00002.tar");
    assert_eq!(failed[0]["attempts"], 3);
    assert!(
        failed[0]["error"].as_str().unwrap().contains("HTTP 503"),
        "{failed}"
    );
    assert_eq!(
        std::fs::read_dir(&work).unwrap().count(),
        0,
        "downloads are deleted once converted"
    );

    // The server recovers; the rerun fetches only the missing shard.
    server.always("/part_00002.tar", None);
    let second = ingest();
    ok(&second);
    assert!(String::from_utf8_lossy(&second.stdout).contains("wrote 1 shard(s) with 6 samples"));
    assert_eq!(
        server.requests("/part_00000.tar"),
        3,
        "finished shards are not fetched again"
    );
    assert_eq!(server.requests("/part_00002.tar"), 4);
    assert!(!h5.join("failed_files.json").exists());
    assert_matches_expected(
        &h5,
        &dir.join("expected_tars.safetensors"),
        &["mean", "logvar", "t5", "clip"],
        3,
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bucketed_masked_shards_split_across_ranks_and_resume_exactly() {
    // Two resolution buckets (two shards of 16×16 latents, one of 16×24), every sample masked.
    let dir = sources(
        "train-h5",
        &["--masks", "--last-latent", "4,16,24", "--tars-only"],
    );
    let (h5, _) = ingest_tars(&dir);
    // 4 samples per step: 3 steps of the 12 16×16 samples and 1 of the 6 16×24 ones per epoch (2
    // sit it out), so the run resumes mid-epoch and crosses into the next one.
    let paths = format!("data.paths=[\"{}\"]", h5.display());
    let common = [
        "data.source=\"hdf5\"",
        paths.as_str(),
        "training.total_steps=6",
        "training.global_batch_size=4",
        "training.micro_batch_size=2",
        "training.resolution_shift=true",
        "training.log_interval=1",
        "training.eval_interval=3",
    ];
    let (one, two, resumed) = (dir.join("one"), dir.join("two"), dir.join("resumed"));
    ok(&train(None, &one, &common));
    ok(&train(Some(2), &two, &common));
    let interval = [&common[..], &["checkpoint.interval=3", "--stop-after 3"]].concat();
    ok(&train(Some(2), &resumed, &interval));
    ok(&train(Some(2), &resumed, &common));
    let (a, b, c) = (records(&one), records(&two), records(&resumed));
    // Two ranks read disjoint halves of each step, always of the same bucket, and together see
    // what one process sees.
    assert_same_records(&a, &b, &["loss", "grad_norm", "eval_loss"], 1e-4);
    assert_same_records(&b, &c, &["loss", "grad_norm", "eval_loss"], 1e-5);
    // Tokens per sample: 8 text tokens and 8×8 or 8×12 image tokens (2×2-packed latents).
    let mut tokens: Vec<u64> = a
        .iter()
        .filter(|r| r["samples_per_s"].as_f64().unwrap() > 0.0)
        .map(|r| {
            (r["tokens_per_s"].as_f64().unwrap() / r["samples_per_s"].as_f64().unwrap()).round()
                as u64
        })
        .collect();
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens, [72, 104], "steps of both buckets");
    let loaded = flux_data::checkpoint::load(&resumed.join("step_000000003")).unwrap();
    assert_eq!(
        (loaded.data.epoch, loaded.data.index),
        (0, 12),
        "3 steps of a 16-sample epoch"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn shards_that_do_not_fit_the_model_are_refused_naming_the_field() {
    let dir = sources("misfit", &["--tars-only"]);
    let (h5, _) = ingest_tars(&dir);
    let refused = |name: &str, paths: &Path, extra: &[&str], want: &str| {
        let paths = format!("data.paths=[\"{}\"]", paths.display());
        let mut args = vec!["data.source=\"hdf5\"", paths.as_str()];
        args.extend(extra);
        let out = train(None, &dir.join(name), &args);
        assert!(!out.status.success(), "{name} trained");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{name}: {stderr}");
    };
    refused(
        "text",
        &h5,
        &["training.text_len=16"],
        "data.paths: the shards' text states shape is [8, 32]",
    );
    // Per-sample files, one shard each: a grid that 2×2 packing cannot cut, latents of another
    // channel count, and two buckets neither of which fills a step.
    let ingest = |name: &str, latents: &[&[i64]]| {
        let (files, out) = (dir.join(name), dir.join(format!("{name}.h5")));
        for (i, latent) in latents.iter().enumerate() {
            write_npy_sample(&files, &format!("s{i}"), latent, None);
        }
        ok(&ingest_dir(
            &files,
            &out,
            "1",
            &["--latent-norm", "identity"],
        ));
        out
    };
    refused(
        "odd",
        &ingest("odd", &[&[4, 15, 16]]),
        &[],
        "latent bucket 15×16 is not a multiple of 2 (the model's patch size 1, after 2×2 packing)",
    );
    refused(
        "channels",
        &ingest("channels", &[&[8, 16, 16]]),
        &[],
        "data.paths: the shards' latent channel count is 8",
    );
    refused(
        "small",
        &ingest("small", &[&[4, 16, 16], &[4, 16, 24]]),
        &[],
        "no resolution bucket holds training.global_batch_size = 8 samples",
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn ingest_refuses_a_mask_off_the_latent_grid_and_two_sizes_in_one_shard() {
    let dir = common::temp_dir("ingest-misfit");
    let ingest = |name: &str| {
        let (files, out) = (dir.join(name), dir.join(format!("{name}.h5")));
        ingest_dir(&files, &out, "2", &[])
    };
    let refused = |out: std::process::Output, want: &str| {
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{stderr}");
    };
    write_npy_sample(&dir.join("mask"), "a", &[4, 16, 16], Some(&[16, 8]));
    refused(
        ingest("mask"),
        "sample `a`: mask shape [16, 8] is not the latent grid [H, W] of [4, 16, 16]",
    );
    write_npy_sample(&dir.join("sizes"), "a", &[4, 16, 16], None);
    write_npy_sample(&dir.join("sizes"), "b", &[4, 16, 24], None);
    refused(
        ingest("sizes"),
        "sample `b` has latents [4, 16, 24], the shard's bucket is [4, 16, 16]",
    );
    assert!(
        !dir.join("sizes.h5/shard_000000.h5").exists(),
        "no partial shard"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
