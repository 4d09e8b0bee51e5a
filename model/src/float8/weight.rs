//! A frozen weight held in float8: e4m3 values with one f32 scale per output row, half of bf16's
//! bytes, widened to the compute dtype each time the layer runs (what fine-tuners call an "fp8
//! base": kohya's `--fp8_base`, ai-toolkit's `quantize`).

use tch::{Kind, Tensor};

use crate::float8::ffi;

/// e4m3's largest finite value.
const E4M3_MAX: f64 = 448.0;

/// A weight `[out, in]` as e4m3 values and per-row scales: `weight ≈ data · scale`.
#[derive(Debug)]
pub struct Float8Weight {
    /// `[out, in]` e4m3.
    data: Tensor,
    /// `[out, 1]` f32: each row's amax / 448 (1 for an all-zero row).
    scale: Tensor,
}

impl Float8Weight {
    /// `weight [out, in]` (any float dtype) scaled row by row into e4m3's range and rounded.
    pub fn quantize(weight: &Tensor) -> Self {
        tch::no_grad(|| {
            let w = weight.to_kind(Kind::Float);
            let amax = w.abs().amax([1], true);
            let scale = (&amax / E4M3_MAX).where_self(&amax.gt(0.0), &amax.ones_like());
            let data = (&w / &scale)
                .clamp(-E4M3_MAX, E4M3_MAX)
                .to_kind(Kind::Float8e4m3fn);
            Self { data, scale }
        })
    }

    /// The weight `[out, in]` in `kind` (the layer's compute dtype).
    pub fn dequantize(&self, kind: Kind) -> Tensor {
        (self.data.to_kind(Kind::Float) * &self.scale).to_kind(kind)
    }

    /// `x [.., in] · weightᵀ → [.., out]` in `x`'s dtype, differentiable in `x`: the graph keeps
    /// this float8 weight, widening it again for the input gradient, not a widened copy.
    pub fn product(&self, x: &Tensor) -> Tensor {
        // SAFETY: the tensors are live for the call; the result is checked at once.
        unsafe {
            let out =
                ffi::flux_fp8_frozen_linear(x.as_ptr(), self.data.as_ptr(), self.scale.as_ptr());
            ffi::returned(out, "frozen float8 linear")
        }
    }

    /// The weight's shape, `[out, in]`.
    pub fn size(&self) -> Vec<i64> {
        self.data.size()
    }

    /// Bytes held: one per value and four per row.
    pub fn bytes(&self) -> u64 {
        (self.data.numel() + 4 * self.scale.numel()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_keep_their_own_range_to_e4m3_precision() {
        // Rows four orders of magnitude apart, and a zero row.
        let w = Tensor::from_slice(&[1e-3f32, -2e-3, 5e-4, 10.0, -20.0, 3.0, 0.0, 0.0, 0.0])
            .view([3, 3]);
        let q = Float8Weight::quantize(&w);
        let back = q.dequantize(Kind::Float);
        let rel = ((&back - &w).abs() / w.abs().clamp_min(1e-12))
            .max()
            .double_value(&[]);
        // e4m3 keeps 3 mantissa bits: a relative error of at most 2⁻⁴ (rows whose amax maps to
        // 448 exactly round their largest entries exactly).
        assert!(rel <= 1.0 / 16.0, "relative error {rel}");
        assert_eq!(back.get(2).abs().sum(Kind::Float).double_value(&[]), 0.0);
        assert_eq!(q.bytes(), 9 + 12);
    }
}
