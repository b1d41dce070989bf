// Which backend serves a set of devices: shared by the whole-group and the subset factories.
#pragma once

#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device.hpp>

namespace mgpu::comm::detail {

/// The backend Backend::automatic picks for these devices: host for host devices, NCCL for
/// distinct GPUs (when built with it), CUDA peer for GPUs shared by ranks. Throws
/// Error(invalid_argument) when they mix host and CUDA devices.
Backend natural_backend(std::vector<Device> const& devices);

/// `requested`, or natural_backend() for Backend::automatic, after checking that it can serve the
/// devices; throws Error(invalid_argument) naming the mismatch.
Backend resolve_backend(std::vector<Device> const& devices, Backend requested);

}  // namespace mgpu::comm::detail
