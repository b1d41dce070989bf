// The CUDA side of the training ops (src/ops/cuda_ops.hpp): the functors of mgpu/ops/detail/math.hpp
// over a grid, reductions through block sums and one atomic add per block, and GEMM via cuBLAS.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <map>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/ops/detail/math.hpp>

#include "core/cuda_device_scope.hpp"
#include "kernels/elementwise.cuh"
#include "ops/cuda_ops.hpp"

namespace mgpu::ops::cuda {
namespace {

constexpr int reduce_threads = 256;

template <class Op>
__global__ void reduce_kernel(std::int64_t n, Op op, float* out, float scale) {
  __shared__ float partial[reduce_threads];
  float sum = 0;
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) sum += op(i);
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = reduce_threads / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, scale * partial[0]);
}

// One cuBLAS handle per thread and GPU: a handle is not safe to share between threads, and its
// stream is set before every call.
cublasHandle_t handle_for(int ordinal) {
  thread_local std::map<int, cublasHandle_t> handles;
  auto it = handles.find(ordinal);
  if (it == handles.end()) {
    cublasHandle_t handle = nullptr;
    MGPU_CUBLAS_CHECK(cublasCreate(&handle));
    it = handles.emplace(ordinal, handle).first;
  }
  return it->second;
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return CUDA_R_16BF;
    case DType::float16: return CUDA_R_16F;
    case DType::float32: break;
  }
  return CUDA_R_32F;
}

}  // namespace

template <class Op>
void each(int ordinal, std::int64_t n, Op const& op, void* stream) {
  mgpu::detail::cuda::DeviceScope scope(ordinal);
  kernels::for_each_index(n, op, static_cast<cudaStream_t>(stream));
}

template <class Op>
void reduce(int ordinal, std::int64_t n, Op const& op, float* out, float scale, void* stream) {
  mgpu::detail::cuda::DeviceScope scope(ordinal);
  auto const s = static_cast<cudaStream_t>(stream);
  MGPU_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), s));
  if (n == 0) return;
  std::int64_t const wanted = (n + reduce_threads - 1) / reduce_threads;
  int const blocks = static_cast<int>(wanted < 1024 ? wanted : 1024);
  reduce_kernel<<<blocks, reduce_threads, 0, s>>>(n, op, out, scale);
  MGPU_CUDA_CHECK(cudaGetLastError());
}

void gemm(int ordinal, DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          void const* a, void const* b, float beta, void* c, void* stream) {
  if (m == 0 || n == 0) return;
  mgpu::detail::cuda::DeviceScope scope(ordinal);
  cublasHandle_t const handle = handle_for(ordinal);
  MGPU_CUBLAS_CHECK(cublasSetStream(handle, static_cast<cudaStream_t>(stream)));
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap places.
  auto const lda = static_cast<int>(transpose_a ? m : k);
  auto const ldb = static_cast<int>(transpose_b ? k : n);
  cudaDataType_t const type = cuda_type(dtype);
  MGPU_CUBLAS_CHECK(cublasGemmEx(handle, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, type, ldb, a, type, lda,
                                 &beta, c, type, static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The instantiations src/ops/ops.cpp launches.
#define MGPU_OPS_FOR_TYPE(T)                                                                                    \
  template void each(int, std::int64_t, detail::ActivationOp<T, detail::Relu> const&, void*);                   \
  template void each(int, std::int64_t, detail::ActivationOp<T, detail::Gelu> const&, void*);                   \
  template void each(int, std::int64_t, detail::ActivationGradOp<T, detail::Relu> const&, void*);               \
  template void each(int, std::int64_t, detail::ActivationGradOp<T, detail::Gelu> const&, void*);               \
  template void each(int, std::int64_t, detail::BiasActivationOp<T, detail::Identity> const&, void*);           \
  template void each(int, std::int64_t, detail::BiasActivationOp<T, detail::Relu> const&, void*);               \
  template void each(int, std::int64_t, detail::BiasActivationOp<T, detail::Gelu> const&, void*);               \
  template void each(int, std::int64_t, detail::ActivationBiasGradCol<T, detail::Identity> const&, void*);      \
  template void each(int, std::int64_t, detail::ActivationBiasGradCol<T, detail::Relu> const&, void*);          \
  template void each(int, std::int64_t, detail::ActivationBiasGradCol<T, detail::Gelu> const&, void*);          \
  template void each(int, std::int64_t, detail::BiasAddOp<T> const&, void*);                                    \
  template void each(int, std::int64_t, detail::BiasGradOp<T> const&, void*);                                   \
  template void each(int, std::int64_t, detail::ScaleOp<T> const&, void*);                                      \
  template void each(int, std::int64_t, detail::DropoutOp<T> const&, void*);                                    \
  template void each(int, std::int64_t, detail::LayerNormRow<T> const&, void*);                                 \
  template void each(int, std::int64_t, detail::LayerNormGradRow<T> const&, void*);                             \
  template void each(int, std::int64_t, detail::LayerNormParamGradCol<T> const&, void*);                        \
  template void each(int, std::int64_t, detail::ScaleConvertOp<T, float> const&, void*);                        \
  template void each(int, std::int64_t, detail::ScaleConvertOp<T, bfloat16> const&, void*);                     \
  template void each(int, std::int64_t, detail::ScaleConvertOp<T, float16> const&, void*);                      \
  template void each(int, std::int64_t, detail::AddScaledOp<T, float> const&, void*);                          \
  template void each(int, std::int64_t, detail::AddScaledOp<T, bfloat16> const&, void*);                       \
  template void each(int, std::int64_t, detail::AddScaledOp<T, float16> const&, void*);                        \
  template void reduce(int, std::int64_t, detail::SoftmaxCrossEntropyRow<T> const&, float*, float, void*);      \
  template void reduce(int, std::int64_t, detail::SquaredErrorOp<T> const&, float*, float, void*);              \
  template void reduce(int, std::int64_t, detail::CorrectRow<T> const&, float*, float, void*);                  \
  template void reduce(int, std::int64_t, detail::ValueOp<T> const&, float*, float, void*);                     \
  template void reduce(int, std::int64_t, detail::SquareOp<T> const&, float*, float, void*);                    \
  template void reduce(int, std::int64_t, detail::NonFiniteOp<T> const&, float*, float, void*);
MGPU_OPS_FOR_TYPE(float)
MGPU_OPS_FOR_TYPE(bfloat16)
MGPU_OPS_FOR_TYPE(float16)
#undef MGPU_OPS_FOR_TYPE
template void each(int, std::int64_t, detail::SgdOp const&, void*);
template void each(int, std::int64_t, detail::AdamWOp const&, void*);

}  // namespace mgpu::ops::cuda
