// The updates family's kernels (src/ops/updates.cpp): SGD and AdamW steps, scaling, scaled
// conversion, scaled accumulation and column copies, each an element functor over a grid.
#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/dtype.hpp>

#include "kernels/op_support.cuh"

namespace mgpu::kernels {

// The functors src/ops/updates.cpp launches.
#define MGPU_UPDATES_FOR_TYPE(T)                                                                      \
  template void each(int, std::int64_t, mgpu::detail::ScaleOp<T> const&, void*);                        \
  template void each(int, std::int64_t, mgpu::detail::ScaleConvertOp<T, float> const&, void*);         \
  template void each(int, std::int64_t, mgpu::detail::ScaleConvertOp<T, bfloat16> const&, void*);      \
  template void each(int, std::int64_t, mgpu::detail::ScaleConvertOp<T, float16> const&, void*);       \
  template void each(int, std::int64_t, mgpu::detail::AddScaledOp<T, float> const&, void*);            \
  template void each(int, std::int64_t, mgpu::detail::AddScaledOp<T, bfloat16> const&, void*);         \
  template void each(int, std::int64_t, mgpu::detail::AddScaledOp<T, float16> const&, void*);          \
  template void each(int, std::int64_t, mgpu::detail::CopyColumnsOp<T> const&, void*);
MGPU_UPDATES_FOR_TYPE(float)
MGPU_UPDATES_FOR_TYPE(bfloat16)
MGPU_UPDATES_FOR_TYPE(float16)
#undef MGPU_UPDATES_FOR_TYPE
template void each(int, std::int64_t, mgpu::detail::SgdOp const&, void*);
template void each(int, std::int64_t, mgpu::detail::AdamWOp const&, void*);

}  // namespace mgpu::kernels
