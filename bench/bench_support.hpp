// What several benchmarks share: the median of their timings, the library's host GEMM totals on a
// stream's worker thread, and (bench_quick.hpp) the smoke run's limits.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>


#include <mgpu/core/stream.hpp>
#include <mgpu/ops/ops.hpp>

#include "bench_quick.hpp"

namespace bench {

inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// ops::host_gemm_stats() as seen by the worker thread of host stream `stream` (the totals are per
// thread), after the work enqueued before it.
inline mgpu::ops::HostGemmStats host_gemm_stats(mgpu::Stream& stream) {
  mgpu::ops::HostGemmStats stats;
  stream.enqueue([&stats] { stats = mgpu::ops::host_gemm_stats(); });
  stream.synchronize();
  return stats;
}

}  // namespace bench
