// The host backend's communicator (see host_communicator.cpp).
#pragma once

#include <memory>

#include "comm/base.hpp"

namespace mgpu::comm::detail {

class HostState;

class HostCommunicator final : public CommunicatorBase {
 public:
  HostCommunicator(DeviceGroup& group, std::chrono::milliseconds timeout);
  /// Over `size` ranks of the group (a subset; the caller maps its ranks to the group's).
  HostCommunicator(DeviceGroup& group, int size, std::chrono::milliseconds timeout);

 protected:
  void launch(int rank, std::vector<Call> calls, Stream& stream) override;
  void check_device(int rank, Device device, std::string_view what, Call const& call) const override;

 private:
  std::shared_ptr<HostState> host_;
};

}  // namespace mgpu::comm::detail
