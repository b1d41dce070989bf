// The part of the ops' kernels that every family shares and that is not a template
// (src/kernels/op_support.cuh): the second pass of the fixed-order sums.
#include <cuda_runtime.h>

#include <mgpu/core/error.hpp>

#include "kernels/op_support.cuh"

namespace mgpu::kernels {
namespace {

// One block sums the partials in a fixed order and writes scale * total.
__global__ void reduce_final_kernel(float const* partials, int count, float* out, float scale) {
  float sum = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += blockDim.x) sum += partials[i];
  float const total = block_sum(sum);
  if (threadIdx.x == 0) *out = scale * total;
}

}  // namespace

void sum_partials(float const* partials, int count, float* out, float scale, cudaStream_t s) {
  reduce_final_kernel<<<1, reduce_threads, 0, s>>>(partials, count, out, scale);
  MGPU_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mgpu::kernels
