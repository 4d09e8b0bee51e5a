//! From prompts to pixels: a tiny Flux trained here (its text and pooled widths those of the tiny
//! random CLIP and T5 of tests/fixtures/make_text_fixtures.py, its 64 input channels FLUX.1's
//! 2×2-packed 16 latent channels) samples from two prompts through a FLUX.1-layout folder
//! (CLIP's vocab.json + merges.txt tokenizer, T5's tokenizer.json, both encoders, the tiny
//! random VAE of make_vae_fixtures.py) into PNGs of the VAE's size that are not flat and differ
//! by prompt; text encoders whose widths do not fit the model are refused naming both fields.

mod common;

use std::path::{Path, PathBuf};

use common::{flux_hpc, ok, temp_dir, train};

/// A diffusers FLUX.1 folder of the tiny fixtures, linked into `dir`.
fn flux_folder(dir: &Path) -> PathBuf {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data");
    let folder = dir.join("flux");
    std::fs::create_dir_all(&folder).unwrap();
    for (name, source) in [
        ("tokenizer", "text/clip_files"),
        ("tokenizer_2", "text/t5"),
        ("text_encoder", "text/text_encoder"),
        ("text_encoder_2", "text/text_encoder_2"),
        ("vae", "vae/vae"),
    ] {
        std::os::unix::fs::symlink(fixtures.join(source), folder.join(name)).unwrap();
    }
    folder
}

/// The RGB pixels of a PNG and its size.
fn pixels(path: &Path) -> (Vec<u8>, (u32, u32)) {
    let image = image::open(path).unwrap().to_rgb8();
    let size = image.dimensions();
    (image.into_raw(), size)
}

#[test]
fn prompts_sample_to_pngs_through_a_flux1_folder() {
    let dir = temp_dir("prompts");
    let folder = flux_folder(&dir);
    let run = dir.join("run");
    let shape = ["model.in_channels=64", "model.vec_in_dim=32"];
    ok(&train(
        None,
        &run,
        &[&shape[..], &["training.total_steps=2"]].concat(),
    ));
    let dir_arg = format!("checkpoint.dir=\"{}\"", run.display());
    let mut args = vec![
        "sample",
        common::FLUX_TINY,
        "--device",
        "cpu",
        "--steps",
        "4",
    ];
    args.extend(["--encoders", folder.to_str().unwrap()]);
    args.extend([
        "--prompt",
        "a photo of a cat",
        "--prompt",
        "🐱 an emoji cat",
    ]);
    args.extend(["--set", &dir_arg]);
    let with_shape: Vec<&str> = shape.iter().flat_map(|s| ["--set", *s]).collect();
    args.extend(&with_shape);
    ok(&flux_hpc(&args));
    let (a, size_a) = pixels(&run.join("samples_0.png"));
    let (b, size_b) = pixels(&run.join("samples_1.png"));
    // 8×8 model latents = 16×16 VAE latents (2×2 packing) = 64×64 pixels (VAE factor 4).
    assert_eq!((size_a, size_b), ((64, 64), (64, 64)));
    let spread = |p: &[u8]| p.iter().max().unwrap() - p.iter().min().unwrap();
    assert!(spread(&a) > 32 && spread(&b) > 32, "flat images");
    assert_ne!(a, b, "two prompts gave the same image");

    // The tiny T5 is 32 wide; a model taking 48-wide text states cannot use it.
    let mut args = vec![
        "sample",
        common::FLUX_TINY,
        "--device",
        "cpu",
        "--steps",
        "1",
    ];
    args.extend(["--encoders", folder.to_str().unwrap(), "--prompt", "x"]);
    args.extend(["--set", &dir_arg, "--set", "model.context_dim=48"]);
    args.extend(&with_shape);
    let out = flux_hpc(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("states of width 32") && stderr.contains("model.context_dim"),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
