//! safetensors files read and written one tensor at a time: the reader parses and checks the
//! header, then reads each tensor's byte range with a positioned read (no memory map, so resident
//! memory stays about one tensor); the writer lays out the header from planned shapes and asks for
//! each tensor's values only when it writes them.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::convert::fp8;
use crate::dataset::{StorageDtype, Values};
use crate::error::{io, DataError};
use crate::files;

/// Largest header accepted (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// Where one tensor lies in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// safetensors dtype name (`F32`, `BF16`, `F16`, `F64`, `F8_E4M3`, `F8_E5M2`).
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
    metadata: BTreeMap<String, String>,
    /// The scale of each float8 weight of a scaled-fp8 file, by weight name.
    scales: BTreeMap<String, Vec<f32>>,
}

fn width(dtype: &str) -> Option<u64> {
    match dtype {
        "F32" => Some(4),
        "BF16" | "F16" => Some(2),
        "F64" => Some(8),
        "F8_E4M3" | "F8_E5M2" => Some(1),
        _ => None,
    }
}

/// A JSON object's members in file order, duplicates kept (a map would silently keep the last).
struct Members(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, Value>()? {
                    out.push(entry);
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// The metadata key holding the CRC-32 of a flux-hpc-written file's data section (8 hex digits).
pub const CRC_KEY: &str = "flux_hpc.crc32";

impl SafetensorsReader {
    /// Open `path` and check its header as strictly as the reference reader: a regular file, a
    /// JSON object without duplicate names, every tensor's dtype a float type flux-hpc reads,
    /// its byte count matching its shape, and the byte ranges tiling the data section exactly
    /// (from 0, no gap, no overlap, to the end of the file). Never panics on hostile input.
    /// A scaled-fp8 file (ComfyUI's) reads as the weights it stands for: each `scale_weight` is
    /// checked and folded into its weight, and the scales and marker are not listed.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let bad = |message: String| DataError::format(path, message);
        let file = files::open_regular(path)?;
        let file_len = file.metadata().map_err(io(path))?.len();
        let mut len_bytes = [0u8; 8];
        file.read_exact_at(&mut len_bytes, 0)
            .map_err(|_| bad("too short for a safetensors header".into()))?;
        let header_len = header_len(u64::from_le_bytes(len_bytes), file_len).map_err(bad)?;
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8).map_err(io(path))?;
        let data_start = 8 + header_len;
        let Header { tensors, metadata } =
            parse_header(&header, file_len - data_start).map_err(bad)?;
        let mut reader = Self {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
            metadata,
            scales: BTreeMap::new(),
        };
        let mut tensors = reader.tensors.clone();
        let scales = fp8::fold_scales(&mut tensors, |name| {
            reader.read_f32(name).map_err(|e| e.to_string())
        })
        .map_err(bad)?;
        reader.tensors = tensors;
        reader.scales = scales;
        Ok(reader)
    }

    /// The header's `__metadata__` entries.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Check the data section against the CRC-32 flux-hpc writes into its files' metadata,
    /// reading it in blocks. `Ok(false)`: the file carries no checksum (written elsewhere).
    pub fn verify_checksum(&self) -> Result<bool, DataError> {
        let Some(stored) = self.metadata.get(CRC_KEY) else {
            return Ok(false);
        };
        let stored = u32::from_str_radix(stored, 16).map_err(|_| {
            DataError::format(
                &self.path,
                format!("metadata `{CRC_KEY}` = {stored:?} is not a CRC-32"),
            )
        })?;
        let end = self.file.metadata().map_err(io(&self.path))?.len();
        let mut crc = crc32fast::Hasher::new();
        let mut block = vec![0u8; 4 << 20];
        let mut at = self.data_start;
        while at < end {
            let n = (end - at).min(block.len() as u64) as usize;
            self.file
                .read_exact_at(&mut block[..n], at)
                .map_err(io(&self.path))?;
            crc.update(&block[..n]);
            at += n as u64;
        }
        if crc.finalize() != stored {
            return Err(DataError::Corrupt {
                path: self.path.display().to_string(),
                dataset: "data section".into(),
            });
        }
        Ok(true)
    }

    /// Every tensor as an f32 [`tch::Tensor`] of its shape, by name.
    pub fn read_all(&self) -> Result<HashMap<String, tch::Tensor>, DataError> {
        self.tensors
            .iter()
            .map(|(name, info)| {
                let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
                let values = self.read_f32(name)?;
                Ok((
                    name.clone(),
                    tch::Tensor::from_slice(&values).view(shape.as_slice()),
                ))
            })
            .collect()
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
        let mut values = decode_f32(&info.dtype, &bytes);
        if let Some(scale) = self.scales.get(name) {
            fp8::apply_scale(&mut values, scale);
        }
        Ok(values)
    }
}

/// The header length a file of `file_len` bytes declares, if it fits.
fn header_len(declared: u64, file_len: u64) -> Result<u64, String> {
    match declared <= MAX_HEADER && declared <= file_len.saturating_sub(8) {
        true => Ok(declared),
        false => Err(format!("header length {declared} does not fit the file")),
    }
}

/// A checked header: tensors by name, and the `__metadata__` entries.
struct Header {
    tensors: BTreeMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

/// Parse and check the JSON `header` of a file whose data section holds `data_len` bytes, as
/// strictly as the reference reader: a JSON object without duplicate names, every tensor's dtype
/// a float type flux-hpc reads, its byte count matching its shape, and the byte ranges tiling
/// the data section exactly (from 0, no gap, no overlap, to its end).
fn parse_header(header: &[u8], data_len: u64) -> Result<Header, String> {
    let Members(members) =
        serde_json::from_slice(header).map_err(|e| format!("header is not a JSON object: {e}"))?;
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, entry) in members {
        if name == "__metadata__" {
            let pairs = entry.as_object().ok_or("`__metadata__` is not an object")?;
            for (k, v) in pairs {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("metadata `{k}` is not a string"))?;
                metadata.insert(k.clone(), v.to_string());
            }
            continue;
        }
        if tensors.contains_key(&name) {
            return Err(format!("`{name}` is listed twice in the header"));
        }
        let dtype = entry["dtype"].as_str().unwrap_or_default().to_string();
        let size = width(&dtype)
            .ok_or_else(|| format!("`{name}`: unsupported dtype {:?}", entry["dtype"]))?;
        let shape: Vec<usize> = entry["shape"]
            .as_array()
            .and_then(|dims| {
                dims.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect()
            })
            .ok_or_else(|| format!("`{name}`: shape is not a list of sizes"))?;
        let offsets: Option<Vec<u64>> = entry["data_offsets"]
            .as_array()
            .and_then(|o| o.iter().map(Value::as_u64).collect());
        let (start, end) = match offsets.as_deref() {
            Some(&[a, b]) if a <= b && b <= data_len => (a, b),
            _ => return Err(format!("`{name}`: data_offsets outside the file")),
        };
        let bytes = shape_numel(&shape).and_then(|n| n.checked_mul(size));
        if bytes != Some(end - start) {
            return Err(format!(
                "`{name}`: {} bytes for shape {shape:?} of {dtype}",
                end - start
            ));
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
    check_tiling(&tensors, data_len)?;
    Ok(Header { tensors, metadata })
}

/// Row-major values of `dtype` (a name [`width`] accepts) in little-endian `bytes`, as f32.
fn decode_f32(dtype: &str, bytes: &[u8]) -> Vec<f32> {
    let pairs = || {
        bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
    };
    match dtype {
        "F32" => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "BF16" => Values::Bf16(pairs().collect()).to_f32(),
        "F16" => pairs().map(|b| half::f16::from_bits(b).to_f32()).collect(),
        "F8_E4M3" => bytes.iter().map(|&b| fp8::e4m3_to_f32(b)).collect(),
        "F8_E5M2" => bytes.iter().map(|&b| fp8::e5m2_to_f32(b)).collect(),
        _ => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
    }
}

/// A decoded tensor: name, shape, row-major f32 values.
pub type DecodedTensor = (String, Vec<usize>, Vec<f32>);

/// The tensors of a whole safetensors file held in memory (a per-sample file in an ingest),
/// checked as [`SafetensorsReader::open`] checks a file.
pub fn decode_in_memory(bytes: &[u8]) -> Result<Vec<DecodedTensor>, String> {
    let declared = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or("too short for a safetensors header")?;
    let header_len = header_len(declared, bytes.len() as u64)? as usize;
    let data = &bytes[8 + header_len..];
    let header = parse_header(&bytes[8..8 + header_len], data.len() as u64)?;
    Ok(header
        .tensors
        .into_iter()
        .map(|(name, info)| {
            let (start, end) = (info.range.0 as usize, info.range.1 as usize);
            (name, info.shape, decode_f32(&info.dtype, &data[start..end]))
        })
        .collect())
}

/// The tensors' byte ranges must cover `0..data_len` exactly once, as the reference reader
/// requires: sorted by start, each begins where the previous ends.
fn check_tiling(tensors: &BTreeMap<String, TensorInfo>, data_len: u64) -> Result<(), String> {
    let mut ranges: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|(n, t)| (t.range.0, t.range.1, n.as_str()))
        .collect();
    ranges.sort_unstable();
    let mut end = 0;
    for (start, stop, name) in ranges {
        if start != end {
            let what = if start < end {
                "overlaps the tensor before it"
            } else {
                "leaves a gap before it"
            };
            return Err(format!(
                "`{name}`: data_offsets [{start}, {stop}] {what} (expected to start at {end})"
            ));
        }
        end = stop;
    }
    if end != data_len {
        return Err(format!(
            "the tensors cover {end} of the data section's {data_len} bytes"
        ));
    }
    Ok(())
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
/// in `dtype`, in plan order, with `metadata` plus the data section's CRC-32 under
/// [`CRC_KEY`]; `values(i)` gives tensor `i`'s f32 values when it is written. On failure the
/// temporary file is removed and the error names the path.
pub fn write_streaming(
    path: &Path,
    dtype: StorageDtype,
    plan: &[(String, Vec<usize>)],
    metadata: &BTreeMap<String, String>,
    mut values: impl FnMut(usize) -> Result<Vec<f32>, DataError>,
) -> Result<(), DataError> {
    // The checksum is known only after the data: write a placeholder, patch it in place.
    const PLACEHOLDER: &str = "00000000";
    let mut metadata = metadata.clone();
    metadata.insert(CRC_KEY.into(), PLACEHOLDER.into());
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
    let marker = format!("\"{CRC_KEY}\":\"{PLACEHOLDER}\"");
    let crc_at = 8
        + text
            .windows(marker.len())
            .position(|w| w == marker.as_bytes())
            .expect("the metadata holds the placeholder")
        + marker.len()
        - PLACEHOLDER.len()
        - 1;
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let tmp = files::tmp_path(path);
    let written = (|| {
        let file = File::create(&tmp).map_err(io(&tmp))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&text))
            .map_err(io(&tmp))?;
        let mut crc = crc32fast::Hasher::new();
        for (i, (name, shape)) in plan.iter().enumerate() {
            let v = values(i)?;
            if Some(v.len() as u64) != shape_numel(shape) {
                return Err(DataError::format(
                    path,
                    format!("`{name}`: {} values for shape {shape:?}", v.len()),
                ));
            }
            let bytes = Values::encode_le_bytes(dtype, &v);
            crc.update(&bytes);
            out.write_all(&bytes).map_err(io(&tmp))?;
        }
        let file = out.into_inner().map_err(|e| io(&tmp)(e.into_error()))?;
        let hex = format!("{:08x}", crc.finalize());
        file.write_all_at(hex.as_bytes(), crc_at as u64)
            .and_then(|()| file.sync_all())
            .map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Write named tensors (any device; bf16 ones stored as BF16, others as F32) to the safetensors
/// file `path` through [`write_streaming`], so it carries the data section's CRC-32.
pub fn write_tensors(path: &Path, tensors: &[(String, tch::Tensor)]) -> Result<(), DataError> {
    let bf16 = tensors.iter().all(|(_, t)| t.kind() == tch::Kind::BFloat16);
    let dtype = if bf16 && !tensors.is_empty() {
        StorageDtype::Bf16
    } else {
        StorageDtype::F32
    };
    let plan: Vec<(String, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.size().iter().map(|&d| d as usize).collect()))
        .collect();
    write_streaming(path, dtype, &plan, &BTreeMap::new(), |i| {
        let t = tensors[i]
            .1
            .to_kind(tch::Kind::Float)
            .to_device(tch::Device::Cpu);
        Ok(Vec::<f32>::try_from(t.flatten(0, -1)).expect("an f32 tensor"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file in a fresh directory: `header` (JSON text) and `data` bytes.
    fn file(name: &str, header: &str, data: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("flux-st-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(data);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn open_err(name: &str, header: &str, data_len: usize) -> String {
        let path = file(name, header, &vec![0u8; data_len]);
        match SafetensorsReader::open(&path) {
            Ok(_) => panic!("{name}: a malformed header was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn headers_the_reference_reader_rejects_are_rejected() {
        let t = |name: &str, a: u64, b: u64| {
            format!(
                r#""{name}":{{"dtype":"F32","shape":[{}],"data_offsets":[{a},{b}]}}"#,
                (b - a) / 4
            )
        };
        let ok = format!("{{{},{}}}", t("a", 0, 8), t("b", 8, 16));
        assert!(SafetensorsReader::open(&file("ok", &ok, &[0u8; 16])).is_ok());

        let dup = format!("{{{},{}}}", t("a", 0, 8), t("a", 8, 16));
        assert!(open_err("dup", &dup, 16).contains("`a` is listed twice"));
        // The same checks hold for a file read whole (a per-sample file in an ingest).
        let in_memory = std::fs::read(file("dup-mem", &dup, &[0u8; 16])).unwrap();
        assert!(decode_in_memory(&in_memory)
            .unwrap_err()
            .contains("`a` is listed twice"));
        let whole = std::fs::read(file("ok-mem", &ok, &[0u8; 16])).unwrap();
        let names: Vec<String> = decode_in_memory(&whole)
            .unwrap()
            .into_iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(names, ["a", "b"]);
        let overlap = format!("{{{},{}}}", t("a", 0, 8), t("b", 4, 12));
        assert!(open_err("overlap", &overlap, 12).contains("overlaps"));
        let gap = format!("{{{},{}}}", t("a", 0, 8), t("b", 12, 20));
        assert!(open_err("gap", &gap, 20).contains("leaves a gap"));
        let late = format!("{{{}}}", t("a", 4, 12));
        assert!(open_err("late", &late, 12).contains("expected to start at 0"));
        let short = format!("{{{}}}", t("a", 0, 8));
        assert!(open_err("trailing", &short, 12).contains("cover 8 of the data section's 12"));
    }

    #[test]
    fn written_files_carry_a_checksum_that_catches_a_flipped_bit() {
        let dir = std::env::temp_dir().join(format!("flux-st-crc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let w = tch::Tensor::from_slice(&[1f32, 2., 3., 4., 5., 6.]).view([2, 3]);
        write_tensors(&path, &[("w".into(), w.shallow_clone())]).unwrap();
        let reader = SafetensorsReader::open(&path).unwrap();
        assert!(reader.verify_checksum().unwrap());
        assert!(reader.read_all().unwrap()["w"].equal(&w));
        assert!(!files::tmp_path(&path).exists());

        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let err = SafetensorsReader::open(&path)
            .unwrap()
            .verify_checksum()
            .unwrap_err();
        assert!(matches!(err, DataError::Corrupt { .. }), "{err}");
    }
}
