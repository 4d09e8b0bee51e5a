//! Ingest from local files: WebDataset tar shards (one latent shard per tar) and directories of
//! per-sample `.npy` / `.safetensors` files (grouped into shards of a fixed size).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::dataset::{sample_ids, ShardLayout};
use crate::error::{io, DataError};
use crate::files;
use crate::ingest::record::split_key;
use crate::ingest::shard::{ShardBuilder, ShardSummary};
use crate::ingest::sources::{Source, Sources, Standing};
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
        // The header's size is untrusted: reserve at most 64 MiB up front.
        let mut bytes = Vec::with_capacity(entry.size().min(64 << 20) as usize);
        entry
            .read_to_end(&mut bytes)
            .map_err(|e| fail(format!("`{name}`: {e}")))?;
        builder.add(&name, &bytes)?;
    }
    builder.finish()
}

/// The output shard of input `name` in `out_dir`: `name` without its `.tar` extension, with
/// `/` turned into `_` (manifest names may hold directories), plus `.h5`.
pub fn shard_path(out_dir: &Path, name: &str) -> PathBuf {
    let stem = name.strip_suffix(".tar").unwrap_or(name);
    out_dir.join(format!(
        "{}.h5",
        stem.trim_start_matches('/').replace('/', "_")
    ))
}

/// The output shard of each input in `out_dir`; `inputs` are `(how the input is named, the name
/// its shard is derived from)`. Refuses an input listed twice, and two inputs that would be
/// written to the same shard (one of them would be silently dropped, or taken as "already
/// present"), naming both.
pub fn plan_shards(out_dir: &Path, inputs: &[(String, String)]) -> Result<Vec<PathBuf>, DataError> {
    let mut seen: HashMap<PathBuf, &str> = HashMap::new();
    inputs
        .iter()
        .map(|(shown, name)| {
            let out = shard_path(out_dir, name);
            let message = match seen.insert(out.clone(), shown) {
                None => return Ok(out),
                Some(first) if first == shown => "is listed twice".to_string(),
                Some(first) => format!(
                    "would be written to {}, as `{first}` is; rename one of them or ingest them \
                     into separate --out directories",
                    out.display()
                ),
            };
            Err(DataError::Format {
                path: shown.clone(),
                message,
            })
        })
        .collect()
}

/// Convert the tar files `tars` into `out_dir`, one shard each. A rerun writes exactly what is
/// missing, decided by content ([`Sources`]): a tar whose bytes are recorded is done, wherever it
/// lies now; a tar whose shard name is taken by another input, or that changed since it was
/// written, is refused by name.
pub fn ingest_tars(
    tars: &[PathBuf],
    out_dir: &Path,
    options: &IngestOptions,
    progress: &dyn Progress,
) -> Result<IngestSummary, DataError> {
    // Shards are named after the tar's file name, so the same run resumes from any directory.
    let inputs: Vec<(String, String)> = tars
        .iter()
        .map(|t| {
            let name = t.file_name().unwrap_or_default().to_string_lossy();
            (t.display().to_string(), name.into_owned())
        })
        .collect();
    let planned = plan_shards(out_dir, &inputs)?;
    for tar in tars {
        files::require_regular(tar)?;
    }
    fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    let mut sources = Sources::open(out_dir, sample_ids)?;
    let mut summary = IngestSummary::default();
    progress.start(tars.len() as u64);
    for (tar, out) in tars.iter().zip(planned) {
        let name = tar.display().to_string();
        let key = fs::canonicalize(tar).map_err(io(tar))?;
        let source = Source::of_files(&key.display().to_string(), std::slice::from_ref(tar))?;
        let shard = out.file_name().expect("a shard file").to_string_lossy();
        match sources.standing(&source, &name)? {
            Standing::Done(_) => summary.skipped += 1,
            Standing::New => {
                if let Some(held) = sources.of_shard(&shard) {
                    let held: Vec<&str> = held.iter().map(|s| s.key.as_str()).take(3).collect();
                    return Err(DataError::Format {
                        path: name,
                        message: format!(
                            "would be written to {}, which already holds {}: rename the tar or \
                             ingest it into another --out",
                            out.display(),
                            held.join(", ")
                        ),
                    });
                }
                sources.record(&shard, vec![source])?;
                let file = files::open_regular(tar)?;
                let reader = std::io::BufReader::new(file);
                summary.add(convert_tar(
                    reader,
                    &name,
                    &out,
                    options,
                    summary.layout.as_ref(),
                )?);
            }
        }
        progress.advance(&name);
    }
    progress.finish();
    Ok(summary)
}

/// Convert a directory of per-sample files (`{key}.{field}.npy`, `{key}.safetensors`, …) into
/// shards `shard_000000.h5`, … of `options.samples_per_shard` keys each (keys in name order). A
/// rerun, or another directory into the same `out_dir`, writes exactly the samples not yet there,
/// decided by content ([`Sources`]) into new shards; a key already written with other bytes is
/// refused by name (sample keys are the shards' ids, unique in a directory).
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
    let mut sources = Sources::open(out_dir, sample_ids)?;
    let mut summary = IngestSummary::default();
    let mut missing = Vec::new();
    for (key, mut paths) in by_key {
        paths.sort();
        let source = Source::of_files(&key, &paths)?;
        let shown = dir.join(&key).display().to_string();
        match sources.standing(&source, &shown)? {
            Standing::Done(_) => summary.skipped += 1,
            Standing::New => missing.push((source, paths)),
        }
    }
    let per_shard = options.samples_per_shard.max(1);
    let first = sources.next_index(DIR_SHARD_PREFIX);
    progress.start(missing.len().div_ceil(per_shard) as u64);
    for (i, chunk) in missing.chunks(per_shard).enumerate() {
        let shard = format!("{DIR_SHARD_PREFIX}{:06}.h5", first + i);
        let out = out_dir.join(&shard);
        let source = dir.display().to_string();
        let mut builder = ShardBuilder::new(
            &out,
            &source,
            &options.layout,
            options.deflate,
            summary.layout.as_ref(),
        );
        for (_, paths) in chunk {
            for path in paths {
                files::require_regular(path)?;
                let bytes = fs::read(path).map_err(io(path))?;
                let name = path.file_name().expect("a listed file").to_string_lossy();
                builder.add(&name, &bytes)?;
            }
        }
        sources.record(&shard, chunk.iter().map(|(s, _)| s.clone()).collect())?;
        summary.add(builder.finish()?);
        progress.advance(&out.display().to_string());
    }
    progress.finish();
    Ok(summary)
}

/// The name shards of a directory ingest start with.
const DIR_SHARD_PREFIX: &str = "shard_";

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(inputs: &[(&str, &str)]) -> Result<Vec<PathBuf>, String> {
        let inputs: Vec<(String, String)> = inputs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        plan_shards(Path::new("out"), &inputs).map_err(|e| e.to_string())
    }

    #[test]
    fn shards_are_named_after_the_whole_input_name() {
        assert_eq!(
            shard_path(Path::new("o"), "part_00001.tar"),
            Path::new("o/part_00001.h5")
        );
        assert_eq!(
            shard_path(Path::new("o"), "a/part.000.tar"),
            Path::new("o/a_part.000.h5")
        );
        let ok = plan(&[("a/part.tar", "a/part.tar"), ("b/part.tar", "b/part.tar")]).unwrap();
        assert_eq!(ok, [Path::new("out/a_part.h5"), Path::new("out/b_part.h5")]);
    }

    #[test]
    fn inputs_that_share_a_shard_are_refused_naming_both() {
        let err = plan(&[("x/part.tar", "part.tar"), ("y/part.tar", "part.tar")]).unwrap_err();
        assert!(
            err.contains("y/part.tar")
                && err.contains("`x/part.tar`")
                && err.contains("out/part.h5"),
            "{err}"
        );
        let err = plan(&[("a.tar", "a.tar"), ("a.tar", "a.tar")]).unwrap_err();
        assert!(err.contains("a.tar: is listed twice"), "{err}");
    }
}
