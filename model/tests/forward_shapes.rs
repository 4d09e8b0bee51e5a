//! The forward pass at several resolutions, patch sizes and conditioning options.

mod common;

use common::{batch, max_abs_diff, tiny_config};
use flux_model::patchify::{patchify, unpatchify};
use flux_model::{DiffusionBatch, DiffusionModel, Flux, FluxConfig};
use tch::{Device, Kind, Tensor};

#[test]
fn output_has_the_input_shape_at_several_resolutions() {
    let model = Flux::new(&tiny_config(), Device::Cpu).unwrap();
    for (rows, cols, text) in [(4, 4, 6), (3, 7, 5), (8, 2, 1), (1, 1, 9)] {
        let inputs = batch(model.config(), 2, rows, cols, text);
        let out = tch::no_grad(|| model.forward(&inputs, false)).unwrap();
        assert_eq!(out.size(), inputs.latents.size(), "grid {rows}×{cols}");
        assert!(out.isfinite().all().int64_value(&[]) == 1);
    }
}

#[test]
fn patchify_round_trips_and_matches_reference_packing() {
    let img = Tensor::arange(2 * 3 * 4 * 6, (Kind::Float, Device::Cpu)).view([2, 3, 4, 6]);
    let tokens = patchify(&img, 2);
    assert_eq!(tokens.size(), [2, 6, 12]);
    // Token (i, j) = 1·3 + 2 holds channel c's 2×2 patch, features ordered (c, ph, pw).
    let token = tokens.get(0).get(5);
    let expected = img.get(0).narrow(1, 2, 2).narrow(2, 4, 2).reshape([12]);
    assert_eq!(max_abs_diff(&token, &expected), 0.0);
    assert_eq!(max_abs_diff(&unpatchify(&tokens, 2, 2, 3), &img), 0.0);
}

#[test]
fn patch_size_two_equals_patch_size_one_on_packed_latents() {
    // A 2×2-patch model over 4-channel latents is the same function as a 1×1 model over the
    // packed 16-channel latents, with the same weights.
    let packed = FluxConfig {
        in_channels: 16,
        ..tiny_config()
    };
    let patched = FluxConfig {
        in_channels: 4,
        patch_size: 2,
        ..tiny_config()
    };
    let a = Flux::new(&packed, Device::Cpu).unwrap();
    let mut b = Flux::new(&patched, Device::Cpu).unwrap();
    b.store.vs.copy(&a.store.vs).unwrap();

    let raw = batch(&patched, 2, 3, 5, 4);
    let packed_img = patchify(&raw.latents, 2)
        .transpose(1, 2)
        .reshape([2, 16, 3, 5]);
    let packed_input = DiffusionBatch {
        latents: packed_img,
        ..raw.clone()
    };
    let out_packed = tch::no_grad(|| a.forward(&packed_input, false)).unwrap();
    let out_patched = tch::no_grad(|| b.forward(&raw, false)).unwrap();
    let repacked = patchify(&out_patched, 2)
        .transpose(1, 2)
        .reshape([2, 16, 3, 5]);
    assert!(max_abs_diff(&out_packed, &repacked) < 1e-5);
}

#[test]
fn guidance_changes_the_output_only_when_embedded() {
    let config = FluxConfig {
        guidance_embed: true,
        ..tiny_config()
    };
    let model = Flux::new(&config, Device::Cpu).unwrap();
    let inputs = batch(&config, 2, 3, 3, 4);
    let low = Tensor::full([2], 1.0, (Kind::Float, Device::Cpu));
    let high = Tensor::full([2], 6.0, (Kind::Float, Device::Cpu));
    let run = |g: &Tensor| {
        tch::no_grad(|| {
            model.forward(
                &DiffusionBatch {
                    guidance: Some(g.shallow_clone()),
                    ..inputs.clone()
                },
                false,
            )
        })
        .unwrap()
    };
    assert!(max_abs_diff(&run(&low), &run(&high)) > 1e-4);
}

#[test]
fn gradients_reach_every_parameter() {
    let model = Flux::new(
        &FluxConfig {
            guidance_embed: true,
            ..tiny_config()
        },
        Device::Cpu,
    )
    .unwrap();
    let inputs = batch(model.config(), 2, 2, 3, 4);
    let out = model.forward(&inputs, true).unwrap();
    out.square().mean(Kind::Float).backward();
    for (name, var) in model.store.vs.variables() {
        let grad = var.grad();
        assert!(grad.defined(), "{name} has no gradient");
        assert!(
            grad.abs().sum(Kind::Float).double_value(&[]) > 0.0,
            "{name} has a zero gradient"
        );
    }
}

#[test]
fn dropout_acts_only_in_training() {
    let config = FluxConfig {
        hidden_dropout: 0.5,
        attention_dropout: 0.5,
        ..tiny_config()
    };
    let model = Flux::new(&config, Device::Cpu).unwrap();
    let inputs = batch(&config, 1, 2, 2, 3);
    let eval = |m: &Flux| tch::no_grad(|| m.forward(&inputs, false)).unwrap();
    assert_eq!(max_abs_diff(&eval(&model), &eval(&model)), 0.0);
    let train = || tch::no_grad(|| model.forward(&inputs, true)).unwrap();
    assert!(max_abs_diff(&train(), &train()) > 0.0);
}

#[test]
fn mismatched_inputs_are_named_errors() {
    let config = FluxConfig {
        guidance_embed: true,
        ..tiny_config()
    };
    let model = Flux::new(&config, Device::Cpu).unwrap();
    let good = batch(&config, 2, 3, 3, 4);
    let wrong_channels = Tensor::zeros([2, 5, 3, 3], (Kind::Float, Device::Cpu));
    let wrong_text = Tensor::zeros([2, 4, 7], (Kind::Float, Device::Cpu));
    let wrong_pooled = Tensor::zeros([2, 7], (Kind::Float, Device::Cpu));
    let cases = [
        (
            DiffusionBatch {
                latents: wrong_channels,
                ..good.clone()
            },
            "latents",
        ),
        (
            DiffusionBatch {
                text: Some(wrong_text),
                ..good.clone()
            },
            "text",
        ),
        (
            DiffusionBatch {
                pooled: Some(wrong_pooled),
                ..good.clone()
            },
            "pooled",
        ),
        (
            DiffusionBatch {
                guidance: None,
                ..good.clone()
            },
            "guidance",
        ),
    ];
    for (input, argument) in cases {
        let err = model.forward(&input, false).unwrap_err();
        assert_eq!(err.argument, argument, "{err}");
    }
    let odd = FluxConfig {
        patch_size: 2,
        ..tiny_config()
    };
    let patched = Flux::new(&odd, Device::Cpu).unwrap();
    let inputs = batch(&odd, 1, 2, 2, 3);
    let odd_img = Tensor::zeros([1, 8, 5, 4], (Kind::Float, Device::Cpu));
    let err = patched
        .forward(
            &DiffusionBatch {
                latents: odd_img,
                ..inputs.clone()
            },
            false,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("divisible by patch_size 2"),
        "{err}"
    );
}

#[test]
fn recomputation_gives_the_same_output_and_gradients() {
    let config = FluxConfig {
        guidance_embed: true,
        ..tiny_config()
    };
    let model = Flux::new(&config, Device::Cpu).unwrap();
    let inputs = batch(&config, 2, 3, 2, 4);
    let run = |recompute: bool| {
        model.set_recompute(recompute);
        model.store.vs.trainable_variables().iter().for_each(|v| {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        });
        let out = model.forward(&inputs, true).unwrap();
        out.square().mean(Kind::Float).backward();
        let mut grads: Vec<(String, Tensor)> = model
            .store
            .vs
            .variables()
            .into_iter()
            .map(|(name, v)| (name, v.grad().copy()))
            .collect();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        (out.detach(), grads)
    };
    let (plain, plain_grads) = run(false);
    let (recomputed, recomputed_grads) = run(true);
    assert!(max_abs_diff(&plain, &recomputed) < 1e-6);
    for ((_, a), (_, b)) in plain_grads.iter().zip(&recomputed_grads) {
        assert!(max_abs_diff(a, b) < 1e-6);
    }

    // Frozen embedders, trainable layers (as LoRA adapters on a frozen base): no input of the
    // first recomputed block requires a gradient, and its parameters still get theirs.
    for (name, var) in model.store.vs.variables() {
        let _ = var.set_requires_grad(name.contains("layers."));
    }
    let (_, plain_grads) = run(false);
    let (_, recomputed_grads) = run(true);
    let mut trained = 0;
    for ((name, a), (_, b)) in plain_grads.iter().zip(&recomputed_grads) {
        if name.contains("layers.") {
            assert!(max_abs_diff(a, b) < 1e-6, "{name}");
            let norm = b.abs().sum(Kind::Float).double_value(&[]);
            assert!(norm > 0.0, "{name} got no gradient with recomputation");
            trained += 1;
        }
    }
    assert!(trained > 0);
    flux_model::execution::recompute::clear_pending();
}
