// The training ops' kernels (src/kernels/ops.hpp): element functors of mgpu/core/detail/training_math.hpp
// over a grid; LayerNorm and softmax rows as a block per row, bias and LayerNorm parameter
// gradients as column tiles, both with block reductions over coalesced reads; reductions in a fixed
// order (per-block tree sums, then one block sums the partials); the label check; GEMM via cuBLAS.
#include "kernels/ops.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <string>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/detail/training_math.hpp>

#include "core/cuda_device_scope.hpp"
#include "kernels/elementwise.cuh"

namespace mgpu::kernels {
namespace {

constexpr int reduce_threads = 256;
constexpr int max_reduce_blocks = 1024;

// Combines `value` over the block (blockDim.x * blockDim.y == reduce_threads) with a fixed tree,
// the same order every run, and returns the result to every thread.
template <class Combine>
__device__ float block_reduce(float value, Combine combine) {
  __shared__ float partial[reduce_threads];
  int const t = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  partial[t] = value;
  __syncthreads();
  for (int width = reduce_threads / 2; width > 0; width /= 2) {
    if (t < width) partial[t] = combine(partial[t], partial[t + width]);
    __syncthreads();
  }
  float const total = partial[0];
  __syncthreads();  // every thread has its total before the next call reuses `partial`
  return total;
}

__device__ float block_sum(float value) {
  return block_reduce(value, [](float a, float b) { return a + b; });
}
__device__ float block_max(float value) {
  return block_reduce(value, [](float a, float b) { return fmaxf(a, b); });
}

// Pass 1: block b sums op(i) over its grid-stride share into partials[b].
template <class Op>
__global__ void reduce_partials_kernel(std::int64_t n, Op op, float* partials) {
  float sum = 0;
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) sum += op(i);
  float const total = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Pass 2: one block sums the partials in a fixed order and writes scale * total.
__global__ void reduce_final_kernel(float const* partials, int count, float* out, float scale) {
  float sum = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += blockDim.x) sum += partials[i];
  float const total = block_sum(sum);
  if (threadIdx.x == 0) *out = scale * total;
}

// *out = scale * sum of op(i), in an order fixed by n alone.
template <class Op>
void sum_terms(std::int64_t n, Op const& op, float* out, float scale, Scratch& scratch, cudaStream_t s) {
  if (n == 0) {
    MGPU_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), s));
    return;
  }
  std::int64_t const wanted = (n + reduce_threads - 1) / reduce_threads;
  int const blocks = static_cast<int>(wanted < max_reduce_blocks ? wanted : max_reduce_blocks);
  // The partials are scratch: the caller releases them in stream order after the final pass.
  void* const partials = scratch.allocate(sizeof(float) * static_cast<std::size_t>(blocks));
  reduce_partials_kernel<<<blocks, reduce_threads, 0, s>>>(n, op, static_cast<float*>(partials));
  MGPU_CUDA_CHECK(cudaGetLastError());
  reduce_final_kernel<<<1, reduce_threads, 0, s>>>(static_cast<float const*>(partials), blocks, out, scale);
  MGPU_CUDA_CHECK(cudaGetLastError());
}

int row_blocks(std::int64_t rows) { return static_cast<int>(rows < 65535 ? rows : 65535); }

// Row kernels: a block per row (grid-stride over rows); the threads stride along the row, so
// neighbours read neighbouring elements (coalesced), and the row's sums are block reductions.
template <class T>
__global__ void layer_norm_rows_kernel(mgpu::detail::LayerNormRow<T> op, std::int64_t rows) {
  using mgpu::detail::load;
  using mgpu::detail::store;
  auto const n = static_cast<float>(op.cols);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T const* xr = op.x + r * op.cols;
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
      store(op.dx, base + j, op.rstd[r] * (g - mean_g - xhat * mean_gx));
    }
  }
}

// Softmax cross-entropy, a block per row: writes dlogits and the row's loss into losses[r].
template <class T>
__global__ void softmax_cross_entropy_rows_kernel(mgpu::detail::SoftmaxCrossEntropyRow<T> op, std::int64_t rows, float* losses) {
  using mgpu::detail::load;
  using mgpu::detail::store;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T const* z = op.logits + r * op.classes;
    T* dz = op.dlogits + r * op.classes;
    float const y = op.labels[r];
    auto const label = static_cast<std::int64_t>(y);
    if (!(y >= 0.0f) || label >= op.classes || static_cast<float>(label) != y) {  // the same for the whole block
      for (std::int64_t j = threadIdx.x; j < op.classes; j += blockDim.x) store(dz, j, NAN);
      if (threadIdx.x == 0) losses[r] = NAN;
      continue;
    }
    float const picked = load(z, label);  // read before any thread writes dz (which may be z)
    float top = -INFINITY;
    for (std::int64_t j = threadIdx.x; j < op.classes; j += blockDim.x) top = fmaxf(top, load(z, j));
    top = block_max(top);
    float sum = 0;
    for (std::int64_t j = threadIdx.x; j < op.classes; j += blockDim.x) sum += expf(load(z, j) - top);
    float const log_sum = logf(block_sum(sum));
    for (std::int64_t j = threadIdx.x; j < op.classes; j += blockDim.x) {
      float const p = expf(load(z, j) - top - log_sum);
      store(dz, j, (p - (j == label ? 1.0f : 0.0f)) * op.grad_scale);
    }
    if (threadIdx.x == 0) losses[r] = log_sum - (picked - top);
  }
}

struct LoadAt {
  float const* values;
  __device__ float operator()(std::int64_t i) const { return values[i]; }
};

// Column kernels: a block per tile of 32 columns (grid-stride over tiles), 8 row lanes. Threads
// x = 0..31 read 32 neighbouring columns of a row (coalesced); each lane sums every 8th row, and
// the 8 lanes are added in a fixed order. `Col` says what to add for (r, j) and what to store.
constexpr int tile_columns = 32;
constexpr int row_lanes = reduce_threads / tile_columns;

template <class Col>
__global__ void column_sums_kernel(Col col, std::int64_t rows, std::int64_t cols) {
  __shared__ float partial[2][row_lanes][tile_columns + 1];
  for (std::int64_t tile = blockIdx.x; tile * tile_columns < cols; tile += gridDim.x) {
    std::int64_t const j = tile * tile_columns + threadIdx.x;
    float acc[2] = {0, 0};
    if (j < cols) {
      for (std::int64_t r = threadIdx.y; r < rows; r += row_lanes) col.add(r, j, acc);
    }
    partial[0][threadIdx.y][threadIdx.x] = acc[0];
    partial[1][threadIdx.y][threadIdx.x] = acc[1];
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
      float total[2] = {0, 0};
      for (int lane = 0; lane < row_lanes; ++lane) {
        total[0] += partial[0][lane][threadIdx.x];
        total[1] += partial[1][lane][threadIdx.x];
      }
      col.finish(j, total);
    }
    __syncthreads();
  }
}

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

template <class Col>
void launch_column_sums(Col const& col, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (cols == 0) return;
  std::int64_t const tiles = (cols + tile_columns - 1) / tile_columns;
  int const blocks = static_cast<int>(tiles < 65535 ? tiles : 65535);
  column_sums_kernel<<<blocks, dim3(tile_columns, row_lanes), 0, s>>>(col, rows, cols);
  MGPU_CUDA_CHECK(cudaGetLastError());
}

// How each functor runs: element functors over a grid; row and column functors by the kernels
// above (the most specialized overload wins). `n` is what the host loop would run over.
template <class Op>
void launch_each(std::int64_t n, Op const& op, cudaStream_t s) {
  for_each_index(n, op, s);
}
template <class T>
void launch_each(std::int64_t rows, mgpu::detail::LayerNormRow<T> const& op, cudaStream_t s) {
  if (rows == 0) return;
  layer_norm_rows_kernel<<<row_blocks(rows), reduce_threads, 0, s>>>(op, rows);
  MGPU_CUDA_CHECK(cudaGetLastError());
}
template <class T>
void launch_each(std::int64_t rows, mgpu::detail::LayerNormGradRow<T> const& op, cudaStream_t s) {
  if (rows == 0) return;
  layer_norm_grad_rows_kernel<<<row_blocks(rows), reduce_threads, 0, s>>>(op, rows);
  MGPU_CUDA_CHECK(cudaGetLastError());
}
template <class T>
void launch_each(std::int64_t cols, mgpu::detail::BiasGradOp<T> const& op, cudaStream_t s) {
  launch_column_sums(BiasGradColumns<T>{op}, op.rows, cols, s);
}
template <class T, class F>
void launch_each(std::int64_t cols, mgpu::detail::ActivationBiasGradCol<T, F> const& op, cudaStream_t s) {
  launch_column_sums(ActivationBiasGradColumns<T, F>{op}, op.rows, cols, s);
}
template <class T>
void launch_each(std::int64_t cols, mgpu::detail::LayerNormParamGradCol<T> const& op, cudaStream_t s) {
  launch_column_sums(LayerNormParamGradColumns<T>{op}, op.rows, cols, s);
}

template <class Op>
void launch_reduce(std::int64_t n, Op const& op, float* out, float scale, Scratch& scratch, cudaStream_t s) {
  sum_terms(n, op, out, scale, scratch, s);
}
template <class T>
void launch_reduce(std::int64_t rows, mgpu::detail::SoftmaxCrossEntropyRow<T> const& op, float* out, float scale,
                   Scratch& scratch, cudaStream_t s) {
  if (rows == 0) {
    sum_terms(0, LoadAt{nullptr}, out, scale, scratch, s);
    return;
  }
  void* const losses = scratch.allocate(sizeof(float) * static_cast<std::size_t>(rows));
  softmax_cross_entropy_rows_kernel<<<row_blocks(rows), reduce_threads, 0, s>>>(op, rows, static_cast<float*>(losses));
  MGPU_CUDA_CHECK(cudaGetLastError());
  sum_terms(rows, LoadAt{static_cast<float const*>(losses)}, out, scale, scratch, s);
}

// The smallest (row << 32 | label bits) over the rows whose label is not a class id.
__global__ void find_bad_label_kernel(float const* labels, std::int64_t rows, std::int64_t classes,
                                      unsigned long long* first) {
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
    float const y = labels[r];
    auto const label = static_cast<std::int64_t>(y);
    if (!(y >= 0.0f) || label >= classes || static_cast<float>(label) != y) {
      auto const code = (static_cast<unsigned long long>(r) << 32) | __float_as_uint(y);
      atomicMin(first, code);  // the smallest row wins whatever the order: deterministic
    }
  }
}

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

template <class Op>
void each(int ordinal, std::int64_t n, Op const& op, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  launch_each(n, op, static_cast<cudaStream_t>(stream));
}

template <class Op>
void reduce(int ordinal, std::int64_t n, Op const& op, float* out, float scale, Scratch& scratch, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  launch_reduce(n, op, out, scale, scratch, static_cast<cudaStream_t>(stream));
}

void find_bad_label(int ordinal, float const* labels, std::int64_t rows, std::int64_t classes,
                    std::uint64_t* host_result, Scratch& scratch, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  auto const s = static_cast<cudaStream_t>(stream);
  void* const first = scratch.allocate(sizeof(unsigned long long));
  MGPU_CUDA_CHECK(cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), s));
  if (rows > 0) {
    std::int64_t const wanted = (rows + reduce_threads - 1) / reduce_threads;
    int const blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
    find_bad_label_kernel<<<blocks, reduce_threads, 0, s>>>(labels, rows, classes, static_cast<unsigned long long*>(first));
    MGPU_CUDA_CHECK(cudaGetLastError());
  }
  MGPU_CUDA_CHECK(cudaMemcpyAsync(host_result, first, sizeof(std::uint64_t), cudaMemcpyDeviceToHost, s));
}

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

// The instantiations the op files of src/ops launch.
#define MGPU_OPS_FOR_TYPE(T)                                                                                         \
  template void each(int, std::int64_t, mgpu::detail::ActivationOp<T, mgpu::detail::Relu> const&, void*);              \
  template void each(int, std::int64_t, mgpu::detail::ActivationOp<T, mgpu::detail::Gelu> const&, void*);              \
  template void each(int, std::int64_t, mgpu::detail::ActivationGradOp<T, mgpu::detail::Relu> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::ActivationGradOp<T, mgpu::detail::Gelu> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::BiasActivationOp<T, mgpu::detail::Identity> const&, void*);      \
  template void each(int, std::int64_t, mgpu::detail::BiasActivationOp<T, mgpu::detail::Relu> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::BiasActivationOp<T, mgpu::detail::Gelu> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::ActivationBiasGradCol<T, mgpu::detail::Identity> const&, void*); \
  template void each(int, std::int64_t, mgpu::detail::ActivationBiasGradCol<T, mgpu::detail::Relu> const&, void*);     \
  template void each(int, std::int64_t, mgpu::detail::ActivationBiasGradCol<T, mgpu::detail::Gelu> const&, void*);     \
  template void each(int, std::int64_t, mgpu::detail::BiasAddOp<T> const&, void*);                                    \
  template void each(int, std::int64_t, mgpu::detail::BiasGradOp<T> const&, void*);                                   \
  template void each(int, std::int64_t, mgpu::detail::ScaleOp<T> const&, void*);                                      \
  template void each(int, std::int64_t, mgpu::detail::DropoutOp<T> const&, void*);                                    \
  template void each(int, std::int64_t, mgpu::detail::LayerNormRow<T> const&, void*);                                 \
  template void each(int, std::int64_t, mgpu::detail::LayerNormGradRow<T> const&, void*);                             \
  template void each(int, std::int64_t, mgpu::detail::LayerNormParamGradCol<T> const&, void*);                        \
  template void each(int, std::int64_t, mgpu::detail::ScaleConvertOp<T, float> const&, void*);                        \
  template void each(int, std::int64_t, mgpu::detail::ScaleConvertOp<T, bfloat16> const&, void*);                     \
  template void each(int, std::int64_t, mgpu::detail::ScaleConvertOp<T, float16> const&, void*);                      \
  template void each(int, std::int64_t, mgpu::detail::AddScaledOp<T, float> const&, void*);                          \
  template void each(int, std::int64_t, mgpu::detail::AddScaledOp<T, bfloat16> const&, void*);                       \
  template void each(int, std::int64_t, mgpu::detail::AddScaledOp<T, float16> const&, void*);                        \
  template void reduce(int, std::int64_t, mgpu::detail::SoftmaxCrossEntropyRow<T> const&, float*, float, Scratch&,     \
                       void*);                                                                                         \
  template void reduce(int, std::int64_t, mgpu::detail::SquaredErrorOp<T> const&, float*, float, Scratch&, void*);     \
  template void reduce(int, std::int64_t, mgpu::detail::CorrectRow<T> const&, float*, float, Scratch&, void*);         \
  template void reduce(int, std::int64_t, mgpu::detail::ValueOp<T> const&, float*, float, Scratch&, void*);            \
  template void reduce(int, std::int64_t, mgpu::detail::SquareOp<T> const&, float*, float, Scratch&, void*);           \
  template void reduce(int, std::int64_t, mgpu::detail::NonFiniteOp<T> const&, float*, float, Scratch&, void*);
MGPU_OPS_FOR_TYPE(float)
MGPU_OPS_FOR_TYPE(bfloat16)
MGPU_OPS_FOR_TYPE(float16)
#undef MGPU_OPS_FOR_TYPE
template void each(int, std::int64_t, mgpu::detail::SgdOp const&, void*);
template void each(int, std::int64_t, mgpu::detail::AdamWOp const&, void*);

}  // namespace mgpu::kernels
