//! The counting CPU allocator, alone in its process so that no other test's tensors move the
//! totals.

use flux_model::tensor_memory::{count_cpu_tensors, cpu_tensor_bytes, reset_peak};
use tch::{Device, Kind, Tensor};

const MIB: u64 = 1 << 20;

#[test]
fn counts_tensors_made_and_freed_on_any_thread() {
    count_cpu_tensors();
    let before = cpu_tensor_bytes().live;
    let a = Tensor::zeros([1024, 256], (Kind::Float, Device::Cpu));
    assert_eq!(cpu_tensor_bytes().live, before + MIB, "a: 1 MiB");
    reset_peak();
    let start = cpu_tensor_bytes();
    assert_eq!(start.peak, start.live);
    // Made on another thread, freed on this one.
    let b = std::thread::spawn(|| Tensor::ones([512, 256], (Kind::Float, Device::Cpu)))
        .join()
        .unwrap();
    let sum = &a.narrow(0, 0, 512) + &b;
    let grown = cpu_tensor_bytes();
    assert_eq!(grown.live, start.live + MIB, "b and sum, 512 KiB each");
    drop((a, b, sum));
    let after = cpu_tensor_bytes();
    assert_eq!(after.live, before, "everything counted is freed");
    assert_eq!(after.peak, grown.live, "the peak stays");
}
