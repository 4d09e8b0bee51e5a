//! The counting CPU allocator, alone in its process so that no other test's tensors move the
//! totals.

use std::sync::Mutex;

use flux_model::tensor_memory::{count_cpu_tensors, cpu_tensor_bytes, reset_peak};
use flux_model::tp::TpContext;
use flux_model::ModelSpec;
use tch::{Device, Kind, Tensor};

const MIB: u64 = 1 << 20;

/// The tests of this file one at a time: each reads totals the other would move.
static ALONE: Mutex<()> = Mutex::new(());

#[test]
fn counts_tensors_made_and_freed_on_any_thread() {
    let _alone = ALONE.lock().unwrap();
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

#[test]
fn a_bf16_model_is_built_without_a_whole_f32_copy() {
    let _alone = ALONE.lock().unwrap();
    count_cpu_tensors();
    let table: toml::Table = "hidden_size = 256\nnum_attention_heads = 4\nnum_joint_layers = 2\n\
                              num_single_layers = 2\naxes_dim = [16, 24, 24]"
        .parse()
        .unwrap();
    let spec = ModelSpec::from_table(table).unwrap();
    let params: u64 = spec.num_params();
    let largest = spec.param_specs(1).iter().map(|s| s.numel()).max().unwrap();
    reset_peak();
    let before = cpu_tensor_bytes().live;
    let model = spec
        .build_as(Device::Cpu, Kind::BFloat16, TpContext::single())
        .unwrap();
    let after = cpu_tensor_bytes();
    assert_eq!(model.kind(), Kind::BFloat16);
    assert_eq!(after.live - before, 2 * params, "the weights, in bf16");
    // Each weight is initialised whole in f32 and rounded as it is created: at most one f32
    // weight beside the bf16 ones, never the 4 bytes per parameter of an f32 model.
    let peak = after.peak - before;
    assert!(
        peak <= 2 * params + 8 * largest,
        "{peak} > {} + 8 × {largest}",
        2 * params
    );
    assert!(peak < 3 * params, "{peak}");
}

/// With a GPU the caching allocator answers; without one, the error says why (no crash).
#[test]
fn cuda_tensor_bytes_come_from_the_caching_allocator_or_say_why_not() {
    let _alone = ALONE.lock().unwrap();
    let r = flux_model::tensor_memory::tensor_bytes(Device::Cuda(0));
    if tch::Cuda::is_available() {
        let before = r.unwrap().live;
        let t = Tensor::zeros([1024, 256], (Kind::Float, Device::Cuda(0)));
        let now = flux_model::tensor_memory::tensor_bytes(Device::Cuda(0)).unwrap();
        assert!(now.live >= before + MIB && now.peak >= now.live, "{now:?}");
        drop(t);
    } else {
        assert!(!r.unwrap_err().is_empty());
    }
}
