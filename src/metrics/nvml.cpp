// NVML's GPU utilisation through dlopen (see nvml.hpp): the function types come from nvml.h
// (the CUDA toolkit's, or the nvidia-nvml-dev wheel's that scripts/setup.sh installs; see
// cmake/mgpuNvml.cmake), the functions from libnvidia-ml.so.1 at run time.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <mutex>
#include <type_traits>

#include <dlfcn.h>

#include <mgpu/core/error.hpp>
#include <mgpu/metrics/nvml.hpp>

#include "core/cuda_backend.hpp"

#ifdef MGPU_NVML_HEADER
#include <nvml.h>
#endif

namespace mgpu::metrics {

namespace {
// A hex field of 1 to `max_digits` digits, whole.
std::optional<unsigned> hex_field(std::string_view field, std::size_t max_digits) {
  if (field.empty() || field.size() > max_digits) return std::nullopt;
  unsigned value = 0;
  auto const [end, ec] = std::from_chars(field.data(), field.data() + field.size(), value, 16);
  if (ec != std::errc{} || end != field.data() + field.size()) return std::nullopt;
  return value;
}
}  // namespace

std::string nvml_pci_bus_id(std::string_view id) {
  auto const bad = [&] {
    return Error(Errc::invalid_argument, "PCI bus id '" + std::string(id) +
                                             "' (expected [domain:]bus:device.function in hex, e.g. 0000:3b:00.0)");
  };
  std::string_view rest = id;
  std::optional<unsigned> domain = 0;
  std::size_t const first = rest.find(':');
  if (first == std::string_view::npos) throw bad();
  if (rest.find(':', first + 1) != std::string_view::npos) {  // a domain
    domain = hex_field(rest.substr(0, first), 8);
    rest.remove_prefix(first + 1);
  }
  std::size_t const colon = rest.find(':');
  std::size_t const dot = rest.find('.');
  if (colon == std::string_view::npos || dot == std::string_view::npos || dot < colon) throw bad();
  std::optional<unsigned> const bus = hex_field(rest.substr(0, colon), 2);
  std::optional<unsigned> const device = hex_field(rest.substr(colon + 1, dot - colon - 1), 2);
  std::optional<unsigned> const function = hex_field(rest.substr(dot + 1), 1);
  if (!domain || !bus || !device || !function || *device > 0x1f || *function > 7) throw bad();
  char out[32];
  std::snprintf(out, sizeof out, "%08X:%02X:%02X.%X", *domain, *bus, *device, *function);
  return out;
}

std::string cuda_pci_bus_id(int ordinal) { return detail::cuda::pci_bus_id(ordinal); }

struct Nvml::Impl {
  void* library = nullptr;
  std::string reason;
#ifdef MGPU_NVML_HEADER
  decltype(&nvmlInit_v2) init = nullptr;
  decltype(&nvmlShutdown) shutdown = nullptr;
  decltype(&nvmlErrorString) error_string = nullptr;
  decltype(&nvmlDeviceGetHandleByPciBusId_v2) handle_by_bus_id = nullptr;
  decltype(&nvmlDeviceGetUtilizationRates) utilization = nullptr;
#endif
  mutable std::mutex mutex;  // NVML is thread-safe; this keeps the calls of one Nvml in order
};

Nvml::Nvml(std::string library) : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
#ifdef MGPU_NVML_HEADER
  im.library = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (im.library == nullptr) {
    char const* const why = ::dlerror();
    im.reason = "NVML not loaded (" + library + ": " + (why != nullptr ? why : "not found") +
                "): GPU utilisation is not exported";
    return;
  }
  auto const find = [&](auto& function, char const* name) {
    function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(::dlsym(im.library, name));
    if (function == nullptr && im.reason.empty())
      im.reason = "NVML's " + library + " has no " + name + ": GPU utilisation is not exported";
  };
  find(im.init, "nvmlInit_v2");
  find(im.shutdown, "nvmlShutdown");
  find(im.error_string, "nvmlErrorString");
  find(im.handle_by_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
  find(im.utilization, "nvmlDeviceGetUtilizationRates");
  if (im.reason.empty()) {
    nvmlReturn_t const status = im.init();
    if (status == NVML_SUCCESS) return;
    im.reason = std::string("NVML did not start (nvmlInit_v2: ") + im.error_string(status) +
                "): GPU utilisation is not exported";
  }
  ::dlclose(im.library);
  im.library = nullptr;
#else
  im.reason = "mgpu was built without NVML's header (MGPU_WITH_NVML; nvml.h from the CUDA toolkit or scripts/setup.sh), "
              "so " + library + " is not loaded: GPU utilisation is not exported";
#endif
}

Nvml::~Nvml() {
#ifdef MGPU_NVML_HEADER
  if (impl_->library != nullptr) {
    (void)impl_->shutdown();
    ::dlclose(impl_->library);
  }
#endif
}

bool Nvml::available() const noexcept { return impl_->reason.empty(); }
std::string const& Nvml::reason() const noexcept { return impl_->reason; }

std::optional<double> Nvml::busy_ratio(std::string_view pci_bus_id) const {
  std::string const id = nvml_pci_bus_id(pci_bus_id);
  if (!available()) return std::nullopt;
#ifdef MGPU_NVML_HEADER
  std::lock_guard const lock(impl_->mutex);
  nvmlDevice_t device{};
  if (impl_->handle_by_bus_id(id.c_str(), &device) != NVML_SUCCESS) return std::nullopt;
  nvmlUtilization_t rates{};
  if (impl_->utilization(device, &rates) != NVML_SUCCESS) return std::nullopt;
  return std::min(1.0, static_cast<double>(rates.gpu) / 100.0);
#else
  return std::nullopt;
#endif
}

}  // namespace mgpu::metrics
