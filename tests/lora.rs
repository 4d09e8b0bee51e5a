//! LoRA end to end: adapters trained on a frozen base load into diffusers' own FLUX.1 and FLUX.2
//! transformers through its LoRA loader (PEFT) and give flux-hpc's forward (1e-4, f32), as does the plain
//! model `flux-hpc lora merge` writes; the kohya file `flux-hpc lora export` writes gives
//! diffusers (through its kohya converter) the same adapters; a LoRA run on TP2×DP2 (`mpirun -np 4`, layers recomputed) logs
//! what one process logs and resumes step for step, its adapters and their EMA included; its
//! checkpoints hold the adapters only; a pattern that selects nothing or a base of another
//! architecture is refused before training.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{assert_same_records, flux_hpc, ok, python, records, temp_dir, train, train_config};
use flux_data::checkpoint;
use flux_model::lora::Adapters;
use flux_model::tp::TpContext;
use flux_model::{DiffusionBatch, DiffusionModel};
use flux_train::{load_base, RunConfig};
use tch::{Device, Tensor};

/// f32 forward of two implementations: only the order of sums differs.
const TOLERANCE: f64 = 1e-4;

/// flux_tiny with diffusers' 256-channel timestep embedding (so diffusers can express it).
const DIFFUSERS_SHAPE: &str = "model.model_channels=256";

/// The settings of every LoRA run here: rank 4, α 8, every linear, no warm-up.
const LORA: [&str; 4] = [
    "lora.rank=4",
    "lora.alpha=8.0",
    "lora.targets=[\"*\"]",
    "optimization.warmup_steps=0",
];

fn lora_args<'a>(base: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = LORA.to_vec();
    args.push(base);
    args.extend(extra);
    args
}

/// flux-hpc's model of the LoRA checkpoint `saved`: its `[lora] base` weights from `base` with the
/// checkpoint's adapters attached (the adapters are returned too: they own the parameters).
fn model_with_adapters(
    saved: &checkpoint::LoadedCheckpoint,
    base: &Path,
) -> (RunConfig, Box<dyn DiffusionModel>, Adapters) {
    let config = RunConfig::parse(&saved.config, "checkpoint", &[]).unwrap();
    let lora = config.lora.clone().expect("a LoRA run");
    let mut model = config
        .model
        .build(Device::Cpu, TpContext::single())
        .unwrap();
    load_base(model.store_mut(), base, config.model.architecture()).unwrap();
    let mut adapters = Adapters::attach(model.as_ref(), lora.settings(), &lora.targets).unwrap();
    adapters
        .store_mut()
        .load_logical(&saved.tensors["params"])
        .unwrap();
    (config, model, adapters)
}

/// The FLUX.1 inputs diffusers' forward script saved in `io`, as flux-hpc's batch.
fn flux1_batch(io: &HashMap<String, Tensor>) -> DiffusionBatch {
    DiffusionBatch {
        latents: io["img"].shallow_clone(),
        timesteps: io["timesteps"].shallow_clone(),
        text: Some(io["txt"].shallow_clone()),
        pooled: Some(io["y"].shallow_clone()),
        guidance: io.get("guidance").map(Tensor::shallow_clone),
    }
}

/// Assert that `ours` is diffusers' output with the adapter (`out`) to the tolerance, and that
/// the adapter moved diffusers' output (`out_base`) by far more than that.
fn assert_same_adapted_output(label: &str, ours: &Tensor, theirs: &HashMap<String, Tensor>) {
    let max_abs = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    let (err, effect) = (
        max_abs(ours, &theirs["out"]),
        max_abs(&theirs["out"], &theirs["out_base"]),
    );
    println!("{label}: max abs error {err:e}; the adapters move the output by {effect:e}");
    assert!(
        effect > 100.0 * TOLERANCE,
        "{label}: the adapters barely change the output ({effect:e})"
    );
    assert!(
        err <= TOLERANCE,
        "{label}: max abs error {err:e} > {TOLERANCE:e}"
    );
}

#[test]
fn trained_adapters_give_flux_hpcs_forward_in_diffusers_through_its_lora_loader() {
    let dir = temp_dir("lora-diffusers");
    let (base, run, export) = (dir.join("base"), dir.join("lora"), dir.join("diffusers"));
    ok(&train(
        None,
        &base,
        &[DIFFUSERS_SHAPE, "training.total_steps=2"],
    ));
    let base_arg = format!("lora.base=\"{}\"", base.display());
    ok(&train(
        None,
        &run,
        &lora_args(&base_arg, &[DIFFUSERS_SHAPE, "training.total_steps=5"]),
    ));
    // Adapters only in the checkpoint; the final adapters in diffusers' LoRA names.
    let saved = checkpoint::load(&run.join("step_000000005")).unwrap();
    assert!(saved.tensors["params"].keys().all(|k| k.contains(".lora_")));
    let lora = run.join("final_lora.safetensors");
    let exported: HashMap<String, Tensor> = Tensor::read_safetensors(&lora)
        .unwrap()
        .into_iter()
        .collect();
    assert!(exported.contains_key("transformer.transformer_blocks.0.attn.to_q.lora_A.weight"));
    assert!(exported.contains_key("transformer.single_transformer_blocks.1.proj_mlp.lora_B.weight"));

    common::convert_to_diffusers(&base, &export);
    let io = diffusers_forward_with(&export, &lora, &dir.join("io.safetensors"));

    // flux-hpc: the base checkpoint, the adapters of the LoRA run's last checkpoint.
    let (config, model, _adapters) = model_with_adapters(&saved, &base);
    let batch = flux1_batch(&io);
    let out = tch::no_grad(|| model.forward(&batch, false)).unwrap();
    assert_same_adapted_output("FLUX.1", &out, &io);
    let max_abs = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);

    // `lora merge` folds the adapters into the base: a plain model with the same forward.
    let dir_arg = format!("checkpoint.dir=\"{}\"", run.display());
    let mut merge = vec!["lora", "merge", common::FLUX_TINY, "--set", &dir_arg];
    let overrides = lora_args(&base_arg, &[DIFFUSERS_SHAPE]);
    merge.extend(overrides.iter().flat_map(|o| ["--set", o]));
    ok(&flux_hpc(&merge));
    let merged: HashMap<String, Tensor> = Tensor::read_safetensors(run.join("merged.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let mut plain = config
        .model
        .build(Device::Cpu, TpContext::single())
        .unwrap();
    plain.store_mut().load_logical(&merged).unwrap();
    let out = tch::no_grad(|| plain.forward(&batch, false)).unwrap();
    let err = max_abs(&out, &io["out"]);
    assert!(
        err <= TOLERANCE,
        "merged: max abs error {err:e} > {TOLERANCE:e}"
    );

    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn peft_adapters_merge_exactly_and_a_run_continues_a_files_adapters() {
    let dir = temp_dir("lora-import");
    let (base, run, export) = (dir.join("base"), dir.join("lora"), dir.join("diffusers"));
    ok(&train(
        None,
        &base,
        &[DIFFUSERS_SHAPE, "training.total_steps=1"],
    ));
    common::convert_to_diffusers(&base, &export);
    // An adapter as diffusers' training script saves one: to_q/to_k/to_v trained apart, α/r
    // (and a per-module α) only in the file's metadata.
    let peft = dir.join("peft.safetensors");
    ok(&python(
        "make_peft_lora.py",
        &[export.as_os_str(), peft.as_os_str()],
    ));
    let io = diffusers_forward_with(&export, &peft, &dir.join("io.safetensors"));
    let base_arg = format!("lora.base=\"{}\"", base.display());
    let overrides = lora_args(&base_arg, &[DIFFUSERS_SHAPE]);
    let (peft_str, merged) = (peft.to_str().unwrap(), dir.join("merged.safetensors"));
    let mut merge = vec!["lora", "merge", common::FLUX_TINY, "--adapter", peft_str];
    merge.extend(["--out", merged.to_str().unwrap()]);
    merge.extend(overrides.iter().flat_map(|o| ["--set", *o]));
    ok(&flux_hpc(&merge));
    let config = RunConfig::parse(
        &std::fs::read_to_string(base.join("config.toml")).unwrap(),
        "base",
        &[],
    )
    .unwrap();
    let mut plain = config
        .model
        .build(Device::Cpu, TpContext::single())
        .unwrap();
    let merged: HashMap<String, Tensor> = Tensor::read_safetensors(&merged)
        .unwrap()
        .into_iter()
        .collect();
    plain.store_mut().load_logical(&merged).unwrap();
    let batch = flux1_batch(&io);
    let out = tch::no_grad(|| plain.forward(&batch, false)).unwrap();
    assert_same_adapted_output("PEFT file merged", &out, &io);

    let refused = |name: &str, extra: &[&str], want: &str| {
        let out = train(
            None,
            &dir.join(name),
            &lora_args(
                &base_arg,
                &[&[DIFFUSERS_SHAPE, "training.total_steps=1"], extra].concat(),
            ),
        );
        assert!(!out.status.success(), "{name} trained");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("lora.init") && stderr.contains(want),
            "{name}: {stderr}"
        );
        assert!(!dir.join(name).join("step_000000001").exists());
    };
    // One fused adapter cannot continue three separately trained ones.
    let init_peft = format!("lora.init=\"{}\"", peft.display());
    refused("peft", &[&init_peft], "have adapters of their own");

    // A run started from another run's final adapters starts at that run's held-out loss.
    let steps = ["training.total_steps=3", "training.eval_interval=3"];
    ok(&train(None, &run, &[&overrides[..], &steps].concat()));
    let (_, source_last) = common::first_and_last_eval(&run);
    let init = format!(
        "lora.init=\"{}\"",
        run.join("final_lora.safetensors").display()
    );
    let continued = dir.join("continued");
    ok(&train(
        None,
        &continued,
        &[&overrides[..], &steps, &[&init]].concat(),
    ));
    let (continued_first, _) = common::first_and_last_eval(&continued);
    assert!(
        (continued_first - source_last).abs() <= 1e-5 * source_last,
        "continued run starts at {continued_first}, its source ended at {source_last}"
    );
    refused(
        "rank",
        &[&init, "lora.rank=2"],
        "has rank 4, [lora] rank is 2",
    );
    refused(
        "untargeted",
        &[&init, "lora.targets=[\"layers.0.*\"]"],
        "which [lora] targets do not select",
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn lora_on_tp2_by_dp2_matches_one_process_and_resumes_step_for_step() {
    let dir = temp_dir("lora-parallel");
    // The seeded random base (no `lora.base`).
    let base_arg = "lora.dropout=0.0";
    let steps = [
        "training.total_steps=6",
        "training.log_interval=1",
        "training.eval_interval=3",
        "training.ema_decay=0.8",
    ];
    let (single, parallel, resumed) = (
        dir.join("single"),
        dir.join("parallel"),
        dir.join("resumed"),
    );
    ok(&train(None, &single, &lora_args(base_arg, &steps)));
    let mut tp2 = lora_args(base_arg, &steps);
    // With layer recomputation: the replayed layers carry their adapters.
    tp2.extend([
        "parallelism.tensor_parallel_size=2",
        "training.recompute=true",
    ]);
    ok(&train(Some(4), &parallel, &tp2));
    let keys = ["loss", "grad_norm", "eval_loss"];
    assert_same_records(&records(&single), &records(&parallel), &keys, 1e-5);
    // Stopped after step 3 and resumed: the same records, bit for bit.
    let mut first = lora_args(base_arg, &steps);
    first.push("--stop-after 3");
    ok(&train(None, &resumed, &first));
    ok(&train(None, &resumed, &lora_args(base_arg, &steps)));
    assert_same_records(&records(&single), &records(&resumed), &keys, 0.0);
    let read = |d: &Path, file: &str| -> HashMap<String, Tensor> {
        Tensor::read_safetensors(d.join(file))
            .unwrap()
            .into_iter()
            .collect()
    };
    // The adapters and their EMA: TP2×DP2 ≡ one process, resumed ≡ uninterrupted.
    for file in ["final_lora.safetensors", "final_lora_ema.safetensors"] {
        let (a, b, c) = (
            read(&single, file),
            read(&parallel, file),
            read(&resumed, file),
        );
        assert_eq!(a.len(), b.len());
        for (name, t) in &a {
            let d = (t - &b[name]).abs().max().double_value(&[]);
            assert!(d <= 1e-5, "{file} {name}: max|Δ| {d:e}");
            assert!(t.equal(&c[name]), "{file} {name} differs after resuming");
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn targets_that_select_nothing_and_a_base_of_another_architecture_are_refused() {
    let dir = temp_dir("lora-refused");
    let out = train(
        None,
        &dir.join("a"),
        &["lora.rank=4", "lora.targets=[\"to_q\"]"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("lora.targets: `to_q` matches no linear layer"),
        "{stderr}"
    );

    let dit = dir.join("dit");
    ok(&train_config(
        "configs/dit_tiny.toml",
        None,
        &dit,
        &["training.total_steps=1"],
    ));
    let base_arg = format!("lora.base=\"{}\"", dit.display());
    let out = train(None, &dir.join("b"), &lora_args(&base_arg, &[]));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("lora.base") && stderr.contains("holds a \"dit\" model"),
        "{stderr}"
    );
    assert!(!dir.join("b/step_000000001").exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// diffusers' output on its seeded inputs (`diffusers_forward.py`) for the model in `export` with
/// the LoRA file `lora` loaded as `FluxPipeline.load_lora_weights` loads it.
fn diffusers_forward_with(export: &Path, lora: &Path, io: &Path) -> HashMap<String, Tensor> {
    ok(&python(
        "diffusers_forward.py",
        &[export.as_os_str(), io.as_os_str(), lora.as_os_str()],
    ));
    Tensor::read_safetensors(io).unwrap().into_iter().collect()
}

#[test]
fn the_kohya_export_gives_diffusers_the_same_adapters_through_its_kohya_converter() {
    let dir = temp_dir("lora-kohya");
    let (base, run, export) = (dir.join("base"), dir.join("lora"), dir.join("diffusers"));
    ok(&train(
        None,
        &base,
        &[DIFFUSERS_SHAPE, "training.total_steps=1"],
    ));
    let base_arg = format!("lora.base=\"{}\"", base.display());
    // The blocks' linears but the single blocks' fused `linear1`: diffusers 0.42's kohya
    // converter fixes that one's widths at FLUX.1 [dev]'s (3072 · 3 + 12288 rows) and leaves the
    // embedders' and final layer's keys without the `transformer.` prefix its loader keeps.
    let targets = r#"lora.targets=["layers.0.*", "layers.1.*", "linear_proj_fc2", "adaln.linear"]"#;
    let dir_arg = format!("checkpoint.dir=\"{}\"", run.display());
    let mut overrides = lora_args(&base_arg, &[DIFFUSERS_SHAPE, "training.total_steps=3"]);
    overrides.push(targets);
    ok(&train(None, &run, &overrides));
    let mut export_kohya = vec!["lora", "export", common::FLUX_TINY, "--format", "kohya"];
    export_kohya.extend(["--set", &dir_arg]);
    export_kohya.extend(overrides.iter().flat_map(|o| ["--set", *o]));
    ok(&flux_hpc(&export_kohya));
    let kohya = run.join("lora_kohya.safetensors");
    let keys: Vec<String> = Tensor::read_safetensors(&kohya)
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    for key in [
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
        "lora_unet_single_blocks_1_linear2.lora_up.weight",
        "lora_unet_single_blocks_0_modulation_lin.alpha",
    ] {
        assert!(keys.iter().any(|k| k == key), "{key} not in {keys:?}");
    }
    common::convert_to_diffusers(&base, &export);
    let via_kohya = diffusers_forward_with(&export, &kohya, &dir.join("kohya.safetensors"));
    let via_diffusers = diffusers_forward_with(
        &export,
        &run.join("final_lora.safetensors"),
        &dir.join("diffusers.safetensors"),
    );
    assert_same_adapted_output(
        "kohya vs diffusers layout",
        &via_diffusers["out"],
        &via_kohya,
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bf16_and_fp8_bases_train_f32_adapters_as_well_as_an_f32_base() {
    let dir = temp_dir("lora-bf16-base");
    let steps = ["training.total_steps=40", "training.eval_interval=0"];
    let (f32_base, bf16_base, fp8_base) = (dir.join("f32"), dir.join("bf16"), dir.join("fp8"));
    ok(&train(
        None,
        &f32_base,
        &lora_args("lora.dropout=0.0", &steps),
    ));
    let mut half = lora_args("lora.base_precision=\"bf16\"", &steps);
    half.push("training.precision=\"fp32\"");
    ok(&train(None, &bf16_base, &half));
    let mut quarter = lora_args("lora.base_precision=\"fp8\"", &steps);
    quarter.push("training.precision=\"fp32\"");
    ok(&train(None, &fp8_base, &quarter));
    let (first, f32_last) = common::first_and_last_eval(&f32_base);
    let (_, bf16_last) = common::first_and_last_eval(&bf16_base);
    assert!(f32_last < 0.7 * first, "held-out loss {first} → {f32_last}");
    // bf16 rounding of the frozen weights moves the result by far less than training does.
    assert!(
        (bf16_last - f32_last).abs() <= 0.02 * f32_last,
        "bf16 base {bf16_last} vs f32 base {f32_last}"
    );
    // A base whose linears are held in e4m3 with per-row scales ends within 3% of the bf16
    // base (measured 0.55%), and holds less: before the first step the tensors alive are the
    // model's, and the float8 linears take half of bf16's bytes (flux_tiny's bf16 linear
    // weights are 0.86 MiB; measured 0.40 MiB less in all).
    let (_, fp8_last) = common::first_and_last_eval(&fp8_base);
    assert!(
        (fp8_last - bf16_last).abs() <= 0.03 * bf16_last,
        "fp8 base {fp8_last} vs bf16 base {bf16_last}"
    );
    let held = |dir: &Path| common::records(dir)[0]["peak_tensor_mib"].as_f64().unwrap();
    let saved = held(&bf16_base) - held(&fp8_base);
    assert!(
        saved >= 0.35,
        "the fp8 base holds {saved} MiB less than the bf16 one"
    );
    // The adapters (all the checkpoint holds) stay f32.
    let inspect = flux_hpc(&["ckpt", "inspect", bf16_base.to_str().unwrap()]);
    ok(&inspect);
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        text.contains("lora_A") && !text.contains("BFloat16"),
        "{text}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn flux2_adapters_load_into_diffusers_flux2_with_flux_hpcs_forward() {
    // Any declared model: FLUX.2's fused `to_qkv` adapters become diffusers' to_q/to_k/to_v ones.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/flux2");
    let config = "tests/fixtures/data/flux2/config.toml";
    let dir = temp_dir("lora-flux2");
    let (base, run, out) = (
        dir.join("base"),
        dir.join("lora"),
        dir.join("out.safetensors"),
    );
    let weights = fixture.join("diffusers.safetensors");
    let (weights, base_str) = (weights.to_str().unwrap(), base.to_str().unwrap());
    ok(&flux_hpc(&[
        "convert",
        "--from",
        "diffusers",
        "--to",
        "native",
        weights,
        base_str,
        "--config",
        config,
    ]));
    let base_arg = format!("lora.base=\"{}\"", base.display());
    let extra = [
        "training.total_steps=3",
        "training.global_batch_size=2",
        "training.micro_batch_size=2",
        "training.latent_height=4",
        "training.latent_width=4",
        "training.text_len=4",
        "optimization.learning_rate=0.01",
    ];
    ok(&train_config(
        config,
        None,
        &run,
        &lora_args(&base_arg, &extra),
    ));
    let (export, io) = (dir.join("diffusers"), fixture.join("io.safetensors"));
    common::convert_to_diffusers(&base, &export);
    let lora = run.join("final_lora.safetensors");
    let keys: Vec<String> = Tensor::read_safetensors(&lora)
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(keys
        .iter()
        .any(|k| k == "transformer.transformer_blocks.0.attn.add_k_proj.lora_B.weight"));
    ok(&python(
        "diffusers_flux2_forward.py",
        &[
            export.as_os_str(),
            io.as_os_str(),
            lora.as_os_str(),
            out.as_os_str(),
        ],
    ));
    let theirs: HashMap<String, Tensor> = Tensor::read_safetensors(&out)
        .unwrap()
        .into_iter()
        .collect();

    let saved = checkpoint::load(&run.join("step_000000003")).unwrap();
    let (_, model, _adapters) = model_with_adapters(&saved, &base);
    let inputs: HashMap<String, Tensor> =
        Tensor::read_safetensors(&io).unwrap().into_iter().collect();
    let batch = DiffusionBatch {
        latents: inputs["img"].shallow_clone(),
        timesteps: inputs["timesteps"].shallow_clone(),
        text: Some(inputs["txt"].shallow_clone()),
        pooled: None,
        guidance: Some(inputs["guidance"].shallow_clone()),
    };
    let ours = tch::no_grad(|| model.forward(&batch, false)).unwrap();
    assert_same_adapted_output("FLUX.2", &ours, &theirs);
    std::fs::remove_dir_all(dir).unwrap();
}
