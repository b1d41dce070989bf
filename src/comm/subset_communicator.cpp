// Communicators over a subset of a DeviceGroup's ranks: the backend follows the subset's devices
// (host; NCCL over distinct GPUs, with its own NCCL communicator; CUDA peer for GPUs the subset's
// ranks share).
#include <mgpu/comm/communicator.hpp>

#include <set>
#include <string>

#include <mgpu/core/error.hpp>

#include "comm/backend_choice.hpp"
#include "comm/cuda_communicators.hpp"
#include "comm/host_communicator.hpp"

namespace mgpu::comm {

std::unique_ptr<Communicator> make_communicator(DeviceGroup& group, std::vector<int> const& ranks, Options options) {
  if (ranks.empty()) throw Error(Errc::invalid_argument, "a communicator over no ranks (expected at least one rank of the group)");
  std::set<int> seen;
  std::vector<Device> devices;
  for (int const r : ranks) {
    if (r < 0 || r >= group.size())
      throw Error(Errc::invalid_argument, "a communicator over rank " + std::to_string(r) + " of a group of " + std::to_string(group.size()) +
                                              " (expected ranks in [0, " + std::to_string(group.size()) + "))");
    if (!seen.insert(r).second)
      throw Error(Errc::invalid_argument, "a communicator listing rank " + std::to_string(r) + " twice (expected distinct ranks)");
    devices.push_back(group.device(r));
  }
  Backend const backend = detail::resolve_backend(devices, options.backend);
  std::chrono::milliseconds const timeout = options.timeout.count() > 0 ? options.timeout : default_timeout();
  switch (backend) {
    case Backend::host: return std::make_unique<detail::HostCommunicator>(group, static_cast<int>(ranks.size()), timeout);
    case Backend::nccl: return detail::make_nccl_communicator(group, ranks, timeout);
    case Backend::cuda_peer: return detail::make_cuda_peer_communicator(group, ranks, timeout);
    case Backend::automatic: break;
  }
  throw Error(Errc::invalid_argument, "unknown communicator backend");
}

}  // namespace mgpu::comm
