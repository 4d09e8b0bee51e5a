// Activation recomputation ("gradient checkpointing") as a libtorch autograd function.
//
// Forward runs a block without recording a graph and keeps only its inputs; backward runs the
// block again with a graph, back-propagates through it (parameter gradients accumulate as usual)
// and returns the gradients of the inputs. The block itself is a Rust closure reached through a
// callback, as in tp_regions.cpp.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

// Run closure `handle` on `n_in` inputs, writing `n_out` new tensors into `outputs`.
// `last` is 1 on the backward recomputation (the closure's final use).
using block_fn = void (*)(void* handle, const at::Tensor* const* inputs, int64_t n_in,
                          at::Tensor** outputs, int64_t n_out, int32_t last);

thread_local std::string last_error;

torch::autograd::variable_list run(int64_t fn, int64_t handle, at::TensorList inputs, int64_t n_out,
                                   int32_t last) {
  std::vector<const at::Tensor*> in;
  for (const auto& x : inputs) in.push_back(&x);
  std::vector<at::Tensor*> out(n_out, nullptr);
  reinterpret_cast<block_fn>(fn)(reinterpret_cast<void*>(handle), in.data(), static_cast<int64_t>(in.size()),
                                 out.data(), n_out, last);
  torch::autograd::variable_list result;
  for (auto* t : out) {
    result.push_back(std::move(*t));
    delete t;
  }
  return result;
}

struct Recompute : public torch::autograd::Function<Recompute> {
  // Inputs arrive as a TensorList so that autograd sees each of them as a differentiable input.
  // The block takes the first `n_block` inputs; any after them are leaves that only make the
  // outputs differentiable (see flux_recompute).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                int64_t fn, int64_t handle, int64_t n_out,
                                                int64_t n_block) {
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["handle"] = handle;
    ctx->saved_data["n_out"] = n_out;
    ctx->saved_data["n_block"] = n_block;
    ctx->save_for_backward(inputs.vec());
    return run(fn, handle, inputs.slice(0, n_block), n_out, 0);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::autograd::variable_list inputs;
    for (const auto& x : saved) inputs.push_back(x.detach().requires_grad_(x.requires_grad()));
    torch::autograd::variable_list outputs;
    {
      at::AutoGradMode enable(true);
      auto n_block = ctx->saved_data["n_block"].toInt();
      outputs = run(ctx->saved_data["fn"].toInt(), ctx->saved_data["handle"].toInt(),
                    at::TensorList(inputs).slice(0, n_block), ctx->saved_data["n_out"].toInt(), 1);
    }
    torch::autograd::variable_list outs, gouts;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        outs.push_back(outputs[i]);
        gouts.push_back(grads[i]);
      }
    }
    if (!outs.empty()) torch::autograd::backward(outs, gouts);
    torch::autograd::variable_list result;
    for (const auto& x : inputs) result.push_back(x.requires_grad() ? x.grad() : at::Tensor());
    for (int i = 0; i < 4; ++i) result.push_back(at::Tensor());
    return result;
  }
};

}  // namespace

extern "C" {

// Apply the recomputing node to `n_in` inputs; writes `n_out` outputs. Returns 0, or 1 with the
// message in flux_recompute_last_error().
int32_t flux_recompute(const at::Tensor* const* inputs, int64_t n_in, block_fn fn, void* handle,
                       at::Tensor** outputs, int64_t n_out) {
  try {
    torch::autograd::variable_list in;
    bool differentiable = false;
    for (int64_t i = 0; i < n_in; ++i) {
      in.push_back(*inputs[i]);
      differentiable = differentiable || inputs[i]->requires_grad();
    }
    // A function's outputs require a gradient only when one of its inputs does. A block whose
    // inputs do not (the first block of a frozen model with LoRA adapters) may still hold
    // trainable parameters: a leaf input that requires a gradient makes its outputs
    // differentiable, so that backward reaches the recomputation.
    if (!differentiable && at::GradMode::is_enabled()) {
      in.push_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true));
    }
    auto out = Recompute::apply(at::TensorList(in), reinterpret_cast<int64_t>(fn),
                                reinterpret_cast<int64_t>(handle), n_out, n_in);
    for (int64_t i = 0; i < n_out; ++i) outputs[i] = new at::Tensor(out[i]);
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

const char* flux_recompute_last_error() { return last_error.c_str(); }

}  // extern "C"
