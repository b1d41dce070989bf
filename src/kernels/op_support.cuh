// What every op family's kernel file of src/kernels shares (the CUDA half of src/ops/op_support.hpp):
// the definitions of the `each` and `reduce` launchers of src/kernels/ops.hpp, the block
// reductions and the column-sum kernel the row and column functors use, and the first-bad-index
// search behind the label and token-id checks. Internal: not installed.
//
// A family file (linear.cu, activation.cu, layer_norm.cu, loss.cu, reductions.cu, updates.cu,
// transformer.cu) includes this header, specializes Launch for any functor that has a kernel of
// its own, and instantiates `each` or `reduce` for each of its functors (Note [adding an op] in
// src/ops/op_support.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <mgpu/core/error.hpp>

#include "core/cuda_device_scope.hpp"
#include "kernels/elementwise.cuh"
#include "kernels/ops.hpp"

namespace mgpu::kernels {

inline constexpr int reduce_threads = 256;
inline constexpr int max_reduce_blocks = 1024;

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

__device__ inline float block_sum(float value) {
  return block_reduce(value, [](float a, float b) { return a + b; });
}
__device__ inline float block_max(float value) {
  return block_reduce(value, [](float a, float b) { return fmaxf(a, b); });
}

// Pass 1 of a fixed-order sum: block b sums op(i) over its grid-stride share into partials[b].
template <class Op>
__global__ void reduce_partials_kernel(std::int64_t n, Op op, float* partials) {
  float sum = 0;
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) sum += op(i);
  float const total = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Pass 2: one block sums partials[0, count) in a fixed order and writes scale * total to *out
// (src/kernels/ops.cu).
void sum_partials(float const* partials, int count, float* out, float scale, cudaStream_t s);

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
  sum_partials(static_cast<float const*>(partials), blocks, out, scale, s);
}

// Row kernels run a block per row (grid-stride over rows): at most this many blocks.
inline int row_blocks(std::int64_t rows) { return static_cast<int>(rows < 65535 ? rows : 65535); }

// Launches kernel(op, rows) with a block of reduce_threads per row.
template <class Op>
void launch_rows(void (*kernel)(Op, std::int64_t), Op const& op, std::int64_t rows, cudaStream_t s) {
  if (rows == 0) return;
  kernel<<<row_blocks(rows), reduce_threads, 0, s>>>(op, rows);
  MGPU_CUDA_CHECK(cudaGetLastError());
}

// Column kernels: a block per tile of 32 columns (grid-stride over tiles), 8 row lanes. Threads
// x = 0..31 read 32 neighbouring columns of a row (coalesced); each lane sums every 8th row, and
// the 8 lanes are added in a fixed order. `Col` says what to add for (r, j) and what to store.
inline constexpr int tile_columns = 32;
inline constexpr int row_lanes = reduce_threads / tile_columns;

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

template <class Col>
void launch_column_sums(Col const& col, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (cols == 0) return;
  std::int64_t const tiles = (cols + tile_columns - 1) / tile_columns;
  int const blocks = static_cast<int>(tiles < 65535 ? tiles : 65535);
  column_sums_kernel<<<blocks, dim3(tile_columns, row_lanes), 0, s>>>(col, rows, cols);
  MGPU_CUDA_CHECK(cudaGetLastError());
}

// How a functor runs on a CUDA stream: an element functor over a grid (`each`), a term functor by
// a fixed-order sum (`reduce`); `n` is what the host loop would run over. A family file
// specializes Launch for a row or column functor with a kernel of its own.
template <class Op>
struct Launch {
  static void each(std::int64_t n, Op const& op, cudaStream_t s) { for_each_index(n, op, s); }
  static void reduce(std::int64_t n, Op const& op, float* out, float scale, Scratch& scratch, cudaStream_t s) {
    sum_terms(n, op, out, scale, scratch, s);
  }
};

template <class Op>
void each(int ordinal, std::int64_t n, Op const& op, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  Launch<Op>::each(n, op, static_cast<cudaStream_t>(stream));
}

template <class Op>
void reduce(int ordinal, std::int64_t n, Op const& op, float* out, float scale, Scratch& scratch, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  Launch<Op>::reduce(n, op, out, scale, scratch, static_cast<cudaStream_t>(stream));
}

// The smallest code(i) over i in [0, n), by an integer atomicMin (the result does not depend on
// the order); code(i) is all ones for a good index.
template <class Code>
__global__ void find_first_kernel(std::int64_t n, Code code, unsigned long long* first) {
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    unsigned long long const c = code(i);
    if (c != ~0ull) atomicMin(first, c);
  }
}

// Copies to `host_result` (page-locked memory, read after the stream has passed this point) the
// smallest code(i) over [0, n), or all ones when there is none, on `stream` of GPU `ordinal`; the
// search's word in `scratch`.
template <class Code>
void find_first(int ordinal, std::int64_t n, Code const& code, std::uint64_t* host_result, Scratch& scratch,
                void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  auto const s = static_cast<cudaStream_t>(stream);
  void* const first = scratch.allocate(sizeof(unsigned long long));
  MGPU_CUDA_CHECK(cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), s));
  if (n > 0) {
    std::int64_t const wanted = (n + reduce_threads - 1) / reduce_threads;
    int const blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
    find_first_kernel<<<blocks, reduce_threads, 0, s>>>(n, code, static_cast<unsigned long long*>(first));
    MGPU_CUDA_CHECK(cudaGetLastError());
  }
  MGPU_CUDA_CHECK(cudaMemcpyAsync(host_result, first, sizeof(std::uint64_t), cudaMemcpyDeviceToHost, s));
}

}  // namespace mgpu::kernels
