// Float8 training linears as a libtorch autograd function: y = x Wᵀ with its three GEMMs
// (output, input gradient, weight gradient) run by at::_scaled_mm on float8 operands that are
// scaled dynamically, the numerics of torchao's Float8Linear:
//
//   amax   = max |t| over the tensor (tensorwise) or along one axis, kept as a dimension (axiswise)
//   scale  = float32(fp8_max / max(float64(amax), 1e-12)), optionally floored to a power of two
//   t_fp8  = saturate(float32(t) · scale) in e4m3 or e5m2
//   y      = _scaled_mm(a_fp8, b_fp8, 1 / scale_a, 1 / scale_b) in the operands' dtype
//
// with an axiswise GEMM that does not use fast accumulation applying both inverse scales after
// the product, as torchao does. An operand whose amax spans a dimension split over the
// tensor-parallel group has its amax replaced by the group's maximum (a Rust callback), so every
// rank scales by the scale one process would use. Each of the six casts (input, weight for the
// output; gradient, weight for the input gradient; gradient, input for the weight gradient) is
// described by one code from the Rust side: bits 0-1 the scaling (0 none: that GEMM runs in the
// operands' own precision, 1 tensorwise, 2 axiswise), bit 2 the dtype (0 e4m3fn, 1 e5m2), bit 3
// whether its amax is reduced over the group.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "guarded.h"

#include <array>
#include <cstdint>
#include <string>

namespace {

// Replace `amax` (contiguous, float, small) in place by its elementwise maximum over the group
// behind `handle`.
using amax_fn = void (*)(void* handle, at::Tensor* amax);

thread_local std::string last_error;

enum Scaling : int64_t { kNone = 0, kTensorwise = 1, kAxiswise = 2 };

struct Cast {
  Scaling scaling;
  at::ScalarType dtype;
  bool reduce;

  static Cast decode(int64_t code) {
    return {static_cast<Scaling>(code & 3), (code & 4) ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn,
            (code & 8) != 0};
  }
};

// Flags beside the casts: bit 0 floors scales to powers of two; bits 1-3 turn on fast
// accumulation for the output, input-gradient and weight-gradient GEMMs.
struct Flags {
  bool pow2;
  std::array<bool, 3> fast_accum;

  static Flags decode(int64_t f) { return {(f & 1) != 0, {(f & 2) != 0, (f & 4) != 0, (f & 8) != 0}}; }
};

struct Group {
  int64_t fn, handle;

  void max(at::Tensor& amax) const {
    reinterpret_cast<amax_fn>(fn)(reinterpret_cast<void*>(handle), &amax);
  }
};

// A float8 operand: its data and the scale that multiplied it (0-dim when tensorwise, the amax's
// keep-dim shape when axiswise).
struct Scaled {
  at::Tensor data, scale;
  bool axiswise;

  Scaled t() const { return {data.t(), axiswise ? scale.t() : scale, axiswise}; }
};

double fp8_max(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn ? 448.0 : 57344.0; }

// Cast `hp` to float8 as `cast` says, scaling along `axis` when axiswise.
Scaled to_float8(const at::Tensor& hp, Cast cast, int64_t axis, bool pow2, const Group& group) {
  at::NoGradGuard no_grad;
  auto amax = cast.scaling == kTensorwise ? hp.abs().max() : at::amax(hp.abs(), {axis}, true);
  if (cast.reduce) {
    amax = amax.contiguous();
    group.max(amax);
  }
  const double max = fp8_max(cast.dtype);
  auto scale = (amax.to(at::kDouble).clamp_min(1e-12).reciprocal() * max).to(at::kFloat);
  if (pow2) scale = at::exp2(at::floor(at::log2(scale)));
  auto data = (hp.to(at::kFloat) * scale).clamp(-max, max).to(cast.dtype);
  return {data, scale, cast.scaling == kAxiswise};
}

bool row_major(const at::Tensor& t) { return t.stride(0) > t.stride(1); }

// Pad the inner dimension K of `a [M, K]` (row-major) and `b [K, N]` (column-major) with zeros to a
// multiple of 16, which GPU float8 GEMMs need (as torchao's `pad_inner_dim`): the weight
// gradient's inner dimension is the token count, which need not be one. Zeros add nothing; the
// layouts stay. Float8 bytes are padded as bytes (0 is +0 in both formats).
void pad_inner(at::Tensor& a, at::Tensor& b) {
  const int64_t k = a.size(1), pad = (16 - k % 16) % 16;
  if (pad == 0) return;
  auto zeros = [pad](const at::Tensor& rows) {
    return at::constant_pad_nd(rows.view(at::kByte), {0, pad}).view(rows.scalar_type());
  };
  a = zeros(a);
  b = zeros(b.t().contiguous()).t();
}

// `a [M, K] · b [K, N]` in `out` dtype, laid out and scaled as torchao's float8 mm leaves them:
// a row-major, b column-major, the inner dimension padded to a multiple of 16, a tensorwise scale
// beside an axiswise one repeated to a row or column, and an axiswise product without fast
// accumulation scaled after the GEMM.
at::Tensor scaled_mm(const Scaled& a, const Scaled& b, at::ScalarType out, bool fast_accum) {
  auto a_data = row_major(a.data) ? a.data : a.data.contiguous();
  auto b_data = row_major(b.data) ? b.data.t().contiguous().t() : b.data;
  pad_inner(a_data, b_data);
  auto a_scale = a.scale, b_scale = b.scale;
  if (!a.axiswise && b.axiswise) a_scale = a_scale.repeat({a_data.size(0)}).reshape({-1, 1});
  if (a.axiswise && !b.axiswise) b_scale = b_scale.repeat({b_data.size(1)}).reshape({1, -1});
  auto a_inverse = a_scale.reciprocal(), b_inverse = b_scale.reciprocal();
  const bool rowwise = a_scale.dim() == 2 && a_scale.size(0) == a_data.size(0) &&
                       a_scale.size(1) == 1 && b_scale.dim() == 2 && b_scale.size(0) == 1 &&
                       b_scale.size(1) == b_data.size(1);
  at::Tensor post;
  if (rowwise && !fast_accum) {
    post = a_inverse * b_inverse;
    a_inverse = a_inverse.new_ones({});
    b_inverse = a_inverse.new_ones({});
  }
  const bool via_bf16 = rowwise && (out == at::kFloat || out == at::kHalf);
  auto y = at::_scaled_mm(a_data, b_data, a_inverse, b_inverse, {}, {},
                          via_bf16 ? at::kBFloat16 : out, fast_accum);
  if (post.defined()) y.mul_(post);
  return via_bf16 ? y.to(out) : y;
}

struct Settings {
  std::array<Cast, 6> casts;
  Flags flags;
  Group group;

  static Settings saved(const torch::autograd::AutogradContext* ctx) {
    const auto& d = ctx->saved_data;
    const auto codes = d.at("casts").toIntVector();
    Settings s{};
    for (size_t i = 0; i < 6; ++i) s.casts[i] = Cast::decode(codes[i]);
    s.flags = Flags::decode(d.at("flags").toInt());
    s.group = {d.at("fn").toInt(), d.at("handle").toInt()};
    return s;
  }

  Scaled cast(size_t i, const at::Tensor& hp, int64_t axis) const {
    return to_float8(hp, casts[i], axis, flags.pow2, group);
  }
};

struct Float8Linear : public torch::autograd::Function<Float8Linear> {
  // x [.., K], w [N, K] → [.., N].
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, std::vector<int64_t> casts, int64_t flags,
                            int64_t fn, int64_t handle) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["casts"] = casts;
    ctx->saved_data["flags"] = flags;
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["handle"] = handle;
    const auto s = Settings::saved(ctx);
    auto x2 = x.reshape({-1, x.size(-1)});
    // x [M, K] · wᵀ [K, N]: the input scaled per token, the weight per output feature.
    auto y = s.casts[0].scaling == kNone
                 ? at::mm(x2, w.t())
                 : scaled_mm(s.cast(0, x2, -1), s.cast(1, w.t(), 0), x.scalar_type(),
                             s.flags.fast_accum[0]);
    auto shape = x.sizes().vec();
    shape.back() = w.size(0);
    return y.reshape(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = Settings::saved(ctx);
    auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    auto g = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      // g [M, N] · w [N, K]: the gradient scaled per token, the weight per input feature.
      at::Tensor product;
      if (s.casts[2].scaling == kNone) {
        product = at::mm(g, w);
      } else {
        auto wt = s.cast(3, w.t(), -1);
        product = scaled_mm(s.cast(2, g, -1), wt.t(), g.scalar_type(), s.flags.fast_accum[1]);
      }
      dx = product.reshape(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      // gᵀ [N, M] · x [M, K]: both scaled per feature, along the tokens.
      auto x2 = x.reshape({-1, x.size(-1)});
      if (s.casts[4].scaling == kNone) {
        dw = at::mm(g.t(), x2);
      } else {
        dw = scaled_mm(s.cast(4, g, 0).t(), s.cast(5, x2, 0), g.scalar_type(),
                       s.flags.fast_accum[2]);
      }
    }
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A frozen linear whose weight is held in e4m3 with per-row scales: y = x (data · scale)ᵀ, the
// weight widened to x's dtype for the product and again for the input gradient, so the graph
// keeps the float8 weight rather than a widened copy of it. The weight gets no gradient.
struct FrozenFloat8Linear : public torch::autograd::Function<FrozenFloat8Linear> {
  static at::Tensor widened(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
    return (data.to(at::kFloat) * scale).to(dtype);
  }

  // x [.., K], data [N, K] e4m3, scale [N, 1] f32 → [.., N].
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& data, const at::Tensor& scale) {
    ctx->save_for_backward({data, scale});
    return at::linear(x, widened(data, scale, x.scalar_type()));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& g = grads[0];
    return {at::matmul(g, widened(saved[0], saved[1], g.scalar_type())), at::Tensor(),
            at::Tensor()};
  }
};


}  // namespace

extern "C" {

// `x [.., K] · w [N, K]ᵀ` through float8 GEMMs as the six cast codes and the flags say; the
// group's maximum is taken through `fn(handle, amax)` for every cast marked to reduce.
at::Tensor* flux_fp8_linear(const at::Tensor* x, const at::Tensor* w, const int64_t* casts,
                            int64_t flags, amax_fn fn, void* handle) {
  return flux::guarded(last_error, [&] {
    std::vector<int64_t> codes(casts, casts + 6);
    return Float8Linear::apply(*x, *w, codes, flags, reinterpret_cast<int64_t>(fn),
                               reinterpret_cast<int64_t>(handle));
  });
}

// `x [.., K] · (data · scale)ᵀ` for a frozen e4m3 weight `data [N, K]` with scales `[N, 1]`.
at::Tensor* flux_fp8_frozen_linear(const at::Tensor* x, const at::Tensor* data,
                                   const at::Tensor* scale) {
  return flux::guarded(last_error,
                       [&] { return FrozenFloat8Linear::apply(*x, *data, *scale); });
}

const char* flux_fp8_last_error() { return last_error.c_str(); }

}  // extern "C"
