// The backend seam: the one internal interface through which the layers above core (comm, ops, nn,
// parallel) reach below the public Stream, Buffer and Tensor API. Internal: not installed.
//
// Note [the backend seam]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A backend (a communicator, an op's CUDA path) enqueues work on a rank's Stream. What it may ask
// of the core beyond the public API is here and nowhere else:
//   - StreamInternals: host work that runs even after earlier work failed (collectives must
//     still take part), and the stream's cuBLAS handle;
//   - release_after / ReleaseAfterOnExit / enqueue_using (BufferInternals): after enqueuing work
//     on tensors or buffers (CUDA work, or host work through raw pointers), record that work as a
//     use, so that their blocks go to other streams only once it has finished, and to that
//     stream at once (stream-ordered release, in place of work that holds the tensors);
//   - StreamScratch: a kernel launcher's temporaries (core/kernel_scratch.hpp) from the caching
//     allocator, for the launch's stream, released in stream order;
//   - host_staging_allocator(): the shared host allocator for staging copies and scalar reads;
//   - mgpu::detail::cuda (core/cuda_backend.hpp, included here): the CUDA runtime calls behind
//     plain C++ signatures (streams, events, host words, memory, error strings), which a build
//     without CUDA answers with "no GPU". Code compiled only in CUDA builds may also use
//     core/cuda_device_scope.hpp (it needs cuda_runtime.h) to make a GPU current for one call.
// Kernels are not part of it: they live in src/kernels, one launcher header per layer above core;
// core's own launchers and the Scratch they take are declared in core (convert_kernels.hpp,
// kernel_scratch.hpp), so that core includes nothing of src/kernels.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <cstdio>
#include <exception>
#include <functional>
#include <tuple>
#include <vector>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

#include "core/cuda_backend.hpp"
#include "core/kernel_scratch.hpp"

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

  // A number that names the stream for as long as the process runs (never given to another one).
  static std::uint64_t id(Stream const& stream) noexcept;

  // A host stream's place in its queue: once `*progress` reaches `position`, every piece of work
  // enqueued on it so far (before the call) has run, or was skipped after a failure.
  struct HostPosition {
    std::shared_ptr<std::atomic<std::uint64_t> const> progress;
    std::uint64_t position;
  };
  static HostPosition host_position(Stream const& stream);
};

struct BufferInternals {
  // Records that the work enqueued so far on `stream` uses the buffer: once its last handle goes,
  // its allocator gives the block to `stream` at once and to anyone else, or frees it, only after
  // that work has finished. On a host stream as on a CUDA stream (see enqueue_using).
  // Thread-safe; call it after enqueuing the work.
  static void record_use(Stream& stream, Buffer const& buffer);
  // The same for a tensor's storage (an undefined tensor is ignored).
  static void record_use(Stream& stream, Tensor const& tensor);
  // The same for each of the tensors.
  static void record_use(Stream& stream, std::vector<Tensor> const& tensors);
  // The allocator that made the tensor's storage (a defined tensor's).
  static Allocator& allocator(Tensor const& tensor);
  // The same view of the same memory, without keeping it: for enqueued work that holds a tensor
  // while the use of its memory is recorded (release_after) after enqueuing it.
  static Tensor unowned(Tensor const& tensor);
  // The memory of a tensor's storage given back (its allocator's, once the uses recorded so far
  // have run) while the storage stays: every view of it keeps its shape and offset and points at
  // nothing (data() is null) until acquire_memory() gives the storage new memory of `bytes` for
  // work on `stream` (Allocator::allocate(bytes, stream)), whose contents are undefined. What a
  // layer bound to a view reads and writes comes and goes so (ZeRO-3's gathered units). Nothing
  // when already so.
  static void release_memory(Tensor const& tensor);
  static void acquire_memory(Tensor const& tensor, std::size_t bytes, Allocator& allocator, Stream& stream);
};

// Records the work enqueued so far on `stream` as a use of each tensor or buffer.
template <class... Storage>
void release_after(Stream& stream, Storage const&... storage) {
  (BufferInternals::record_use(stream, storage), ...);
}

// Calls release_after(stream, storage...) when it goes out of scope: also when enqueuing throws
// after part of the work is on the stream (the first of two kernels, a copy before a failed free),
// so no block is reused under that work. For code that enqueues work on storage in several calls;
// the storage must outlive it. Never throws: a use it cannot record is reported on stderr.
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

// Enqueues host work that reaches the tensors (or buffers) through their raw pointers, and records
// it as their use instead of letting it hold them: a block whose last handle goes while the work
// waits goes back to this stream at once and to anyone else once the work has run, as on a CUDA
// stream. So the allocator's counters follow what the issuing thread holds, on host devices as on
// GPUs, however far it runs ahead of the stream's worker.
template <class Work, class... Storage>
void enqueue_using(Stream& stream, Work&& work, Storage const&... storage) {
  ReleaseAfterOnExit<Storage...> const release(stream, storage...);
  stream.enqueue(std::forward<Work>(work));
}

// A kernel launcher's scratch memory from the caching allocator of a tensor the op uses, for work
// on `stream`: blocks that earlier work on the stream freed come back at once, without waiting for
// that work. When it goes, the launched work is recorded as the blocks' use (also when a launch
// failed part way), so the stream reuses them at once and anyone else once that work has run.
class StreamScratch final : public kernels::Scratch {
 public:
  StreamScratch(Stream& stream, Tensor const& like) : stream_(stream), allocator_(BufferInternals::allocator(like)) {}
  StreamScratch(StreamScratch const&) = delete;
  StreamScratch& operator=(StreamScratch const&) = delete;
  ~StreamScratch() {
    for (Buffer const& b : buffers_) {
      try {
        release_after(stream_, b);
      } catch (std::exception const& e) {
        std::fprintf(stderr, "mgpu: recording the use of a kernel's scratch memory failed: %s\n", e.what());
      }
    }
  }

  void* allocate(std::size_t bytes) override {
    return buffers_.emplace_back(allocator_.allocate(bytes, stream_)).data();
  }

 private:
  Stream& stream_;
  Allocator& allocator_;
  std::vector<Buffer> buffers_;
};

// The library's one host allocator for staging copies (to and from GPUs, checkpoints, scalar reads,
// weight initialisation): created on first use, shared by every thread (Allocator is synchronized).
Allocator& host_staging_allocator();

}  // namespace mgpu::detail
