//! One low-rank adapter: the update `(α/r) · B · A · x` a `Linear` adds to its output.

use std::cell::Cell;
use std::rc::Rc;

use tch::Tensor;

use crate::activations::{Saved, Width};

/// LoRA's `A [r, in]` and `B [out, r]` on one rank, split like the base weight: under a
/// column-parallel base this rank holds `B`'s rows of its output slice (`A` whole), under a
/// row-parallel base `A`'s columns of its input slice (`B` whole).
#[derive(Debug)]
pub struct Adapter {
    /// Down-projection `A`, `[r, in]` or `[r, in/tp]`.
    pub a: Tensor,
    /// Up-projection `B`, `[out, r]` or `[out/tp, r]`; starts at zero, so a new adapter changes
    /// nothing.
    pub b: Tensor,
    /// `α / r`.
    pub scale: f64,
    /// Dropout on the adapter's input while training.
    pub dropout: f64,
    /// Whether the model is in a training forward pass (shared by all adapters of a model).
    pub training: Rc<Cell<bool>>,
}

impl Adapter {
    /// `x [.., in]` (this rank's input to the layer) → the update `[.., out]` of this rank's
    /// output (a partial sum, like the base's, under a row-parallel base), in `x`'s dtype;
    /// computed in the adapter's own dtype (f32 adapters on a bf16 base).
    pub fn delta(&self, x: &Tensor) -> Tensor {
        let input = x.to_kind(self.a.kind());
        let input = if self.dropout > 0.0 {
            input.dropout(self.dropout, self.training.get())
        } else {
            input
        };
        (input
            .linear::<Tensor>(&self.a, None)
            .linear::<Tensor>(&self.b, None)
            * self.scale)
            .to_kind(x.kind())
    }
}

/// What one adapter saves for backward, for `input`, the saved input of the linear it wraps
/// ([`Serves::Weight`](crate::activations::Serves)): its own copy of the input for `A`'s
/// gradient (cast to f32 where the adapter computes in f32 (`f32`) and the activations do not;
/// under dropout the dropped copy beside its mask), and `A`'s output, `rank` per row, for `B`'s.
/// The frozen base linear itself saves no input.
pub fn saved_by_adapter(input: &Saved, rank: i64, f32: bool, dropout: bool) -> Vec<Saved> {
    let copy = Saved {
        f32: input.f32 || f32,
        ..*input
    };
    let copies = if dropout { 2 } else { 1 };
    let down = Saved::new(input.rows, rank as f64, Width::Gathered).serving(input.serves);
    let down = Saved { f32, ..down };
    std::iter::repeat_n(copy, copies).chain([down]).collect()
}
