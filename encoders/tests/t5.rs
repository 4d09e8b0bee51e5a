//! T5's encoder against transformers' `T5EncoderModel` (random weights, v1.1's gated GELU, width
//! 32, 2 blocks, 4 heads, 32 relative-position buckets), through the loader users run on FLUX.1's
//! `text_encoder_2/`: final states for the T5 ids of hard captions (32 tokens, so distances
//! beyond the exact buckets occur) agree to 1e-5 in f32 (measured 7e-7), without an attention
//! mask (as FLUX.1 calls it) and with the tokenizer's mask; the same weights as two shards behind
//! an index load alike; bf16 weights (FLUX.1's T5 precision) give the f32 result to 0.1 on
//! outputs RMS-normed to about 1 (measured 0.035).
//!
//! `FLUX_TEST_DEVICE=cuda` runs them on the GPU (benches/gpu.sh does), where bf16 is what
//! `data encode` and `sample` run T5 in.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use flux_encoders::T5Encoder;
use tch::{Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/data/text")
}

fn expected() -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixtures().join("t5_outputs.safetensors"))
        .unwrap()
        .into_iter()
        .collect()
}

/// The device of `FLUX_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`; default: the CPU).
fn device() -> Device {
    match std::env::var("FLUX_TEST_DEVICE").as_deref() {
        Err(_) | Ok("cpu") => Device::Cpu,
        Ok("cuda") => Device::Cuda(0),
        Ok(other) => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::Cuda(n),
            None => panic!("FLUX_TEST_DEVICE={other}: cpu, cuda or cuda:N"),
        },
    }
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_device(Device::Cpu).to_kind(Kind::Float) - b)
        .abs()
        .max()
        .double_value(&[])
}

#[test]
fn t5_encoder_gives_transformers_states_with_and_without_a_mask() {
    let e = expected();
    let d = device();
    let model = T5Encoder::load(&fixtures().join("text_encoder_2"), d, Kind::Float).unwrap();
    let (ids, mask) = (
        e["input_ids"].to_device(d),
        e["attention_mask"].to_device(d),
    );
    let (plain, masked) =
        tch::no_grad(|| (model.forward(&ids, None), model.forward(&ids, Some(&mask))));
    for (name, ours) in [
        ("last_hidden_state", &plain),
        ("last_hidden_state_masked", &masked),
    ] {
        let err = max_abs(ours, &e[name]);
        println!("{name}: max abs error {err:e}");
        assert!(err <= TOLERANCE, "{name}: max abs error {err:e}");
    }
    // The mask matters for the padded prompts: the two outputs differ.
    assert!(max_abs(&plain, &masked) > 1e-3);
}

#[test]
fn sharded_weights_and_bf16_load_through_the_index() {
    let dir = std::env::temp_dir().join(format!("flux-t5-shards-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let source = fixtures().join("text_encoder_2");
    std::fs::copy(source.join("config.json"), dir.join("config.json")).unwrap();
    let tensors = Tensor::read_safetensors(source.join("model.safetensors")).unwrap();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        Tensor::write_safetensors(part, dir.join(file)).unwrap();
        for (name, _) in part {
            map.insert(name.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let e = expected();
    for (kind, tolerance) in [(Kind::Float, TOLERANCE), (Kind::BFloat16, 0.1)] {
        let d = device();
        let model = T5Encoder::load(&dir, d, kind).unwrap();
        let out = tch::no_grad(|| model.forward(&e["input_ids"].to_device(d), None));
        assert_eq!(out.kind(), kind);
        let err = max_abs(&out, &e["last_hidden_state"]);
        println!("{kind:?}: max abs error {err:e}");
        assert!(err <= tolerance, "{kind:?}: max abs error {err:e}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
