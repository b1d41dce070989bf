// A GPU's utilisation from NVML, loaded at run time (docs/metrics.md).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace mgpu::metrics {

/// `id` ("0000:3b:00.0", a missing domain 0) in NVML's spelling, "00000000:3B:00.0". Throws
/// Error(invalid_argument) naming `id` unless it is [domain:]bus:device.function in hex.
[[nodiscard]] std::string nvml_pci_bus_id(std::string_view id);

/// NVML's utilisation of the GPUs, by PCI bus id. Thread-safe. Never throws on loading: without
/// NVML (in the build or at run time) available() is false and reason() says why.
class Nvml {
 public:
  /// dlopen()s `library` and calls nvmlInit_v2; the destructor calls nvmlShutdown and dlclose.
  explicit Nvml(std::string library = "libnvidia-ml.so.1");
  Nvml(Nvml const&) = delete;
  Nvml& operator=(Nvml const&) = delete;
  ~Nvml();

  [[nodiscard]] bool available() const noexcept;
  /// Why NVML is not available (empty when it is).
  [[nodiscard]] std::string const& reason() const noexcept;

  /// The share of NVML's last sample period in which a kernel ran on that GPU, in [0, 1]; empty
  /// without NVML or such a GPU. Throws Error(invalid_argument) for a malformed id.
  [[nodiscard]] std::optional<double> busy_ratio(std::string_view pci_bus_id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The PCI bus id of GPU cuda:`ordinal` ("0000:3b:00.0", cudaDeviceGetPCIBusId). Throws
/// Error(device) when the build has no CUDA backend or there is no such GPU.
[[nodiscard]] std::string cuda_pci_bus_id(int ordinal);

}  // namespace mgpu::metrics
