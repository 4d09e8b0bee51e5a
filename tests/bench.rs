//! `flux-hpc bench` end to end: each measurement prints one JSON line whose counts follow from
//! the config (the FLOPs from the analytic model). The data-parallel variant runs under mpirun
//! in tests/plan.rs, which compares its measured memory with the plan. Timings are printed,
//! never asserted.

mod common;

use common::latents::{ingest_tars, sources};
use common::{flux_hpc, ok};
use flux_train::RunConfig;
use serde_json::Value;

fn json(out: &std::process::Output) -> Value {
    ok(out);
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn tiny() -> RunConfig {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/flux_tiny.toml");
    RunConfig::load(std::path::Path::new(path), &[]).unwrap()
}

#[test]
fn step_and_forward_report_the_configs_work() {
    let run = tiny();
    let t = &run.training;
    let tokens = t.latent_height * t.latent_width;
    for (what, samples) in [
        ("step", t.global_batch_size),
        ("forward", t.micro_batch_size),
    ] {
        let r = json(&flux_hpc(&[
            "bench",
            what,
            "configs/flux_tiny.toml",
            "--device",
            "cpu",
            "--steps",
            "3",
            "--threads",
            "1",
        ]));
        let flops = run.model.forward_flops(samples as i64, tokens, t.text_len);
        let expected = if what == "step" {
            flops.training_step()
        } else {
            flops.total()
        };
        assert_eq!(r["what"], what);
        assert_eq!(r["samples"], samples);
        assert_eq!(r["image_tokens"], tokens);
        assert_eq!(r["seconds"].as_array().unwrap().len(), 3);
        assert_eq!(r["flops"].as_f64().unwrap(), expected);
        assert!(r["median_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["peak_rss_mib"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn matmul_reports_a_rate_and_read_counts_every_sample() {
    let m = json(&flux_hpc(&[
        "bench",
        "matmul",
        "--device",
        "cpu",
        "--size",
        "128",
        "--repeats",
        "3",
    ]));
    assert_eq!(m["size"], 128);
    assert!(m["flops_per_s"].as_f64().unwrap() > 0.0);

    let dir = sources("bench-read", &[]);
    let (h5, _) = ingest_tars(&dir);
    let r = json(&flux_hpc(&["bench", "read", h5.to_str().unwrap()]));
    assert_eq!(r["samples"], 18, "3 shards of 6 samples");
    assert!(r["mib_per_s"].as_f64().unwrap() > 0.0);
    std::fs::remove_dir_all(dir).unwrap();
}
