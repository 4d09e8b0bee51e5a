//! Sample values as stored in a shard: bf16 (as `u16` bits, HDF5 has no bf16 type), f16 or f32,
//! with the little-endian bytes their CRC-32 covers.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use hdf5::{Dataset, Hyperslab, Selection, SliceOrIndex};
use ndarray::{ArrayView, IxDyn};

/// How a shard stores its numeric datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageDtype {
    /// bfloat16 bit patterns in `u16` datasets (MLPerf's encoding); half the bytes of f32.
    Bf16,
    /// IEEE half precision (HDF5's native 16-bit float).
    F16,
    /// IEEE single precision.
    F32,
}

impl StorageDtype {
    /// The name written in the `dtype` attribute.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::F32 => "f32",
        }
    }

    /// Bytes per stored value.
    pub fn size(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

impl FromStr for StorageDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            "f32" => Ok(Self::F32),
            other => Err(format!("unknown dtype {other:?} (bf16, f16 or f32)")),
        }
    }
}

impl fmt::Display for StorageDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Values of one or more samples in their stored type.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    /// Half floats.
    F16(Vec<f16>),
    /// Single floats.
    F32(Vec<f32>),
}

impl Values {
    /// Round `values` to `dtype` (to nearest, ties to even).
    pub fn encode(dtype: StorageDtype, values: &[f32]) -> Self {
        match dtype {
            StorageDtype::Bf16 => Self::Bf16(
                values
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_bits())
                    .collect(),
            ),
            StorageDtype::F16 => Self::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            StorageDtype::F32 => Self::F32(values.to_vec()),
        }
    }

    /// The little-endian bytes of `values` rounded to `dtype`, without an intermediate vector.
    pub fn encode_le_bytes(dtype: StorageDtype, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * dtype.size());
        match dtype {
            StorageDtype::Bf16 => {
                out.extend(values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()))
            }
            StorageDtype::F16 => {
                out.extend(values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()))
            }
            StorageDtype::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        }
        out
    }

    /// The values as f32 (exact for every stored type).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Self::Bf16(bits) => bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
            Self::F16(v) => v.iter().map(|h| h.to_f32()).collect(),
            Self::F32(v) => v.clone(),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Self::Bf16(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::F32(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Little-endian bytes, as the CRC-32 of a dataset covers them.
    pub fn le_bytes(&self) -> Vec<u8> {
        match self {
            Self::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Self::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Self::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Write these values as rows `start..` of `ds` (`[rows, *sample_shape]`).
    pub fn write_rows(
        &self,
        ds: &Dataset,
        start: usize,
        sample_shape: &[usize],
    ) -> hdf5::Result<()> {
        let rows = self.len() / sample_shape.iter().product::<usize>().max(1);
        let shape: Vec<usize> = std::iter::once(rows)
            .chain(sample_shape.iter().copied())
            .collect();
        let selection = rows_of(start..start + rows, shape.len());
        match self {
            Self::Bf16(v) => ds.write_slice(view(&shape, v)?, selection),
            Self::F16(v) => ds.write_slice(view(&shape, v)?, selection),
            Self::F32(v) => ds.write_slice(view(&shape, v)?, selection),
        }
    }

    /// Read rows `rows` of `ds`, stored as `dtype`.
    pub fn read_rows(
        dtype: StorageDtype,
        ds: &Dataset,
        rows: std::ops::Range<usize>,
    ) -> hdf5::Result<Self> {
        let selection = rows_of(rows, ds.ndim());
        Ok(match dtype {
            StorageDtype::Bf16 => Self::Bf16(flat(ds.read_slice::<u16, _, IxDyn>(selection)?)),
            StorageDtype::F16 => Self::F16(flat(ds.read_slice::<f16, _, IxDyn>(selection)?)),
            StorageDtype::F32 => Self::F32(flat(ds.read_slice::<f32, _, IxDyn>(selection)?)),
        })
    }
}

/// Rows `rows` (along the first axis) of a dataset of rank `ndim`, every other axis whole.
fn rows_of(rows: std::ops::Range<usize>, ndim: usize) -> Selection {
    let mut slices = vec![SliceOrIndex::from(rows)];
    slices.extend((1..ndim).map(|_| SliceOrIndex::from(..)));
    Hyperslab::from(slices).into()
}

fn flat<T>(array: ndarray::ArrayD<T>) -> Vec<T> {
    array.into_raw_vec_and_offset().0
}

fn view<'a, T>(shape: &[usize], values: &'a [T]) -> hdf5::Result<ArrayView<'a, T, IxDyn>> {
    ArrayView::from_shape(IxDyn(shape), values).map_err(|e| hdf5::Error::from(e.to_string()))
}
