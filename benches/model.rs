//! Criterion benchmarks of the model's parts at two or three sizes, on libtorch's default
//! threads: RoPE, joint attention, the double and single blocks, the full forward pass and a
//! forward + backward pass. `cargo bench --bench model` (results in target/criterion/).
//!
//! Sizes: `small` is hidden 256 (4 heads of 64) at 16×16 image + 64 text tokens; `bench` is the
//! side-by-side config (hidden 512, 8 heads, 32×32 image + 128 text tokens); `wide` is hidden 1024
//! (16 heads) at the `bench` token count. Batch 2 throughout.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use flux_model::attention::{attention, Qkv};
use flux_model::embeddings::{token_grid_ids, EmbedNd, Rope};
use flux_model::{DiffusionBatch, DiffusionModel, Flux, FluxConfig, ModelConfig};
use tch::{Device, Kind, Tensor};

const BATCH: i64 = 2;

/// A named model size and token grid.
struct Size {
    name: &'static str,
    hidden: i64,
    grid: i64,
    text: i64,
}

const SIZES: [Size; 3] = [
    Size {
        name: "small",
        hidden: 256,
        grid: 16,
        text: 64,
    },
    Size {
        name: "bench",
        hidden: 512,
        grid: 32,
        text: 128,
    },
    Size {
        name: "wide",
        hidden: 1024,
        grid: 32,
        text: 128,
    },
];

fn config(size: &Size) -> FluxConfig {
    FluxConfig {
        num_joint_layers: 2,
        num_single_layers: 4,
        hidden_size: size.hidden,
        num_attention_heads: size.hidden / 64,
        in_channels: 64,
        axes_dim: vec![16, 24, 24],
        guidance_embed: true,
        ..FluxConfig::default()
    }
}

fn rope(config: &FluxConfig, size: &Size) -> Rope {
    let img = token_grid_ids(BATCH, size.grid, size.grid, Device::Cpu);
    let txt = Tensor::zeros([BATCH, size.text, 3], (Kind::Float, Device::Cpu));
    EmbedNd::new(config.theta, &config.axes_dim, true).forward(&Tensor::cat(&[txt, img], 1))
}

fn tokens(size: &Size) -> i64 {
    size.grid * size.grid + size.text
}

fn randn(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

fn parts(c: &mut Criterion) {
    tch::manual_seed(0);
    let mut group = c.benchmark_group("parts");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for size in &SIZES {
        let config = config(size);
        let (d, heads, l) = (config.hidden_size, config.num_attention_heads, tokens(size));
        let model = Flux::new(&config, Device::Cpu).unwrap();
        let rope = rope(&config, size);
        let q = randn(&[BATCH, heads, l, 64]);
        group.bench_with_input(BenchmarkId::new("rope", size.name), &q, |b, q| {
            b.iter(|| rope.apply(q))
        });
        let qkv = Qkv {
            q: q.shallow_clone(),
            k: randn(&[BATCH, heads, l, 64]),
            v: randn(&[BATCH, heads, l, 64]),
        };
        group.bench_with_input(BenchmarkId::new("attention", size.name), &qkv, |b, qkv| {
            b.iter(|| attention(qkv, Some(&rope), 0.0))
        });
        let img_len = size.grid * size.grid;
        let (img, txt, vec) = (
            randn(&[BATCH, img_len, d]),
            randn(&[BATCH, size.text, d]),
            randn(&[BATCH, d]),
        );
        let t = &model.transformer;
        group.bench_function(BenchmarkId::new("joint_attention", size.name), |b| {
            b.iter(|| {
                tch::no_grad(|| {
                    t.joint_layers[0]
                        .self_attention
                        .forward(&img, &txt, &rope, false)
                })
            })
        });
        group.bench_function(BenchmarkId::new("double_block", size.name), |b| {
            b.iter(|| tch::no_grad(|| t.joint_layers[0].forward(&img, &txt, &vec, &rope, false)))
        });
        let x = randn(&[BATCH, l, d]);
        group.bench_function(BenchmarkId::new("single_block", size.name), |b| {
            b.iter(|| tch::no_grad(|| t.single_layers[0].forward(&x, &vec, &rope, false)))
        });
    }
    group.finish();
}

fn whole_model(c: &mut Criterion) {
    tch::manual_seed(0);
    let mut group = c.benchmark_group("model");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for size in &SIZES[..2] {
        let config = config(size);
        let model = Flux::new(&config, Device::Cpu).unwrap();
        let (inputs, p) = (config.inputs(), config.patch_size);
        let (side, text) = (size.grid * p, size.text);
        let batch = DiffusionBatch::random(&inputs, BATCH, side, side, text, Device::Cpu);
        group.bench_function(BenchmarkId::new("forward", size.name), |b| {
            b.iter(|| tch::no_grad(|| model.forward(&batch, false).unwrap()))
        });
        group.bench_function(BenchmarkId::new("forward_backward", size.name), |b| {
            b.iter(|| {
                let out = model.forward(&batch, true).unwrap();
                out.square().mean(Kind::Float).backward();
                model.store.vs.trainable_variables().iter().for_each(|v| {
                    let mut g = v.grad();
                    if g.defined() {
                        let _ = g.zero_();
                    }
                });
            })
        });
    }
    group.finish();
}

criterion_group!(benches, parts, whole_model);
criterion_main!(benches);
