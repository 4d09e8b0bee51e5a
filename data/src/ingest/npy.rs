//! The NumPy `.npy` format (versions 1–3), as MLPerf's pre-encoded Flux shards store their
//! `.bytes` entries: a header naming dtype, order and shape, then raw little-endian values.

/// A parsed array: shape and values as f32.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyArray {
    /// Shape from the header (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// Values in C order.
    pub values: Vec<f32>,
}

fn field<'a>(header: &'a str, key: &str) -> Result<&'a str, String> {
    let pattern = format!("'{key}':");
    let start = header
        .find(&pattern)
        .ok_or_else(|| format!("npy header has no '{key}' entry"))?
        + pattern.len();
    Ok(header[start..].trim_start())
}

/// Parse an `.npy` file's bytes. `<u2` (uint16) is read as bf16 bit patterns (MLPerf's encoding
/// of bf16, which NumPy lacks); `<f2`, `<f4` and `<f8` as floats. Fortran order, big-endian data
/// and object arrays are refused with the reason.
pub fn parse_npy(bytes: &[u8]) -> Result<NpyArray, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not an .npy array (bad magic)".into());
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or("npy header runs past the end of the data")?;
    let header = std::str::from_utf8(&bytes[start..end]).map_err(|_| "npy header is not text")?;
    let descr = field(header, "descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split('\'').next())
        .ok_or("npy descr is not a quoted string")?;
    if field(header, "fortran_order")?.starts_with("True") {
        return Err("Fortran-ordered arrays are not supported".into());
    }
    let shape_text = field(header, "shape")?;
    let shape_text = shape_text
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("npy shape is not a tuple")?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("bad npy dimension {s:?}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or("npy shape overflows")?;
    let data = &bytes[end..];
    let width = match descr {
        "<u2" | "<f2" => 2,
        "<f4" => 4,
        "<f8" => 8,
        other => {
            return Err(format!(
                "unsupported npy dtype {other:?} (<u2 as bf16, <f2, <f4, <f8)"
            ))
        }
    };
    if count.checked_mul(width) != Some(data.len()) {
        return Err(format!(
            "npy data holds {} bytes, shape {shape:?} of {descr} needs {}",
            data.len(),
            count.saturating_mul(width)
        ));
    }
    let values = match descr {
        "<u2" => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        "<f2" => data
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        "<f4" => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        _ => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
    };
    Ok(NpyArray { shape, values })
}
