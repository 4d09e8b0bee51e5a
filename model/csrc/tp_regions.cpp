// Tensor-parallel region boundaries as libtorch autograd functions (Megatron's f and g).
//
//   copy_to_region:     forward identity,          backward all-reduce(grad)
//   reduce_from_region: forward all-reduce(input), backward identity
//
// The all-reduce itself is a callback into Rust (the MPI communicator lives there); tch has no
// Rust-side custom autograd function, so these two small nodes are the bridge. Tensors cross the
// boundary as `at::Tensor*`, the representation tch's C API uses.
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <string>

namespace {

// Sum `t` (contiguous, owned by the caller) in place across the group behind `handle`.
// `kind` is 0 for a forward reduction and 1 for a backward one (the Rust side counts them).
using reduce_fn = void (*)(void* handle, at::Tensor* t, int32_t kind);

thread_local std::string last_error;

void reduce(const torch::autograd::AutogradContext* ctx, at::Tensor& t, int32_t kind) {
  auto fn = reinterpret_cast<reduce_fn>(ctx->saved_data.at("fn").toInt());
  auto handle = reinterpret_cast<void*>(ctx->saved_data.at("handle").toInt());
  fn(handle, &t, kind);
}

struct CopyToRegion : public torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                               int64_t fn, int64_t handle) {
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["handle"] = handle;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto g = grads[0].contiguous().clone();
    reduce(ctx, g, 1);
    return {g, at::Tensor(), at::Tensor()};
  }
};

struct ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                               int64_t fn, int64_t handle) {
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["handle"] = handle;
    auto out = x.contiguous().clone();
    reduce(ctx, out, 0);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

template <typename F>
at::Tensor* guarded(F&& f) {
  try {
    return new at::Tensor(f());
  } catch (const std::exception& e) {
    last_error = e.what();
    return nullptr;
  }
}

}  // namespace

extern "C" {

at::Tensor* flux_tp_copy_to_region(const at::Tensor* x, reduce_fn fn, void* handle) {
  return guarded([&] {
    return CopyToRegion::apply(*x, reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(handle));
  });
}

at::Tensor* flux_tp_reduce_from_region(const at::Tensor* x, reduce_fn fn, void* handle) {
  return guarded([&] {
    return ReduceFromRegion::apply(*x, reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(handle));
  });
}

const char* flux_tp_last_error() { return last_error.c_str(); }

}  // extern "C"
