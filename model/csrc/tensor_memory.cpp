// Counting the bytes of tensors. On the CPU: an allocator that takes libtorch's place and keeps
// the live and peak totals of the memory it hands out, on every thread, the analogue of CUDA's
// `max_memory_allocated` (tensors only, none of the kernels' own workspaces or the runtime's
// libraries, which the resident set size adds on top). On accelerators: the caching allocator's
// own statistics, read through c10's device-generic interface (no CUDA headers needed).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace {

thread_local std::string last_error;

// Room kept before each block for its size; a multiple of libtorch's 64-byte alignment, so the
// data stays aligned.
constexpr size_t kHeader = 64;

std::atomic<int64_t> live_bytes{0};
std::atomic<int64_t> peak_bytes{0};

void count(int64_t delta) {
  const int64_t now = live_bytes.fetch_add(delta) + delta;
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
}

void release(void* data) {
  if (data == nullptr) {
    return;
  }
  char* base = static_cast<char*>(data) - kHeader;
  count(-static_cast<int64_t>(*reinterpret_cast<size_t*>(base)));
  c10::free_cpu(base);
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    }
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    count(static_cast<int64_t>(n));
    void* data = base + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator counting_allocator;
std::once_flag installed;

}  // namespace

extern "C" {

// From now on every new CPU tensor's memory is counted (tensors that exist already are not, and
// free as before). Idempotent.
void flux_count_cpu_tensor_memory() {
  std::call_once(installed, [] { c10::SetCPUAllocator(&counting_allocator, /*priority=*/100); });
}

// Bytes of counted CPU tensors alive now.
int64_t flux_cpu_tensor_bytes_live() {
  return live_bytes.load();
}

// The most bytes of counted CPU tensors alive at once since counting began or the last reset.
int64_t flux_cpu_tensor_bytes_peak() {
  return peak_bytes.load();
}

// Start the peak again from the bytes alive now.
void flux_cpu_tensor_bytes_reset_peak() {
  peak_bytes.store(live_bytes.load());
}

// Bytes the caching allocator of device `type` (c10::DeviceType), index `index`, has handed to
// tensors now and at most since its peak was last reset. Returns 0, or 1 with
// `flux_tensor_memory_last_error` set (no such allocator, e.g. CUDA on a CPU-only build).
int32_t flux_device_tensor_bytes(int32_t type, int32_t index, int64_t* live, int64_t* peak) {
  try {
    auto* allocator = c10::getDeviceAllocator(static_cast<c10::DeviceType>(type));
    const auto stats = allocator->getDeviceStats(static_cast<c10::DeviceIndex>(index));
    const auto& bytes = stats.allocated_bytes[static_cast<size_t>(
        c10::CachingAllocator::StatType::AGGREGATE)];
    *live = bytes.current;
    *peak = bytes.peak;
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

const char* flux_tensor_memory_last_error() {
  return last_error.c_str();
}

}  // extern "C"
