// The world's device list: lookups, the communicator factory for executors, and the world of a job
// of one process.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

#include "comm/cuda_communicators.hpp"
#include "dist/common.hpp"

namespace mgpu::dist {
namespace {
void check_process(World const& world, int process) {
  if (process < 0 || process >= world.processes)
    throw Error(Errc::invalid_argument, "process " + std::to_string(process) + " (expected a process in [0, " +
                                            std::to_string(world.processes) + "))");
}
}  // namespace

int World::first_rank(int p) const {
  check_process(*this, p);
  for (WorldDevice const& d : devices) {
    if (d.process == p) return d.rank;
  }
  return size();
}

int World::local_size(int p) const {
  check_process(*this, p);
  int count = 0;
  for (WorldDevice const& d : devices) count += d.process == p ? 1 : 0;
  return count;
}

std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> communicator_factory(World world) {
  return [world = std::move(world)](DeviceGroup& group, comm::Options options) {
    return make_communicator(world, group, options);
  };
}

SubsetFactory subset_communicator_factory(World world) {
  return [world = std::move(world)](DeviceGroup& group, std::vector<int> const& world_ranks, comm::Options options) {
    return make_communicator(world, group, world_ranks, options);
  };
}

namespace detail {

std::string ranks_text(std::vector<int> const& ranks) {
  std::string text = "{";
  for (std::size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + "}";
}

Subset subset_of(World const& world, std::vector<int> const& world_ranks) {
  std::string const what = "a communicator over world ranks " + ranks_text(world_ranks);
  if (world_ranks.empty())
    throw Error(Errc::invalid_argument, "a communicator over no world ranks (expected at least one rank)");
  Subset subset;
  subset.world_ranks = world_ranks;
  std::vector<bool> seen(static_cast<std::size_t>(world.size()), false);
  for (std::size_t i = 0; i < world_ranks.size(); ++i) {
    int const r = world_ranks[i];
    if (r < 0 || r >= world.size())
      throw Error(Errc::invalid_argument, what + ": rank " + std::to_string(r) + " (expected world ranks in [0, " +
                                              std::to_string(world.size()) + "))");
    if (seen[static_cast<std::size_t>(r)])
      throw Error(Errc::invalid_argument, what + " lists rank " + std::to_string(r) + " twice (expected distinct ranks)");
    seen[static_cast<std::size_t>(r)] = true;
    WorldDevice d = world.devices[static_cast<std::size_t>(r)];
    if (subset.processes.empty() || subset.processes.back() != d.process) {
      if (std::find(subset.processes.begin(), subset.processes.end(), d.process) != subset.processes.end())
        throw Error(Errc::invalid_argument,
                    what + " lists process " + std::to_string(d.process) + "'s ranks apart (expected each process's "
                                                                            "ranks next to each other)");
      subset.processes.push_back(d.process);
    }
    if (d.process == world.process) subset.locals.push_back(d.local_rank);
    d.rank = static_cast<int>(i);
    d.process = static_cast<int>(subset.processes.size()) - 1;
    subset.world.devices.push_back(std::move(d));
  }
  auto const here = std::find(subset.processes.begin(), subset.processes.end(), world.process);
  if (here == subset.processes.end())
    throw Error(Errc::invalid_argument, what + " on process " + std::to_string(world.process) +
                                            ", which drives none of them (expected only the processes driving "
                                            "those ranks to make it)");
  subset.world.process = static_cast<int>(here - subset.processes.begin());
  subset.world.processes = static_cast<int>(subset.processes.size());
  return subset;
}

std::vector<int> group_ranks(DeviceGroup const& group) {
  std::vector<int> ranks(static_cast<std::size_t>(group.size()));
  for (std::size_t r = 0; r < ranks.size(); ++r) ranks[r] = static_cast<int>(r);
  return ranks;
}

World single_process_world(DeviceGroup const& group, std::string const& host) {
  World world;
  for (int r = 0; r < group.size(); ++r) world.devices.push_back({r, group.device(r), 0, r, host});
  return world;
}

void check_world(World const& world, DeviceGroup const& group) {
  if (world.process < 0 || world.process >= world.processes)
    throw Error(Errc::invalid_argument, "a world whose process is " + std::to_string(world.process) + " of " +
                                            std::to_string(world.processes) + " (expected a world from make_world)");
  if (world.processes > 1 && !world.devices.empty()) {
    // Across processes: host devices (MPI carries the bytes) or CUDA GPUs (NCCL does), not both,
    // and NCCL cannot have two ranks on one GPU of a server.
    WorldDevice const& first = world.devices.front();
    for (WorldDevice const& d : world.devices) {
      if (d.device.kind != first.device.kind)
        throw Error(Errc::invalid_argument,
                    "world rank " + std::to_string(d.rank) + " is " + d.device.to_string() + " on process " +
                        std::to_string(d.process) + ", world rank 0 is " + first.device.to_string() +
                        " (expected one kind of device across processes: host devices over MPI or CUDA GPUs over "
                        "NCCL)");
      if (d.device.kind != DeviceKind::cuda) continue;
      for (WorldDevice const& e : world.devices) {
        if (e.rank >= d.rank) break;
        if (e.host == d.host && e.device.index == d.device.index)
          throw Error(Errc::invalid_argument,
                      "world ranks " + std::to_string(e.rank) + " and " + std::to_string(d.rank) + " are both " +
                          d.device.to_string() + " on server " + d.host +
                          " (expected distinct GPUs on a server: NCCL cannot have two ranks on one GPU)");
      }
    }
  }
  int const local = world.local_size(world.process);
  bool same = local == group.size();
  for (int l = 0; same && l < local; ++l)
    same = world.devices[static_cast<std::size_t>(world.rank_of(l))].device == group.device(l);
  if (!same)
    throw Error(Errc::invalid_argument, "the DeviceGroup has " + std::to_string(group.size()) +
                                            " device(s) starting with " + group.device(0).to_string() +
                                            ", the world lists " + std::to_string(local) +
                                            " for this process (expected the group the world was made from)");
}

std::vector<std::byte> nccl_id_message() {
  std::vector<std::byte> message;
  try {
    std::vector<std::byte> const id = comm::detail::nccl_unique_id();
    message.resize(1 + id.size());
    message[0] = std::byte{1};
    std::memcpy(message.data() + 1, id.data(), id.size());
  } catch (Error const& e) {
    std::string_view const failure = e.what();
    message.resize(1 + failure.size());
    message[0] = std::byte{0};
    std::memcpy(message.data() + 1, failure.data(), failure.size());
  }
  return message;
}

std::vector<std::byte> nccl_id_from(std::span<std::byte const> message, std::string const& subset) {
  if (message.empty() || message.front() != std::byte{1})
    throw Error(Errc::device, (subset.empty() ? std::string("process 0")
                                              : "the first process of world ranks " + subset) +
                                  " could not make the NCCL unique id: " +
                                  (message.empty() ? std::string("(no reason given)")
                                                   : std::string(reinterpret_cast<char const*>(message.data() + 1),
                                                                 message.size() - 1)));
  return {message.begin() + 1, message.end()};
}

}  // namespace detail
}  // namespace mgpu::dist
