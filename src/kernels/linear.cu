// The linear family's kernels (src/ops/linear.cpp): bias add, bias + activation, the bias gradient
// as column sums (fused with the activation's backward), and GEMM through cuBLAS with a handle per
// stream.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>

#include "kernels/op_support.cuh"

namespace mgpu::kernels {
namespace {

template <class T>
struct BiasGradColumns {
  mgpu::detail::BiasGradOp<T> op;
  __device__ void add(std::int64_t r, std::int64_t j, float (&acc)[2]) const { acc[0] += mgpu::detail::load(op.dy, r * op.cols + j); }
  __device__ void finish(std::int64_t j, float const (&total)[2]) const { mgpu::detail::store(op.db, j, total[0]); }
};

template <class T, class F>
struct ActivationBiasGradColumns {
  mgpu::detail::ActivationBiasGradCol<T, F> op;
  __device__ void add(std::int64_t r, std::int64_t j, float (&acc)[2]) const {
    std::int64_t const i = r * op.cols + j;
    float const d = F::backward(mgpu::detail::load(op.z, i), mgpu::detail::load(op.dy, i));
    mgpu::detail::store(op.dz, i, d);
    acc[0] += d;
  }
  __device__ void finish(std::int64_t j, float const (&total)[2]) const { mgpu::detail::store(op.db, j, total[0]); }
};

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return CUDA_R_16BF;
    case DType::float16: return CUDA_R_16F;
    case DType::int32: return CUDA_R_32I;
    case DType::float32: break;
  }
  return CUDA_R_32F;
}

int blas_extent(std::int64_t value, char const* name) {
  if (value < 0 || value > INT_MAX)
    throw Error(Errc::invalid_argument, std::string("gemm on a GPU: ") + name + " = " + std::to_string(value) +
                                            " (expected at most " + std::to_string(INT_MAX) + ", cuBLAS takes int extents)");
  return static_cast<int>(value);
}

}  // namespace

// The bias gradients are column sums over the rows (`n` is the column count).
template <class T>
struct Launch<mgpu::detail::BiasGradOp<T>> {
  static void each(std::int64_t cols, mgpu::detail::BiasGradOp<T> const& op, cudaStream_t s) {
    launch_column_sums(BiasGradColumns<T>{op}, op.rows, cols, s);
  }
};
template <class T, class F>
struct Launch<mgpu::detail::ActivationBiasGradCol<T, F>> {
  static void each(std::int64_t cols, mgpu::detail::ActivationBiasGradCol<T, F> const& op, cudaStream_t s) {
    launch_column_sums(ActivationBiasGradColumns<T, F>{op}, op.rows, cols, s);
  }
};

void* create_blas_handle(int ordinal) {
  detail::cuda::DeviceScope scope(ordinal);
  cublasHandle_t handle = nullptr;
  MGPU_CUBLAS_CHECK(cublasCreate(&handle));
  return handle;
}

void destroy_blas_handle(void* handle) noexcept { (void)cublasDestroy(static_cast<cublasHandle_t>(handle)); }

void gemm(void* blas_handle, int ordinal, DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n,
          std::int64_t k, float alpha, void const* a, void const* b, float beta, void* c, void* stream, bool tf32) {
  int const rows = blas_extent(m, "m");
  int const cols = blas_extent(n, "n");
  int const inner = blas_extent(k, "k");
  if (rows == 0 || cols == 0) return;
  detail::cuda::DeviceScope scope(ordinal);
  auto const handle = static_cast<cublasHandle_t>(blas_handle);
  MGPU_CUBLAS_CHECK(cublasSetStream(handle, static_cast<cudaStream_t>(stream)));
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap places.
  int const lda = transpose_a ? rows : inner;
  int const ldb = transpose_b ? inner : cols;
  cudaDataType_t const type = cuda_type(dtype);
  cublasComputeType_t const compute = tf32 && dtype == DType::float32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  MGPU_CUBLAS_CHECK(cublasGemmEx(handle, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, cols,
                                 rows, inner, &alpha, b, type, ldb, a, type, lda, &beta, c, type, cols, compute,
                                 CUBLAS_GEMM_DEFAULT));
}

// The functors src/ops/linear.cpp launches.
#define MGPU_LINEAR_FOR_TYPE(T)                                                                                      \
  template void each(int, std::int64_t, mgpu::detail::BiasAddOp<T> const&, void*);                                    \
  template void each(int, std::int64_t, mgpu::detail::BiasGradOp<T> const&, void*);                                   \
  template void each(int, std::int64_t, mgpu::detail::BiasActivationOp<T, mgpu::detail::Identity> const&, void*);      \
  template void each(int, std::int64_t, mgpu::detail::BiasActivationOp<T, mgpu::detail::Relu> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::BiasActivationOp<T, mgpu::detail::Gelu> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::ActivationBiasGradCol<T, mgpu::detail::Identity> const&, void*); \
  template void each(int, std::int64_t, mgpu::detail::ActivationBiasGradCol<T, mgpu::detail::Relu> const&, void*);     \
  template void each(int, std::int64_t, mgpu::detail::ActivationBiasGradCol<T, mgpu::detail::Gelu> const&, void*);
MGPU_LINEAR_FOR_TYPE(float)
MGPU_LINEAR_FOR_TYPE(bfloat16)
MGPU_LINEAR_FOR_TYPE(float16)
#undef MGPU_LINEAR_FOR_TYPE

}  // namespace mgpu::kernels
