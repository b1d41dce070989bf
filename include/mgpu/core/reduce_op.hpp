// How a reduction combines elements: the operator of comm's all_reduce, reduce and reduce_scatter
// (mgpu::comm::ReduceOp names this type). It lives in core, with its element math in
// mgpu/core/detail/reduce_slice.hpp, so that comm's host loops and the CUDA kernels below comm
// share one definition.
#pragma once

#include <string_view>

namespace mgpu {

/// How all_reduce, reduce and reduce_scatter combine elements (in float32 for every dtype).
enum class ReduceOp { sum, avg, min, max };

constexpr std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
  }
  return "unknown";
}

}  // namespace mgpu
