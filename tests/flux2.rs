//! FLUX.2 end to end: `configs/flux2_tiny.toml` (`architecture = "flux2"`) trains with the same
//! loop as Flux, `info` counts FLUX.2 [dev] from its config alone, and `convert` takes diffusers
//! and BFL weights to native checkpoints and back bit for bit, into a folder diffusers loads. Parity with
//! diffusers is `model/tests/flux2.rs`; tensor × data parallel equivalence is `tests/parallel.rs`,
//! and fully sharded training on two ranks matches one process here.

mod common;

use std::path::Path;

use common::{
    assert_same_records, first_and_last_eval, flux_hpc, ok, python, records, temp_dir, train_config,
};
use tch::Tensor;

#[test]
fn flux2_trains_on_synthetic_latents_and_info_counts_flux2_dev() {
    let dir = temp_dir("flux2-learn");
    let out = train_config(
        "configs/flux2_tiny.toml",
        None,
        &dir,
        &["training.total_steps=100", "training.eval_interval=0"],
    );
    ok(&out);
    let (first, last) = first_and_last_eval(&dir);
    assert!(last <= 0.7 * first, "held-out loss {first} → {last}");
    std::fs::remove_dir_all(dir).unwrap();

    let info = flux_hpc(&["info", "configs/flux2_dev.toml"]);
    ok(&info);
    let text = String::from_utf8_lossy(&info.stdout);
    // diffusers' default Flux2Transformer2DModel, counted on the meta device by the fixture
    // script (model/tests/flux2.rs checks the number against it).
    assert!(
        text.contains("architecture      flux2") && text.contains("32,223,281,152"),
        "{text}"
    );
}

#[test]
fn flux2_fully_sharded_on_two_ranks_matches_one_process() {
    // Full sharding gathers the stem (embedders and the blocks' shared modulations), each block
    // and the head around their use; backward gathers the stem again once the single-stream
    // modulation's gradient is complete, before the double blocks run backward.
    let steps = ["training.total_steps=4", "training.log_interval=1"];
    let (one, two) = (temp_dir("flux2-np1"), temp_dir("flux2-full"));
    ok(&train_config("configs/flux2_tiny.toml", None, &one, &steps));
    let mut full = steps.to_vec();
    full.extend([
        "parallelism.sharding=\"full\"",
        "parallelism.bucket_mib=0.25",
    ]);
    ok(&train_config(
        "configs/flux2_tiny.toml",
        Some(2),
        &two,
        &full,
    ));
    let keys = ["loss", "grad_norm"];
    assert_same_records(&records(&one), &records(&two), &keys, 1e-5);
    for dir in [one, two] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn flux2_converts_between_diffusers_bfl_and_native_bit_for_bit() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/flux2");
    let dir = temp_dir("flux2-convert");
    let (weights, config) = (
        fixture.join("diffusers.safetensors"),
        fixture.join("config.toml"),
    );
    let (run, export) = (dir.join("run"), dir.join("export"));
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let convert = |from: &str, to: &str, input: &Path, output: &Path, extra: &[&str]| {
        let mut args = vec!["convert".to_string(), "--from".into(), from.into()];
        args.extend(["--to".into(), to.into(), path(input), path(output)]);
        args.extend(extra.iter().map(|s| s.to_string()));
        flux_hpc(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    ok(&convert(
        "diffusers",
        "native",
        &weights,
        &run,
        &["--config", config.to_str().unwrap()],
    ));
    ok(&convert(
        "native",
        "diffusers",
        &run,
        &export,
        &["--dtype", "f32"],
    ));
    let read = |p: &Path| -> std::collections::HashMap<String, Tensor> {
        Tensor::read_safetensors(p).unwrap().into_iter().collect()
    };
    let same = |before: &Path, after: &Path| {
        let (before, after) = (read(before), read(after));
        assert_eq!(before.len(), after.len());
        for (name, t) in &before {
            assert!(t.equal(&after[name]), "{name} changed");
        }
    };
    same(
        &weights,
        &export.join("diffusion_pytorch_model.safetensors"),
    );
    // BFL's layout (fused qkv, `scale`s, [shift; scale] output modulation) both ways, and across:
    // BFL → native → diffusers gives diffusers' file, diffusers → native → BFL gives BFL's.
    let (bfl, bfl_run) = (fixture.join("bfl.safetensors"), dir.join("bfl-run"));
    let config_arg = ["--config", config.to_str().unwrap()];
    ok(&convert("bfl", "native", &bfl, &bfl_run, &config_arg));
    let (via_bfl, to_bfl) = (dir.join("via-bfl"), dir.join("bfl.safetensors"));
    ok(&convert(
        "native",
        "diffusers",
        &bfl_run,
        &via_bfl,
        &["--dtype", "f32"],
    ));
    same(
        &weights,
        &via_bfl.join("diffusion_pytorch_model.safetensors"),
    );
    ok(&convert(
        "native",
        "bfl",
        &run,
        &to_bfl,
        &["--dtype", "f32"],
    ));
    same(&bfl, &to_bfl);
    let config_json = std::fs::read_to_string(export.join("config.json")).unwrap();
    assert!(
        config_json.contains("Flux2Transformer2DModel"),
        "{config_json}"
    );
    let io = fixture.join("io.safetensors");
    ok(&python(
        "diffusers_flux2_forward.py",
        &[export.as_os_str(), io.as_os_str()],
    ));

    // An architecture without the layout is refused before anything is written.
    let refused = convert(
        "diffusers",
        "native",
        &weights,
        &dir.join("dit"),
        &["--config", "configs/dit_tiny.toml"],
    );
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("architecture \"dit\" has no Diffusers layout"),
        "{stderr}"
    );
    assert!(!dir.join("dit").exists());
    std::fs::remove_dir_all(dir).unwrap();
}
