//! CLIP's text transformer against transformers' `CLIPTextModel` (random weights, width 32, 2
//! layers, quick-GELU, FLUX.1's legacy `eos_token_id = 2`), through the same loader users run on
//! FLUX.1's `text_encoder/`: the final states and the pooled vector for the token ids of hard
//! captions agree to 1e-5 in f32 (only the order of sums may differ; measured 0), from the folder
//! transformers 5 saves and from FLUX.1's layout (`text_model.` names and the old
//! `position_ids` buffer). A folder whose weights do not fit its config is refused naming the
//! tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use flux_encoders::ClipTextModel;
use tch::{Device, Tensor};

const TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/data/text")
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

fn assert_matches_transformers(dir: &Path) {
    let expected = read(&fixtures().join("clip_outputs.safetensors"));
    let model = ClipTextModel::load(dir, Device::Cpu).unwrap();
    let out = tch::no_grad(|| model.forward(&expected["input_ids"]));
    for (name, ours) in [
        ("last_hidden_state", &out.last_hidden_state),
        ("pooled", &out.pooled),
    ] {
        let theirs = &expected[name];
        assert_eq!(ours.size(), theirs.size(), "{name}");
        let err = (ours - theirs).abs().max().double_value(&[]);
        println!("{name}: max abs error {err:e}");
        assert!(err <= TOLERANCE, "{name}: max abs error {err:e}");
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flux-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn clip_text_model_gives_transformers_outputs() {
    assert_matches_transformers(&fixtures().join("text_encoder"));
}

#[test]
fn clip_text_model_loads_flux1s_text_model_names() {
    let dir = temp_dir("clip-flux-layout");
    let source = fixtures().join("text_encoder");
    std::fs::copy(source.join("config.json"), dir.join("config.json")).unwrap();
    let mut tensors: Vec<(String, Tensor)> = read(&source.join("model.safetensors"))
        .into_iter()
        .map(|(k, t)| (format!("text_model.{k}"), t))
        .collect();
    tensors.push((
        "text_model.embeddings.position_ids".into(),
        Tensor::arange(77, (tch::Kind::Int64, Device::Cpu)).unsqueeze(0),
    ));
    Tensor::write_safetensors(&tensors, dir.join("model.safetensors")).unwrap();
    assert_matches_transformers(&dir);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn weights_that_do_not_fit_the_config_are_refused_naming_the_tensor() {
    let dir = temp_dir("clip-misfit");
    let source = fixtures().join("text_encoder");
    let config = std::fs::read_to_string(source.join("config.json")).unwrap();
    let config = config.replace("\"intermediate_size\": 64", "\"intermediate_size\": 48");
    assert!(
        config.contains("48"),
        "the fixture's config names intermediate_size 64"
    );
    std::fs::write(dir.join("config.json"), config).unwrap();
    std::fs::copy(
        source.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let err = ClipTextModel::load(&dir, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.safetensors")
            && err.contains(".mlp.fc")
            && err.contains("the config needs"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
