// The library's one host allocator for staging copies (to and from GPUs, checkpoints, scalar reads,
// weight initialisation): created on first use, shared by every thread (Allocator is synchronized).
#pragma once

#include <mgpu/core/memory.hpp>

namespace mgpu::detail {

Allocator& host_staging_allocator();

}  // namespace mgpu::detail
