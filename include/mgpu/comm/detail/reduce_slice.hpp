// The reduction at the heart of the shared-memory all-reduce: elements [begin, end) of every rank's
// input, combined in rank order, written to every rank's output. Each input is read once and each
// output written once. Host code runs it in cache-sized blocks; the CUDA kernel runs the per-element
// operator on a grid.
#pragma once

#include <algorithm>
#include <cstdint>

#include <mgpu/comm/reduce_op.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/host_device.hpp>

namespace mgpu::comm::detail {

/// The most ranks one reduction reads (the size of the pointer arrays passed to a kernel).
inline constexpr int max_reduce_ranks = 16;

/// Per-element form: out[q][i] = finish(in[0][i] (+) in[1][i] (+) ... ) for every output q.
template <Element T, ReduceOp O>
struct ReduceSlice {
  T const* in[max_reduce_ranks];
  T* out[max_reduce_ranks];
  int inputs;
  int outputs;

  MGPU_HD void operator()(std::int64_t i) const {
    float acc = static_cast<float>(in[0][i]);
    for (int p = 1; p < inputs; ++p) acc = combine<O>(acc, static_cast<float>(in[p][i]));
    T const result(finish<O>(acc, inputs));
    for (int q = 0; q < outputs; ++q) out[q][i] = result;
  }
};

/// Host form of ReduceSlice over [begin, end), in blocks that stay in L1 so every input is streamed
/// once and the inner loops vectorize. Same element math, same order, same results.
template <Element T, ReduceOp O>
void reduce_slice_host(ReduceSlice<T, O> const& r, std::int64_t begin, std::int64_t end) {
  constexpr std::int64_t block = 2048;
  float acc[block];
  for (std::int64_t b = begin; b < end; b += block) {
    std::int64_t const len = std::min(block, end - b);
    T const* first = r.in[0] + b;
    for (std::int64_t j = 0; j < len; ++j) acc[j] = static_cast<float>(first[j]);
    for (int p = 1; p < r.inputs; ++p) {
      T const* src = r.in[p] + b;
      for (std::int64_t j = 0; j < len; ++j) acc[j] = combine<O>(acc[j], static_cast<float>(src[j]));
    }
    for (int q = 0; q < r.outputs; ++q) {
      T* dst = r.out[q] + b;
      for (std::int64_t j = 0; j < len; ++j) dst[j] = T(finish<O>(acc[j], r.inputs));
    }
  }
}

}  // namespace mgpu::comm::detail
