// libtorch's c10d process groups for flux-hpc: a TCP store for their rendezvous, gloo groups on
// CPU tensors and, where the build found CUDA's and NCCL's headers (FLUX_WITH_NCCL), NCCL groups
// on CUDA tensors; the four collectives the training needs, each returning its work handle.
// MPI stays the launcher: flux-hpc opens the store on world rank 0 and broadcasts its address
// over MPI. Every function catches libtorch's exceptions and returns null or -1; the message is
// then `flux_c10d_last_error()`, on the calling thread.
#define USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FLUX_WITH_NCCL
#define USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace {

thread_local std::string last_error;

struct Store {
  c10::intrusive_ptr<c10d::Store> store;
};

struct Group {
  c10::intrusive_ptr<c10d::Backend> backend;
};

struct Work {
  c10::intrusive_ptr<c10d::Work> work;
};

template <typename F>
auto guarded(F f, decltype(f()) failed) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    last_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return failed;
}

Work* started(c10::intrusive_ptr<c10d::Work> work) { return new Work{std::move(work)}; }

// The gloo transport device: the interface named by GLOO_SOCKET_IFNAME (as in PyTorch), else the
// address this host's name resolves to.
std::shared_ptr<::gloo::transport::Device> gloo_device() {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::Backend> new_group(const c10::intrusive_ptr<c10d::Store>& store,
                                            int backend, int rank, int size,
                                            std::chrono::milliseconds timeout) {
  if (backend == 0) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(gloo_device());
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  }
#ifdef FLUX_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  throw std::runtime_error(
      "this flux-hpc was built without NCCL (CUDA's or NCCL's headers were not found; "
      "scripts/setup.sh installs them)");
#endif
}

}  // namespace

extern "C" {

const char* flux_c10d_last_error() { return last_error.c_str(); }

int flux_c10d_has_nccl() {
#ifdef FLUX_WITH_NCCL
  return 1;
#else
  return 0;
#endif
}

// A TCP store at host:port; the server (on one rank) listens on `port`, 0 for any free port, and
// waits for nobody; clients connect within `connect_timeout_ms`, and the store's operations wait
// up to `timeout_ms`. The bound port goes to `*bound_port`.
Store* flux_c10d_store(const char* host, int port, int is_server, int world,
                       int64_t connect_timeout_ms, int64_t timeout_ms, int* bound_port) {
  return guarded(
      [&]() -> Store* {
        c10d::TCPStoreOptions options;
        options.port = static_cast<uint16_t>(port);
        options.isServer = is_server != 0;
        options.numWorkers = world;
        options.waitWorkers = false;
        // Reaching the store is bounded by the connect timeout; the store's own operations
        // (the groups' rendezvous) by the collective timeout.
        options.timeout = std::chrono::milliseconds(connect_timeout_ms);
        auto store = c10::make_intrusive<c10d::TCPStore>(host, options);
        store->setTimeout(std::chrono::milliseconds(timeout_ms));
        *bound_port = store->getPort();
        return new Store{store};
      },
      nullptr);
}

void flux_c10d_store_free(Store* store) { delete store; }

// The group `prefix` names (unique among the groups of the store) of `size` ranks, this one
// `rank`: backend 0 gloo, 1 NCCL. Every member must call this with the same prefix.
Group* flux_c10d_group(Store* store, const char* prefix, int backend, int rank, int size,
                       int64_t timeout_ms) {
  return guarded(
      [&]() -> Group* {
        auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store->store);
        auto group = new_group(prefixed, backend, rank, size, std::chrono::milliseconds(timeout_ms));
        return new Group{group};
      },
      nullptr);
}

void flux_c10d_group_free(Group* group) { delete group; }

// Sum `t` over the group in place.
Work* flux_c10d_all_reduce(Group* group, const at::Tensor* t) {
  return guarded(
      [&] {
        std::vector<at::Tensor> tensors{*t};
        return started(group->backend->allreduce(tensors));
      },
      static_cast<Work*>(nullptr));
}

// Every rank's `input` into `output`, in rank order (both contiguous, of any shape: flattened
// views are what c10d moves).
Work* flux_c10d_all_gather(Group* group, const at::Tensor* input, const at::Tensor* output) {
  return guarded(
      [&] {
        at::Tensor in = input->view({-1});
        at::Tensor out = output->view({-1});
        return started(group->backend->_allgather_base(out, in));
      },
      static_cast<Work*>(nullptr));
}

// Block `rank` of the sum of every rank's `input` into `output` (flattened, as above).
Work* flux_c10d_reduce_scatter(Group* group, const at::Tensor* input, const at::Tensor* output) {
  return guarded(
      [&] {
        at::Tensor in = input->view({-1});
        at::Tensor out = output->view({-1});
        return started(group->backend->_reduce_scatter_base(out, in));
      },
      static_cast<Work*>(nullptr));
}

// Rank `root`'s `t` into every rank's `t`.
Work* flux_c10d_broadcast(Group* group, const at::Tensor* t, int root) {
  return guarded(
      [&] {
        std::vector<at::Tensor> tensors{*t};
        c10d::BroadcastOptions options;
        options.rootRank = root;
        return started(group->backend->broadcast(tensors, options));
      },
      static_cast<Work*>(nullptr));
}

// 1 when the work has finished, 0 while it runs, -1 when it failed.
int flux_c10d_is_completed(Work* work) {
  return guarded([&] { return work->work->isCompleted() ? 1 : 0; }, -1);
}

// Wait for the work (on CUDA: the current stream waits for it); 0, or -1 when it failed.
int flux_c10d_wait(Work* work) {
  return guarded(
      [&] {
        work->work->wait();
        return 0;
      },
      -1);
}

void flux_c10d_work_free(Work* work) { delete work; }

}  // extern "C"
