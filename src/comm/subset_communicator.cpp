// Communicators over a subset of a DeviceGroup's ranks.
#include <mgpu/comm/communicator.hpp>

#include <set>
#include <string>

#include <mgpu/core/error.hpp>

#include "comm/host_communicator.hpp"

namespace mgpu::comm {

std::unique_ptr<Communicator> make_communicator(DeviceGroup& group, std::vector<int> const& ranks, Options options) {
  if (ranks.empty()) throw Error(Errc::invalid_argument, "a communicator over no ranks (expected at least one rank of the group)");
  std::set<int> seen;
  for (int const r : ranks) {
    if (r < 0 || r >= group.size())
      throw Error(Errc::invalid_argument, "a communicator over rank " + std::to_string(r) + " of a group of " + std::to_string(group.size()) +
                                              " (expected ranks in [0, " + std::to_string(group.size()) + "))");
    if (!seen.insert(r).second)
      throw Error(Errc::invalid_argument, "a communicator listing rank " + std::to_string(r) + " twice (expected distinct ranks)");
    if (group.device(r).kind != DeviceKind::host)
      throw Error(Errc::invalid_argument, "a communicator over some ranks of a group of " + group.device(r).to_string() +
                                              " (expected host devices: subset communicators are host-only for now)");
  }
  if (options.backend != Backend::automatic && options.backend != Backend::host)
    throw Error(Errc::invalid_argument, "the " + std::string(to_string(options.backend)) +
                                            " backend for a subset communicator (expected automatic or host)");
  std::chrono::milliseconds const timeout = options.timeout.count() > 0 ? options.timeout : default_timeout();
  return std::make_unique<detail::HostCommunicator>(group, static_cast<int>(ranks.size()), timeout);
}

}  // namespace mgpu::comm
