// BufferInternals: stream-ordered release, the internal interface the layers use after enqueuing
// CUDA work on tensors, in place of host callbacks that hold the tensors. Internal: not installed.
#pragma once

#include <cstdio>
#include <exception>
#include <tuple>
#include <vector>

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
  // The same for each of the tensors.
  static void record_use(Stream& stream, std::vector<Tensor> const& tensors);
};

// Records the work enqueued so far on `stream` as a use of each tensor or buffer.
template <class... Storage>
void release_after(Stream& stream, Storage const&... storage) {
  (BufferInternals::record_use(stream, storage), ...);
}

// Calls release_after(stream, storage...) when it goes out of scope: also when enqueuing throws
// after part of the work is on the stream (the first of two kernels, a copy before a failed free),
// so no block is reused under that work. For code that enqueues work on storage in several CUDA
// calls; the storage must outlive it. Never throws: a use it cannot record is reported on stderr.
template <class... Storage>
class ReleaseAfterOnExit {
 public:
  explicit ReleaseAfterOnExit(Stream& stream, Storage const&... storage) : stream_(stream), storage_(storage...) {}
  ReleaseAfterOnExit(ReleaseAfterOnExit const&) = delete;
  ReleaseAfterOnExit& operator=(ReleaseAfterOnExit const&) = delete;
  ~ReleaseAfterOnExit() {
    try {
      std::apply([this](Storage const&... s) { release_after(stream_, s...); }, storage_);
    } catch (std::exception const& e) {
      std::fprintf(stderr, "mgpu: recording the use of a buffer by GPU work failed: %s\n", e.what());
    }
  }

 private:
  Stream& stream_;
  std::tuple<Storage const&...> storage_;
};

}  // namespace mgpu::detail
