//! A second architecture end to end: `configs/dit_tiny.toml` (`architecture = "dit"`) trains,
//! checkpoints, resumes under tensor × data parallelism (fully sharded), samples and benches through the same
//! commands as Flux, and its checkpoints refuse to load into a Flux run.

mod common;

use common::{
    assert_same_records, assert_samples_beat_the_data, first_and_last_eval, flux_hpc, ok, records,
    temp_dir, train_config,
};
use flux_train::RunConfig;
use serde_json::Value;

const DIT: &str = "configs/dit_tiny.toml";

#[test]
fn dit_on_tp2_by_dp2_with_a_fully_sharded_resume_matches_one_process() {
    // Gradient clipping is active from the first steps (norms above the clip of 1.0), so equal
    // norms also show the global norm is summed over TP shards and DP replicas.
    let steps = ["training.total_steps=6", "training.log_interval=1"];
    let (one, four) = (temp_dir("dit-np1"), temp_dir("dit-np4"));
    ok(&train_config(DIT, None, &one, &steps));
    let mut parallel = steps.to_vec();
    parallel.push("parallelism.tensor_parallel_size=2");
    let mut first = parallel.clone();
    first.push("--stop-after 3");
    ok(&train_config(DIT, Some(4), &four, &first));
    assert!(four.join("step_000000003").is_dir());
    // The second half resumes fully sharded: stem, blocks and head gathered around their use.
    parallel.push("parallelism.sharding=\"full\"");
    let resumed = train_config(DIT, Some(4), &four, &parallel);
    ok(&resumed);
    assert!(
        String::from_utf8_lossy(&resumed.stderr).contains("resumed from"),
        "the second run must resume"
    );
    let (a, b) = (records(&one), records(&four));
    // The stopped run logged a held-out loss at its last step (3); compare the steps both log.
    let b: Vec<Value> = b
        .into_iter()
        .filter(|r| r["step"] != 3 || r["loss"].is_number())
        .collect();
    let keys = ["loss", "grad_norm", "eval_loss"];
    assert_same_records(&a, &b, &keys, 1e-4);
    assert!(a[1]["grad_norm"].as_f64().unwrap() > 1.0, "{}", a[1]);
    for dir in [one, four] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn dit_learns_samples_and_benches_and_its_checkpoint_refuses_a_flux_run() {
    let dir = temp_dir("dit-learn");
    let out = train_config(
        DIT,
        None,
        &dir,
        &["training.total_steps=120", "training.eval_interval=0"],
    );
    ok(&out);
    let (first, last) = first_and_last_eval(&dir);
    assert!(last <= 0.7 * first, "held-out loss {first} → {last}");
    let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(config.contains("architecture = \"dit\""), "{config}");

    // The trained weights sample latents closer to the data than the data's own spread.
    assert_samples_beat_the_data(DIT, &dir);

    // bench counts the DiT's FLOPs: image tokens only, no text.
    let bench = flux_hpc(&[
        "bench",
        "step",
        DIT,
        "--device",
        "cpu",
        "--steps",
        "2",
        "--threads",
        "1",
    ]);
    ok(&bench);
    let r: Value = serde_json::from_str(String::from_utf8_lossy(&bench.stdout).trim()).unwrap();
    let run = RunConfig::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(DIT),
        &[],
    )
    .unwrap();
    let t = &run.training;
    let flops = run
        .model
        .forward_flops(t.global_batch_size as i64, 64, 0)
        .training_step();
    assert_eq!(r["architecture"], "dit");
    assert_eq!(
        (r["image_tokens"].as_i64(), r["text_tokens"].as_i64()),
        (Some(64), Some(0))
    );
    assert_eq!(r["flops"].as_f64().unwrap(), flops);

    // info describes it from the config alone.
    let info = flux_hpc(&["info", DIT]);
    ok(&info);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        text.contains("architecture      dit") && text.contains("4 DiT blocks"),
        "{text}"
    );

    // A Flux run pointed at the DiT's run directory stops before touching a weight.
    let flux = train_config(common::FLUX_TINY, None, &dir, &["training.total_steps=130"]);
    assert!(!flux.status.success());
    let stderr = String::from_utf8_lossy(&flux.stderr);
    assert!(
        stderr.contains("holds a \"dit\" model, but this run's [model] architecture is \"flux\""),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
