//! Ingest from local files: WebDataset tar shards (one latent shard per tar) and directories of
//! per-sample `.npy` / `.safetensors` files (grouped into shards of a fixed size).

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::dataset::ShardLayout;
use crate::error::{io, DataError};
use crate::ingest::record::split_key;
use crate::ingest::shard::{ShardBuilder, ShardSummary};
use crate::ingest::{IngestOptions, IngestSummary, Progress};

/// Convert the tar archive read from `reader` (named `source` in errors) into the latent shard
/// `out`, streaming entry by entry.
pub fn convert_tar(
    reader: impl Read,
    source: &str,
    out: &Path,
    options: &IngestOptions,
    expected: Option<&ShardLayout>,
) -> Result<ShardSummary, DataError> {
    let fail = |message: String| DataError::Format {
        path: source.to_string(),
        message,
    };
    let mut builder = ShardBuilder::new(out, source, &options.layout, options.deflate, expected);
    let mut archive = tar::Archive::new(reader);
    let entries = archive
        .entries()
        .map_err(|e| fail(format!("not a tar archive: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| fail(format!("tar entry: {e}")))?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let name = entry
            .path()
            .map_err(|e| fail(format!("tar entry name: {e}")))?
            .to_string_lossy()
            .into_owned();
        let mut bytes = Vec::with_capacity(entry.size() as usize);
        entry
            .read_to_end(&mut bytes)
            .map_err(|e| fail(format!("`{name}`: {e}")))?;
        builder.add(&name, &bytes)?;
    }
    builder.finish()
}

/// The output shard of input `name` (its stem plus `.h5`) in `out_dir`.
pub fn shard_path(out_dir: &Path, name: &str) -> PathBuf {
    let base = name.rsplit('/').next().unwrap_or(name);
    let stem = base.split('.').next().unwrap_or(base);
    out_dir.join(format!("{stem}.h5"))
}

/// Convert the tar files `tars` into `out_dir`, one shard each, skipping shards that exist.
pub fn ingest_tars(
    tars: &[PathBuf],
    out_dir: &Path,
    options: &IngestOptions,
    progress: &dyn Progress,
) -> Result<IngestSummary, DataError> {
    fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    let mut summary = IngestSummary::default();
    progress.start(tars.len() as u64);
    for tar in tars {
        let name = tar.display().to_string();
        let out = shard_path(out_dir, &name);
        if out.exists() {
            summary.skipped += 1;
        } else {
            let file = fs::File::open(tar).map_err(io(tar))?;
            let reader = std::io::BufReader::new(file);
            summary.add(convert_tar(
                reader,
                &name,
                &out,
                options,
                summary.layout.as_ref(),
            )?);
        }
        progress.advance(&name);
    }
    progress.finish();
    Ok(summary)
}

/// Convert a directory of per-sample files (`{key}.{field}.npy`, `{key}.safetensors`, …) into
/// shards `shard_000000.h5`, … of `options.samples_per_shard` keys each (keys in name order),
/// skipping shards that exist.
pub fn ingest_dir(
    dir: &Path,
    out_dir: &Path,
    options: &IngestOptions,
    progress: &dyn Progress,
) -> Result<IngestSummary, DataError> {
    fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    let mut by_key: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some((key, _)) = name.as_deref().and_then(split_key) {
            by_key
                .entry(key.to_string())
                .or_default()
                .push(path.clone());
        }
    }
    let keys: Vec<_> = by_key.into_values().collect();
    let per_shard = options.samples_per_shard.max(1);
    let mut summary = IngestSummary::default();
    progress.start(keys.len().div_ceil(per_shard) as u64);
    for (i, chunk) in keys.chunks(per_shard).enumerate() {
        let out = out_dir.join(format!("shard_{i:06}.h5"));
        if out.exists() {
            summary.skipped += 1;
        } else {
            let source = dir.display().to_string();
            let mut builder = ShardBuilder::new(
                &out,
                &source,
                &options.layout,
                options.deflate,
                summary.layout.as_ref(),
            );
            for mut paths in chunk.iter().cloned() {
                paths.sort();
                for path in paths {
                    let bytes = fs::read(&path).map_err(io(&path))?;
                    let name = path.file_name().expect("a listed file").to_string_lossy();
                    builder.add(&name, &bytes)?;
                }
            }
            let written = builder.finish()?;
            summary.add(written);
        }
        progress.advance(&out.display().to_string());
    }
    progress.finish();
    Ok(summary)
}
