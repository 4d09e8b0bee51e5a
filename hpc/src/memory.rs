//! The machine's memory, and how the process' C allocator treats large freed blocks. libtorch allocates every tensor with
//! `malloc`; glibc serves blocks above its mmap threshold (128 KiB, rising to at most 32 MiB) with
//! fresh `mmap`s and returns them on free, so every training step faults in and zeroes its
//! activations' pages again. Keeping freed memory in the heap for reuse removes that work.

/// Largest mmap threshold glibc accepts on 64-bit Linux, bytes.
const MMAP_THRESHOLD: i32 = 32 << 20;

/// Set `FLUX_HPC_MALLOC=system` to keep glibc's defaults (to compare, or under another
/// allocator such as jemalloc preloaded).
pub const ENV: &str = "FLUX_HPC_MALLOC";

/// Serve allocations up to 32 MiB from the heap and never trim freed memory back to the OS, so
/// that the buffers of one step are reused by the next (the peak resident set is unchanged: it
/// is what a step needs anyway). Call once, first thing in `main`. Measured in
/// docs/benchmarks.md.
pub fn reuse_freed_buffers() {
    if std::env::var(ENV).is_ok_and(|v| v == "system") {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before any other thread
    // exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// The machine's physical memory in bytes (`MemTotal` of `/proc/meminfo`); `None` where it
/// cannot be read.
pub fn physical_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    mem_total(&text)
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_total_is_read_in_kib() {
        let text = "MemTotal:       24576000 kB\nMemFree:  1 kB\n";
        assert_eq!(mem_total(text), Some(24_576_000 * 1024));
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert!(physical_bytes().is_some_and(|b| b > 0));
    }
}
