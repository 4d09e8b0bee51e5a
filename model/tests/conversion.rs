//! The BFL / diffusers key table: round trips, strict loading and its errors.

mod common;

use std::collections::HashMap;

use common::tiny_config;
use flux_model::convert::{self, Layout, LoadError};
use flux_model::{Flux, FluxConfig, ModelSpec};
use tch::{Device, Tensor};

fn spec(model: &Flux) -> ModelSpec {
    ModelSpec::new(model.config().clone())
}

fn exported(model: &Flux, layout: Layout) -> HashMap<String, Tensor> {
    convert::export(&model.store, &spec(model), layout)
        .into_iter()
        .collect()
}

fn load_into(
    target: &mut Flux,
    tensors: &HashMap<String, Tensor>,
    layout: Layout,
) -> Result<(), LoadError> {
    let model = spec(target);
    convert::load_into(&mut target.store, &model, tensors, layout)
}

#[test]
fn export_then_load_reproduces_every_weight_in_both_layouts() {
    for layout in [Layout::Bfl, Layout::Diffusers] {
        let config = FluxConfig {
            guidance_embed: true,
            ..tiny_config()
        };
        let source = Flux::new(&config, Device::Cpu).unwrap();
        let mut target = Flux::new(&config, Device::Cpu).unwrap();
        load_into(&mut target, &exported(&source, layout), layout).unwrap();
        let target_vars = target.store.vs.variables();
        for (name, value) in source.store.vs.variables() {
            assert!(
                value.equal(&target_vars[&name]),
                "{layout:?}: {name} differs"
            );
        }
    }
}

#[test]
fn reference_key_names_are_produced() {
    let model = Flux::new(&tiny_config(), Device::Cpu).unwrap(); // 1 joint + 2 single
    let bfl = exported(&model, Layout::Bfl);
    for key in [
        "img_in.weight",
        "double_blocks.0.img_attn.qkv.weight",
        "double_blocks.0.txt_attn.norm.key_norm.scale",
        "single_blocks.1.linear1.weight",
        "single_blocks.0.norm.query_norm.scale",
        "final_layer.adaLN_modulation.1.weight",
    ] {
        assert!(bfl.contains_key(key), "BFL export lacks {key}");
    }
    let diffusers = exported(&model, Layout::Diffusers);
    assert_eq!(
        diffusers["single_transformer_blocks.1.proj_mlp.weight"].size(),
        [256, 64]
    );
    assert_eq!(
        diffusers["transformer_blocks.0.attn.add_v_proj.bias"].size(),
        [64]
    );
    // diffusers' norm_out is [scale; shift]; native and BFL are [shift; scale].
    let native = &model.store.vs.variables()["norm_out.linear.weight"];
    assert!(diffusers["norm_out.linear.weight"]
        .narrow(0, 0, 64)
        .equal(&native.narrow(0, 64, 64)));
}

#[test]
fn missing_and_unused_tensors_are_reported() {
    let config = tiny_config();
    let source = Flux::new(&config, Device::Cpu).unwrap();
    let mut tensors = exported(&source, Layout::Diffusers);
    tensors.remove("transformer_blocks.0.attn.to_k.weight");
    let mut target = Flux::new(&config, Device::Cpu).unwrap();
    let err = load_into(&mut target, &tensors, Layout::Diffusers).unwrap_err();
    assert!(
        matches!(&err, LoadError::Missing { key, .. } if key == "transformer_blocks.0.attn.to_k.weight"),
        "{err}"
    );

    // A guidance-distilled checkpoint loaded into a model without guidance: the extra tensors are named.
    let guided = Flux::new(
        &FluxConfig {
            guidance_embed: true,
            ..config.clone()
        },
        Device::Cpu,
    )
    .unwrap();
    let err = load_into(&mut target, &exported(&guided, Layout::Bfl), Layout::Bfl).unwrap_err();
    match err {
        LoadError::Unused(keys) => assert!(
            keys.iter().all(|k| k.starts_with("guidance_in.")),
            "{keys:?}"
        ),
        other => panic!("expected Unused, got {other}"),
    }
}

#[test]
fn wrong_shapes_are_reported_with_the_native_name() {
    let small = Flux::new(&tiny_config(), Device::Cpu).unwrap();
    let mut wider = Flux::new(
        &FluxConfig {
            context_dim: 32,
            ..tiny_config()
        },
        Device::Cpu,
    )
    .unwrap();
    let err = load_into(&mut wider, &exported(&small, Layout::Bfl), Layout::Bfl).unwrap_err();
    match err {
        LoadError::Shape {
            native,
            expected,
            got,
        } => {
            assert_eq!(native, "context_embedder.weight");
            assert_eq!((expected, got), (vec![64, 32], vec![64, 24]));
        }
        other => panic!("expected Shape, got {other}"),
    }
}

#[test]
fn unreadable_files_name_the_path() {
    let dir = std::env::temp_dir().join(format!("flux-conv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("broken.safetensors");
    std::fs::write(&path, b"not a safetensors file").unwrap();
    let err = convert::read_safetensors(&path).unwrap_err();
    assert!(
        err.to_string().starts_with(&path.display().to_string()),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
