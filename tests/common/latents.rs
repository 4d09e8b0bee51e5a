//! Latent sources for the end-to-end tests: written by tests/fixtures/make_latent_sources.py
//! (NumPy, safetensors) and ingested into HDF5 shards by `flux-hpc data ingest`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

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
