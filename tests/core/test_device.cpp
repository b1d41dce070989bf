// Device specs, the environment variable, properties and peer access.
#include <mgpu/core/device.hpp>
#include <mgpu/core/stream.hpp>

#include <chrono>
#include <string>
#include <thread>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/scoped_env.hpp"

using mgpu::Device;
using mgpu::DeviceKind;
using mgpu::Errc;

using mgpu::test::ScopedEnv;

TEST_CASE("Host device specs", "[core][device]") {
  auto const four = mgpu::parse_devices("host:4");
  REQUIRE(four.size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(four[static_cast<std::size_t>(i)] == Device{DeviceKind::host, i});
  CHECK(mgpu::parse_devices("host") == std::vector<Device>{{DeviceKind::host, 0}});
  CHECK(mgpu::parse_devices("  host: 2 ").size() == 2);
  CHECK(four[3].to_string() == "host:3");
}

TEST_CASE("auto picks every GPU, else one host device per hardware thread", "[core][device]") {
  auto const devices = mgpu::parse_devices("auto");
  if (mgpu::cuda_device_count() > 0) {
    CHECK(devices.size() == static_cast<std::size_t>(mgpu::cuda_device_count()));
    CHECK(devices[0].kind == DeviceKind::cuda);
  } else {
    CHECK(devices.size() == std::max(1u, std::thread::hardware_concurrency()));
    CHECK(devices[0].kind == DeviceKind::host);
  }
}

TEST_CASE("Emulated device speeds: parsed per device, scale the throughput hint, stretch stream work", "[core][device]") {
  auto const two = mgpu::parse_devices("host:2@speed=1,0.5");
  REQUIRE(two.size() == 2);
  CHECK(two[0].speed == 1.0);
  CHECK(two[1].speed == 0.5);
  CHECK(two[1] == Device{DeviceKind::host, 1});  // speed is not identity
  for (Device const d : mgpu::parse_devices("host:3@speed=0.25")) CHECK(d.speed == 0.25);
  CHECK(mgpu::properties(two[1]).throughput_gflops == Approx(0.5 * mgpu::properties(two[0]).throughput_gflops));

  using Clock = std::chrono::steady_clock;
  mgpu::Stream slow(two[1]);
  auto const start = Clock::now();
  slow.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
  slow.synchronize();
  CHECK(Clock::now() - start >= std::chrono::milliseconds(40));  // 20 ms of work at half speed

  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:2@speed=1,0.5,1"), Errc::invalid_argument, "3 speeds for 2 devices, expected 1 or 2");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:2@speed=0"), Errc::invalid_argument, "speed '0' is not a number in (0, 1]");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:2@speed=1.5"), Errc::invalid_argument, "is not a number in (0, 1]");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:2@fast"), Errc::invalid_argument, "'fast' after '@' is not 'speed=S1,...'");
}

TEST_CASE("Bad device specs give clear errors", "[core][device]") {
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:0"), Errc::invalid_argument, "host device count is 0, expected at least 1");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:-2"), Errc::invalid_argument, "expected at least 1");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:x"), Errc::invalid_argument, "'x' is not a whole number");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:"), Errc::invalid_argument, "nothing follows ':'");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("gpu:1"), Errc::invalid_argument, "unknown device kind 'gpu'");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices(""), Errc::invalid_argument, "the spec is empty");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("   "), Errc::invalid_argument, "expected 'auto', 'host', 'host:N'");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("auto:3"), Errc::invalid_argument, "'auto' takes no list");
  // A huge count is refused before anything is allocated for it.
  CHECK(mgpu::parse_devices("host:4096").size() == 4096);
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:4097"), Errc::invalid_argument, "host device count is 4097, expected at most 4096");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("host:2147483647"), Errc::invalid_argument, "expected at most 4096");
  int const gpus = mgpu::cuda_device_count();
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("cuda:9"), Errc::invalid_argument, "no GPU cuda:9 (" + std::to_string(gpus) + " visible");
  REQUIRE_MGPU_ERROR(mgpu::parse_devices("cuda:0,,1"), Errc::invalid_argument, "is not a whole number");
  if (gpus == 0) REQUIRE_MGPU_ERROR(mgpu::parse_devices("cuda"), Errc::invalid_argument, "no CUDA GPU is visible");
}

TEST_CASE("MGPU_DEVICES overrides the fallback spec", "[core][device]") {
  {
    ScopedEnv env(mgpu::devices_env_var, "host:3");
    CHECK(mgpu::devices_from_env().size() == 3);
  }
  {
    ScopedEnv env(mgpu::devices_env_var, "");
    CHECK(mgpu::devices_from_env("host:2").size() == 2);
  }
  {
    ScopedEnv env(mgpu::devices_env_var, "gpu");
    REQUIRE_MGPU_ERROR(mgpu::devices_from_env(), Errc::invalid_argument, "device spec 'gpu'");
  }
}

TEST_CASE("Host device properties and peer access", "[core][device]") {
  auto const props = mgpu::properties({DeviceKind::host, 1});
  CHECK(props.memory_bytes > (std::size_t{64} << 20));
  CHECK(props.throughput_gflops > 0);
  CHECK(props.compute_units == 1);
  CHECK_FALSE(props.name.empty());
  REQUIRE_MGPU_ERROR(mgpu::properties({DeviceKind::cuda, 42}), Errc::invalid_argument, "no GPU cuda:42");

  auto const peer = mgpu::peer_access_matrix(mgpu::parse_devices("host:3"));
  REQUIRE(peer.size() == 3);
  for (auto const& row : peer) CHECK(row == std::vector<bool>{true, true, true});
}
