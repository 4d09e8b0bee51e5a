// Keeps libtorch's exceptions from crossing into Rust: a bridge function runs its work through
// `flux::guarded`, which hands the resulting tensor to the caller on the heap, or returns nullptr
// and keeps the exception's message in the file's thread-local error string for the Rust side to
// read.
#pragma once

#include <ATen/ATen.h>

#include <exception>
#include <string>

namespace flux {

template <typename F>
at::Tensor* guarded(std::string& error, F&& f) {
  try {
    return new at::Tensor(f());
  } catch (const std::exception& e) {
    error = e.what();
    return nullptr;
  }
}

}  // namespace flux
