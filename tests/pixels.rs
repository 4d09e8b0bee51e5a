//! From pixels and prompts to pixels, end to end: tiny random CLIP, T5 and VAE
//! (tests/fixtures/make_text_fixtures.py, make_vae_fixtures.py) in a FLUX.1-layout folder;
//! `flux-hpc data encode --config` turns a folder of captioned images of three sizes and formats
//! (make_images.py: PNG, JPEG in a sub-folder, WebP, CMYK JPEG, 16-bit PNG) into shards of the
//! config's `[data] buckets` (a bucket listed twice is refused),
//! skipping and listing a broken, a truncated and a 1×1 image, and resumes (still listing them);
//! a tiny Flux (its text and pooled widths the encoders', its 64 input channels FLUX.1's
//! 2×2-packed 16) trains on the shards under mpirun, dropped captions (`cfg_dropout_prob`) taking the stored empty caption's encodings,
//! which must fit the shards; `flux-hpc sample --prompt` gives PNGs of the VAE's size that are
//! not flat and differ by prompt, and of another `--width` × `--height` with a
//! `--negative-prompt` (a size the VAE and packing do not divide is refused); text encoders whose
//! widths do not fit the model are refused naming both fields. The training run draws
//! `[sampling]` grids and writes TensorBoard event files across a stop and resume, read back
//! with TensorBoard's own reader (tests/fixtures/read_tensorboard.py).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{flux_hpc, ok, python, temp_dir, train};

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

/// `flux-hpc data encode` of `images` with the encoders of `folder` into `out` on the CPU, with
/// flux_tiny's text length, `buckets` (a `--set`), a minimum side of 16 px and `extra` arguments.
fn encode_images(
    images: &Path,
    folder: &Path,
    out: &Path,
    buckets: &str,
    extra: &[&str],
) -> std::process::Output {
    let mut args = vec!["data", "encode", "--images", images.to_str().unwrap()];
    args.extend([
        "--encoders",
        folder.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    args.extend(["--config", common::FLUX_TINY, "--set", buckets]);
    args.extend(["--min-side", "16", "--device", "cpu"]);
    args.extend(extra);
    flux_hpc(&args)
}

/// The RGB pixels of a PNG and its size.
fn pixels(path: &Path) -> (Vec<u8>, (u32, u32)) {
    let image = image::open(path).unwrap().to_rgb8();
    let size = image.dimensions();
    (image.into_raw(), size)
}

/// The aspect buckets the images are encoded into (the config's `[training] text_len` is 8).
const BUCKETS: &str = "data.buckets=[\"32x32\", \"48x32\", \"32x48\"]";

/// The model shape that fits the tiny encoders.
const SHAPE: [&str; 2] = ["model.in_channels=64", "model.vec_in_dim=32"];

/// `flux-hpc sample` of flux_tiny in the shape of [`SHAPE`] on the CPU, with the encoders of
/// `folder`, the weights of `run` and `extra` arguments.
fn sample(folder: &Path, run: &Path, extra: &[&str]) -> std::process::Output {
    let dir_arg = format!("checkpoint.dir=\"{}\"", run.display());
    let mut args = vec!["sample", common::FLUX_TINY, "--device", "cpu"];
    args.extend(["--encoders", folder.to_str().unwrap(), "--set", &dir_arg]);
    args.extend(SHAPE.iter().flat_map(|s| ["--set", *s]));
    args.extend(extra);
    flux_hpc(&args)
}

/// The run's sample grids (steps 2, 3 at the stop, 4 at the end: 2 prompts × 2 seeds of
/// 64×64 with 2-pixel gaps) are not flat and differ by prompt; TensorBoard's reader finds one
/// loss per step equal to metrics.jsonl's, the held-out losses, and the grids.
fn check_grids_and_tensorboard(run: &Path) {
    for step in [2, 3, 4] {
        let (grid, size) = pixels(&run.join(format!("samples/step_{step:09}.png")));
        assert_eq!(size, (130, 130), "step {step}");
        let cell = |row: usize, col: usize| -> Vec<u8> {
            let (x0, y0) = (col * 66, row * 66);
            (y0..y0 + 64)
                .flat_map(|y| grid[(y * 130 + x0) * 3..(y * 130 + x0 + 64) * 3].to_vec())
                .collect()
        };
        let spread = |p: &[u8]| p.iter().max().unwrap() - p.iter().min().unwrap();
        assert!(spread(&cell(0, 0)) > 32, "a flat cell at step {step}");
        assert_ne!(cell(0, 0), cell(1, 0), "two prompts gave the same image");
        assert_ne!(cell(0, 0), cell(0, 1), "two seeds gave the same image");
    }
    let out = python("read_tensorboard.py", &[run.as_os_str()]);
    ok(&out);
    let board: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let series = |tag: &str| -> Vec<(u64, f64)> {
        board["scalars"][tag]
            .as_array()
            .unwrap_or_else(|| panic!("no {tag}: {board}"))
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect()
    };
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let losses: Vec<(u64, f64)> = metrics
        .iter()
        .filter_map(|r| Some((r["step"].as_u64()?, r["loss"].as_f64()?)))
        .collect();
    let logged = series("train/loss");
    assert_eq!(logged.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
    for ((step, ours), (_, theirs)) in logged.iter().zip(&losses) {
        // TensorBoard stores f32.
        assert!((ours - theirs).abs() <= 1e-6 * theirs.abs(), "step {step}");
    }
    let evals: Vec<u64> = series("eval/loss").iter().map(|p| p.0).collect();
    assert_eq!((evals.first(), evals.last()), (Some(&0), Some(&4)));
    for tag in ["train/lr", "train/grad_norm", "perf/tokens_per_s"] {
        assert_eq!(series(tag).len(), 4, "{tag}");
    }
    let images = board["images"]["samples"].as_array().unwrap();
    let expected = serde_json::json!([
        [2, 130, 130, true],
        [3, 130, 130, true],
        [4, 130, 130, true]
    ]);
    assert_eq!(images, expected.as_array().unwrap());
}

#[test]
fn captioned_images_encode_train_and_sample_back_to_pngs() {
    let dir = temp_dir("pixels");
    let folder = flux_folder(&dir);
    let (images, shards, run) = (dir.join("images"), dir.join("shards"), dir.join("run"));
    ok(&python("make_images.py", &[images.as_os_str()]));
    // `data encode` of the images into `out`, the buckets set by `buckets` (a `--set`).
    let encode_into = |out: &Path, buckets: &str| {
        let extra = ["--batch", "3", "--samples-per-shard", "4"];
        encode_images(&images, &folder, out, buckets, &extra)
    };
    let encode = || {
        let out = encode_into(&shards, BUCKETS);
        ok(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = encode();
    for line in [
        "bucket 32x32        8 image(s)",
        "bucket 48x32        4 image(s)",
        "bucket 32x48        1 image(s)",
        "wrote 4 shard(s) with 12 samples",
    ] {
        assert!(first.contains(line), "{line}: {first}");
    }
    let failed = std::fs::read_to_string(shards.join("failed_files.json")).unwrap();
    assert!(
        failed.contains("broken.png") && failed.contains("unreadable image"),
        "{failed}"
    );
    assert!(
        failed.contains("tiny.png") && failed.contains("1×1 is smaller"),
        "{failed}"
    );
    assert!(
        failed.contains("truncated.png") && failed.contains("unreadable image"),
        "{failed}"
    );
    assert!(
        encode().contains("wrote 0 shard(s) with 0 samples"),
        "a rerun resumes"
    );
    let again = std::fs::read_to_string(shards.join("failed_files.json")).unwrap();
    assert!(
        again.contains("truncated.png") && again.contains("tiny.png"),
        "a rerun keeps what a skipped shard left out: {again}"
    );
    ok(&flux_hpc(&["data", "validate", shards.to_str().unwrap()]));
    let twice = encode_into(
        &dir.join("twice"),
        "data.buckets=[\"32x32\", \"48x32\", \"32x32\"]",
    );
    assert!(!twice.status.success());
    let stderr = String::from_utf8_lossy(&twice.stderr);
    assert!(
        stderr.contains("data.buckets") && stderr.contains("32x32 is listed twice"),
        "{stderr}"
    );

    let paths = format!("data.paths=[\"{}\"]", shards.display());
    let steps = [
        "data.source=\"hdf5\"",
        &paths,
        "training.global_batch_size=4",
        "training.micro_batch_size=2",
        "training.total_steps=4",
        "training.eval_samples=4",
        "training.cfg_dropout_prob=0.3",
    ];
    // Sample grids every 2 steps and TensorBoard, over a stop at step 3 and a resume.
    let encoders = format!("sampling.encoders=\"{}\"", folder.display());
    let watched = [
        "sampling.interval=2",
        &encoders,
        "sampling.prompts=[\"a red square\", \"a blue sky\"]",
        "sampling.seeds=[0, 1]",
        "sampling.steps=2",
        "logging.tensorboard=true",
        "training.log_interval=1",
    ];
    let args = [&SHAPE[..], &steps, &watched].concat();
    ok(&train(
        Some(2),
        &run,
        &[&args[..], &["--stop-after 3"]].concat(),
    ));
    ok(&train(Some(2), &run, &args));
    check_grids_and_tensorboard(&run);

    let prompts = [
        "--prompt",
        "a photo of a cat",
        "--prompt",
        "🐱 an emoji cat",
    ];
    ok(&sample(
        &folder,
        &run,
        &[&["--steps", "4"], &prompts[..]].concat(),
    ));
    let (a, size_a) = pixels(&run.join("samples_0.png"));
    let (b, size_b) = pixels(&run.join("samples_1.png"));
    // 8×8 model latents = 16×16 VAE latents (2×2 packing) = 64×64 pixels (VAE factor 4).
    assert_eq!((size_a, size_b), ((64, 64), (64, 64)));
    let spread = |p: &[u8]| p.iter().max().unwrap() - p.iter().min().unwrap();
    assert!(spread(&a) > 32 && spread(&b) > 32, "flat images");
    assert_ne!(a, b, "two prompts gave the same image");

    // Another size, with a negative prompt for the unconditional pass of two-pass guidance.
    let out = dir.join("wide.safetensors");
    let mut wide = vec!["--steps", "2", "--prompt", "a wide river"];
    wide.extend(["--negative-prompt", "blurry", "--cfg-scale", "2.0"]);
    wide.extend([
        "--width",
        "96",
        "--height",
        "64",
        "--out",
        out.to_str().unwrap(),
    ]);
    ok(&sample(&folder, &run, &wide));
    assert_eq!(pixels(&dir.join("wide_0.png")).1, (96, 64));
    let bad: Vec<&str> = wide
        .iter()
        .map(|a| if *a == "96" { "100" } else { a })
        .collect();
    let refused = sample(&folder, &run, &bad);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("--width 100 is not a positive multiple of 8 pixels"),
        "{stderr}"
    );

    // The tiny T5 is 32 wide; a model taking 48-wide text states cannot use it.
    let narrow = [
        "--steps",
        "1",
        "--prompt",
        "x",
        "--set",
        "model.context_dim=48",
    ];
    let out = sample(&folder, &run, &narrow);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("states of width 32") && stderr.contains("model.context_dim"),
        "{stderr}"
    );

    // Dropped captions become the stored empty caption's encodings, which must fit the shards.
    let wrong = [(
        "t5".to_string(),
        tch::Tensor::zeros([4, 32], tch::kind::FLOAT_CPU),
    )];
    tch::Tensor::write_safetensors(&wrong, shards.join("empty_prompt.safetensors")).unwrap();
    let out = train(None, &dir.join("refused"), &[&SHAPE[..], &steps].concat());
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("data.paths")
            && stderr.contains(
                "empty_prompt.safetensors: `t5` has shape [4, 32], the shards' is [8, 32]"
            ),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A noise PNG of `w`×`h` seeded by `seed` at `path` (with a `{stem}.txt` caption when given).
fn noise_png(path: &Path, w: u32, h: u32, seed: u8, caption: Option<&[u8]>) {
    let image = image::RgbImage::from_fn(w, h, |x, y| {
        let v = (x * 31 + y * 17 + u32::from(seed) * 101) as u8;
        image::Rgb([v, v.wrapping_mul(3), v ^ seed])
    });
    image.save(path).unwrap();
    if let Some(caption) = caption {
        std::fs::write(path.with_extension("txt"), caption).unwrap();
    }
}

#[test]
fn encode_reads_each_file_once_upright_and_resumes_by_content() {
    let dir = temp_dir("encode-inputs");
    let folder = flux_folder(&dir);
    let (images, shards) = (dir.join("images"), dir.join("shards"));
    std::fs::create_dir_all(images.join("sub")).unwrap();
    for i in 0..3 {
        noise_png(
            &images.join(format!("square{i}.png")),
            32,
            32,
            i,
            Some(b"a square"),
        );
    }
    // A portrait phone photo: stored 96×60, EXIF orientation 6 (upright 60×96).
    ok(&python(
        "make_images.py",
        &[
            images.as_os_str(),
            "--portrait".as_ref(),
            "portrait.jpg".as_ref(),
        ],
    ));
    // A link back up the tree (a loop), and a second path to the same file.
    std::os::unix::fs::symlink(&images, images.join("sub/loop")).unwrap();
    std::os::unix::fs::symlink(images.join("square0.png"), images.join("again.png")).unwrap();
    // Special files and captions that are not text.
    let fifo = images.join("fifo.png");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    noise_png(&images.join("latin1.png"), 32, 32, 7, Some(b"caf\xe9"));
    noise_png(&images.join("dircap.png"), 32, 32, 8, None);
    std::fs::create_dir(images.join("dircap.txt")).unwrap();
    let fifo_caption = images.join("fifocap.txt");
    assert!(Command::new("mkfifo")
        .arg(&fifo_caption)
        .status()
        .unwrap()
        .success());
    noise_png(&images.join("fifocap.png"), 32, 32, 9, None);

    let encode = || {
        encode_images(
            &images,
            &folder,
            &shards,
            BUCKETS,
            &["--samples-per-shard", "2"],
        )
    };
    let out = encode();
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    // square0..2 and the portrait, each once; the portrait in the tall bucket.
    for line in [
        "bucket 32x32        6 image(s)",
        "bucket 32x48        1 image(s)",
        "with 4 samples",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    let failed = std::fs::read_to_string(shards.join("failed_files.json")).unwrap();
    for (file, why) in [
        ("fifo.png", "FIFO"),
        // The first path in order is kept: the link sorts first.
        ("square0.png", "same file as again.png"),
        ("latin1.png", "latin1.txt"),
        ("dircap.png", "a directory"),
        ("fifocap.png", "FIFO"),
    ] {
        assert!(
            failed.contains(file) && failed.contains(why),
            "{file}: {why}: {failed}"
        );
    }
    assert!(!failed.contains("loop"), "{failed}");

    // Inputs that sort before the encoded ones are added, and nothing is encoded twice.
    noise_png(&images.join("aaa.png"), 32, 32, 10, Some(b"a first photo"));
    let out = encode();
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("wrote 1 shard(s) with 1 samples") && stdout.contains("4 input(s) already"),
        "{stdout}"
    );
    let validated = flux_hpc(&["data", "validate", shards.to_str().unwrap()]);
    ok(&validated);
    assert!(
        String::from_utf8_lossy(&validated.stdout).contains("5 samples"),
        "{}",
        String::from_utf8_lossy(&validated.stdout)
    );
    // An image that changed since it was encoded is refused by name.
    noise_png(&images.join("square1.png"), 32, 32, 11, None);
    let out = encode();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("square1.png") && stderr.contains("already written into"),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
