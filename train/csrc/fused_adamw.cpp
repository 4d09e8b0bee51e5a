// One AdamW update over many tensors with libtorch's fused kernel (`_fused_adamw_`, what
// `torch.optim.AdamW(fused=True)` calls): each tensor is read and written once per step instead
// of once per elementwise operation. Tensors cross the boundary as `at::Tensor*`, the
// representation tch's C API uses.
#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace {

thread_local std::string last_error;

std::vector<at::Tensor> list(at::Tensor* const* tensors, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) out.push_back(*tensors[i]);
  return out;
}

}  // namespace

extern "C" {

// Call with gradient recording off (the Rust side runs it under tch::no_grad).
// Update `params` in place from `grads`, `exp_avgs` and `exp_avg_sqs` (all f32, same shapes),
// with `steps` holding each tensor's step count (already incremented). Returns 0, or 1 with the
// message in `flux_fused_adamw_error()`.
int32_t flux_fused_adamw(at::Tensor* const* params, at::Tensor* const* grads,
                         at::Tensor* const* exp_avgs, at::Tensor* const* exp_avg_sqs,
                         at::Tensor* const* steps, int64_t n, double lr, double beta1,
                         double beta2, double weight_decay, double eps) {
  try {
    at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n), list(exp_avg_sqs, n),
                      {}, list(steps, n), lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

const char* flux_fused_adamw_error() { return last_error.c_str(); }

}  // extern "C"
