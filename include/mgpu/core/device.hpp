// Devices: what they are, how a device spec names them, and what each one can do.
#pragma once

#include <compare>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mgpu {

/// Where a device's work runs: an emulated device driven by host threads, or a CUDA GPU.
enum class DeviceKind { host, cuda };

/// A device: its kind and index. For CUDA the index is the GPU's ordinal; several ranks of a
/// group may name the same GPU (logical devices sharing it). Host devices are numbered 0..N-1.
struct Device {
  DeviceKind kind = DeviceKind::host;
  int index = 0;
  /// A host device's speed (0 < speed <= 1): its streams stretch each task to 1/speed of its time.
  /// Always 1 for CUDA devices; comparisons ignore it.
  double speed = 1.0;

  friend constexpr bool operator==(Device const& a, Device const& b) noexcept { return a.kind == b.kind && a.index == b.index; }
  friend constexpr auto operator<=>(Device const& a, Device const& b) noexcept {
    return a.kind != b.kind ? a.kind <=> b.kind : a.index <=> b.index;
  }
  /// "host:2" or "cuda:0".
  [[nodiscard]] std::string to_string() const;
};

/// What a device offers. Host devices report the machine's memory and a nominal throughput.
struct DeviceProperties {
  std::string name;
  std::size_t memory_bytes = 0;   ///< capacity (for host devices: the machine's physical memory)
  double throughput_gflops = 0;   ///< peak float32 throughput estimate, a hint for placement
  int compute_units = 0;          ///< SMs of a GPU; 1 worker thread for a host device
};

/// The environment variable read by devices_from_env() and DeviceGroup's default constructor.
inline constexpr char const devices_env_var[] = "MGPU_DEVICES";

/// Parses a device spec:
///   "host:N"     N emulated host devices (N >= 1); "host" is one
///   "host:N@speed=S1,...,SN"  the same, device i running at speed Si (0 < Si <= 1; one value
///                applies to all), e.g. "host:2@speed=1,0.5" for a device at half speed
///   "cuda"       every visible GPU
///   "cuda:0,2"   the listed GPUs; a repeated index adds a logical device sharing that GPU
///   "auto"       every visible GPU, else one host device per hardware thread
/// Throws Error(invalid_argument) naming the bad part and what was expected.
std::vector<Device> parse_devices(std::string_view spec);

/// parse_devices() of $MGPU_DEVICES when it is set and not empty, else of `fallback`.
std::vector<Device> devices_from_env(std::string_view fallback = "auto");

/// How many CUDA GPUs are visible: 0 when built without CUDA or when no driver or GPU is present.
int cuda_device_count() noexcept;

/// The device's properties. Throws Error(invalid_argument) for a GPU that does not exist.
DeviceProperties properties(Device device);

/// peer[i][j]: devices[i] can access devices[j]'s memory (host, same GPU, or cudaDeviceCanAccessPeer).
std::vector<std::vector<bool>> peer_access_matrix(std::vector<Device> const& devices);

}  // namespace mgpu
