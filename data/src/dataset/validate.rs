//! `flux-hpc data validate`: every shard's structure, every dataset's CRC-32 and finite values,
//! and no sample id in two shards.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::dataset::checksum::check_crc;
use crate::dataset::layout::{ShardLayout, IDS};
use crate::dataset::reader::{no_shards, shard_files};
use crate::error::DataError;
use crate::h5attr::h5err;

/// What validation found.
#[derive(Debug, Default)]
pub struct ValidationReport {
    /// Shards that passed, with their sample counts.
    pub good: Vec<(PathBuf, u64)>,
    /// Every problem found, each naming its file (and dataset).
    pub problems: Vec<DataError>,
}

impl ValidationReport {
    /// Samples in the shards that passed.
    pub fn samples(&self) -> u64 {
        self.good.iter().map(|g| g.1).sum()
    }
}

/// The sample ids of shard `path`, in row order.
pub fn sample_ids(path: &Path) -> Result<Vec<String>, DataError> {
    crate::files::require_regular(path)?;
    let file = hdf5::File::open(path).map_err(h5err(path, "open"))?;
    let ds = file.dataset(IDS).map_err(h5err(path, IDS))?;
    let ids = ds
        .read_1d::<hdf5::types::VarLenUnicode>()
        .map_err(h5err(path, IDS))?;
    Ok(ids.iter().map(|t| t.as_str().to_string()).collect())
}

/// Check one shard fully: layout, shapes and every CRC. Returns its layout and sample count.
pub fn validate_shard(path: &Path) -> Result<(ShardLayout, u64), DataError> {
    let dataset = crate::dataset::reader::LatentDataset::open(&[path.to_path_buf()])?;
    let layout = dataset.layout().clone();
    let file = hdf5::File::open(path).map_err(h5err(path, "open"))?;
    for (name, _) in layout.numeric() {
        let ds = file.dataset(name).map_err(h5err(path, name))?;
        check_crc(path, name, &ds, Some(layout.dtype))?;
    }
    for name in layout.strings() {
        let ds = file.dataset(name).map_err(h5err(path, name))?;
        check_crc(path, name, &ds, None)?;
    }
    Ok((layout, dataset.len()))
}

/// Validate every shard named by `paths` (files or directories): each one fully, and all against
/// the first good shard's layout (latent sizes may differ: they are resolution buckets). Problems
/// are collected, not fatal.
pub fn validate(paths: &[PathBuf]) -> Result<ValidationReport, DataError> {
    let mut report = ValidationReport::default();
    let mut reference: Option<(PathBuf, ShardLayout)> = None;
    let files = shard_files(paths)?;
    if files.is_empty() {
        return Err(no_shards(paths));
    }
    // Sample id → the first shard holding it.
    let mut holders: HashMap<String, PathBuf> = HashMap::new();
    for path in files {
        let checked = validate_shard(&path).and_then(|found| {
            let ids = sample_ids(&path)?;
            let twice: Vec<String> = ids
                .into_iter()
                .filter_map(|id| match holders.get(&id) {
                    Some(first) => Some(format!("`{id}` (also in {})", first.display())),
                    None => {
                        holders.insert(id, path.clone());
                        None
                    }
                })
                .collect();
            match twice.first() {
                None => Ok(found),
                Some(first) => Err(DataError::format(
                    &path,
                    format!(
                        "holds {} sample id(s) another shard holds too, first {first}: the same \
                         samples would train twice per epoch",
                        twice.len()
                    ),
                )),
            }
        });
        match checked {
            Ok((layout, rows)) => match &reference {
                Some((first, expected)) if !expected.same_but_bucket(&layout) => {
                    report.problems.push(DataError::format(
                        &path,
                        format!(
                            "layout differs from {} in more than the latent size",
                            first.display()
                        ),
                    ))
                }
                _ => {
                    reference.get_or_insert((path.clone(), layout));
                    report.good.push((path, rows));
                }
            },
            Err(e) => report.problems.push(e),
        }
    }
    Ok(report)
}
