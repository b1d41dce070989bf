// Factories of the CUDA backends. Builds without CUDA (or without NCCL) get versions that throw
// Error(device) saying what the build lacks.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

#include <mgpu/comm/communicator.hpp>

namespace mgpu::comm::detail {

/// A communicator whose rank i is the group's rank ranks[i] (every rank of the group, or a subset:
/// distinct, in range, CUDA devices). The NCCL one needs distinct GPUs and gets its own NCCL
/// communicator; the CUDA-peer one serves ranks sharing a GPU.
std::unique_ptr<Communicator> make_nccl_communicator(DeviceGroup& group, std::vector<int> const& ranks, std::chrono::milliseconds timeout);
std::unique_ptr<Communicator> make_cuda_peer_communicator(DeviceGroup& group, std::vector<int> const& ranks,
                                                          std::chrono::milliseconds timeout);

/// A fresh NCCL unique id, as bytes to hand to the other processes.
std::vector<std::byte> nccl_unique_id();
/// One NCCL communicator of `size` ranks across processes (a world's, or a subset's of its ranks):
/// this process drives ranks first_rank to first_rank + ranks.size() - 1, rank first_rank + i on
/// the group's rank ranks[i] (distinct GPUs), every process with the same `id` (from
/// nccl_unique_id() on one of them).
std::unique_ptr<Communicator> make_nccl_world_communicator(DeviceGroup& group, std::vector<int> const& ranks, int size,
                                                           int first_rank, std::vector<std::byte> const& id,
                                                           std::chrono::milliseconds timeout);

}  // namespace mgpu::comm::detail
