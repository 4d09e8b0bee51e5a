//! Wall-clock helpers shared by the commands that time the model (`demo`, `bench`).

use tch::Device;

/// The median of `values` (seconds, or any other unit): the middle value, or the mean of the two
/// middle ones for an even count; NaN for none.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Wait for the work queued on `device`, so that a wall time covers it (CPU work is synchronous).
pub fn synchronize(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}
