// Reduction operators and their element math, shared by the host backend and the CUDA kernels.
#pragma once

#include <type_traits>

#include <mgpu/core/host_device.hpp>

namespace mgpu::comm {

/// How all_reduce, reduce and reduce_scatter combine elements (in float32 for every dtype).
enum class ReduceOp { sum, avg, min, max };

/// a combined with b under O.
template <ReduceOp O>
MGPU_HD inline float combine(float a, float b) {
  if constexpr (O == ReduceOp::min) {
    return b < a ? b : a;
  } else if constexpr (O == ReduceOp::max) {
    return b > a ? b : a;
  } else {
    return a + b;
  }
}

/// The combined value of `ranks` inputs as the operation's result (avg divides by the count).
template <ReduceOp O>
MGPU_HD inline float finish(float combined, int ranks) {
  if constexpr (O == ReduceOp::avg) {
    return combined / static_cast<float>(ranks);
  } else {
    return combined;
  }
}

/// Calls fn(std::integral_constant<ReduceOp, O>{}) for the runtime value `op`.
template <class Fn>
decltype(auto) visit_reduce_op(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::avg: return fn(std::integral_constant<ReduceOp, ReduceOp::avg>{});
    case ReduceOp::min: return fn(std::integral_constant<ReduceOp, ReduceOp::min>{});
    case ReduceOp::max: return fn(std::integral_constant<ReduceOp, ReduceOp::max>{});
    case ReduceOp::sum: break;
  }
  return fn(std::integral_constant<ReduceOp, ReduceOp::sum>{});
}

}  // namespace mgpu::comm
