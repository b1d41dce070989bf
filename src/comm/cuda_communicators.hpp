// Factories of the CUDA backends. Builds without CUDA (or without NCCL) get versions that throw
// Error(device) saying what the build lacks.
#pragma once

#include <chrono>
#include <memory>

#include <mgpu/comm/communicator.hpp>

namespace mgpu::comm::detail {

std::unique_ptr<Communicator> make_nccl_communicator(DeviceGroup& group, std::chrono::milliseconds timeout);
std::unique_ptr<Communicator> make_cuda_peer_communicator(DeviceGroup& group, std::chrono::milliseconds timeout);

}  // namespace mgpu::comm::detail
