//! bf16 values stored as raw `u16` bits (MLPerf's `.bytes` entries, HDF5 without a bf16 type).

use tch::{Kind, Tensor};

/// Reinterpret little-endian bf16 bit patterns as a bf16 tensor of `shape`.
///
/// Fails with the expected and actual element counts when `bits` does not fill `shape`.
pub fn bf16_from_bits(bits: &[u16], shape: &[i64]) -> Result<Tensor, String> {
    let expected: i64 = shape.iter().product();
    if expected != bits.len() as i64 {
        return Err(format!(
            "bf16 data holds {} values but shape {shape:?} needs {expected}",
            bits.len()
        ));
    }
    // Same width, so the i16 view of the bits is a free reinterpretation.
    let raw: Vec<i16> = bits.iter().map(|&b| b as i16).collect();
    Ok(Tensor::from_slice(&raw)
        .view_dtype(Kind::BFloat16)
        .view(shape))
}

/// Parse little-endian bytes into bf16 bit patterns; fails on an odd byte count.
pub fn bits_from_le_bytes(bytes: &[u8]) -> Result<Vec<u16>, String> {
    if !bytes.len().is_multiple_of(2) {
        return Err(format!("bf16 data has an odd byte count ({})", bytes.len()));
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// The bf16 bit patterns of `t` (converted to bf16 first), flattened.
pub fn bits_of(t: &Tensor) -> Vec<u16> {
    let raw = t
        .to_kind(Kind::BFloat16)
        .contiguous()
        .view_dtype(Kind::Int16)
        .flatten(0, -1);
    Vec::<i16>::try_from(raw)
        .expect("int16 tensor")
        .into_iter()
        .map(|v| v as u16)
        .collect()
}
