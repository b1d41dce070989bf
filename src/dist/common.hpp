// What the MPI and the single-process builds of the dist module share. Internal: not installed.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <mgpu/dist/dist.hpp>

namespace mgpu::dist::detail {

/// The launcher variables of this process's environment.
Environment read_environment();

/// This server's host name ("unknown" when the system does not say).
std::string host_name();

/// The world of a job of one process: `group`'s devices.
World single_process_world(DeviceGroup const& group, std::string const& host);

/// Throws Error(invalid_argument) unless this process's devices in `world` are `group`'s and, across
/// processes, every device is a host device or every one a CUDA GPU, no two of them the same GPU
/// of one server.
void check_world(World const& world, DeviceGroup const& group);

/// A subset of the world's ranks (make_communicator(world, group, world_ranks)) as a world of its
/// own: rank i is world rank world_ranks[i], process p the p-th process in the list's order (its
/// devices' local_rank still their rank in that process's DeviceGroup).
struct Subset {
  World world;
  std::vector<int> world_ranks;  ///< the list it was made from
  std::vector<int> processes;  ///< the job's process of each of the subset's processes
  std::vector<int> locals;     ///< this process's ranks in the subset, as its DeviceGroup's ranks
};

/// The subset of `world` that `world_ranks` lists; throws Error(invalid_argument) for an empty
/// list, a repeated or out-of-range rank, a process's ranks apart in the list, or a list without
/// this process's ranks.
Subset subset_of(World const& world, std::vector<int> const& world_ranks);

/// "{0, 2}".
std::string ranks_text(std::vector<int> const& ranks);

/// The ranks of `group`, 0 to group.size() - 1 (this process's part of a whole world).
std::vector<int> group_ranks(DeviceGroup const& group);

/// Process 0's message to the other processes making one NCCL communicator over their GPUs (every
/// process's, or a subset's first process's to the subset's others): a flag byte, then the unique id (1) or why process 0 could not make one (0), so that no
/// process waits for an id that never comes.
std::vector<std::byte> nccl_id_message();

/// The unique id in process 0's message; throws Error(device) with process 0's failure (the
/// subset's first process's, where `subset` is given: "{0, 2}").
std::vector<std::byte> nccl_id_from(std::span<std::byte const> message, std::string const& subset = {});

}  // namespace mgpu::dist::detail
