// Host-callable launchers of the communicators' kernels (src/kernels/reduce.cu), used by the
// cuda_peer backend (src/comm/cuda_peer_communicator.cpp).
#pragma once

#include <cstdint>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/reduce_op.hpp>

namespace mgpu::kernels {

// out[q][i] = op over p of in[p][i], for i in [begin, end), on `stream` (the current device's).
void reduce_slice(DType dtype, ReduceOp op, void const* const* inputs, int input_count, void* const* outputs,
                  int output_count, std::int64_t begin, std::int64_t end, void* stream);

}  // namespace mgpu::kernels
