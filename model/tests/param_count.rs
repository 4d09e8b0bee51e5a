//! Parameter counts from the shape-only layout, against the reference numbers and real allocation.

mod common;

use std::collections::BTreeMap;

use flux_model::{Flux, FluxConfig, ModelConfig};
use tch::Device;

#[test]
fn flux_535m_without_guidance_has_the_reference_count() {
    assert_eq!(FluxConfig::flux_535m().num_params(), 535_318_336);
}

#[test]
fn flux_12b_counts_match_flux1_without_allocating() {
    let no_guidance = FluxConfig::flux_12b();
    assert_eq!(no_guidance.num_params(), 11_891_178_560);
    let dev = FluxConfig {
        guidance_embed: true,
        ..FluxConfig::flux_12b()
    };
    assert_eq!(dev.num_params(), 11_901_408_320);
}

#[test]
fn per_block_counts_match_the_reference() {
    let base = FluxConfig::flux_535m();
    let two_joint = FluxConfig {
        num_joint_layers: 2,
        ..base.clone()
    };
    let two_single = FluxConfig {
        num_single_layers: 2,
        ..base.clone()
    };
    assert_eq!(two_joint.num_params() - base.num_params(), 339_831_296);
    assert_eq!(two_single.num_params() - base.num_params(), 141_591_808);
}

#[test]
fn allocated_flux_535m_matches_the_layout_count() {
    let config = FluxConfig::flux_535m();
    let model = Flux::new(&config, Device::Cpu).unwrap();
    assert_eq!(model.get_num_params(false), config.num_params());
    assert_eq!(model.get_num_params(true), config.num_params());
}

#[test]
fn layout_names_and_shapes_equal_the_allocated_state_dict() {
    for guidance_embed in [false, true] {
        let config = FluxConfig {
            guidance_embed,
            ..common::tiny_config()
        };
        let model = Flux::new(&config, Device::Cpu).unwrap();
        let allocated: BTreeMap<String, Vec<i64>> = model
            .store
            .vs
            .variables()
            .into_iter()
            .map(|(name, t)| (name, t.size()))
            .collect();
        let layout: BTreeMap<String, Vec<i64>> = config
            .param_layout()
            .into_iter()
            .map(|p| (p.name, p.shape))
            .collect();
        assert_eq!(allocated, layout);
    }
}

#[test]
fn trainable_count_excludes_frozen_parameters() {
    let config = common::tiny_config();
    let mut model = Flux::new(&config, Device::Cpu).unwrap();
    model.store.vs.freeze();
    assert_eq!(model.get_num_params(true), 0);
    assert_eq!(model.get_num_params(false), config.num_params());
}

#[test]
fn state_dict_uses_the_unified_layer_namespace() {
    let config = common::tiny_config(); // 1 joint + 2 single
    let names: Vec<String> = config.param_layout().into_iter().map(|p| p.name).collect();
    for expected in [
        "x_embedder.weight",
        "context_embedder.bias",
        "time_embedder.linear_1.weight",
        "vector_embedder.linear_2.bias",
        "transformer.layers.0.self_attention.linear_qkv.weight",
        "transformer.layers.0.self_attention.added_k_layernorm.weight",
        "transformer.layers.0.context_mlp.linear_fc2.weight",
        "transformer.layers.1.linear_qkv_fc1.weight",
        "transformer.layers.2.linear_proj_fc2.bias",
        "transformer.layers.2.self_attention.q_layernorm.weight",
        "norm_out.linear.weight",
        "proj_out.bias",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
    assert!(!names.iter().any(|n| n.starts_with("transformer.layers.3.")));
    assert!(!names.iter().any(|n| n.starts_with("guidance_embedder")));
}

#[test]
fn the_flops_model_counts_every_weight_matrix_once() {
    let dev = FluxConfig {
        guidance_embed: true,
        ..FluxConfig::flux_12b()
    };
    for config in [common::tiny_config(), FluxConfig::flux_535m(), dev] {
        let matrices: f64 = flux_model::flux::flops::weight_matrices(&config)
            .iter()
            .map(|(w, _)| w)
            .sum();
        let layout: u64 = config
            .param_layout()
            .iter()
            .filter(|s| s.shape.len() == 2)
            .map(|s| s.numel())
            .sum();
        assert_eq!(matrices, layout as f64, "{config:?}");
    }
    // Attention at one token per sample is 4·D per layer; 2·weights per token otherwise.
    let c = FluxConfig::flux_535m();
    let f = c.forward_flops(1, 1, 0);
    assert_eq!(f.attention, 4.0 * c.hidden_size as f64 * 2.0);
}

#[test]
fn every_registered_architecture_counts_each_weight_matrix_once_for_flops() {
    for architecture in flux_model::ARCHITECTURES {
        // The full-size defaults: FLUX.1 [dev], DiT-XL/2, FLUX.2 [dev].
        let mut table = toml::Table::new();
        table.insert("architecture".into(), architecture.name.into());
        let spec = flux_model::ModelSpec::from_table(table).unwrap();
        let matrices: f64 = spec.weight_matrices().iter().map(|(w, _)| w).sum();
        let layout: u64 = spec
            .param_specs(1)
            .iter()
            .filter(|s| s.shape.len() == 2)
            .map(|s| s.numel())
            .sum();
        assert_eq!(matrices, layout as f64, "{}", architecture.name);
        assert_eq!(
            spec.num_params(),
            spec.param_specs(8).iter().map(|s| s.numel()).sum::<u64>()
        );
    }
}
