//! Each dataset of a shard against the CRC-32 stored with it, read in bounded blocks: what
//! reads check when they open a shard and what `data validate` checks everywhere.

use std::path::Path;

use crate::dataset::values::{StorageDtype, Values};
use crate::error::DataError;
use crate::h5attr::{h5err, read_u64};

/// Rows read per CRC pass; bounds memory for large datasets.
const ROWS_PER_READ: usize = 64;

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

/// Check dataset `name` of shard `path` against its stored CRC-32, reading it in bounded
/// blocks: numeric values of `dtype`, or (`None`) the strings of an id or caption dataset.
pub(crate) fn check_crc(
    path: &Path,
    name: &str,
    ds: &hdf5::Dataset,
    dtype: Option<StorageDtype>,
) -> Result<(), DataError> {
    let non_finite = std::cell::Cell::new(0u64);
    let crc = match dtype {
        Some(dtype) => crc_of(ds, |rows| {
            Values::read_rows(dtype, ds, rows).map(|v| {
                let bad = v.to_f32().iter().filter(|x| !x.is_finite()).count();
                non_finite.set(non_finite.get() + bad as u64);
                v.le_bytes()
            })
        }),
        None => crc_of(ds, |rows| {
            let texts = ds.read_slice_1d::<hdf5::types::VarLenUnicode, _>(rows)?;
            Ok(texts
                .iter()
                .flat_map(|t| t.as_str().bytes().chain(std::iter::once(b'\n')))
                .collect())
        }),
    }
    .map_err(h5err(path, name))?;
    if crc as u64 != read_u64(ds, "crc32", path)? {
        return Err(DataError::Corrupt {
            path: path.display().to_string(),
            dataset: name.into(),
        });
    }
    match non_finite.get() {
        0 => Ok(()),
        n => Err(DataError::format(
            path,
            format!(
                "dataset `{name}` holds {n} NaN or infinite value(s): no sample can train on them"
            ),
        )),
    }
}
