//! The float8 training recipes: how each of a linear's six casts scales, in which float8 dtype,
//! as torchao's `Float8LinearConfig.from_recipe_name` sets them.

use serde::{Deserialize, Serialize};

use crate::tp::Shard;

/// How a linear's GEMMs run in float8 (`[fp8] recipe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Float8Recipe {
    /// One scale per tensor, e4m3 forward and e5m2 gradients (torchao's default, the fastest
    /// kernels).
    #[default]
    Tensorwise,
    /// One scale per row of each GEMM operand (per token, per feature), e4m3 throughout, scales
    /// floored to powers of two.
    Rowwise,
    /// As `rowwise`, with the weight gradient in high precision and the weight tensorwise for the
    /// input gradient (torchao's `rowwise_with_gw_hp`: the most accurate).
    RowwiseGwHp,
}

/// One cast's granularity (the code's bits 0-1 in `csrc/fp8_linear.cpp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scaling {
    /// No cast: the GEMM runs in the operands' precision.
    None = 0,
    Tensorwise = 1,
    Axiswise = 2,
}

/// A float8 dtype (bit 2 of a cast's code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dtype {
    E4m3 = 0,
    E5m2 = 1,
}

/// The six casts of a linear `y = x Wᵀ` (`x [M, K]`, `W [N, K]`, gradient `g [M, N]`), in the
/// order the C++ side reads them, with the dimension each one's amax spans when axiswise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operand {
    /// `x` for the output, per token (spans K).
    Input,
    /// `W` for the output, per output feature (spans K).
    Weight,
    /// `g` for the input gradient, per token (spans N).
    GradOutput,
    /// `W` for the input gradient, per input feature (spans N).
    WeightForGradInput,
    /// `g` for the weight gradient, per output feature (spans M).
    GradOutputForGradWeight,
    /// `x` for the weight gradient, per input feature (spans M).
    InputForGradWeight,
}

const OPERANDS: [Operand; 6] = [
    Operand::Input,
    Operand::Weight,
    Operand::GradOutput,
    Operand::WeightForGradInput,
    Operand::GradOutputForGradWeight,
    Operand::InputForGradWeight,
];

impl Operand {
    /// Whether this operand, as a tensor-parallel layer split as `shard` holds it, is split along
    /// a dimension its amax spans: then the amax is a maximum over the group.
    fn split_under_amax(self, shard: Shard, scaling: Scaling) -> bool {
        let whole = scaling == Scaling::Tensorwise;
        match (self, shard) {
            (_, Shard::Replicated) => false,
            // Row-parallel: x and W split along K.
            (Operand::Input, Shard::Row) | (Operand::Weight, Shard::Row) => true,
            (Operand::WeightForGradInput, Shard::Row)
            | (Operand::InputForGradWeight, Shard::Row) => whole,
            (Operand::GradOutput, Shard::Row) | (Operand::GradOutputForGradWeight, Shard::Row) => {
                false
            }
            // Column-parallel: W and g split along N.
            (Operand::GradOutput, Shard::Column) | (Operand::WeightForGradInput, Shard::Column) => {
                true
            }
            (Operand::Weight, Shard::Column)
            | (Operand::GradOutputForGradWeight, Shard::Column) => whole,
            (Operand::Input, Shard::Column) | (Operand::InputForGradWeight, Shard::Column) => false,
        }
    }
}

impl Float8Recipe {
    /// Each cast's scaling and dtype, in [`OPERANDS`] order.
    fn casts(self) -> [(Scaling, Dtype); 6] {
        use Dtype::{E4m3, E5m2};
        use Scaling::{Axiswise, None, Tensorwise};
        match self {
            Float8Recipe::Tensorwise => [
                (Tensorwise, E4m3),
                (Tensorwise, E4m3),
                (Tensorwise, E5m2),
                (Tensorwise, E4m3),
                (Tensorwise, E5m2),
                (Tensorwise, E4m3),
            ],
            Float8Recipe::Rowwise => [(Axiswise, E4m3); 6],
            Float8Recipe::RowwiseGwHp => [
                (Axiswise, E4m3),
                (Axiswise, E4m3),
                (Axiswise, E4m3),
                (Tensorwise, E4m3),
                (None, E4m3),
                (None, E4m3),
            ],
        }
    }

    /// The six cast codes `csrc/fp8_linear.cpp` reads for a layer split as `shard` over a group
    /// of `tp_size` ranks: scaling in bits 0-1, dtype in bit 2, amax over the group in bit 3.
    pub(crate) fn cast_codes(self, shard: Shard, tp_size: usize) -> [i64; 6] {
        let casts = self.casts();
        std::array::from_fn(|i| {
            let (scaling, dtype) = casts[i];
            let reduce = tp_size > 1 && OPERANDS[i].split_under_amax(shard, scaling);
            scaling as i64 | (dtype as i64) << 2 | i64::from(reduce) << 3
        })
    }

    /// The flags beside the casts: bit 0 floors scales to powers of two; bits 1-3 turn on fast
    /// accumulation for the output, input-gradient and weight-gradient GEMMs (torchao's
    /// defaults: the output only).
    pub(crate) fn flags(self) -> i64 {
        let pow2 = self != Float8Recipe::Tensorwise;
        i64::from(pow2) | 1 << 1
    }

    /// The name `[fp8] recipe` takes.
    pub fn name(self) -> &'static str {
        match self {
            Float8Recipe::Tensorwise => "tensorwise",
            Float8Recipe::Rowwise => "rowwise",
            Float8Recipe::RowwiseGwHp => "rowwise_gw_hp",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REDUCE: i64 = 8;

    fn reduced(recipe: Float8Recipe, shard: Shard) -> Vec<bool> {
        recipe
            .cast_codes(shard, 2)
            .iter()
            .map(|c| c & REDUCE != 0)
            .collect()
    }

    #[test]
    fn tensorwise_scales_of_split_operands_are_maxima_over_the_group() {
        // Column-parallel: W and g are split, x is whole.
        assert_eq!(
            reduced(Float8Recipe::Tensorwise, Shard::Column),
            [false, true, true, true, true, false]
        );
        // Row-parallel: x and W are split, g is whole.
        assert_eq!(
            reduced(Float8Recipe::Tensorwise, Shard::Row),
            [true, true, false, true, false, true]
        );
        assert!(reduced(Float8Recipe::Tensorwise, Shard::Replicated)
            .iter()
            .all(|r| !r));
        assert!(Float8Recipe::Tensorwise
            .cast_codes(Shard::Column, 1)
            .iter()
            .all(|c| c & REDUCE == 0));
    }

    #[test]
    fn rowwise_scales_reduce_only_where_a_row_is_split() {
        // Column: g's rows (over N) for the input gradient, W's columns (over N) likewise.
        assert_eq!(
            reduced(Float8Recipe::Rowwise, Shard::Column),
            [false, false, true, true, false, false]
        );
        // Row: x's and W's rows over K for the output.
        assert_eq!(
            reduced(Float8Recipe::Rowwise, Shard::Row),
            [true, true, false, false, false, false]
        );
        // The high-precision weight gradient casts nothing; W for the input gradient is
        // tensorwise, so split either way it reduces.
        let gw_hp = Float8Recipe::RowwiseGwHp.cast_codes(Shard::Row, 2);
        assert_eq!(gw_hp[3], 1 | REDUCE);
        assert_eq!(gw_hp[4] & 3, 0);
        assert_eq!(gw_hp[5] & 3, 0);
    }

    #[test]
    fn gradients_are_e5m2_only_in_the_tensorwise_recipe() {
        let dtype = |r: Float8Recipe| -> Vec<i64> {
            r.cast_codes(Shard::Replicated, 1)
                .iter()
                .map(|c| c >> 2 & 1)
                .collect()
        };
        assert_eq!(dtype(Float8Recipe::Tensorwise), [0, 0, 1, 0, 1, 0]);
        assert_eq!(dtype(Float8Recipe::Rowwise), [0; 6]);
        assert_eq!(Float8Recipe::Tensorwise.flags(), 2);
        assert_eq!(Float8Recipe::Rowwise.flags(), 3);
    }
}
