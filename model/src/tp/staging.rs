//! Tensor collectives for a backend that moves only `f32` buffers in host memory (MPI): each
//! tensor that is not already one — another dtype, or on a GPU — is copied into a host `f32`
//! buffer and back, and the bytes of those buffers are counted, so a run can report how much of
//! its traffic took the detour ([`host_staged_bytes`]).

use std::sync::atomic::{AtomicU64, Ordering};

use tch::{Device, Kind, Tensor};

use super::Collective;

/// Bytes of host `f32` buffers filled or read back for collectives since the process started.
static STAGED: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has staged through host `f32` buffers for collectives so far: tensors
/// copied off a GPU or converted from another dtype, counted once per copy (in and out count
/// twice). Zero when every collective moved its tensors where they lay.
pub fn host_staged_bytes() -> u64 {
    STAGED.load(Ordering::Relaxed)
}

/// Count `elements` f32 values staged through host memory.
pub fn record_staged(elements: usize) {
    STAGED.fetch_add(elements as u64 * 4, Ordering::Relaxed);
}

/// Whether `t` is a contiguous `f32` tensor in host memory, which a host collective can take as
/// it is.
pub fn is_host_f32(t: &Tensor) -> bool {
    t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous()
}

/// `t`'s elements, flattened, as a contiguous host `f32` tensor: `t` itself (shared) when it is
/// one already, else a counted copy.
pub fn host_f32(t: &Tensor) -> Tensor {
    if is_host_f32(t) {
        return t.shallow_clone();
    }
    record_staged(t.numel());
    t.to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous()
        .flatten(0, -1)
}

/// `t` copied to host memory in its own dtype, contiguous and flat (counted), for a collective
/// that only moves data.
pub fn host_copy(t: &Tensor) -> Tensor {
    let bytes = t.numel() * t.kind().elt_size_in_bytes();
    STAGED.fetch_add(bytes as u64, Ordering::Relaxed);
    t.to_device(Device::Cpu).contiguous().flatten(0, -1)
}

/// A host `f32` buffer for the result a collective writes into `t`: `t` itself (shared) when it
/// is one already, else fresh zeros (nothing to copy: the collective overwrites them).
pub fn host_output(t: &Tensor) -> Tensor {
    match is_host_f32(t) {
        true => t.shallow_clone(),
        false => Tensor::zeros([t.numel() as i64], (Kind::Float, Device::Cpu)),
    }
}

/// Overwrite `t` (any dtype and device) with `values`, the host `f32` tensor [`host_f32`] gave
/// for it, unless they share storage already.
pub fn copy_back(t: &Tensor, values: &Tensor) {
    if is_host_f32(t) && t.data_ptr() == values.data_ptr() {
        return;
    }
    record_staged(t.numel());
    let values = values
        .view(t.size().as_slice())
        .to_kind(t.kind())
        .to_device(t.device());
    tch::no_grad(|| t.shallow_clone().copy_(&values));
}

/// The `f32` values of a contiguous host `f32` tensor, for the span of `f`.
pub fn with_elements<R>(t: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> R {
    assert!(is_host_f32(t), "a contiguous f32 tensor on the CPU");
    let n = t.numel();
    // SAFETY: checked above to be `n` contiguous f32 values in host memory; callers hold no
    // other access to them while the slice, which does not outlive `f`, exists.
    f(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) })
}

/// [`Collective::all_reduce`] through host `f32` buffers.
pub fn all_reduce<C: Collective + ?Sized>(group: &C, t: &Tensor) {
    let host = host_f32(t);
    with_elements(&host, |data| group.all_reduce_sum(data));
    copy_back(t, &host);
}

/// [`Collective::all_gather_into`] through host `f32` buffers.
pub fn all_gather<C: Collective + ?Sized>(group: &C, input: &Tensor, output: &Tensor) {
    let (src, dst) = (host_f32(input), host_output(output));
    with_elements(&src, |data| {
        with_elements(&dst, |out| group.all_gather(data, out))
    });
    copy_back(output, &dst);
}

/// [`Collective::reduce_scatter_into`] through host `f32` buffers.
pub fn reduce_scatter<C: Collective + ?Sized>(group: &C, input: &Tensor, output: &Tensor) {
    let (src, dst) = (host_f32(input), host_output(output));
    with_elements(&src, |data| {
        with_elements(&dst, |out| group.reduce_scatter_sum(data, out))
    });
    copy_back(output, &dst);
}

/// [`Collective::broadcast`] as a sum to which only `root` contributes.
pub fn broadcast<C: Collective + ?Sized>(group: &C, t: &Tensor, root: usize) {
    if group.rank() != root {
        let _ = tch::no_grad(|| t.shallow_clone().zero_());
    }
    all_reduce(group, t);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tp::SingleRank;

    #[test]
    fn a_host_f32_tensor_is_used_in_place() {
        let t = Tensor::from_slice(&[1f32, 2.0]);
        let host = host_f32(&t);
        assert_eq!(host.data_ptr(), t.data_ptr());
        let _ = host.shallow_clone().g_add_scalar_(1.0);
        copy_back(&t, &host);
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [2.0, 3.0]);
    }

    #[test]
    fn another_dtype_is_copied_both_ways_and_counted() {
        let t = Tensor::from_slice(&[1f32, 2.0, 3.0]).to_kind(Kind::BFloat16);
        let before = host_staged_bytes();
        let host = host_f32(&t);
        let _ = host.shallow_clone().g_mul_scalar_(2.0);
        copy_back(&t, &host);
        assert!(host_staged_bytes() >= before + 2 * 3 * 4);
        assert_eq!(
            Vec::<f32>::try_from(t.to_kind(Kind::Float)).unwrap(),
            [2.0, 4.0, 6.0]
        );
    }

    #[test]
    fn a_single_rank_broadcast_from_itself_keeps_the_tensor() {
        let t = Tensor::from_slice(&[5f32, 6.0]);
        broadcast(&SingleRank, &t, 0);
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [5.0, 6.0]);
    }
}
