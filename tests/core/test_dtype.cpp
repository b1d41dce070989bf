// float32 <-> bfloat16 / float16 conversions against independent references.
#include <mgpu/core/dtype.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/catch.hpp"

namespace {

// Reference bfloat16 rounding by exhaustive candidate comparison in double precision.
std::uint16_t reference_bfloat16(float value) {
  auto const bits = std::bit_cast<std::uint32_t>(value);
  auto const low = static_cast<std::uint16_t>(bits >> 16);  // truncation toward zero
  auto const high = static_cast<std::uint16_t>(low + 1);    // next bfloat16 away from zero
  double const v = value;
  double const a = std::bit_cast<float>(static_cast<std::uint32_t>(low) << 16);
  double const b = std::bit_cast<float>(static_cast<std::uint32_t>(high) << 16);
  double const da = std::fabs(v - a);
  double const db = std::isinf(b) ? std::fabs(v - std::ldexp(1.0, 128) * (v < 0 ? -1 : 1)) : std::fabs(v - b);
  if (da < db) return low;
  if (db < da) return high;
  return (low & 1u) ? high : low;
}

// The value of a float16 bit pattern from its fields (IEEE 754 binary16), in double precision.
double reference_float16_value(std::uint16_t bits) {
  double const sign = (bits & 0x8000u) ? -1.0 : 1.0;
  int const exponent = (bits >> 10) & 0x1f;
  int const mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * HUGE_VAL;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// Reference float16 rounding: the nearest of every finite non-negative float16 (and 2^16, which
// stands for infinity in round-to-nearest-even), ties to the even bit pattern, sign copied.
class Float16Rounding {
 public:
  Float16Rounding() {
    for (std::uint16_t b = 0; b < 0x7c00u; ++b) magnitudes_.push_back(reference_float16_value(b));
    magnitudes_.push_back(65536.0);
  }
  std::uint16_t operator()(float value) const {
    auto const sign = static_cast<std::uint16_t>(std::signbit(value) ? 0x8000u : 0u);
    double const v = std::fabs(static_cast<double>(value));
    if (v >= 65536.0) return sign | 0x7c00u;
    auto const above = std::lower_bound(magnitudes_.begin(), magnitudes_.end(), v);
    auto const high = static_cast<std::uint16_t>(above - magnitudes_.begin());
    if (*above == v || high == 0) return sign | high;
    auto const low = static_cast<std::uint16_t>(high - 1);
    double const below_distance = v - magnitudes_[low];
    double const above_distance = *above - v;
    if (below_distance < above_distance) return sign | low;
    if (above_distance < below_distance) return sign | high;
    return sign | ((low & 1u) ? high : low);
  }

 private:
  std::vector<double> magnitudes_;
};

std::vector<float> probe_floats() {
  std::vector<float> values = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65505.0f, 65519.99f, 65520.0f, 1e-8f,
                               5.9604645e-8f, 2.9802322e-8f, 2.98023259e-8f, 6.1035156e-5f, 6.1e-5f, 3.0f,
                               std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity()};
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    float const f = std::bit_cast<float>(any_bits(rng));
    if (!std::isnan(f)) values.push_back(f);
  }
  std::uniform_real_distribution<float> moderate(-70000.0f, 70000.0f);
  for (int i = 0; i < 100000; ++i) values.push_back(moderate(rng));
  std::uniform_real_distribution<float> tiny(-1e-4f, 1e-4f);
  for (int i = 0; i < 100000; ++i) values.push_back(tiny(rng));
  return values;
}

}  // namespace

TEST_CASE("float16 conversion matches an exact reference", "[core][dtype]") {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    auto const bits = static_cast<std::uint16_t>(h);
    float const ours = mgpu::float16_bits_to_float(bits);
    double const reference = reference_float16_value(bits);
    if (std::isnan(reference)) {
      REQUIRE(std::isnan(ours));
    } else {
      REQUIRE(std::bit_cast<std::uint32_t>(ours) == std::bit_cast<std::uint32_t>(static_cast<float>(reference)));
    }
  }
  Float16Rounding const rounding;
  for (float const f : probe_floats()) {
    INFO("value " << f);
    REQUIRE(mgpu::float_to_float16_bits(f) == rounding(f));
  }
  CHECK(std::isnan(mgpu::float16_bits_to_float(mgpu::float_to_float16_bits(std::nanf("")))));
}

#ifdef __FLT16_MAX__  // the compiler has _Float16 on this target (GCC on x86-64; Clang 14 only with AVX512-FP16)
TEST_CASE("float16 conversion matches the compiler's _Float16", "[core][dtype]") {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    auto const bits = static_cast<std::uint16_t>(h);
    float const ours = mgpu::float16_bits_to_float(bits);
    float const reference = static_cast<float>(std::bit_cast<_Float16>(bits));
    if (std::isnan(reference)) {
      REQUIRE(std::isnan(ours));
    } else {
      REQUIRE(std::bit_cast<std::uint32_t>(ours) == std::bit_cast<std::uint32_t>(reference));
    }
  }
  for (float const f : probe_floats()) {
    INFO("value " << f);
    REQUIRE(mgpu::float_to_float16_bits(f) == std::bit_cast<std::uint16_t>(static_cast<_Float16>(f)));
  }
}
#endif

TEST_CASE("bfloat16 conversion rounds to nearest even", "[core][dtype]") {
  for (float const f : probe_floats()) {
    INFO("value " << f);
    REQUIRE(mgpu::float_to_bfloat16_bits(f) == reference_bfloat16(f));
  }
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    float const f = mgpu::bfloat16_bits_to_float(static_cast<std::uint16_t>(h));
    if (!std::isnan(f)) REQUIRE(mgpu::float_to_bfloat16_bits(f) == h);  // exact round trip
  }
  CHECK(std::isnan(static_cast<float>(mgpu::bfloat16(std::nanf("")))));
  CHECK(static_cast<float>(mgpu::bfloat16(1.0f)) == 1.0f);
  CHECK(mgpu::size_of(mgpu::DType::bfloat16) == 2);
  CHECK(mgpu::to_string(mgpu::DType::float16) == "float16");
}
