// Fuzz target: parse_devices (src/core/device.cpp), the device-spec parser behind DeviceGroup,
// --devices and $MGPU_DEVICES.
#include <mgpu/core/device.hpp>

#include <string_view>

#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string_view const spec(reinterpret_cast<char const*>(data), size);
  mgpu::fuzz::expect_load_or_error("", [&] { (void)mgpu::parse_devices(spec); });
  return 0;
}
