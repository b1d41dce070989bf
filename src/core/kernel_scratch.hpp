// Device memory for a kernel launcher's temporaries (partial sums, row losses, a result word):
// the caller hands it out from the caching allocator for the launcher's stream and releases it
// after the launched work, in stream order (detail::StreamScratch, src/core/backend.hpp).
// Internal: not installed. Core declares the interface, which its StreamScratch implements and the
// launchers of src/kernels take, so that core includes nothing of the kernels module.
#pragma once

#include <cstddef>

namespace mgpu::kernels {

class Scratch {
 public:
  // `bytes` (256-byte aligned) usable by work enqueued on the launcher's stream from now on, until
  // the caller releases it after that work.
  virtual void* allocate(std::size_t bytes) = 0;

 protected:
  Scratch() = default;
  Scratch(Scratch const&) = default;
  Scratch& operator=(Scratch const&) = default;
  ~Scratch() = default;
};

}  // namespace mgpu::kernels
