//! Helpers shared by the model's integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

use flux_model::embeddings::{text_position_ids, token_grid_ids};
use flux_model::FluxConfig;
use tch::{Device, Kind, Tensor};

/// Folder of the reference fixtures made by `tests/fixtures/make_flux_fixtures.py`.
pub fn fixture_dir(case: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/data").join(case);
    assert!(
        dir.join("io.safetensors").exists(),
        "fixture {} is missing: run `.venv/bin/python tests/fixtures/make_flux_fixtures.py` (scripts/test.sh does)",
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

/// Random inputs for `config` with a `rows × cols` token grid and `text_len` text tokens.
pub struct Inputs {
    pub img: Tensor,
    pub txt: Tensor,
    pub y: Tensor,
    pub timesteps: Tensor,
    pub img_ids: Tensor,
    pub txt_ids: Tensor,
    pub guidance: Option<Tensor>,
}

impl Inputs {
    pub fn random(config: &FluxConfig, batch: i64, rows: i64, cols: i64, text_len: i64) -> Self {
        let opts = (Kind::Float, Device::Cpu);
        let p = config.patch_size;
        Self {
            img: Tensor::randn([batch, config.in_channels, rows * p, cols * p], opts),
            txt: Tensor::randn([batch, text_len, config.context_dim], opts),
            y: Tensor::randn([batch, config.vec_in_dim], opts),
            timesteps: Tensor::rand([batch], opts),
            img_ids: token_grid_ids(batch, rows, cols, Device::Cpu),
            txt_ids: text_position_ids(batch, text_len, Device::Cpu),
            guidance: config.guidance_embed.then(|| Tensor::full([batch], 3.5, opts)),
        }
    }

    pub fn as_input(&self) -> flux_model::FluxInput<'_> {
        flux_model::FluxInput {
            img: &self.img,
            txt: &self.txt,
            y: &self.y,
            timesteps: &self.timesteps,
            img_ids: &self.img_ids,
            txt_ids: &self.txt_ids,
            guidance: self.guidance.as_ref(),
        }
    }
}

/// Largest absolute elementwise difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}
