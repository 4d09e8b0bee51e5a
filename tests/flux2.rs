//! FLUX.2 end to end: `configs/flux2_tiny.toml` (`architecture = "flux2"`) trains with the same
//! loop as Flux, and `info` counts FLUX.2 [dev] from its config alone. Parity with diffusers is
//! `model/tests/flux2.rs`; tensor × data parallel equivalence is `tests/parallel.rs`.

mod common;

use common::{flux_hpc, ok, records, temp_dir, train_config};

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
    let rs = records(&dir);
    let (first, last) = (
        rs[0]["eval_loss"].as_f64().unwrap(),
        rs.last().unwrap()["eval_loss"].as_f64().unwrap(),
    );
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
