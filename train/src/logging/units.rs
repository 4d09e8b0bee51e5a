//! Byte counts of tensors, and as the binary units reports print them.

use tch::Tensor;

/// Bytes of the elements of `tensors`.
pub fn bytes_of<'t>(tensors: impl IntoIterator<Item = &'t Tensor>) -> u64 {
    tensors
        .into_iter()
        .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

/// `bytes` in MiB (2^20 bytes).
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// `bytes` in GiB (2^30 bytes).
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_units() {
        assert_eq!(mib(3 << 20), 3.0);
        assert_eq!(gib(1 << 29), 0.5);
    }
}
