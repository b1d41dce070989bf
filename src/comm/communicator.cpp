// make_communicator(): backend choice, the default deadline, names.
#include <mgpu/comm/communicator.hpp>

#include <cmath>
#include <cstdlib>
#include <numeric>
#include <set>
#include <string>

#include <mgpu/config.hpp>
#include <mgpu/core/error.hpp>

#include "comm/backend_choice.hpp"
#include "comm/cuda_communicators.hpp"
#include "comm/host_communicator.hpp"

namespace mgpu::comm {

std::string_view to_string(Backend backend) noexcept {
  switch (backend) {
    case Backend::automatic: return "automatic";
    case Backend::host: return "host";
    case Backend::nccl: return "nccl";
    case Backend::cuda_peer: return "cuda_peer";
  }
  return "unknown";
}

std::chrono::milliseconds default_timeout() {
  char const* text = std::getenv(timeout_env_var);
  if (text == nullptr || *text == '\0') return std::chrono::seconds(300);
  char* end = nullptr;
  double const seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(seconds) || seconds <= 0)
    throw Error(Errc::invalid_argument, std::string(timeout_env_var) + "='" + text +
                                            "' (expected a positive number of seconds, e.g. 30 or 0.5)");
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
}

namespace detail {

Backend natural_backend(std::vector<Device> const& devices) {
  bool any_host = false;
  std::set<int> gpus;
  for (Device const d : devices) {
    if (d.kind == DeviceKind::host) {
      any_host = true;
    } else {
      gpus.insert(d.index);
    }
  }
  if (any_host && !gpus.empty())
    throw Error(Errc::invalid_argument, "a communicator over a group that mixes host and CUDA devices (expected one kind)");
  if (any_host) return Backend::host;
  bool const shared_gpu = gpus.size() < devices.size();
  return (built_with_nccl && !shared_gpu) ? Backend::nccl : Backend::cuda_peer;
}

Backend resolve_backend(std::vector<Device> const& devices, Backend requested) {
  Backend const natural = natural_backend(devices);
  Backend const backend = requested == Backend::automatic ? natural : requested;
  bool const host_group = natural == Backend::host;
  if ((backend == Backend::host) != host_group)
    throw Error(Errc::invalid_argument, "the " + std::string(to_string(backend)) + " backend for a group of " +
                                            devices.front().to_string() + "... (expected " +
                                            (host_group ? "the host backend for host devices" : "nccl or cuda_peer for CUDA devices") + ")");
  return backend;
}

}  // namespace detail

Backend choose_backend(DeviceGroup const& group) { return detail::natural_backend(group.devices()); }

std::unique_ptr<Communicator> make_communicator(DeviceGroup& group, Options options) {
  std::chrono::milliseconds const timeout = options.timeout.count() > 0 ? options.timeout : default_timeout();
  std::vector<int> all(static_cast<std::size_t>(group.size()));
  std::iota(all.begin(), all.end(), 0);
  switch (detail::resolve_backend(group.devices(), options.backend)) {
    case Backend::host: return std::make_unique<detail::HostCommunicator>(group, timeout);
    case Backend::nccl: return detail::make_nccl_communicator(group, all, timeout);
    case Backend::cuda_peer: return detail::make_cuda_peer_communicator(group, all, timeout);
    case Backend::automatic: break;
  }
  throw Error(Errc::invalid_argument, "unknown communicator backend");
}

}  // namespace mgpu::comm
