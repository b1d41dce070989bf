// BufferInternals: stream-ordered release, the internal interface the layers use after enqueuing
// CUDA work on tensors, in place of host callbacks that hold the tensors. Internal: not installed.
#pragma once

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::detail {

struct BufferInternals {
  // Records that the work enqueued so far on `stream` uses the buffer: once its last handle goes,
  // its allocator reuses or frees the block only after that work has finished. Nothing to do on a
  // host stream (host work holds what it uses). Thread-safe; call it after enqueuing the work.
  static void record_use(Stream& stream, Buffer const& buffer);
  // The same for a tensor's storage (an undefined tensor is ignored).
  static void record_use(Stream& stream, Tensor const& tensor);
};

// Records the work enqueued so far on `stream` as a use of each tensor or buffer.
template <class... Storage>
void release_after(Stream& stream, Storage const&... storage) {
  (BufferInternals::record_use(stream, storage), ...);
}

}  // namespace mgpu::detail
