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
    let dtype = format!("{:?}", tensor.kind());
    write_values(
        group,
        spec,
        &tensor.size(),
        &f32_values(tensor),
        &dtype,
        path,
    )
    .map(drop)
}

/// Write `part` (this data-parallel rank's part of a shard of `spec` whose local shape is
/// `local_shape`: the flattened shard's elements from `offset` on) as `group/name` in f32: a 1-D
/// dataset with the shard attributes, `local_shape` and `offset`.
pub fn write_part(
    group: &hdf5::Group,
    spec: &ParamSpec,
    local_shape: &[i64],
    offset: usize,
    part: &Tensor,
    path: &Path,
) -> Result<(), DataError> {
    let values = f32_values(part);
    let dtype = format!("{:?}", part.kind());
    let shape = [values.len() as i64];
    let ds = write_values(group, spec, &shape, &values, &dtype, path)?;
    write_i64s(&ds, "local_shape", local_shape, path)?;
    write_u64(&ds, "offset", offset as u64, path)
}

/// `tensor`'s elements as f32 on the host, row-major.
fn f32_values(tensor: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(
        tensor
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu)
            .flatten(0, -1),
    )
    .expect("f32 buffer")
}

/// Write `values` (row-major, local shape `shape`, a shard of `spec`) as `group/name` in f32,
/// with the shard attributes, the dtype name the values had in training and their CRC-32;
/// returns the dataset for more attributes.
pub fn write_values(
    group: &hdf5::Group,
    spec: &ParamSpec,
    shape: &[i64],
    values: &[f32],
    dtype: &str,
    path: &Path,
) -> Result<hdf5::Dataset, DataError> {
    let name = &spec.name;
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let ds = group
        .new_dataset::<f32>()
        .shape(dims)
        .create(name.as_str())
        .map_err(h5err(path, name))?;
    ds.write_raw(values).map_err(h5err(path, name))?;
    write_u64(&ds, "crc32", crc32_f32(values) as u64, path)?;
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
    write_str(&ds, "dtype", dtype, path)?;
    Ok(ds)
}

/// CRC-32 of `values`' little-endian bytes, hashed in blocks (no full byte copy).
pub fn crc32_f32(values: &[f32]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    let mut block = Vec::with_capacity(4 << 16);
    for chunk in values.chunks(1 << 16) {
        block.clear();
        block.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        crc.update(&block);
    }
    crc.finalize()
}

/// One stored dataset: its values, local shape, training dtype and the shard spec it belongs to.
pub struct StoredShard {
    /// Row-major f32 values.
    pub values: Vec<f32>,
    /// Local (this tensor-parallel rank's) shape.
    pub shape: Vec<i64>,
    /// For a data-parallel part: where its values start among the shard's (flattened) elements.
    pub offset: Option<usize>,
    /// The dtype the tensor had in training.
    pub kind: Kind,
    /// The logical tensor's layout (with the file's `tp_size`).
    pub spec: ParamSpec,
}

/// Read `group/name` and its shard attributes (with the file's `tp_size`). Fails on a CRC
/// mismatch, naming the file and dataset.
pub fn read_values(
    group: &hdf5::Group,
    name: &str,
    tp_size: i64,
    path: &Path,
) -> Result<StoredShard, DataError> {
    // Errors name the dataset with its group: `exp_avg/x.weight`.
    let full = format!("{}/{name}", group.name().trim_start_matches('/'));
    let ds = group.dataset(name).map_err(h5err(path, &full))?;
    let values = ds.read_raw::<f32>().map_err(h5err(path, &full))?;
    if crc32_f32(&values) as u64 != read_u64(&ds, "crc32", path)? {
        return Err(DataError::Corrupt {
            path: path.display().to_string(),
            dataset: full,
        });
    }
    let split = read_i64s(&ds, "split_dim", path)?;
    let sizes = read_i64s(&ds, "part_sizes", path)?;
    let names = read_str(&ds, "part_names", path)?;
    let names: Vec<&str> = names.split(',').filter(|s| !s.is_empty()).collect();
    if names.len() != sizes.len() {
        return Err(layout_error(
            path,
            &full,
            &format!("{} part names for {} part sizes", names.len(), sizes.len()),
        ));
    }
    let parts = names.into_iter().map(str::to_string).zip(sizes).collect();
    let kind = if read_str(&ds, "dtype", path)? == "BFloat16" {
        Kind::BFloat16
    } else {
        Kind::Float
    };
    let spec = ParamSpec {
        name: name.to_string(),
        shape: read_i64s(&ds, "logical_shape", path)?,
        split_dim: match split.as_slice() {
            [-1] => None,
            [d] => Some(usize::try_from(*d).unwrap_or(usize::MAX)),
            _ => return Err(layout_error(path, &full, "`split_dim` is not one integer")),
        },
        parts,
        tp_size,
        grad_sync: GradSync::Complete,
        all_reduce: None,
        // Checkpoints record layouts, not what kind of layer a tensor belongs to.
        linear: false,
    };
    // A data-parallel part is 1-D and says the shard's shape and where it starts.
    let (shape, offset) = match ds.attr("offset") {
        Ok(_) => (
            read_i64s(&ds, "local_shape", path)?,
            Some(read_u64(&ds, "offset", path)? as usize),
        ),
        Err(_) => (ds.shape().iter().map(|&d| d as i64).collect(), None),
    };
    check_layout(&spec, &shape).map_err(|m| layout_error(path, &full, &m))?;
    Ok(StoredShard {
        values,
        shape,
        offset,
        kind,
        spec,
    })
}

fn layout_error(path: &Path, name: &str, message: &str) -> DataError {
    DataError::format(path, format!("dataset `{name}`: {message}"))
}

/// Whether `local` (a stored dataset's shape) is a valid shard of `spec`: a split dimension
/// inside the shape, parts that tile it, sizes that divide evenly over `tp_size`, and the local
/// shape the split implies. Hostile attributes fail here, before anything is sliced.
fn check_layout(spec: &ParamSpec, local: &[i64]) -> Result<(), String> {
    let logical = &spec.shape;
    if logical.iter().any(|&d| d < 0) || logical.len() != local.len() {
        return Err(format!(
            "logical shape {logical:?} does not fit the stored shape {local:?}"
        ));
    }
    if spec.tp_size < 1 {
        return Err(format!("tensor-parallel size {}", spec.tp_size));
    }
    let Some(d) = spec.split_dim else {
        return match (spec.parts.is_empty(), logical.as_slice() == local) {
            (true, true) => Ok(()),
            (false, _) => Err("named parts without a split dimension".into()),
            (true, false) => Err(format!(
                "replicated with logical shape {logical:?} but stored as {local:?}"
            )),
        };
    };
    if d >= logical.len() {
        return Err(format!(
            "split dimension {d} of a {}-D tensor",
            logical.len()
        ));
    }
    let sizes: Vec<i64> = match spec.parts.is_empty() {
        true => vec![logical[d]],
        false => spec.parts.iter().map(|p| p.1).collect(),
    };
    let total = sizes.iter().try_fold(0i64, |acc, &s| {
        (s >= 0).then(|| acc.checked_add(s)).flatten()
    });
    if total != Some(logical[d]) || sizes.iter().any(|s| s % spec.tp_size != 0) {
        return Err(format!(
            "parts {sizes:?} do not tile dimension {d} ({}) evenly over {} rank(s)",
            logical[d], spec.tp_size
        ));
    }
    let mut expected = logical.clone();
    expected[d] /= spec.tp_size;
    match expected.as_slice() == local {
        true => Ok(()),
        false => Err(format!(
            "a shard of {logical:?} split on dimension {d} over {} rank(s) is {expected:?}, stored {local:?}",
            spec.tp_size
        )),
    }
}

/// Read `group/name` as a tensor (in its saved dtype) with the spec it was a shard of, from
/// `files` (path and file): one file holding the whole shard, or the data-parallel parts of it,
/// which must tile its elements exactly.
pub fn read_tensor(
    files: &[(&Path, &hdf5::File)],
    group: &str,
    name: &str,
    tp_size: i64,
) -> Result<(Tensor, ParamSpec), DataError> {
    let mut stored = Vec::with_capacity(files.len());
    for (path, file) in files {
        let g = file.group(group).map_err(h5err(path, group))?;
        stored.push((*path, read_values(&g, name, tp_size, path)?));
    }
    stored.sort_by_key(|(_, s)| s.offset);
    let (first_path, first) = &stored[0];
    let values = match first.offset {
        None => first.values.clone(),
        Some(_) => {
            let numel: i64 = first.shape.iter().product();
            let mut values = vec![0f32; numel as usize];
            let mut at = 0;
            for (path, s) in &stored {
                let full = format!("{group}/{name}");
                // A rank may own none of a small tensor: its part is empty, anywhere.
                let continues = s.offset == Some(at) || s.values.is_empty();
                if s.spec != first.spec || s.shape != first.shape || !continues {
                    return Err(layout_error(
                        path,
                        &full,
                        &format!(
                            "a part from element {:?} does not continue the parts before it \
                             (at {at}) of the shard in {}",
                            s.offset,
                            first_path.display()
                        ),
                    ));
                }
                let end = at + s.values.len();
                if end > values.len() {
                    return Err(layout_error(path, &full, "parts overrun the shard"));
                }
                values[at..end].copy_from_slice(&s.values);
                at = end;
            }
            if at != values.len() {
                return Err(layout_error(
                    first_path,
                    &format!("{group}/{name}"),
                    &format!("parts hold {at} of the shard's {} elements", values.len()),
                ));
            }
            values
        }
    };
    let t = Tensor::from_slice(&values)
        .view(first.shape.as_slice())
        .to_kind(first.kind);
    Ok((t, first.spec.clone()))
}
