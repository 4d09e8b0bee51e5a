//! `flux-hpc convert` end to end: a trained native checkpoint exported to diffusers runs in the
//! diffusers `FluxTransformer2DModel` with flux-hpc's forward (1e-4, f32), BFL round trips are
//! exact, a converted checkpoint starts training, and a mismatched config writes nothing.

mod common;

use std::collections::HashMap;

use common::{flux_hpc, ok, python, records, temp_dir, train};
use flux_data::checkpoint;
use flux_data::convert::SafetensorsReader;
use flux_model::{DiffusionBatch, DiffusionModel, Flux, FluxConfig};
use flux_train::RunConfig;
use tch::{Device, Tensor};

/// f32 forward of two implementations: only the order of sums differs.
const TOLERANCE: f64 = 1e-4;

/// flux_tiny with diffusers' fixed 256-channel timestep embedding, trained for 3 steps.
fn trained(name: &str) -> std::path::PathBuf {
    let dir = temp_dir(name);
    ok(&train(
        None,
        &dir.join("run"),
        &["model.model_channels=256", "training.total_steps=3"],
    ));
    dir
}

fn model_from(ckpt: &std::path::Path) -> Flux {
    let loaded = checkpoint::load(ckpt).unwrap();
    let run = RunConfig::parse(&loaded.config, "checkpoint", &[]).unwrap();
    let config = run.model.get::<FluxConfig>().expect("a FLUX.1 run");
    let mut model = Flux::new(config, Device::Cpu).unwrap();
    model.store.load_logical(&loaded.tensors["params"]).unwrap();
    model
}

#[test]
fn native_weights_exported_to_diffusers_give_the_same_forward_in_diffusers() {
    let dir = trained("to-diffusers");
    let (run, export) = (dir.join("run"), dir.join("diffusers"));
    common::convert_to_diffusers(&run, &export);
    let io_path = dir.join("io.safetensors");
    ok(&python(
        "diffusers_forward.py",
        &[export.as_os_str(), io_path.as_os_str()],
    ));

    let model = model_from(&run.join("step_000000003"));
    let io: HashMap<String, Tensor> = Tensor::read_safetensors(&io_path)
        .unwrap()
        .into_iter()
        .collect();
    // The fixture's positions are FLUX.1's: image tokens (0, row, column), text tokens 0, as
    // the model derives them.
    let input = DiffusionBatch {
        latents: io["img"].shallow_clone(),
        text: Some(io["txt"].shallow_clone()),
        pooled: Some(io["y"].shallow_clone()),
        timesteps: io["timesteps"].shallow_clone(),
        guidance: io.get("guidance").map(Tensor::shallow_clone),
    };
    let out = tch::no_grad(|| model.forward(&input, false)).unwrap();
    let err = (&out - &io["out"]).abs().max().double_value(&[]);
    assert!(err <= TOLERANCE, "max abs error {err:e} > {TOLERANCE:e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bfl_round_trip_is_exact_and_a_converted_checkpoint_starts_training() {
    let dir = trained("bfl-round-trip");
    let (run, bfl, back) = (
        dir.join("run"),
        dir.join("flux.safetensors"),
        dir.join("back"),
    );
    let config = dir.join("run/config.toml");
    for (from, to, input, output) in [
        ("native", "bfl", &run, &bfl),
        ("bfl", "native", &bfl, &back),
    ] {
        let mut args = vec!["convert", "--from", from, "--to", to];
        args.extend([input.to_str().unwrap(), output.to_str().unwrap()]);
        args.extend(["--dtype", "f32", "--config", config.to_str().unwrap()]);
        ok(&flux_hpc(&args));
    }
    let (a, b) = (
        checkpoint::load(&run.join("step_000000003")).unwrap(),
        checkpoint::load(&back.join("step_000000000")).unwrap(),
    );
    assert!(!b.tensors.contains_key("exp_avg"), "weights only");
    assert_eq!(a.tensors["params"].len(), b.tensors["params"].len());
    for (name, t) in &a.tensors["params"] {
        assert!(t.equal(&b.tensors["params"][name]), "{name} changed");
    }

    // Training in the converted run directory starts from the converted weights: its held-out
    // loss before the first step is the trained run's final one.
    ok(&train(
        None,
        &back,
        &["model.model_channels=256", "training.total_steps=1"],
    ));
    let (trained, resumed) = (records(&run), records(&back));
    let last = trained.last().unwrap()["eval_loss"].as_f64().unwrap();
    let first = resumed[0]["eval_loss"].as_f64().unwrap();
    assert!(
        (last - first).abs() <= 1e-6 * last.abs(),
        "{last} vs {first}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn weights_that_do_not_fit_the_config_are_refused_before_writing() {
    let dir = trained("misfit");
    let bfl = dir.join("flux.safetensors");
    ok(&flux_hpc(&[
        "convert",
        "--from",
        "native",
        "--to",
        "bfl",
        dir.join("run").to_str().unwrap(),
        bfl.to_str().unwrap(),
    ]));
    let out_dir = dir.join("out");
    let out = flux_hpc(&[
        "convert",
        "--from",
        "bfl",
        "--to",
        "native",
        bfl.to_str().unwrap(),
        out_dir.to_str().unwrap(),
        "--config",
        "configs/flux_tiny.toml",
        "--set",
        "model.model_channels=256",
        "--set",
        "model.guidance_embed=false",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tensor(s) are not used by this config (e.g. `guidance_in."),
        "{stderr}"
    );
    assert!(!out_dir.exists(), "nothing written");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn float8_weight_files_read_as_torch_reads_them_and_hostile_scales_are_refused() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/fp8");
    // Every byte of both float8 formats decodes to torch's value (NaNs where torch has them).
    let bytes = SafetensorsReader::open(&fixtures.join("bytes.safetensors")).unwrap();
    for format in ["e4m3", "e5m2"] {
        let (ours, torch) = (
            bytes.read_f32(format).unwrap(),
            bytes.read_f32(&format!("{format}_values")).unwrap(),
        );
        for (i, (a, b)) in ours.iter().zip(&torch).enumerate() {
            assert!(
                a == b || (a.is_nan() && b.is_nan()),
                "{format} byte {i}: {a} vs {b}"
            );
        }
    }

    // A plain e4m3 export of a BFL file and a ComfyUI scaled-fp8 file convert to native weights
    // whose BFL export equals torch's dequantization exactly (f32: the same products).
    let dir = temp_dir("fp8-files");
    let config = "tests/fixtures/data/flux_guidance_on/config.toml";
    for name in ["bfl_e4m3", "comfy_scaled"] {
        let (native, back) = (dir.join(name), dir.join(format!("{name}.bfl.safetensors")));
        let file = fixtures.join(format!("{name}.safetensors"));
        for (from, to, input, output) in [
            ("bfl", "native", file.as_path(), native.as_path()),
            ("native", "bfl", native.as_path(), back.as_path()),
        ] {
            let mut args = vec!["convert", "--from", from, "--to", to];
            args.extend([input.to_str().unwrap(), output.to_str().unwrap()]);
            args.extend(["--dtype", "f32", "--config", config]);
            ok(&flux_hpc(&args));
        }
        let read = |p: &std::path::Path| -> HashMap<String, Tensor> {
            Tensor::read_safetensors(p).unwrap().into_iter().collect()
        };
        let (ours, torch) = (
            read(&back),
            read(&fixtures.join(format!("{name}.reference.safetensors"))),
        );
        assert_eq!(
            ours.len(),
            torch.len(),
            "{name}: scales and marker are not weights"
        );
        for (key, t) in &torch {
            let t = t.to_kind(tch::Kind::Float);
            assert!(ours[key].equal(&t), "{name}: `{key}` differs from torch's");
        }
    }

    // A scale of 0, NaN or the wrong shape is refused, naming it.
    for (name, says) in [
        ("bad_zero", "holds 0"),
        ("bad_nan", "holds NaN"),
        ("bad_shape", "has shape [2, 2]"),
    ] {
        let file = fixtures.join(format!("{name}.safetensors"));
        let out = flux_hpc(&[
            "convert",
            "--from",
            "bfl",
            "--to",
            "native",
            file.to_str().unwrap(),
            dir.join(name).to_str().unwrap(),
            "--config",
            config,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} was accepted");
        assert!(
            stderr.contains("`proj.scale_weight`") && stderr.contains(says),
            "{name}: {stderr}"
        );
        assert!(!dir.join(name).exists(), "{name}: nothing is written");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
