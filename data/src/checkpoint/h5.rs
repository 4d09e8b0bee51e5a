//! Tensor datasets in HDF5 with the attributes that describe their shard and a CRC-32 of their
//! bytes, so a flipped bit or a truncated file is reported, never loaded.

use std::path::Path;

use flux_model::tp::{GradSync, ParamSpec};
use tch::{Kind, Tensor};

use crate::error::DataError;
use crate::h5attr::{h5err, read_i64s, read_str, read_u64, write_i64s, write_str, write_u64};

/// Write `tensor` (this rank's shard of `spec`) as `group/name` in f32, with its logical shape,
/// split, parts, original dtype and CRC-32.
pub fn write_tensor(
    group: &hdf5::Group,
    spec: &ParamSpec,
    tensor: &Tensor,
    path: &Path,
) -> Result<(), DataError> {
    let data = Vec::<f32>::try_from(
        tensor
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu)
            .flatten(0, -1),
    )
    .expect("f32 buffer");
    let dtype = format!("{:?}", tensor.kind());
    write_values(group, spec, &tensor.size(), &data, &dtype, path)
}

/// Write `values` (row-major, local shape `shape`, a shard of `spec`) as `group/name` in f32,
/// with the shard attributes, the dtype name the values had in training and their CRC-32.
pub fn write_values(
    group: &hdf5::Group,
    spec: &ParamSpec,
    shape: &[i64],
    values: &[f32],
    dtype: &str,
    path: &Path,
) -> Result<(), DataError> {
    let name = &spec.name;
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let ds = group
        .new_dataset::<f32>()
        .shape(dims)
        .create(name.as_str())
        .map_err(h5err(path, name))?;
    ds.write_raw(values).map_err(h5err(path, name))?;
    let mut crc = crc32fast::Hasher::new();
    for v in values {
        crc.update(&v.to_le_bytes());
    }
    write_u64(&ds, "crc32", crc.finalize() as u64, path)?;
    write_i64s(&ds, "logical_shape", &spec.shape, path)?;
    write_i64s(
        &ds,
        "split_dim",
        &[spec.split_dim.map_or(-1, |d| d as i64)],
        path,
    )?;
    write_i64s(
        &ds,
        "part_sizes",
        &spec.parts.iter().map(|p| p.1).collect::<Vec<_>>(),
        path,
    )?;
    write_str(
        &ds,
        "part_names",
        &spec
            .parts
            .iter()
            .map(|p| p.0.as_str())
            .collect::<Vec<_>>()
            .join(","),
        path,
    )?;
    write_str(&ds, "dtype", dtype, path)
}

/// Read `group/name`: the tensor (in its saved dtype) and the spec it was a shard of (with the
/// file's `tp_size`). Fails on a CRC mismatch, naming the file and dataset.
pub fn read_tensor(
    group: &hdf5::Group,
    name: &str,
    tp_size: i64,
    path: &Path,
) -> Result<(Tensor, ParamSpec), DataError> {
    let ds = group.dataset(name).map_err(h5err(path, name))?;
    let data = ds.read_raw::<f32>().map_err(h5err(path, name))?;
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    if crc32fast::hash(&bytes) as u64 != read_u64(&ds, "crc32", path)? {
        return Err(DataError::Corrupt {
            path: path.display().to_string(),
            dataset: name.to_string(),
        });
    }
    let shape: Vec<i64> = ds.shape().iter().map(|&d| d as i64).collect();
    let split = read_i64s(&ds, "split_dim", path)?;
    let sizes = read_i64s(&ds, "part_sizes", path)?;
    let names = read_str(&ds, "part_names", path)?;
    let parts = names
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .zip(sizes)
        .collect();
    let kind = if read_str(&ds, "dtype", path)? == "BFloat16" {
        Kind::BFloat16
    } else {
        Kind::Float
    };
    let spec = ParamSpec {
        name: name.to_string(),
        shape: read_i64s(&ds, "logical_shape", path)?,
        split_dim: split.first().and_then(|&d| usize::try_from(d).ok()),
        parts,
        tp_size,
        grad_sync: GradSync::Complete,
    };
    Ok((
        Tensor::from_slice(&data)
            .view(shape.as_slice())
            .to_kind(kind),
        spec,
    ))
}
