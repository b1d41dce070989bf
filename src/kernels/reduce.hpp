// Host-callable launchers of the communicators' kernels (src/kernels/reduce.cu), used by the
// cuda_peer backend (src/comm/cuda_communicators.cpp).
#pragma once

#include <cstdint>

#include <mgpu/comm/reduce_op.hpp>
#include <mgpu/core/dtype.hpp>

namespace mgpu::kernels {

// out[q][i] = op over p of in[p][i], for i in [begin, end), on `stream` (the current device's).
void reduce_slice(DType dtype, comm::ReduceOp op, void const* const* inputs, int input_count, void* const* outputs,
                  int output_count, std::int64_t begin, std::int64_t end, void* stream);

}  // namespace mgpu::kernels
