// StreamInternals: the narrow internal interface other layers (comm, ops) use to reach below a
// Stream's public API, so that they never see Stream::Impl. Internal: not installed.
#pragma once

#include <functional>

#include <mgpu/core/stream.hpp>

namespace mgpu::detail {

struct StreamInternals {
  // Enqueues host work that runs even after earlier work on the stream failed (collectives must
  // still take part, or the other ranks wait); `work` is told whether earlier work failed. Same
  // threading contract as Stream::enqueue.
  static void enqueue_even_after_failure(Stream& stream, std::function<void(bool earlier_work_failed)> work);

  // The stream's cuBLAS handle (CUDA streams only), made on first use by `create` (given the
  // stream's GPU) and released by
  // `destroy` when the stream is destroyed, after its work has finished. `use` runs under the
  // stream's handle lock, so threads enqueuing on one stream never share the handle at once.
  static void with_blas_handle(Stream& stream, void* (*create)(int ordinal), void (*destroy)(void*) noexcept,
                               std::function<void(void*)> const& use);
};

}  // namespace mgpu::detail
