// What sharding the parameters (ZeRO-3) needs from libtorch: a tensor whose memory is given back
// while its shape, autograd identity and every view of it stay (FSDP's storage resize), filled
// again later without counting as an in-place write (so the graph that saved it still accepts
// it), and a hook that runs when a tensor's gradient is about to flow back through the
// operations that made it.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

namespace {

thread_local std::string last_error;

using hook_fn = void (*)(void* handle);
using drop_fn = void (*)(void* handle);

}  // namespace

extern "C" {

// Give back the memory of `t`'s storage (every view of it): its data must not be read until
// `flux_fill_storage`.
void flux_release_storage(at::Tensor* t) {
  c10::StorageImpl* s = t->storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

// Whether `t`'s storage holds its elements.
int32_t flux_storage_present(at::Tensor* t) {
  const size_t needed = (t->storage_offset() + t->numel()) * t->element_size();
  return t->storage().nbytes() >= needed ? 1 : 0;
}

// Allocate `t`'s storage again if it was given back, and copy `src` (as many elements, any dtype
// and device) into `t` without bumping its version counter. Returns 0, or 1 with
// `flux_residency_last_error` set.
int32_t flux_fill_storage(at::Tensor* t, at::Tensor* src) {
  try {
    c10::StorageImpl* s = t->storage().unsafeGetStorageImpl();
    const size_t needed = (t->storage_offset() + t->numel()) * t->element_size();
    if (s->nbytes() < needed) {
      c10::Allocator* alloc = s->allocator();
      if (alloc == nullptr) {
        alloc = c10::GetAllocator(s->device_type());
      }
      s->set_data_ptr_noswap(alloc->allocate(needed));
      s->set_nbytes(needed);
    }
    at::AutoDispatchBelowADInplaceOrView guard;
    t->copy_(src->reshape(t->sizes()));
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

// Call `fn(handle)` each time a gradient for `t` (not a leaf) has been computed, before it flows
// on into the operations that produced `t`; `drop(handle)` when the hook goes. Returns 0, or 1
// when `t` does not require a gradient.
int32_t flux_on_grad(at::Tensor* t, void* fn, void* handle, void* drop) {
  if (!t->requires_grad()) {
    return 1;
  }
  std::shared_ptr<void> owner(handle, reinterpret_cast<drop_fn>(drop));
  auto call = reinterpret_cast<hook_fn>(fn);
  t->register_hook([call, owner](const at::TensorBase&) { call(owner.get()); });
  return 0;
}

const char* flux_residency_last_error() { return last_error.c_str(); }

}  // extern "C"
