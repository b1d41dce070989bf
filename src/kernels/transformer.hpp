// Host-callable launchers of the transformer ops' kernels (src/kernels/transformer.cu), used by
// src/ops/transformer.cpp: the functors of mgpu/ops/detail/transformer_math.hpp over a grid and
// the token-id check. Each leaves the calling thread's current device as it was.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/scratch.hpp"

namespace mgpu::kernels {

// op(i) for i in [0, n) on `stream` of GPU `ordinal` (instantiated for the transformer functors).
template <class Op>
void transformer_each(int ordinal, std::int64_t n, Op const& op, void* stream);

// Copies to `host_result` (page-locked memory, read after the stream has passed this point) the
// first position whose id is outside [0, vocab) and not `ignore`, as (position << 32) | the id's
// bits, or all ones when every id is good. The search's word in `scratch`.
void find_bad_token(int ordinal, std::int32_t const* ids, std::int64_t n, std::int64_t vocab, std::int64_t ignore,
                    std::uint64_t* host_result, Scratch& scratch, void* stream);

}  // namespace mgpu::kernels
