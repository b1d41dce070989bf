// The reductions family's kernels (src/ops/reductions.cpp): sum, sum of squares and the count of
// non-finite elements, each a fixed-order sum.
#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/dtype.hpp>

#include "kernels/op_support.cuh"

namespace mgpu::kernels {

// The functors src/ops/reductions.cpp launches.
#define MGPU_REDUCTIONS_FOR_TYPE(T)                                                                \
  template void reduce(int, std::int64_t, mgpu::detail::ValueOp<T> const&, float*, float, Scratch&, void*);    \
  template void reduce(int, std::int64_t, mgpu::detail::SquareOp<T> const&, float*, float, Scratch&, void*);   \
  template void reduce(int, std::int64_t, mgpu::detail::NonFiniteOp<T> const&, float*, float, Scratch&, void*);
MGPU_REDUCTIONS_FOR_TYPE(float)
MGPU_REDUCTIONS_FOR_TYPE(bfloat16)
MGPU_REDUCTIONS_FOR_TYPE(float16)
#undef MGPU_REDUCTIONS_FOR_TYPE

}  // namespace mgpu::kernels
