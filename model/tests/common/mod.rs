//! Helpers shared by the model's integration tests.
#![allow(dead_code)] // each test binary uses its own subset

pub mod threads;

use std::path::PathBuf;

use flux_model::{DiffusionBatch, FluxConfig, ModelConfig};
use tch::{Device, Tensor};

/// Random CPU inputs for `config` on a `rows × cols` token grid with `text_len` text tokens.
pub fn batch(
    config: &FluxConfig,
    size: i64,
    rows: i64,
    cols: i64,
    text_len: i64,
) -> DiffusionBatch {
    let p = config.patch_size;
    DiffusionBatch::random(
        &config.inputs(),
        size,
        rows * p,
        cols * p,
        text_len,
        Device::Cpu,
    )
}

/// Folder of the reference fixtures made by the scripts in `tests/fixtures/`.
pub fn fixture_dir(case: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/data")
        .join(case);
    assert!(
        dir.join("io.safetensors").exists(),
        "fixture {} is missing: run `.venv/bin/python tests/fixtures/make_flux_fixtures.py` and `make_flux2_fixtures.py` (scripts/test.sh does)",
        dir.display()
    );
    dir
}

/// A valid small config: hidden 64, 4 heads (head 16 = 4 + 6 + 6), 1 joint + 2 single layers.
pub fn tiny_config() -> FluxConfig {
    FluxConfig {
        num_joint_layers: 1,
        num_single_layers: 2,
        hidden_size: 64,
        num_attention_heads: 4,
        in_channels: 8,
        context_dim: 24,
        vec_in_dim: 12,
        model_channels: 32,
        axes_dim: vec![4, 6, 6],
        ..FluxConfig::default()
    }
}

/// Largest absolute elementwise difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}
