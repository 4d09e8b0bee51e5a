//! Numerical parity with diffusers' `FluxTransformer2DModel` through both public key layouts.
//!
//! Fixtures come from `tests/fixtures/make_flux_fixtures.py` (hidden 128, 4 heads, axes (8,12,12),
//! 2 joint + 2 single layers, a 3×5 token grid and 7 text tokens, batch 2). Tolerance: 1e-4 max
//! absolute error in f32 — the two implementations order their sums differently, nothing more.

mod common;

use std::collections::HashMap;

use flux_model::convert::{self, Layout};
use flux_model::{DiffusionBatch, DiffusionModel, Flux, FluxConfig, ModelSpec};
use tch::{Device, Tensor};

const TOLERANCE: f64 = 1e-4;

#[derive(serde::Deserialize)]
struct FixtureConfig {
    model: FluxConfig,
}

fn run_case(case: &str, layout: Layout) -> f64 {
    let dir = common::fixture_dir(case);
    let text = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    let config = toml::from_str::<FixtureConfig>(&text).unwrap().model;
    let mut model = Flux::new(&config, Device::Cpu).unwrap();
    let file = match layout {
        Layout::Bfl => "bfl.safetensors",
        Layout::Diffusers => "diffusers.safetensors",
    };
    let spec = ModelSpec::new(config.clone());
    convert::load_file(&mut model.store, &spec, &dir.join(file), layout).unwrap();

    let io: HashMap<String, Tensor> =
        convert::read_safetensors(&dir.join("io.safetensors")).unwrap();
    // The fixture's positions are FLUX.1's: image tokens (0, row, column), text tokens 0, as
    // the model derives them.
    let input = DiffusionBatch {
        latents: io["img"].shallow_clone(),
        text: Some(io["txt"].shallow_clone()),
        pooled: Some(io["y"].shallow_clone()),
        timesteps: io["timesteps"].shallow_clone(),
        guidance: io.get("guidance").map(Tensor::shallow_clone),
    };
    let out = tch::no_grad(|| model.forward(&input, false)).unwrap();
    assert_eq!(out.size(), io["out"].size());
    common::max_abs_diff(&out, &io["out"])
}

#[test]
fn matches_diffusers_weights_without_guidance() {
    let err = run_case("flux_guidance_off", Layout::Diffusers);
    assert!(err <= TOLERANCE, "max abs error {err:e} > {TOLERANCE:e}");
}

#[test]
fn matches_diffusers_weights_with_guidance() {
    let err = run_case("flux_guidance_on", Layout::Diffusers);
    assert!(err <= TOLERANCE, "max abs error {err:e} > {TOLERANCE:e}");
}

#[test]
fn matches_bfl_weights_without_guidance() {
    let err = run_case("flux_guidance_off", Layout::Bfl);
    assert!(err <= TOLERANCE, "max abs error {err:e} > {TOLERANCE:e}");
}

#[test]
fn matches_bfl_weights_with_guidance() {
    let err = run_case("flux_guidance_on", Layout::Bfl);
    assert!(err <= TOLERANCE, "max abs error {err:e} > {TOLERANCE:e}");
}
