//! Float8 weight files: the two float8 formats safetensors stores (`F8_E4M3`, `F8_E5M2`) decoded
//! to f32, and ComfyUI's "scaled fp8" files, whose float8 weights carry a `scale_weight` each.
//!
//! A scaled file holds, beside a weight `X.weight` in float8, `X.scale_weight` (f32, one value or
//! one per output row) such that the weight is `X.weight · X.scale_weight`; it may also hold
//! `X.scale_input` (for ComfyUI's float8 matmuls) and an empty `scaled_fp8` marker. The reader
//! folds each scale into its weight and hides the rest, so a scaled file reads as the weights
//! it stands for wherever weights are read.

use std::collections::BTreeMap;

use crate::convert::TensorInfo;

/// The marker tensor ComfyUI puts in scaled files (any prefix).
const MARKER: &str = "scaled_fp8";
const SCALE: &str = ".scale_weight";
const INPUT_SCALE: &str = ".scale_input";

/// The value of an `F8_E4M3` byte (e4m3fn: bias 7, no infinities, `S.1111.111` NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from(b >> 3 & 0xf), f32::from(b & 7));
    sign * match exp {
        15 if b & 7 == 7 => f32::NAN,
        0 => man / 8.0 * 2f32.powi(-6),
        _ => (1.0 + man / 8.0) * 2f32.powi(exp - 7),
    }
}

/// The value of an `F8_E5M2` byte (bias 15, IEEE-like infinities and NaNs).
pub fn e5m2_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from(b >> 2 & 0x1f), f32::from(b & 3));
    sign * match exp {
        31 if b & 3 == 0 => f32::INFINITY,
        31 => f32::NAN,
        0 => man / 4.0 * 2f32.powi(-14),
        _ => (1.0 + man / 4.0) * 2f32.powi(exp - 15),
    }
}

/// Whether `dtype` is a float8 type.
pub fn is_float8(dtype: &str) -> bool {
    matches!(dtype, "F8_E4M3" | "F8_E5M2")
}

/// Take the scaled-fp8 entries out of `tensors`: each `X.scale_weight` of a weight `X.weight`
/// (read by `read`), every `X.scale_input` and the marker; the scales by weight name. A scale
/// that is not finite and positive, has a shape that is neither one value nor one per row of
/// its weight, or has no float8 weight beside it is refused, naming it.
pub fn fold_scales(
    tensors: &mut BTreeMap<String, TensorInfo>,
    mut read: impl FnMut(&str) -> Result<Vec<f32>, String>,
) -> Result<BTreeMap<String, Vec<f32>>, String> {
    let hidden: Vec<String> = tensors
        .keys()
        .filter(|n| {
            n.as_str() == MARKER
                || n.ends_with(&format!(".{MARKER}"))
                || n.ends_with(INPUT_SCALE)
                || n.ends_with(SCALE)
        })
        .cloned()
        .collect();
    let mut scales = BTreeMap::new();
    for name in hidden {
        let info = tensors.remove(&name).expect("listed above");
        let Some(module) = name.strip_suffix(SCALE) else {
            continue;
        };
        let weight_name = format!("{module}.weight");
        let weight = tensors
            .get(&weight_name)
            .filter(|w| is_float8(&w.dtype))
            .ok_or_else(|| format!("`{name}` scales no float8 weight `{weight_name}`"))?;
        let numel: usize = info.shape.iter().product();
        let rows = weight.shape.first().copied().unwrap_or(1);
        let shape_ok = numel == 1 || (numel == rows && info.shape.first() == Some(&rows));
        if !shape_ok {
            return Err(format!(
                "`{name}` has shape {:?}: a scale is one value or one per row of `{weight_name}` \
                 {:?}",
                info.shape, weight.shape
            ));
        }
        let values = read(&name)?;
        if let Some(bad) = values.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
            return Err(format!(
                "`{name}` holds {bad}: a weight scale must be finite and positive"
            ));
        }
        scales.insert(weight_name, values);
    }
    Ok(scales)
}

/// `values` (a weight's, row-major) multiplied by its `scale`: one value, or one per row.
pub fn apply_scale(values: &mut [f32], scale: &[f32]) {
    let per_row = values.len() / scale.len().max(1);
    for (row, s) in values.chunks_mut(per_row.max(1)).zip(scale.iter().cycle()) {
        row.iter_mut().for_each(|v| *v *= s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float8_bytes_decode_to_their_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e5m2_to_f32(0x3c), 1.0);
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
        assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
        assert_eq!(e5m2_to_f32(0x7c), f32::INFINITY);
        assert_eq!(e5m2_to_f32(0xfc), f32::NEG_INFINITY);
        assert!(e5m2_to_f32(0x7d).is_nan());
    }

    #[test]
    fn scales_multiply_whole_weights_or_their_rows() {
        let mut v = [1.0, 2.0, 3.0, 4.0];
        apply_scale(&mut v, &[0.5]);
        assert_eq!(v, [0.5, 1.0, 1.5, 2.0]);
        apply_scale(&mut v, &[2.0, 10.0]);
        assert_eq!(v, [1.0, 2.0, 15.0, 20.0]);
    }
}
