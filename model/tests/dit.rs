//! The DiT written with `#[diffusion_block]`: shapes, adaLN-Zero at initialisation, its fixed
//! position embedding, and its face as an architecture (inputs, FLOPs, registry).

use approx::assert_abs_diff_eq;
use flux_model::dit::{sincos_2d, Dit, DitConfig, DitTransformer};
use flux_model::tp::TpContext;
use flux_model::{Block, DiffusionBatch, ModelConfig, ModelSpec};
use tch::{Device, Kind, Tensor};

fn config() -> DitConfig {
    DitConfig {
        depth: 2,
        hidden_size: 32,
        num_attention_heads: 4,
        mlp_ratio: 4.0,
        in_channels: 4,
        patch_size: 2,
        cond_dim: 6,
        frequency_embedding_size: 16,
        layernorm_epsilon: 1e-6,
    }
}

#[test]
fn output_matches_input_shape_and_starts_at_zero() {
    let dit = Dit::new_parallel(&config(), Device::Cpu, Kind::Float, TpContext::single()).unwrap();
    let x = Tensor::randn([2, 4, 6, 10], (Kind::Float, Device::Cpu));
    let t = Tensor::from_slice(&[0.1f32, 0.9]);
    let y = Tensor::randn([2, 6], (Kind::Float, Device::Cpu));
    let out = tch::no_grad(|| dit.transformer.forward(&x, &t, &y));
    assert_eq!(out.size(), x.size());
    // adaLN-Zero: zero gates and a zero output layer make the initial prediction exactly zero.
    assert_eq!(out.abs().max().double_value(&[]), 0.0);
}

#[test]
fn parameter_names_and_count() {
    let c = config();
    let names: Vec<String> = DitTransformer::param_specs("", &c, 1)
        .into_iter()
        .map(|s| s.name)
        .collect();
    for expected in [
        "x_embedder.weight",
        "t_embedder.linear_1.weight",
        "blocks.1.mlp.linear_fc2.bias",
        "final_layer.adaln.linear.weight",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected} missing");
    }
    let d = 32u64;
    let block =
        6 * d * d + 6 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d;
    let embed = 16 * d + d + d * d + d + (16 * d + d) + (6 * d + d + d * d + d);
    let out = 2 * d * d + 2 * d + 16 * d + 16;
    assert_eq!(DitTransformer::num_params(&c), embed + 2 * block + out);
}

#[test]
fn the_generic_forward_is_the_transformer_on_the_pooled_vector() {
    tch::manual_seed(3);
    let spec = ModelSpec::new(config());
    let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
    tch::no_grad(|| {
        for mut var in model.store().vs.trainable_variables() {
            let _ = var.g_add_(&(var.randn_like() * 0.1));
        }
    });
    let batch = DiffusionBatch::random(&spec.inputs(), 2, 6, 10, 0, Device::Cpu);
    assert!(batch.text.is_none() && batch.guidance.is_none());
    let out = tch::no_grad(|| model.forward(&batch, false)).unwrap();
    let dit = Dit::new_parallel(&config(), Device::Cpu, Kind::Float, TpContext::single()).unwrap();
    let mut dit = dit;
    dit.store
        .load_logical(&model.store().gather_logical(false).into_iter().collect())
        .unwrap();
    let pooled = batch.pooled.as_ref().unwrap();
    let direct = tch::no_grad(|| {
        dit.transformer
            .forward(&batch.latents, &batch.timesteps, pooled)
    });
    assert_eq!(out.size(), [2, 4, 6, 10]);
    assert_eq!((out - direct).abs().max().double_value(&[]), 0.0);
    // A text tensor the DiT does not take is refused by name.
    let with_text = DiffusionBatch {
        text: Some(Tensor::zeros([2, 3, 8], (Kind::Float, Device::Cpu))),
        ..batch.narrow(0, 2)
    };
    assert_eq!(
        model.forward(&with_text, false).unwrap_err().argument,
        "text"
    );
}

#[test]
fn dit_attends_over_image_tokens_only() {
    // 4·L²·D per block and sample, L = 3 image tokens; the 7 text tokens do not count.
    let f = config().forward_flops(1, 3, 7);
    assert_eq!(f.attention, 2.0 * 4.0 * 9.0 * 32.0);
}

#[test]
fn sincos_positions_encode_column_then_row() {
    let pe = sincos_2d(2, 3, 8, Device::Cpu); // token (1, 2) is index 5
    assert_eq!(pe.size(), [6, 8]);
    let row: Vec<f32> = Vec::try_from(pe.get(5)).unwrap();
    // Column 2 in channels 0..4: [sin(2), sin(2/100), cos(2), cos(2/100)]; row 1 in 4..8.
    let expected = [
        2f64.sin(),
        0.02f64.sin(),
        2f64.cos(),
        0.02f64.cos(),
        1f64.sin(),
        0.01f64.sin(),
        1f64.cos(),
        0.01f64.cos(),
    ];
    for (got, want) in row.iter().zip(expected) {
        assert_abs_diff_eq!(*got as f64, want, epsilon = 1e-6);
    }
}

#[test]
fn invalid_dit_configs_name_the_field() {
    let mut c = config();
    c.num_attention_heads = 5;
    assert_eq!(c.validate().unwrap_err().field, "num_attention_heads");
    let shallow = DitConfig {
        depth: 0,
        ..config()
    };
    assert_eq!(shallow.validate().unwrap_err().field, "depth");
}
