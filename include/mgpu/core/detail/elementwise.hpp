// Element operations shared by the host loops and the CUDA kernels in src/kernels/.
#pragma once

#include <cstdint>
#include <type_traits>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/host_device.hpp>

namespace mgpu::detail {

// Calls fn(std::type_identity<T>{}) with T the floating-point element type stored as `type`;
// throws Error(invalid_argument) for int32, which holds token ids and takes no arithmetic.
template <class Fn>
decltype(auto) visit_dtype(DType type, Fn&& fn) {
  switch (type) {
    case DType::bfloat16: return fn(std::type_identity<bfloat16>{});
    case DType::float16: return fn(std::type_identity<float16>{});
    case DType::int32:
      throw Error(Errc::invalid_argument, "arithmetic on an int32 tensor (expected float32, bfloat16 or float16; int32 tensors hold token ids)");
    case DType::float32: break;
  }
  return fn(std::type_identity<float>{});
}

// dst[i] = src[i], converted through float with round-to-nearest-even.
template <Element Dst, Element Src>
struct ConvertOp {
  Dst* dst;
  Src const* src;
  MGPU_HD void operator()(std::int64_t i) const { dst[i] = Dst(static_cast<float>(src[i])); }
};

// dst[i] = value (already rounded to the element type).
template <Element T>
struct FillOp {
  T* dst;
  T value;
  MGPU_HD void operator()(std::int64_t i) const { dst[i] = value; }
};

// The host driver of an element operation: op(i) for i in [0, count).
template <class Op>
void for_each_index(std::int64_t count, Op const& op) {
  for (std::int64_t i = 0; i < count; ++i) op(i);
}

}  // namespace mgpu::detail
