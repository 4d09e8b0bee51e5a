//! How many bytes tensors hold on a device: live now, and at most since counting began. What
//! `flux-hpc plan` predicts and `flux-hpc bench step` and training measure. On the CPU a counting
//! allocator takes libtorch's place (the analogue of CUDA's `max_memory_allocated`; the resident
//! set size adds libtorch's kernels' own workspaces, MPI's buffers and the loaded libraries); on
//! CUDA the caching allocator's own statistics are read (`csrc/tensor_memory.cpp`).

use std::ffi::CStr;
use std::os::raw::c_char;

use tch::Device;

extern "C" {
    fn flux_count_cpu_tensor_memory();
    fn flux_cpu_tensor_bytes_live() -> i64;
    fn flux_cpu_tensor_bytes_peak() -> i64;
    fn flux_cpu_tensor_bytes_reset_peak();
    fn flux_device_tensor_bytes(type_: i32, index: i32, live: *mut i64, peak: *mut i64) -> i32;
    fn flux_tensor_memory_last_error() -> *const c_char;
}

/// c10's `DeviceType::CUDA`.
const CUDA: i32 = 1;

/// Bytes of counted CPU tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorBytes {
    /// Alive now.
    pub live: u64,
    /// The most alive at once since counting began or [`reset_peak`].
    pub peak: u64,
}

/// Count the memory of every CPU tensor created from now on, on every thread (libtorch's CPU
/// allocator is replaced by a counting one; tensors that exist already are not counted).
/// Idempotent.
pub fn count_cpu_tensors() {
    // SAFETY: installs a static allocator once.
    unsafe { flux_count_cpu_tensor_memory() }
}

/// The counted bytes (zeros before [`count_cpu_tensors`]).
pub fn cpu_tensor_bytes() -> TensorBytes {
    // SAFETY: reads two atomics.
    let (live, peak) = unsafe { (flux_cpu_tensor_bytes_live(), flux_cpu_tensor_bytes_peak()) };
    TensorBytes {
        live: live.max(0) as u64,
        peak: peak.max(0) as u64,
    }
}

/// Start the peak again from the bytes alive now.
pub fn reset_peak() {
    // SAFETY: writes an atomic.
    unsafe { flux_cpu_tensor_bytes_reset_peak() }
}

/// The bytes of tensors on `device`: on the CPU those [`count_cpu_tensors`] counts (zeros before
/// it), on CUDA the caching allocator's since the process started. Fails, with libtorch's
/// reason, where the device has no caching allocator to ask.
pub fn tensor_bytes(device: Device) -> Result<TensorBytes, String> {
    let index = match device {
        Device::Cpu => return Ok(cpu_tensor_bytes()),
        Device::Cuda(index) => index as i32,
        other => return Err(format!("tensor memory is not counted on {other:?}")),
    };
    let (mut live, mut peak) = (0i64, 0i64);
    // SAFETY: two out-pointers to live locals; the error string is copied before the next call.
    let rc = unsafe { flux_device_tensor_bytes(CUDA, index, &mut live, &mut peak) };
    if rc != 0 {
        let reason = unsafe { CStr::from_ptr(flux_tensor_memory_last_error()) };
        return Err(reason.to_string_lossy().into_owned());
    }
    Ok(TensorBytes {
        live: live.max(0) as u64,
        peak: peak.max(0) as u64,
    })
}
