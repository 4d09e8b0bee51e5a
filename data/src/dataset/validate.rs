//! `flux-hpc data validate`: every shard's structure and every dataset's CRC-32.

use std::path::{Path, PathBuf};

use crate::dataset::layout::ShardLayout;
use crate::dataset::reader::shard_files;
use crate::dataset::values::Values;
use crate::error::DataError;
use crate::h5attr::{h5err, read_u64};

/// Rows read per CRC pass; bounds memory for large datasets.
const ROWS_PER_READ: usize = 64;

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

fn crc_of(
    ds: &hdf5::Dataset,
    read: impl Fn(std::ops::Range<usize>) -> hdf5::Result<Vec<u8>>,
) -> hdf5::Result<u32> {
    let rows = ds.shape().first().copied().unwrap_or(0);
    let mut crc = crc32fast::Hasher::new();
    for start in (0..rows).step_by(ROWS_PER_READ) {
        crc.update(&read(start..(start + ROWS_PER_READ).min(rows))?);
    }
    Ok(crc.finalize())
}

/// Check one shard fully: layout, shapes and every CRC. Returns its layout and sample count.
pub fn validate_shard(path: &Path) -> Result<(ShardLayout, u64), DataError> {
    let dataset = crate::dataset::reader::LatentDataset::open(&[path.to_path_buf()])?;
    let layout = dataset.layout().clone();
    let file = hdf5::File::open(path).map_err(h5err(path, "open"))?;
    for (name, _) in layout.numeric() {
        let ds = file.dataset(name).map_err(h5err(path, name))?;
        let crc = crc_of(&ds, |rows| {
            Values::read_rows(layout.dtype, &ds, rows).map(|v| v.le_bytes())
        })
        .map_err(h5err(path, name))?;
        if crc as u64 != read_u64(&ds, "crc32", path)? {
            return Err(DataError::Corrupt {
                path: path.display().to_string(),
                dataset: name.into(),
            });
        }
    }
    for name in layout.strings() {
        let ds = file.dataset(name).map_err(h5err(path, name))?;
        let crc = crc_of(&ds, |rows| {
            let texts = ds.read_slice_1d::<hdf5::types::VarLenUnicode, _>(rows)?;
            Ok(texts
                .iter()
                .flat_map(|t| t.as_str().bytes().chain(std::iter::once(b'\n')))
                .collect())
        })
        .map_err(h5err(path, name))?;
        if crc as u64 != read_u64(&ds, "crc32", path)? {
            return Err(DataError::Corrupt {
                path: path.display().to_string(),
                dataset: name.into(),
            });
        }
    }
    Ok((layout, dataset.len()))
}

/// Validate every shard named by `paths` (files or directories): each one fully, and all against
/// the first good shard's layout. Problems are collected, not fatal.
pub fn validate(paths: &[PathBuf]) -> Result<ValidationReport, DataError> {
    let mut report = ValidationReport::default();
    let mut reference: Option<(PathBuf, ShardLayout)> = None;
    for path in shard_files(paths)? {
        match validate_shard(&path) {
            Ok((layout, rows)) => match &reference {
                Some((first, expected)) if *expected != layout => report.problems.push(
                    DataError::format(&path, format!("layout differs from {}", first.display())),
                ),
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
