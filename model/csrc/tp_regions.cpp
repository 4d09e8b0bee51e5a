// Tensor-parallel region boundaries as libtorch autograd functions (Megatron's f and g).
//
//   copy_to_region:     forward identity,          backward all-reduce(grad)
//   reduce_from_region: forward all-reduce(input), backward identity
//
// and, for sequence parallelism, one node that applies a sequence operation forward and another
// backward, each one of: split (keep this rank's slice of the sequence dimension, no
// communication), all-gather along the sequence, reduce-scatter along the sequence.
//
// The collectives themselves are callbacks into Rust (the MPI communicator lives there); tch has
// no Rust-side custom autograd function, so these small nodes are the bridge. Tensors cross the
// boundary as `at::Tensor*`, the representation tch's C API uses. The nodes lay the sequence out
// rank-major so that the callbacks move flat contiguous buffers.
#include <torch/csrc/autograd/custom_function.h>

#include "guarded.h"

#include <cstdint>
#include <string>

namespace {

// Sum `t` (contiguous, owned by the caller) in place across the group behind `handle`.
// `kind` is 0 for a forward reduction and 1 for a backward one (the Rust side counts them).
using reduce_fn = void (*)(void* handle, at::Tensor* t, int32_t kind);

// Gather (`op` 1: `in` [n] → `out` [size·n], rank-major) or reduce-scatter (`op` 2: `in`
// [size·n] → `out` [n], block `rank` of the sum) across the group behind `handle`; both
// contiguous, of one dtype and device.
using sequence_fn = void (*)(void* handle, int32_t op, at::Tensor* in, at::Tensor* out);

enum SequenceOp : int64_t { kSplit = 0, kGather = 1, kReduceScatter = 2 };

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

// What a sequence node needs to run its operations.
struct SequenceArgs {
  int64_t dim, rank, size, fn, handle;

  static SequenceArgs saved(const torch::autograd::AutogradContext* ctx) {
    const auto& d = ctx->saved_data;
    return {d.at("dim").toInt(), d.at("rank").toInt(), d.at("size").toInt(), d.at("fn").toInt(),
            d.at("handle").toInt()};
  }

  void save(torch::autograd::AutogradContext* ctx) const {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["size"] = size;
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["handle"] = handle;
  }

  void call(int64_t op, at::Tensor& in, at::Tensor& out) const {
    reinterpret_cast<sequence_fn>(fn)(reinterpret_cast<void*>(handle), static_cast<int32_t>(op),
                                      &in, &out);
  }

  // `x` with its dimension `dim` (the sequence) split, gathered or reduce-scattered.
  at::Tensor apply(int64_t op, const at::Tensor& x) const {
    auto sizes = x.sizes().vec();
    switch (op) {
      case kSplit:
        TORCH_CHECK(sizes[dim] % size == 0, "sequence length ", sizes[dim],
                    " does not divide over ", size, " ranks");
        return x.narrow(dim, rank * (sizes[dim] / size), sizes[dim] / size)
            .clone(at::MemoryFormat::Contiguous);
      case kGather: {
        auto in = x.contiguous();
        auto stacked = sizes;
        stacked.insert(stacked.begin(), size);
        auto all = at::empty(stacked, in.options());  // [size, .., S/size, ..]
        call(op, in, all);
        sizes[dim] *= size;
        return all.movedim(0, dim).reshape(sizes);
      }
      case kReduceScatter: {
        TORCH_CHECK(sizes[dim] % size == 0, "sequence length ", sizes[dim],
                    " does not divide over ", size, " ranks");
        auto blocks = sizes;
        blocks[dim] /= size;
        blocks.insert(blocks.begin() + dim, size);  // [.., size, S/size, ..]
        auto in = x.reshape(blocks).movedim(dim, 0).contiguous();
        sizes[dim] /= size;
        auto out = at::empty(sizes, x.options());
        call(op, in, out);
        return out;
      }
      default:
        TORCH_CHECK(false, "unknown sequence operation ", op);
    }
  }
};

struct SequenceRegion : public torch::autograd::Function<SequenceRegion> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t forward_op, int64_t backward_op, SequenceArgs args) {
    args.save(ctx);
    ctx->saved_data["backward_op"] = backward_op;
    return args.apply(forward_op, x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto op = ctx->saved_data.at("backward_op").toInt();
    return {SequenceArgs::saved(ctx).apply(op, grads[0]), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};


}  // namespace

extern "C" {

at::Tensor* flux_tp_copy_to_region(const at::Tensor* x, reduce_fn fn, void* handle) {
  return flux::guarded(last_error, [&] {
    return CopyToRegion::apply(*x, reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(handle));
  });
}

at::Tensor* flux_tp_reduce_from_region(const at::Tensor* x, reduce_fn fn, void* handle) {
  return flux::guarded(last_error, [&] {
    return ReduceFromRegion::apply(*x, reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(handle));
  });
}

at::Tensor* flux_tp_sequence_region(const at::Tensor* x, int64_t forward_op, int64_t backward_op,
                                     int64_t dim, int64_t rank, int64_t size, sequence_fn fn,
                                     void* handle) {
  return flux::guarded(last_error, [&] {
    SequenceArgs args{dim, rank, size, reinterpret_cast<int64_t>(fn),
                      reinterpret_cast<int64_t>(handle)};
    return SequenceRegion::apply(*x, forward_op, backward_op, args);
  });
}

const char* flux_tp_last_error() { return last_error.c_str(); }

}  // extern "C"
