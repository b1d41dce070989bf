// Host-callable launchers of the transformer ops' kernels (src/kernels/transformer.cu), used by
// src/ops/transformer.cpp beside `each` (src/kernels/ops.hpp), which runs the functors of
// mgpu/core/detail/transformer_math.hpp: the token-id check. Each leaves the calling thread's
// current device as it was.
#pragma once

#include <cstdint>

#include "core/kernel_scratch.hpp"

namespace mgpu::kernels {

// Copies to `host_result` (page-locked memory, read after the stream has passed this point) the
// first position whose id is outside [0, vocab) and not `ignore`, as (position << 32) | the id's
// bits, or all ones when every id is good. The search's word in `scratch`.
void find_bad_token(int ordinal, std::int32_t const* ids, std::int64_t n, std::int64_t vocab, std::int64_t ignore,
                    std::uint64_t* host_result, Scratch& scratch, void* stream);

}  // namespace mgpu::kernels
