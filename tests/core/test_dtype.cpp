// float32 <-> bfloat16 / float16 conversions against independent references.
#include <mgpu/core/dtype.hpp>

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
  CHECK(std::isnan(mgpu::float16_bits_to_float(mgpu::float_to_float16_bits(std::nanf("")))));
}

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
