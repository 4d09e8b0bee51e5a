//! Bucketed gradient all-reduce: many parameters' gradients summed with few collectives.

use tch::{Kind, Tensor};

use crate::tp::Collective;

/// The default largest bucket, in elements (100 MiB of f32).
pub const BUCKET_ELEMENTS: usize = 25 * 1024 * 1024;

/// Sum the gradients of `params` over `comm` and multiply them by `scale`, packing them into
/// flat buckets of at most `bucket_elements` (a larger gradient alone) so that each bucket is one
/// all-reduce. Parameters without a gradient are skipped. Returns the number of all-reduces
/// issued.
pub fn all_reduce_grads(
    params: &[Tensor],
    comm: &dyn Collective,
    scale: f64,
    bucket_elements: usize,
) -> u64 {
    if comm.size() == 1 && scale == 1.0 {
        // A group of one: the sum is the gradient itself.
        return 0;
    }
    let grads: Vec<Tensor> = params
        .iter()
        .map(Tensor::grad)
        .filter(Tensor::defined)
        .collect();
    let mut buckets = 0;
    let mut start = 0;
    while start < grads.len() {
        let mut end = start;
        let mut elements = 0;
        while end < grads.len()
            && (end == start || elements + grads[end].numel() <= bucket_elements)
        {
            elements += grads[end].numel();
            end += 1;
        }
        reduce_bucket(&grads[start..end], comm, scale);
        buckets += 1;
        start = end;
    }
    buckets
}

fn reduce_bucket(grads: &[Tensor], comm: &dyn Collective, scale: f64) {
    let flat = pack(grads);
    comm.all_reduce(&flat);
    if scale != 1.0 {
        let _ = flat.shallow_clone().g_mul_scalar_(scale);
    }
    unpack(grads, &flat);
}

/// `grads` flattened end to end into one contiguous `f32` tensor `[Σ numel]` on their device:
/// the bucket a collective sums (in `f32` whatever the gradients' dtype).
pub fn pack(grads: &[Tensor]) -> Tensor {
    let flat: Vec<Tensor> = grads
        .iter()
        .map(|g| g.to_kind(Kind::Float).flatten(0, -1))
        .collect();
    Tensor::cat(&flat, 0)
}

/// Overwrite `grads` with their values in `flat` (as [`pack`] laid them out), converted to each
/// gradient's dtype and device.
pub fn unpack(grads: &[Tensor], flat: &Tensor) {
    let mut offset = 0;
    for g in grads {
        let n = g.numel() as i64;
        let piece = flat
            .narrow(0, offset, n)
            .view(g.size().as_slice())
            .to_kind(g.kind())
            .to_device(g.device());
        tch::no_grad(|| g.shallow_clone().copy_(&piece));
        offset += n;
    }
}
