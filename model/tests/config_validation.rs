//! Invalid configs are rejected with an error naming the field.

mod common;

use flux_model::{Flux, FluxConfig};
use tch::Device;

fn field_of(config: FluxConfig) -> String {
    config
        .validate()
        .expect_err("config should be rejected")
        .field
}

#[test]
fn presets_and_tiny_config_are_valid() {
    FluxConfig::flux_535m().validate().unwrap();
    FluxConfig::flux_12b().validate().unwrap();
    common::tiny_config().validate().unwrap();
}

#[test]
fn heads_must_divide_hidden() {
    let err = FluxConfig {
        num_attention_heads: 5,
        ..common::tiny_config()
    }
    .validate()
    .unwrap_err();
    assert_eq!(err.field, "num_attention_heads");
    assert!(
        err.message.contains("do not divide hidden_size 64"),
        "{err}"
    );
}

#[test]
fn axes_must_sum_to_head_width() {
    let err = FluxConfig {
        axes_dim: vec![4, 6, 8],
        ..common::tiny_config()
    }
    .validate()
    .unwrap_err();
    assert_eq!(err.field, "axes_dim");
    assert!(
        err.message.contains("sum to 18") && err.message.contains("is 16"),
        "{err}"
    );
}

#[test]
fn axes_need_three_positive_even_entries() {
    assert_eq!(
        field_of(FluxConfig {
            axes_dim: vec![8, 8],
            ..common::tiny_config()
        }),
        "axes_dim"
    );
    assert_eq!(
        field_of(FluxConfig {
            axes_dim: vec![5, 5, 6],
            ..common::tiny_config()
        }),
        "axes_dim"
    );
    assert_eq!(
        field_of(FluxConfig {
            axes_dim: vec![-2, 8, 10],
            ..common::tiny_config()
        }),
        "axes_dim"
    );
}

#[test]
fn every_counted_field_is_checked() {
    let t = common::tiny_config;
    assert_eq!(
        field_of(FluxConfig {
            num_joint_layers: 0,
            ..t()
        }),
        "num_joint_layers"
    );
    assert_eq!(
        field_of(FluxConfig {
            num_single_layers: 0,
            ..t()
        }),
        "num_single_layers"
    );
    assert_eq!(
        field_of(FluxConfig {
            hidden_size: 0,
            ..t()
        }),
        "hidden_size"
    );
    assert_eq!(
        field_of(FluxConfig {
            context_dim: 0,
            ..t()
        }),
        "context_dim"
    );
    assert_eq!(
        field_of(FluxConfig {
            vec_in_dim: -1,
            ..t()
        }),
        "vec_in_dim"
    );
    assert_eq!(
        field_of(FluxConfig {
            in_channels: 0,
            ..t()
        }),
        "in_channels"
    );
    assert_eq!(
        field_of(FluxConfig {
            patch_size: 0,
            ..t()
        }),
        "patch_size"
    );
    assert_eq!(
        field_of(FluxConfig {
            model_channels: 31,
            ..t()
        }),
        "model_channels"
    );
    assert_eq!(field_of(FluxConfig { theta: 0.0, ..t() }), "theta");
    assert_eq!(
        field_of(FluxConfig {
            mlp_ratio: 0.3,
            hidden_size: 64,
            ..t()
        }),
        "mlp_ratio"
    );
    assert_eq!(
        field_of(FluxConfig {
            layernorm_epsilon: 0.0,
            ..t()
        }),
        "layernorm_epsilon"
    );
    assert_eq!(
        field_of(FluxConfig {
            hidden_dropout: 1.0,
            ..t()
        }),
        "hidden_dropout"
    );
    assert_eq!(
        field_of(FluxConfig {
            attention_dropout: -0.1,
            ..t()
        }),
        "attention_dropout"
    );
    assert_eq!(
        field_of(FluxConfig {
            guidance_scale: -1.0,
            ..t()
        }),
        "guidance_scale"
    );
}

#[test]
fn model_construction_refuses_invalid_configs() {
    let err = Flux::new(
        &FluxConfig {
            num_attention_heads: 3,
            ..common::tiny_config()
        },
        Device::Cpu,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "num_attention_heads: 3 heads do not divide hidden_size 64"
    );
    assert_eq!(err.within("model").field, "model.num_attention_heads");
}

/// The run configs shipped as `configs/<architecture>_tiny.toml` build the model the registry's
/// tiny config describes (an architecture need not ship one).
#[test]
fn shipped_tiny_run_configs_hold_each_architectures_tiny_model() {
    for architecture in flux_model::ARCHITECTURES {
        let file = format!(
            "{}/../configs/{}_tiny.toml",
            env!("CARGO_MANIFEST_DIR"),
            architecture.name
        );
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let mut run: toml::Table = toml::from_str(&text).unwrap();
        let table = run.remove("model").unwrap().try_into().unwrap();
        let shipped = flux_model::ModelSpec::from_table(table).unwrap();
        assert_eq!(shipped, architecture.tiny(), "{file}");
    }
}
