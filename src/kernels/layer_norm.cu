// The LayerNorm family's kernels (src/ops/layer_norm.cpp): forward and input gradient as a block per
// row (threads stride along the row, so neighbours read neighbouring elements, and the row's sums
// are block reductions), and the gamma and beta gradients as column sums.
#include <cuda_runtime.h>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>

#include "kernels/op_support.cuh"

namespace mgpu::kernels {
namespace {

template <class T>
__global__ void layer_norm_rows_kernel(mgpu::detail::LayerNormRow<T> op, std::int64_t rows) {
  using mgpu::detail::load;
  using mgpu::detail::store;
  auto const n = static_cast<float>(op.cols);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T const* xr = op.x + r * op.cols;
    if (op.residual != nullptr) {  // each thread reads back only the columns it wrote
      for (std::int64_t j = threadIdx.x; j < op.cols; j += blockDim.x)
        store(op.sum + r * op.cols, j, load(xr, j) + load(op.residual + r * op.cols, j));
      xr = op.sum + r * op.cols;
    }
    float sum = 0;
    for (std::int64_t j = threadIdx.x; j < op.cols; j += blockDim.x) sum += load(xr, j);
    float const mu = block_sum(sum) / n;
    float sq = 0;
    for (std::int64_t j = threadIdx.x; j < op.cols; j += blockDim.x) {
      float const d = load(xr, j) - mu;
      sq += d * d;
    }
    float const rs = 1.0f / sqrtf(block_sum(sq) / n + op.eps);
    for (std::int64_t j = threadIdx.x; j < op.cols; j += blockDim.x)
      store(op.y + r * op.cols, j, (load(xr, j) - mu) * rs * load(op.gamma, j) + load(op.beta, j));
    if (threadIdx.x == 0) {
      op.mean[r] = mu;
      op.rstd[r] = rs;
    }
  }
}

template <class T>
__global__ void layer_norm_grad_rows_kernel(mgpu::detail::LayerNormGradRow<T> op, std::int64_t rows) {
  using mgpu::detail::load;
  using mgpu::detail::store;
  auto const n = static_cast<float>(op.cols);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    std::int64_t const base = r * op.cols;
    float sum_g = 0;
    float sum_gx = 0;
    for (std::int64_t j = threadIdx.x; j < op.cols; j += blockDim.x) {
      float const g = load(op.dy, base + j) * load(op.gamma, j);
      sum_g += g;
      sum_gx += g * (load(op.x, base + j) - op.mean[r]) * op.rstd[r];
    }
    float const mean_g = block_sum(sum_g) / n;
    float const mean_gx = block_sum(sum_gx) / n;
    for (std::int64_t j = threadIdx.x; j < op.cols; j += blockDim.x) {
      float const g = load(op.dy, base + j) * load(op.gamma, j);
      float const xhat = (load(op.x, base + j) - op.mean[r]) * op.rstd[r];
      float const skip = op.residual != nullptr ? load(op.residual, base + j) : 0.0f;
      store(op.dx, base + j, op.rstd[r] * (g - mean_g - xhat * mean_gx) + skip);
    }
  }
}

template <class T>
struct LayerNormParamGradColumns {
  mgpu::detail::LayerNormParamGradCol<T> op;
  __device__ void add(std::int64_t r, std::int64_t j, float (&acc)[2]) const {
    float const g = mgpu::detail::load(op.dy, r * op.cols + j);
    acc[0] += g * (mgpu::detail::load(op.x, r * op.cols + j) - op.mean[r]) * op.rstd[r];
    acc[1] += g;
  }
  __device__ void finish(std::int64_t j, float const (&total)[2]) const {
    mgpu::detail::store(op.dgamma, j, total[0]);
    mgpu::detail::store(op.dbeta, j, total[1]);
  }
};

}  // namespace

template <class T>
struct Launch<mgpu::detail::LayerNormRow<T>> {
  static void each(std::int64_t rows, mgpu::detail::LayerNormRow<T> const& op, cudaStream_t s) {
    launch_rows(layer_norm_rows_kernel<T>, op, rows, s);
  }
};
template <class T>
struct Launch<mgpu::detail::LayerNormGradRow<T>> {
  static void each(std::int64_t rows, mgpu::detail::LayerNormGradRow<T> const& op, cudaStream_t s) {
    launch_rows(layer_norm_grad_rows_kernel<T>, op, rows, s);
  }
};
template <class T>
struct Launch<mgpu::detail::LayerNormParamGradCol<T>> {
  static void each(std::int64_t cols, mgpu::detail::LayerNormParamGradCol<T> const& op, cudaStream_t s) {
    launch_column_sums(LayerNormParamGradColumns<T>{op}, op.rows, cols, s);
  }
};

// The functors src/ops/layer_norm.cpp launches.
#define MGPU_LAYER_NORM_FOR_TYPE(T)                                                          \
  template void each(int, std::int64_t, mgpu::detail::LayerNormRow<T> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::LayerNormGradRow<T> const&, void*);      \
  template void each(int, std::int64_t, mgpu::detail::LayerNormParamGradCol<T> const&, void*);
MGPU_LAYER_NORM_FOR_TYPE(float)
MGPU_LAYER_NORM_FOR_TYPE(bfloat16)
MGPU_LAYER_NORM_FOR_TYPE(float16)
#undef MGPU_LAYER_NORM_FOR_TYPE

}  // namespace mgpu::kernels
