//! HDF5 attributes (strings, integers) and the mapping of HDF5 errors to [`DataError`]s that name
//! the file and the object.

use std::path::Path;

use hdf5::types::VarLenUnicode;

use crate::error::DataError;

/// Map an HDF5 error on `what` in the file `path`; a failed Fletcher-32 chunk checksum becomes
/// [`DataError::Corrupt`].
pub fn h5err<'a>(path: &'a Path, what: &str) -> impl Fn(hdf5::Error) -> DataError + 'a {
    let what = what.to_string();
    move |e| {
        let message = e.to_string();
        if message.contains("Fletcher32") {
            DataError::Corrupt {
                path: path.display().to_string(),
                dataset: what.clone(),
            }
        } else {
            DataError::Hdf5 {
                path: path.display().to_string(),
                what: what.clone(),
                message,
            }
        }
    }
}

/// Write a string attribute.
pub fn write_str(
    loc: &hdf5::Location,
    name: &str,
    value: &str,
    path: &Path,
) -> Result<(), DataError> {
    let v: VarLenUnicode = value
        .parse()
        .expect("any UTF-8 string is a valid HDF5 string");
    loc.new_attr::<VarLenUnicode>()
        .create(name)
        .and_then(|a| a.write_scalar(&v))
        .map_err(h5err(path, name))
}

/// Read a string attribute.
pub fn read_str(loc: &hdf5::Location, name: &str, path: &Path) -> Result<String, DataError> {
    loc.attr(name)
        .and_then(|a| a.read_scalar::<VarLenUnicode>())
        .map(|s| s.to_string())
        .map_err(h5err(path, name))
}

/// Write a scalar attribute.
pub fn write_u64(
    loc: &hdf5::Location,
    name: &str,
    value: u64,
    path: &Path,
) -> Result<(), DataError> {
    loc.new_attr::<u64>()
        .create(name)
        .and_then(|a| a.write_scalar(&value))
        .map_err(h5err(path, name))
}

/// Read a scalar attribute.
pub fn read_u64(loc: &hdf5::Location, name: &str, path: &Path) -> Result<u64, DataError> {
    loc.attr(name)
        .and_then(|a| a.read_scalar::<u64>())
        .map_err(h5err(path, name))
}

/// Read a scalar attribute that older files may lack (`default` then).
pub fn read_u64_or(
    loc: &hdf5::Location,
    name: &str,
    default: u64,
    path: &Path,
) -> Result<u64, DataError> {
    if loc
        .attr_names()
        .map_err(h5err(path, name))?
        .iter()
        .any(|n| n == name)
    {
        read_u64(loc, name, path)
    } else {
        Ok(default)
    }
}

/// Write a 1-D integer attribute.
pub fn write_i64s(
    loc: &hdf5::Location,
    name: &str,
    values: &[i64],
    path: &Path,
) -> Result<(), DataError> {
    loc.new_attr::<i64>()
        .shape([values.len()])
        .create(name)
        .and_then(|a| a.write_raw(values))
        .map_err(h5err(path, name))
}

/// Read a 1-D integer attribute.
pub fn read_i64s(loc: &hdf5::Location, name: &str, path: &Path) -> Result<Vec<i64>, DataError> {
    loc.attr(name)
        .and_then(|a| a.read_raw::<i64>())
        .map_err(h5err(path, name))
}
