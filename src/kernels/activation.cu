// The activation family's kernels (src/ops/activation.cpp): ReLU and GELU forward and backward, and
// dropout, each an element functor over a grid.
#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/dtype.hpp>

#include "kernels/op_support.cuh"

namespace mgpu::kernels {

// The functors src/ops/activation.cpp launches.
#define MGPU_ACTIVATION_FOR_TYPE(T)                                                                          \
  template void each(int, std::int64_t, mgpu::detail::ActivationOp<T, mgpu::detail::Relu> const&, void*);     \
  template void each(int, std::int64_t, mgpu::detail::ActivationOp<T, mgpu::detail::Gelu> const&, void*);     \
  template void each(int, std::int64_t, mgpu::detail::ActivationGradOp<T, mgpu::detail::Relu> const&, void*); \
  template void each(int, std::int64_t, mgpu::detail::ActivationGradOp<T, mgpu::detail::Gelu> const&, void*); \
  template void each(int, std::int64_t, mgpu::detail::DropoutOp<T> const&, void*);
MGPU_ACTIVATION_FOR_TYPE(float)
MGPU_ACTIVATION_FOR_TYPE(bfloat16)
MGPU_ACTIVATION_FOR_TYPE(float16)
#undef MGPU_ACTIVATION_FOR_TYPE

}  // namespace mgpu::kernels
