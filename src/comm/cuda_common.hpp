// What the CUDA backends (cuda_peer_communicator.cpp, nccl_communicator.cpp) share: a rank's
// stream as a CUDA stream, the devices a communicator's ranks run on, and the check that a
// tensor is on its rank's own GPU. CUDA builds only; internal.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/core/device.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/stream.hpp>

#include "comm/base.hpp"

namespace mgpu::comm::detail {

using Clock = std::chrono::steady_clock;

inline cudaStream_t native(Stream& stream) { return static_cast<cudaStream_t>(stream.native_handle()); }

// The devices of the group's `ranks`, in order: communicator rank i runs on the i-th.
inline std::vector<Device> devices_of(DeviceGroup const& group, std::vector<int> const& ranks) {
  std::vector<Device> devices;
  for (int const r : ranks) devices.push_back(group.device(r));
  return devices;
}

// `devices[rank]` is the communicator rank's device (the group's rank it stands for).
inline void check_cuda_device(std::vector<Device> const& devices, int rank, Device device, std::string_view what, Call const& call) {
  Device const own = devices[static_cast<std::size_t>(rank)];
  if (device != own)
    throw Error(Errc::invalid_argument, call.name(rank) + ": " + std::string(what) + " is on " + device.to_string() +
                                            " (expected the rank's own device, " + own.to_string() + ")");
}

}  // namespace mgpu::comm::detail
