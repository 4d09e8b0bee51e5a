//! Latent sources for the end-to-end tests: written by tests/fixtures/make_latent_sources.py
//! (NumPy, safetensors) and ingested into HDF5 shards by `flux-hpc data ingest`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Output;

use super::{flux_hpc, ok, python, temp_dir};

/// Sources written into a fresh directory `name`; `options` are passed to the script (e.g.
/// `["--nan-sample", "00001_0004"]`).
pub fn sources(name: &str, options: &[&str]) -> PathBuf {
    let dir = temp_dir(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut args: Vec<&OsStr> = vec![dir.as_os_str()];
    args.extend(options.iter().map(OsStr::new));
    ok(&python("make_latent_sources.py", &args));
    dir
}

/// The generated tar shards of `dir`.
pub fn tars(dir: &Path) -> Vec<String> {
    (0..3)
        .map(|s| {
            dir.join(format!("tars/part_{s:05}.tar"))
                .display()
                .to_string()
        })
        .collect()
}

/// `flux-hpc data ingest --tar` of the generated tars into `<dir>/h5`: the directory and stdout.
pub fn ingest_tars(dir: &Path) -> (PathBuf, String) {
    let h5 = dir.join("h5");
    let mut args = vec!["data", "ingest", "--out", h5.to_str().unwrap(), "--tar"];
    let tar_paths = tars(dir);
    args.extend(tar_paths.iter().map(String::as_str));
    let out = flux_hpc(&args);
    ok(&out);
    (h5, String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One sample as per-sample NumPy files in `dir`: `{key}.latents.npy` of shape `latent`, the
/// 8×32 text states and 16-wide pooled vector of flux_tiny, and `{key}.mask.npy` of shape
/// `mask` when given (values seeded random, masks all ones).
pub fn write_npy_sample(dir: &Path, key: &str, latent: &[i64], mask: Option<&[i64]>) {
    std::fs::create_dir_all(dir).unwrap();
    let _guard = tch::no_grad_guard();
    let fields = [
        ("latents", tch::Tensor::randn(latent, tch::kind::FLOAT_CPU)),
        ("t5", tch::Tensor::randn([8, 32], tch::kind::FLOAT_CPU)),
        ("clip", tch::Tensor::randn([16], tch::kind::FLOAT_CPU)),
    ];
    let mask = mask.map(|shape| ("mask", tch::Tensor::ones(shape, tch::kind::FLOAT_CPU)));
    for (field, value) in fields.into_iter().chain(mask) {
        value
            .write_npy(dir.join(format!("{key}.{field}.npy")))
            .unwrap();
    }
}

/// `flux-hpc data ingest --dir files --out out --samples-per-shard per_shard` with `extra`
/// arguments.
pub fn ingest_dir(files: &Path, out: &Path, per_shard: &str, extra: &[&str]) -> Output {
    let mut args = vec!["data", "ingest", "--dir", files.to_str().unwrap()];
    args.extend([
        "--out",
        out.to_str().unwrap(),
        "--samples-per-shard",
        per_shard,
    ]);
    args.extend(extra);
    flux_hpc(&args)
}
