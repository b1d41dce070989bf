// Element operations shared by the host loops and the CUDA kernels in src/kernels/.
#pragma once

#include <cstdint>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/host_device.hpp>

namespace mgpu::detail {

// Reads element i of a buffer of the given type as float.
MGPU_HD inline float load_as_float(DType type, void const* data, std::int64_t i) {
  switch (type) {
    case DType::float32: return static_cast<float const*>(data)[i];
    case DType::bfloat16: return bfloat16_bits_to_float(static_cast<std::uint16_t const*>(data)[i]);
    case DType::float16: return float16_bits_to_float(static_cast<std::uint16_t const*>(data)[i]);
  }
  return 0.0f;
}

// Writes a float, rounded to the buffer's type, as element i.
MGPU_HD inline void store_from_float(DType type, void* data, std::int64_t i, float value) {
  switch (type) {
    case DType::float32: static_cast<float*>(data)[i] = value; return;
    case DType::bfloat16: static_cast<std::uint16_t*>(data)[i] = float_to_bfloat16_bits(value); return;
    case DType::float16: static_cast<std::uint16_t*>(data)[i] = float_to_float16_bits(value); return;
  }
}

// dst[i] = src[i], converting between element types.
struct ConvertOp {
  void* dst;
  DType dst_type;
  void const* src;
  DType src_type;
  MGPU_HD void operator()(std::int64_t i) const {
    store_from_float(dst_type, dst, i, load_as_float(src_type, src, i));
  }
};

// dst[i] = value, rounded to the element type.
struct FillOp {
  void* dst;
  DType type;
  float value;
  MGPU_HD void operator()(std::int64_t i) const { store_from_float(type, dst, i, value); }
};

// The host driver of an element operation: op(i) for i in [0, count).
template <class Op>
void for_each_index(std::int64_t count, Op const& op) {
  for (std::int64_t i = 0; i < count; ++i) op(i);
}

}  // namespace mgpu::detail
