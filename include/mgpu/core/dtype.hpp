// Element types: float32, bfloat16 and float16, with conversions shared by host and device code, and
// int32 for token ids and targets.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#include <mgpu/core/host_device.hpp>

namespace mgpu {

/// A tensor's element type. Host code computes in float32 whatever the floating-point storage type.
/// int32 holds token ids and targets: such tensors are stored, copied, sliced and checkpointed, and
/// arithmetic (ops, convert_async, fill_async, communicators) rejects them with Error(invalid_argument).
enum class DType : std::uint8_t { float32, bfloat16, float16, int32 };

/// Bytes per element.
constexpr std::size_t size_of(DType dtype) noexcept { return dtype == DType::float32 || dtype == DType::int32 ? 4 : 2; }

/// The type's name: "float32", "bfloat16", "float16" or "int32".
constexpr std::string_view to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::float32: return "float32";
    case DType::bfloat16: return "bfloat16";
    case DType::float16: return "float16";
    case DType::int32: return "int32";
  }
  return "unknown";
}

namespace detail {
MGPU_HD inline std::uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  return std::bit_cast<std::uint32_t>(value);
#endif
}

MGPU_HD inline float bits_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}
}  // namespace detail

/// Rounds a float to bfloat16 bits, to nearest with ties to even; NaN stays a quiet NaN.
MGPU_HD inline std::uint16_t float_to_bfloat16_bits(float value) {
  std::uint32_t const bits = detail::float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  std::uint32_t const rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding_bias) >> 16);
}

/// The float a bfloat16 bit pattern stands for (exact).
MGPU_HD inline float bfloat16_bits_to_float(std::uint16_t bits) {
  return detail::bits_float(static_cast<std::uint32_t>(bits) << 16);
}

/// Rounds a float to IEEE binary16 bits, to nearest with ties to even, overflowing to infinity.
MGPU_HD inline std::uint16_t float_to_float16_bits(float value) {
  std::uint32_t x = detail::float_bits(value);
  auto const sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN, infinity
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504
  if (x < 0x38800000u) {                        // below 2^-14: a binary16 subnormal or zero
    if (x < 0x33000000u) return sign;           // at most 2^-25 rounds to zero
    std::uint32_t const exponent = x >> 23;
    std::uint32_t const mantissa = (x & 0x7fffffu) | 0x800000u;
    std::uint32_t const shift = 126u - exponent;  // value / 2^-24 = mantissa >> shift
    std::uint32_t result = mantissa >> shift;
    std::uint32_t const rest = mantissa & ((1u << shift) - 1u);
    std::uint32_t const half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (result & 1u))) ++result;
    return sign | static_cast<std::uint16_t>(result);
  }
  std::uint32_t result = (x - 0x38000000u) >> 13;  // rebias the exponent, keep 10 mantissa bits
  std::uint32_t const rest = x & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
  return sign | static_cast<std::uint16_t>(result);
}

/// The float an IEEE binary16 bit pattern stands for (exact).
MGPU_HD inline float float16_bits_to_float(std::uint16_t bits) {
  std::uint32_t const sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  std::uint32_t const exponent = (bits >> 10) & 0x1fu;
  std::uint32_t const mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return detail::bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    float const magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // m * 2^-24
    return sign ? -magnitude : magnitude;
  }
  return detail::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/// bfloat16 storage: 16 bits, converted to and from float with round-to-nearest-even.
struct bfloat16 {
  std::uint16_t bits = 0;
  bfloat16() = default;
  MGPU_HD explicit bfloat16(float value) : bits(float_to_bfloat16_bits(value)) {}
  MGPU_HD explicit operator float() const { return bfloat16_bits_to_float(bits); }
};

/// IEEE binary16 storage, converted to and from float with round-to-nearest-even.
struct float16 {
  std::uint16_t bits = 0;
  float16() = default;
  MGPU_HD explicit float16(float value) : bits(float_to_float16_bits(value)) {}
  MGPU_HD explicit operator float() const { return float16_bits_to_float(bits); }
};

/// The DType that stores elements of type T (float, bfloat16, float16 or std::int32_t).
template <class T>
inline constexpr DType dtype_of = DType::float32;
template <>
inline constexpr DType dtype_of<bfloat16> = DType::bfloat16;
template <>
inline constexpr DType dtype_of<float16> = DType::float16;
template <>
inline constexpr DType dtype_of<std::int32_t> = DType::int32;

/// True for the floating-point element types, those that ops compute with.
template <class T>
concept Element = std::same_as<T, float> || std::same_as<T, bfloat16> || std::same_as<T, float16>;

/// True for every element type a Tensor can hold: the floating-point ones and std::int32_t.
template <class T>
concept Storable = Element<T> || std::same_as<T, std::int32_t>;

}  // namespace mgpu
