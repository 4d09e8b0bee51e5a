//! How many bytes CPU tensors hold: live now, and at most since counting began. The CPU analogue
//! of CUDA's `memory_allocated` / `max_memory_allocated`, which `flux-hpc plan` predicts and
//! `flux-hpc bench step` measures. Counting covers tensors only; the resident set size adds
//! libtorch's kernels' own workspaces, MPI's buffers and the loaded libraries
//! (`csrc/tensor_memory.cpp`).

extern "C" {
    fn flux_count_cpu_tensor_memory();
    fn flux_cpu_tensor_bytes_live() -> i64;
    fn flux_cpu_tensor_bytes_peak() -> i64;
    fn flux_cpu_tensor_bytes_reset_peak();
}

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
