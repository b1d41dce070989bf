// Device specs, properties and peer access.
#include <mgpu/core/device.hpp>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <mgpu/core/error.hpp>

#include "core/cuda_backend.hpp"

namespace mgpu {
namespace {

// Each host device runs worker threads; a larger count is a typo, not a machine.
constexpr int max_host_devices = 4096;
constexpr std::string_view spec_forms =
    "expected 'auto', 'host', 'host:N' (1 <= N <= 4096), 'host:N@speed=S1,...' (0 < S <= 1), 'cuda' or 'cuda:I,J,...'";

[[noreturn]] void bad_spec(std::string_view spec, std::string_view what) {
  throw Error(Errc::invalid_argument,
              "device spec '" + std::string(spec) + "': " + std::string(what) + "; " + std::string(spec_forms));
}

int parse_count(std::string_view spec, std::string_view text, std::string_view what) {
  int value = -1;
  auto const* end = text.data() + text.size();
  auto const [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc{} || ptr != end)
    bad_spec(spec, std::string(what) + " '" + std::string(text) + "' is not a whole number");
  return value;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

// "speed=S1,S2,...": each 0 < S <= 1.
std::vector<double> parse_speeds(std::string_view spec, std::string_view text) {
  constexpr std::string_view key = "speed=";
  if (text.substr(0, key.size()) != key) bad_spec(spec, "'" + std::string(text) + "' after '@' is not 'speed=S1,...'");
  text.remove_prefix(key.size());
  std::vector<double> speeds;
  while (true) {
    auto const comma = text.find(',');
    std::string const item(trim(text.substr(0, comma)));
    char* end = nullptr;
    double const value = item.empty() ? 0.0 : std::strtod(item.c_str(), &end);
    if (item.empty() || end != item.c_str() + item.size() || !(value > 0.0 && value <= 1.0))
      bad_spec(spec, "speed '" + item + "' is not a number in (0, 1]");
    speeds.push_back(value);
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return speeds;
}

std::vector<Device> host_devices(int count) {
  std::vector<Device> devices;
  for (int i = 0; i < count; ++i) devices.push_back({DeviceKind::host, i});
  return devices;
}

std::vector<Device> cuda_devices(std::string_view spec, std::string_view list) {
  int const visible = cuda_device_count();
  std::vector<Device> devices;
  if (list.empty()) {
    if (visible == 0) bad_spec(spec, "no CUDA GPU is visible");
    for (int i = 0; i < visible; ++i) devices.push_back({DeviceKind::cuda, i});
    return devices;
  }
  std::vector<int> indices;
  while (true) {
    auto const comma = list.find(',');
    indices.push_back(parse_count(spec, trim(list.substr(0, comma)), "GPU index"));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  for (int const index : indices) {
    if (index < 0 || index >= visible)
      bad_spec(spec, "no GPU cuda:" + std::to_string(index) + " (" + std::to_string(visible) +
                         " visible, expected an index in [0, " + std::to_string(visible) + "))");
    devices.push_back({DeviceKind::cuda, index});
  }
  return devices;
}

std::string host_cpu_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto const colon = line.find(':');
      if (colon != std::string::npos) return std::string(trim(std::string_view(line).substr(colon + 1)));
    }
  }
  return "host CPU";
}

}  // namespace

std::string Device::to_string() const {
  return (kind == DeviceKind::host ? "host:" : "cuda:") + std::to_string(index);
}

std::vector<Device> parse_devices(std::string_view spec) {
  std::string_view const text = trim(spec);
  if (text.empty()) bad_spec(spec, "the spec is empty");
  auto const colon = text.find(':');
  std::string_view const kind = text.substr(0, colon);
  std::string_view const rest = colon == std::string_view::npos ? std::string_view{} : trim(text.substr(colon + 1));
  if (colon != std::string_view::npos && rest.empty()) bad_spec(spec, "nothing follows ':'");

  if (kind == "auto") {
    if (colon != std::string_view::npos) bad_spec(spec, "'auto' takes no list");
    if (int const gpus = cuda_device_count(); gpus > 0) return cuda_devices(spec, {});
    return host_devices(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
  if (kind == "host") {
    if (rest.empty()) return host_devices(1);
    auto const at = rest.find('@');
    int const count = parse_count(spec, trim(rest.substr(0, at)), "host device count");
    if (count < 1) bad_spec(spec, "host device count is " + std::to_string(count) + ", expected at least 1");
    if (count > max_host_devices)
      bad_spec(spec, "host device count is " + std::to_string(count) + ", expected at most " + std::to_string(max_host_devices));
    std::vector<Device> devices = host_devices(count);
    if (at != std::string_view::npos) {
      std::vector<double> const speeds = parse_speeds(spec, trim(rest.substr(at + 1)));
      if (speeds.size() != 1 && speeds.size() != devices.size())
        bad_spec(spec, std::to_string(speeds.size()) + " speeds for " + std::to_string(count) + " devices, expected 1 or " +
                           std::to_string(count));
      for (std::size_t i = 0; i < devices.size(); ++i) devices[i].speed = speeds[speeds.size() == 1 ? 0 : i];
    }
    return devices;
  }
  if (kind == "cuda") return cuda_devices(spec, rest);
  bad_spec(spec, "unknown device kind '" + std::string(kind) + "'");
}

std::vector<Device> devices_from_env(std::string_view fallback) {
  char const* value = std::getenv(devices_env_var);
  if (value != nullptr && *value != '\0') return parse_devices(value);
  return parse_devices(fallback);
}

int cuda_device_count() noexcept { return detail::cuda::device_count(); }

DeviceProperties properties(Device device) {
  if (device.kind == DeviceKind::cuda) {
    int const visible = cuda_device_count();
    if (device.index < 0 || device.index >= visible)
      throw Error(Errc::invalid_argument, "no GPU " + device.to_string() + ": " + std::to_string(visible) +
                                              " visible, expected an index in [0, " + std::to_string(visible) + ")");
    return detail::cuda::properties(device.index);
  }
  if (device.index < 0)
    throw Error(Errc::invalid_argument, "host device index " + std::to_string(device.index) + " is negative, expected >= 0");
  static std::string const cpu = host_cpu_name();
  DeviceProperties out;
  out.name = "emulated device on " + cpu;
  out.memory_bytes = static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(sysconf(_SC_PAGE_SIZE));
  out.throughput_gflops = 32.0 * device.speed;  // nominal: one core's float32 FMA rate, for relative placement only
  out.compute_units = 1;
  return out;
}

std::vector<std::vector<bool>> peer_access_matrix(std::vector<Device> const& devices) {
  auto const n = devices.size();
  std::vector<std::vector<bool>> peer(n, std::vector<bool>(n, false));
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      Device const a = devices[i];
      Device const b = devices[j];
      if (a.kind != b.kind) continue;  // host and GPU memory reach each other only through copies
      if (a.kind == DeviceKind::host || a.index == b.index) {
        peer[i][j] = true;
      } else {
        peer[i][j] = detail::cuda::can_access_peer(a.index, b.index);
      }
    }
  }
  return peer;
}

}  // namespace mgpu
