// A GPU's utilisation as NVIDIA's management library (NVML) samples it, for a job's metrics:
// libnvidia-ml.so.1 (installed with the driver) loaded at run time, so the library links nothing
// of NVML and runs where the driver lacks it, with the metric absent.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace mgpu::metrics {

/// NVML's spelling of a PCI bus id, as nvmlDeviceGetHandleByPciBusId_v2 matches it: an eight-digit
/// domain, upper-case hex, "00000000:3B:00.0". Reads CUDA's "0000:3b:00.0" (cudaDeviceGetPCIBusId)
/// as well as NVML's own; a missing domain is 0. Throws Error(invalid_argument) naming `id` when it
/// is not [domain:]bus:device.function in hex (bus up to 2 digits, device 2, function 1).
[[nodiscard]] std::string nvml_pci_bus_id(std::string_view id);

/// NVML's utilisation of the GPUs, by PCI bus id. Loading never throws: where the library was
/// built without NVML's header (MGPU_WITH_NVML), or `library` cannot be loaded or initialised,
/// available() is false and reason() says why, once, for the caller to say. Thread-safe.
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

  /// The share of NVML's last sample period (1/6 s to 1 s, by product) in which a kernel ran on
  /// the GPU at `pci_bus_id` (nvmlDeviceGetUtilizationRates' gpu / 100), in [0, 1]; empty when
  /// NVML is not available or has no such GPU. Throws Error(invalid_argument) for a malformed id
  /// (see nvml_pci_bus_id).
  [[nodiscard]] std::optional<double> busy_ratio(std::string_view pci_bus_id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The PCI bus id of GPU cuda:`ordinal` ("0000:3b:00.0", cudaDeviceGetPCIBusId). Throws
/// Error(device) when the build has no CUDA backend or there is no such GPU.
[[nodiscard]] std::string cuda_pci_bus_id(int ordinal);

}  // namespace mgpu::metrics
