// The loss family's kernels (src/ops/loss.cpp): softmax cross-entropy as a block per row (the
// row's loss into a scratch array, then a fixed-order sum), squared error and correct-row counts as
// fixed-order sums, and the label check.
#include <cuda_runtime.h>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>

#include "kernels/op_support.cuh"

namespace mgpu::kernels {
namespace {

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

// (row << 32 | label bits) for a row whose label is not a class id, else all ones.
struct BadLabel {
  float const* labels;
  std::int64_t classes;
  __device__ unsigned long long operator()(std::int64_t r) const {
    float const y = labels[r];
    auto const label = static_cast<std::int64_t>(y);
    if (y >= 0.0f && label < classes && static_cast<float>(label) == y) return ~0ull;
    return (static_cast<unsigned long long>(r) << 32) | __float_as_uint(y);
  }
};

}  // namespace

template <class T>
struct Launch<mgpu::detail::SoftmaxCrossEntropyRow<T>> {
  static void reduce(std::int64_t rows, mgpu::detail::SoftmaxCrossEntropyRow<T> const& op, float* out, float scale,
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
};

void find_bad_label(int ordinal, float const* labels, std::int64_t rows, std::int64_t classes, std::uint64_t* host_result,
                    Scratch& scratch, void* stream) {
  find_first(ordinal, rows, BadLabel{labels, classes}, host_result, scratch, stream);
}

// The functors src/ops/loss.cpp launches.
#define MGPU_LOSS_FOR_TYPE(T)                                                                                      \
  template void reduce(int, std::int64_t, mgpu::detail::SoftmaxCrossEntropyRow<T> const&, float*, float, Scratch&, void*);    \
  template void reduce(int, std::int64_t, mgpu::detail::SquaredErrorOp<T> const&, float*, float, Scratch&, void*);            \
  template void reduce(int, std::int64_t, mgpu::detail::CorrectRow<T> const&, float*, float, Scratch&, void*);
MGPU_LOSS_FOR_TYPE(float)
MGPU_LOSS_FOR_TYPE(bfloat16)
MGPU_LOSS_FOR_TYPE(float16)
#undef MGPU_LOSS_FOR_TYPE

}  // namespace mgpu::kernels
