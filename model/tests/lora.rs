//! LoRA on every linear of FLUX.1 (replicated, column- and row-parallel, fused parts): a new
//! adapter changes nothing, the base stays frozen, two tensor-parallel ranks (threads joined by
//! a shared-memory collective) match one process in output and in every adapter gradient to
//! 1e-5 relative, and the diffusers export names each fused part's module.

mod common;

use std::collections::HashMap;

use common::threads::ThreadGroup;
use common::tiny_config;
use flux_model::lora::{export, import, Adapters, LoraSettings};
use flux_model::tp::{Shard, TpContext};
use flux_model::{DiffusionBatch, FluxConfig, ModelSpec};
use tch::{Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-5;

const SETTINGS: LoraSettings = LoraSettings {
    rank: 2,
    alpha: 4.0,
    dropout: 0.0,
};

fn spec() -> ModelSpec {
    ModelSpec::new(FluxConfig {
        guidance_embed: true,
        ..tiny_config()
    })
}

fn all() -> Vec<String> {
    vec!["*".to_string()]
}

/// Output and logical adapter gradients of the model on `tp` with `base` and `adapter` weights.
fn run(
    tp: TpContext,
    base: &HashMap<String, Tensor>,
    adapter: &HashMap<String, Tensor>,
    batch: &DiffusionBatch,
) -> (Tensor, Vec<(String, Tensor)>) {
    let mut model = spec().build(Device::Cpu, tp).unwrap();
    model.store_mut().load_logical(base).unwrap();
    model.store_mut().vs.freeze();
    let mut adapters = Adapters::attach(model.as_ref(), SETTINGS, &all()).unwrap();
    adapters.store_mut().load_logical(adapter).unwrap();
    adapters.set_training(true);
    let y = model.forward(batch, true).unwrap();
    let probe = Tensor::arange(y.numel() as i64, (Kind::Float, Device::Cpu))
        .view(y.size().as_slice())
        .cos();
    (&y * probe).sum(Kind::Float).backward();
    adapters.store().finish_grads();
    for var in model.store().vs.variables().values() {
        assert!(!var.grad().defined(), "a frozen base weight got a gradient");
    }
    (y.detach(), adapters.store().gather_logical(true))
}

/// Random logical values (`N(0, 0.1²)`) for every adapter tensor: nonzero updates.
fn random_adapters(adapters: &Adapters) -> HashMap<String, Tensor> {
    adapters
        .store()
        .param_specs()
        .iter()
        .map(|s| {
            let t = Tensor::randn(s.shape.as_slice(), (Kind::Float, Device::Cpu)) * 0.1;
            (s.name.clone(), t)
        })
        .collect()
}

#[test]
fn adapters_on_every_linear_match_across_two_ranks_and_start_as_no_change() {
    tch::manual_seed(11);
    let model = spec().build(Device::Cpu, TpContext::single()).unwrap();
    let base: HashMap<String, Tensor> = model.store().gather_logical(false).into_iter().collect();
    let batch = DiffusionBatch::random(&spec().inputs(), 2, 4, 6, 5, Device::Cpu);
    let before = tch::no_grad(|| model.forward(&batch, false)).unwrap();

    // Every kind of linear is wrapped, and a new adapter (B = 0) leaves the output unchanged.
    let adapters = Adapters::attach(model.as_ref(), SETTINGS, &all()).unwrap();
    let mut shards = Vec::new();
    model.visit_linears(&mut |l| shards.push(l.shard()));
    assert_eq!(adapters.modules().len(), shards.len());
    for kind in [Shard::Replicated, Shard::Column, Shard::Row] {
        assert!(shards.contains(&kind), "{kind:?}");
    }
    let after = tch::no_grad(|| model.forward(&batch, false)).unwrap();
    assert!(before.equal(&after));

    // Nonzero adapters (B random), the same logical values on every group size.
    let adapter = random_adapters(&adapters);
    let (y1, grads1) = run(TpContext::single(), &base, &adapter, &batch);
    assert!(
        !y1.allclose(&before, 1e-3, 1e-3, false),
        "the adapters change the output"
    );
    let ranks: Vec<_> = ThreadGroup::group(2)
        .into_iter()
        .map(|comm| {
            let copy = |m: &HashMap<String, Tensor>| -> HashMap<String, Tensor> {
                m.iter().map(|(k, v)| (k.clone(), v.copy())).collect()
            };
            let (base, adapter) = (copy(&base), copy(&adapter));
            let batch = batch.narrow(0, 2);
            std::thread::spawn(move || run(TpContext::new(Box::new(comm)), &base, &adapter, &batch))
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        let (y2, grads2) = handle.join().unwrap();
        let dy = (&y2 - &y1).abs().max().double_value(&[]);
        assert!(dy <= TOLERANCE, "rank {rank}: output max|Δ| {dy:e}");
        common::threads::assert_grads_match(rank, &grads1, &grads2, TOLERANCE);
    }
}

#[test]
fn bad_settings_and_targets_name_the_lora_field() {
    let model = spec().build(Device::Cpu, TpContext::single()).unwrap();
    let attach = |settings: LoraSettings, targets: &[&str]| {
        let targets: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
        Adapters::attach(model.as_ref(), settings, &targets).unwrap_err()
    };
    let e = attach(SETTINGS, &["linear_qkv", "to_q"]);
    assert_eq!(e.field, "lora.targets");
    assert!(
        e.message.starts_with("`to_q` matches no linear layer"),
        "{e}"
    );
    let e = attach(
        LoraSettings {
            rank: 0,
            ..SETTINGS
        },
        &["*"],
    );
    assert_eq!(e.field, "lora.rank");
    let e = attach(
        LoraSettings {
            rank: 13,
            ..SETTINGS
        },
        &["*"],
    );
    assert_eq!(e.field, "lora.rank");
    assert!(e.message.contains("the rank must be at most 8"), "{e}");
    let e = attach(
        LoraSettings {
            dropout: 1.0,
            ..SETTINGS
        },
        &["*"],
    );
    assert_eq!(e.field, "lora.dropout");
}

#[test]
fn diffusers_export_gives_each_fused_part_the_same_a_and_its_rows_of_b() {
    tch::manual_seed(3);
    let spec = spec();
    let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
    let mut adapters = Adapters::attach(
        model.as_ref(),
        SETTINGS,
        &["layers.0.self_attention.linear_qkv".to_string()],
    )
    .unwrap();
    let b = Tensor::randn([192, 2], (Kind::Float, Device::Cpu));
    let values: HashMap<String, Tensor> = adapters
        .store()
        .gather_logical(false)
        .into_iter()
        .map(|(k, v)| {
            if k.ends_with("lora_B.weight") {
                (k, b.copy())
            } else {
                (k, v)
            }
        })
        .collect();
    adapters.store_mut().load_logical(&values).unwrap();
    let out: HashMap<String, Tensor> = export::diffusers_state_dict(&adapters, &values, &spec)
        .unwrap()
        .into_iter()
        .collect();
    let a = &values["transformer.layers.0.self_attention.linear_qkv.lora_A.weight"];
    let scale = SETTINGS.alpha / SETTINGS.rank as f64;
    for (i, part) in ["to_q", "to_k", "to_v"].iter().enumerate() {
        let key =
            |leaf: &str| format!("transformer.transformer_blocks.0.attn.{part}.{leaf}.weight");
        assert!(out[&key("lora_A")].equal(a));
        let expected = b.narrow(0, 64 * i as i64, 64) * scale;
        assert!(
            out[&key("lora_B")].allclose(&expected, 1e-6, 1e-6, false),
            "{part}"
        );
    }
    assert_eq!(out.len(), 6);
}

#[test]
fn merged_weights_compute_what_base_and_adapters_compute() {
    tch::manual_seed(5);
    let spec = spec();
    let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
    let mut adapters = Adapters::attach(model.as_ref(), SETTINGS, &all()).unwrap();
    let random = random_adapters(&adapters);
    adapters.store_mut().load_logical(&random).unwrap();
    let batch = DiffusionBatch::random(&spec.inputs(), 2, 4, 6, 5, Device::Cpu);
    let adapted = tch::no_grad(|| model.forward(&batch, false)).unwrap();
    let merged: HashMap<String, Tensor> = adapters.merged(model.store()).into_iter().collect();
    let mut plain = spec.build(Device::Cpu, TpContext::single()).unwrap();
    plain.store_mut().load_logical(&merged).unwrap();
    let out = tch::no_grad(|| plain.forward(&batch, false)).unwrap();
    let err = (&out - &adapted).abs().max().double_value(&[]);
    assert!(err <= TOLERANCE, "merged max|Δ| {err:e}");
}

#[test]
fn exported_adapters_import_back_in_both_layouts() {
    tch::manual_seed(7);
    let spec = spec();
    let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
    let mut adapters = Adapters::attach(model.as_ref(), SETTINGS, &all()).unwrap();
    let random = random_adapters(&adapters);
    adapters.store_mut().load_logical(&random).unwrap();
    for (label, exported) in [
        (
            "diffusers",
            export::diffusers_state_dict(&adapters, &random, &spec),
        ),
        ("kohya", export::kohya_state_dict(&adapters, &random, &spec)),
    ] {
        let imported =
            import::import(exported.unwrap(), &Default::default(), &spec, label).unwrap();
        assert_eq!(imported.len(), adapters.modules().len(), "{label}");
        let other = spec.build(Device::Cpu, TpContext::single()).unwrap();
        let mut fresh = Adapters::attach(other.as_ref(), SETTINGS, &all()).unwrap();
        fresh.load_imported(&imported, label).unwrap();
        for (name, value) in fresh.store().gather_logical(false) {
            assert!(
                value.allclose(&random[&name], 1e-6, 1e-6, false),
                "{label}: {name}"
            );
        }
        // A file of another rank is refused, naming the file and both ranks.
        let other = spec.build(Device::Cpu, TpContext::single()).unwrap();
        let rank3 = LoraSettings {
            rank: 3,
            ..SETTINGS
        };
        let mut wider = Adapters::attach(other.as_ref(), rank3, &all()).unwrap();
        let err = wider
            .load_imported(&imported, label)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("lora.init") && err.contains("rank 2") && err.contains(label),
            "{err}"
        );
    }
}

#[test]
fn separately_trained_parts_of_a_fused_weight_import_as_their_own_updates() {
    tch::manual_seed(9);
    let spec = spec();
    let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
    let qkv = "transformer.layers.0.self_attention.linear_qkv";
    let mut adapters = Adapters::attach(model.as_ref(), SETTINGS, &[qkv.to_string()]).unwrap();
    let random = random_adapters(&adapters);
    adapters.store_mut().load_logical(&random).unwrap();
    // diffusers' own training gives `to_k` an `A` of its own.
    let key = |part: &str, leaf: &str| {
        format!("transformer.transformer_blocks.0.attn.{part}.{leaf}.weight")
    };
    let mut file: HashMap<String, Tensor> = export::diffusers_state_dict(&adapters, &random, &spec)
        .unwrap()
        .into_iter()
        .collect();
    let a_k = Tensor::randn([2, 64], (Kind::Float, Device::Cpu));
    file.insert(key("to_k", "lora_A"), a_k.copy());
    let copy = |f: &HashMap<String, Tensor>| -> HashMap<String, Tensor> {
        f.iter().map(|(k, v)| (k.clone(), v.copy())).collect()
    };
    let imported = import::import(
        copy(&file).into_iter().collect(),
        &Default::default(),
        &spec,
        "f",
    )
    .unwrap();
    assert_eq!(imported.len(), 1);
    assert!(imported[0].shared().is_none());
    let delta = imported[0].delta();
    let expected_k = file[&key("to_k", "lora_B")].mm(&a_k);
    assert!(delta
        .narrow(0, 64, 64)
        .allclose(&expected_k, 1e-6, 1e-6, false));
    let expected_q = file[&key("to_q", "lora_B")].mm(&file[&key("to_q", "lora_A")]);
    assert!(delta
        .narrow(0, 0, 64)
        .allclose(&expected_q, 1e-6, 1e-6, false));
    let err = adapters
        .load_imported(&imported, "f")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("adapters of their own") && err.contains("merge"),
        "{err}"
    );

    // A module the model lacks, a missing part, a mis-shaped B: each refused naming the key.
    let mut foreign = copy(&file);
    foreign.insert(
        "transformer.transformer_blocks.9.attn.to_q.lora_A.weight".into(),
        a_k.copy(),
    );
    let mut partial = copy(&file);
    partial.remove(&key("to_v", "lora_A"));
    partial.remove(&key("to_v", "lora_B"));
    let mut misshaped = copy(&file);
    misshaped.insert(
        key("to_q", "lora_B"),
        Tensor::zeros([63, 2], (Kind::Float, Device::Cpu)),
    );
    // Why the adapters `bad` are refused.
    let refused = |bad: HashMap<String, Tensor>| {
        import::import(
            bad.into_iter().collect(),
            &Default::default(),
            &spec,
            "bad.safetensors",
        )
        .unwrap_err()
        .to_string()
    };
    for (bad, expect) in [
        (foreign, "transformer_blocks.9.attn.to_q"),
        (partial, "to_v"),
        (misshaped, "to_q"),
    ] {
        let err = refused(bad);
        assert!(
            err.contains("bad.safetensors")
                && err.contains(expect)
                && err.contains("another model"),
            "{err}"
        );
    }

    // Values no update can be made of, each refused naming the tensor or module.
    let with = |key: String, value: Tensor| {
        let mut f = copy(&file);
        f.insert(key, value);
        f
    };
    let nan_a = file[&key("to_q", "lora_A")].copy();
    let _ = nan_a.get(0).get(0).fill_(f64::NAN);
    let inf_b = file[&key("to_v", "lora_B")].copy().fill_(f64::INFINITY);
    let alpha = |module: &str| format!("transformer.transformer_blocks.0.attn.{module}.alpha");
    let scalar = |v: f64| Tensor::from(v as f32);
    let mut rank_zero = copy(&file);
    for part in ["to_q", "to_k", "to_v"] {
        rank_zero.insert(
            key(part, "lora_A"),
            Tensor::zeros([0, 64], (Kind::Float, Device::Cpu)),
        );
        rank_zero.insert(
            key(part, "lora_B"),
            Tensor::zeros([64, 0], (Kind::Float, Device::Cpu)),
        );
    }
    // The same module under diffusers' and PEFT's prefixes with other values.
    let peft_key = key("to_q", "lora_B").replacen("transformer.", "base_model.model.", 1);
    let mut twice = copy(&file);
    twice.insert(peft_key.clone(), file[&key("to_q", "lora_B")].copy() + 1.0);
    for (bad, expect) in [
        (with(key("to_q", "lora_A"), nan_a), "NaN or infinite"),
        (with(key("to_v", "lora_B"), inf_b), "NaN or infinite"),
        (with(alpha("to_q"), scalar(f64::NAN)), "NaN or infinite"),
        (
            with(alpha("to_q"), scalar(f64::INFINITY)),
            "NaN or infinite",
        ),
        (
            with(alpha("to_q"), Tensor::ones([2], (Kind::Float, Device::Cpu))),
            "not one number",
        ),
        (rank_zero, "rank 0"),
        (twice, "the same module twice"),
    ] {
        let err = refused(bad);
        assert!(
            err.contains("bad.safetensors") && err.contains(expect),
            "{expect}: {err}"
        );
    }
    // An identical copy under the second prefix is the same update.
    let mut same = copy(&file);
    same.insert(peft_key, file[&key("to_q", "lora_B")].copy());
    import::import(same.into_iter().collect(), &Default::default(), &spec, "f").unwrap();
}
