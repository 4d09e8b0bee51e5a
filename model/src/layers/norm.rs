//! LayerNorm without weight or bias, as every Flux modulation uses.

use tch::Tensor;

/// LayerNorm over the last dimension without weight or bias: `(x - mean) / sqrt(var + eps)`.
///
/// `x [.., D]` → `[.., D]`.
pub fn layer_norm(x: &Tensor, eps: f64) -> Tensor {
    let width = *x
        .size()
        .last()
        .expect("layer_norm needs at least one dimension");
    x.layer_norm([width], None::<Tensor>, None::<Tensor>, eps, true)
}
