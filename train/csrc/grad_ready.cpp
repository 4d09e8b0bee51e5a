// A hook on a parameter that tells Rust when backward has accumulated its gradient, so that
// gradient buckets can be reduced while backward goes on (as PyTorch's DDP reducer does).
//
// libtorch calls a parameter's post-accumulate-grad hook right after AccumulateGrad wrote its
// `.grad`; this one calls `fn(handle, index)`. Tensors cross the boundary as `at::Tensor*`, the
// representation tch's C API uses.
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>

namespace {

using ready_fn = void (*)(void* handle, int64_t index);

struct GradReady : public torch::autograd::PostAccumulateGradHook {
  GradReady(ready_fn fn, void* handle, int64_t index) : fn(fn), handle(handle), index(index) {}
  void operator()(const torch::autograd::Variable&) override { fn(handle, index); }
  ready_fn fn;
  void* handle;
  int64_t index;
};

}  // namespace

extern "C" {

// Call `fn(handle, index)` each time backward accumulates `param`'s gradient (replacing any
// hook set before). Returns 0, or 1 when `param` is not a leaf that requires a gradient.
int32_t flux_set_grad_ready_hook(at::Tensor* param, void* fn, void* handle, int64_t index) {
  if (!param->is_leaf() || !param->requires_grad()) {
    return 1;
  }
  torch::autograd::impl::set_post_acc_grad_hooks(
      *param, std::make_unique<GradReady>(reinterpret_cast<ready_fn>(fn), handle, index));
  return 0;
}

// Remove the hook of `param`.
void flux_clear_grad_ready_hook(at::Tensor* param) {
  torch::autograd::impl::set_post_acc_grad_hooks(*param, nullptr);
}

// Drop `param`'s gradient (Python's `param.grad = None`); allowed inside its own hook.
void flux_free_grad(at::Tensor* param) { param->mutable_grad().reset(); }

}  // extern "C"
