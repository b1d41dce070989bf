// A grid-stride driver for the element operations of mgpu/core/detail/elementwise.hpp.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <mgpu/core/error.hpp>

namespace mgpu::kernels {

template <class Op>
__global__ void for_each_index_kernel(std::int64_t count, Op op) {
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) op(i);
}

// Launches op(i) for i in [0, count) on `stream`: the device twin of detail::for_each_index.
template <class Op>
void for_each_index(std::int64_t count, Op const& op, cudaStream_t stream) {
  if (count == 0) return;
  constexpr int threads = 256;
  std::int64_t const wanted = (count + threads - 1) / threads;
  int const blocks = static_cast<int>(std::min<std::int64_t>(wanted, 65535));
  for_each_index_kernel<<<blocks, threads, 0, stream>>>(count, op);
  MGPU_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mgpu::kernels
