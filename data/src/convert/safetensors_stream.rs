//! safetensors files read and written one tensor at a time: the reader parses and checks the
//! header, then reads each tensor's byte range with a positioned read (no memory map, so resident
//! memory stays about one tensor); the writer lays out the header from planned shapes and asks for
//! each tensor's values only when it writes them.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::dataset::{StorageDtype, Values};
use crate::error::{io, DataError};

/// Largest header accepted (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// Where one tensor lies in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// safetensors dtype name (`F32`, `BF16`, `F16`, `F64`).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range in the data section.
    pub range: (u64, u64),
}

/// An open safetensors file.
pub struct SafetensorsReader {
    path: PathBuf,
    file: File,
    data_start: u64,
    tensors: BTreeMap<String, TensorInfo>,
}

fn width(dtype: &str) -> Option<u64> {
    match dtype {
        "F32" => Some(4),
        "BF16" | "F16" => Some(2),
        "F64" => Some(8),
        _ => None,
    }
}

impl SafetensorsReader {
    /// Open `path` and check its header: every tensor's dtype is a float type flux-hpc reads, and
    /// its byte range lies in the file and matches its shape. Never panics on hostile input.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let bad = |message: String| DataError::format(path, message);
        let file = File::open(path).map_err(io(path))?;
        let file_len = file.metadata().map_err(io(path))?.len();
        let mut len_bytes = [0u8; 8];
        file.read_exact_at(&mut len_bytes, 0)
            .map_err(|_| bad("too short for a safetensors header".into()))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER || header_len > file_len.saturating_sub(8) {
            return Err(bad(format!(
                "header length {header_len} does not fit the file"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8).map_err(io(path))?;
        let header: Map<String, Value> = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
        let data_start = 8 + header_len;
        let data_len = file_len - data_start;
        let mut tensors = BTreeMap::new();
        for (name, entry) in header {
            if name == "__metadata__" {
                continue;
            }
            let dtype = entry["dtype"].as_str().unwrap_or_default().to_string();
            let size = width(&dtype)
                .ok_or_else(|| bad(format!("`{name}`: unsupported dtype {:?}", entry["dtype"])))?;
            let shape: Vec<usize> = entry["shape"]
                .as_array()
                .and_then(|dims| {
                    dims.iter()
                        .map(|d| d.as_u64().map(|d| d as usize))
                        .collect()
                })
                .ok_or_else(|| bad(format!("`{name}`: shape is not a list of sizes")))?;
            let offsets: Option<Vec<u64>> = entry["data_offsets"]
                .as_array()
                .and_then(|o| o.iter().map(Value::as_u64).collect());
            let (start, end) = match offsets.as_deref() {
                Some(&[a, b]) if a <= b && b <= data_len => (a, b),
                _ => return Err(bad(format!("`{name}`: data_offsets outside the file"))),
            };
            let bytes = shape_numel(&shape).and_then(|n| n.checked_mul(size));
            if bytes != Some(end - start) {
                return Err(bad(format!(
                    "`{name}`: {} bytes for shape {shape:?} of {dtype}",
                    end - start
                )));
            }
            tensors.insert(
                name,
                TensorInfo {
                    dtype,
                    shape,
                    range: (start, end),
                },
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors, by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// The values of tensor `name` as f32.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, DataError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| DataError::format(&self.path, format!("no tensor `{name}`")))?;
        let mut bytes = vec![0u8; (info.range.1 - info.range.0) as usize];
        self.file
            .read_exact_at(&mut bytes, self.data_start + info.range.0)
            .map_err(io(&self.path))?;
        let pairs = || {
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
        };
        Ok(match info.dtype.as_str() {
            "F32" => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            "BF16" => Values::Bf16(pairs().collect()).to_f32(),
            "F16" => pairs().map(|b| half::f16::from_bits(b).to_f32()).collect(),
            _ => bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
        })
    }
}

fn shape_numel(shape: &[usize]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64))
}

/// The safetensors name of a storage type.
fn dtype_name(dtype: StorageDtype) -> &'static str {
    match dtype {
        StorageDtype::Bf16 => "BF16",
        StorageDtype::F16 => "F16",
        StorageDtype::F32 => "F32",
    }
}

/// Write `path` (through a temporary file and a rename) holding `plan`'s tensors `(name, shape)`
/// in `dtype`, in plan order, with `metadata`; `values(i)` gives tensor `i`'s f32 values when it
/// is written.
pub fn write_streaming(
    path: &Path,
    dtype: StorageDtype,
    plan: &[(String, Vec<usize>)],
    metadata: &BTreeMap<String, String>,
    mut values: impl FnMut(usize) -> Result<Vec<f32>, DataError>,
) -> Result<(), DataError> {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!(metadata));
    let mut offset = 0u64;
    for (name, shape) in plan {
        let bytes = shape_numel(shape).unwrap_or(0) * dtype.size() as u64;
        header.insert(
            name.clone(),
            json!({"dtype": dtype_name(dtype), "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_vec(&Value::Object(header)).expect("JSON values serialise");
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let tmp = path.with_extension("safetensors.tmp");
    let file = File::create(&tmp).map_err(io(&tmp))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(text.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&text))
        .map_err(io(&tmp))?;
    for (i, (name, shape)) in plan.iter().enumerate() {
        let v = values(i)?;
        if Some(v.len() as u64) != shape_numel(shape) {
            return Err(DataError::format(
                path,
                format!("`{name}`: {} values for shape {shape:?}", v.len()),
            ));
        }
        out.write_all(&Values::encode_le_bytes(dtype, &v))
            .map_err(io(&tmp))?;
    }
    let file = out.into_inner().map_err(|e| io(&tmp)(e.into_error()))?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}
