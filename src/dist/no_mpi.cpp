// The dist module in a build without MPI: a job of one process, or a torchrun-style job of GPUs
// (its TCP rendezvous carries the world's device list and the NCCL unique id).
#include <mutex>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

#include "dist/common.hpp"
#include "dist/rendezvous.hpp"

namespace mgpu::dist {

namespace {
struct Global {
  std::mutex mutex;
  bool initialized = false;
  Place place;
};
Global& global() {
  static Global g;
  return g;
}
}  // namespace

Place init() {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  if (g.initialized) return g.place;
  Place place = parse_environment(detail::read_environment());
  if (place.size > 1 && place.launcher != Launcher::torchrun)
    throw Error(Errc::invalid_argument,
                "a job of " + std::to_string(place.size) +
                    " processes (launcher: " + std::string(to_string(place.launcher)) +
                    "), but mgpu was built without MPI (expected 1 process, a torchrun-style job of GPUs, or a build "
                    "with MGPU_WITH_MPI=ON)");
  place.host = detail::host_name();
  if (place.size > 1) detail::join_rendezvous(place, comm::default_timeout());
  g.place = place;
  g.initialized = true;
  return place;
}

void finalize() noexcept {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  detail::leave_rendezvous();
  g.initialized = false;
}

World make_world(DeviceGroup const& group, std::chrono::milliseconds timeout) {
  if (!detail::in_rendezvous()) return detail::single_process_world(group, detail::host_name());
  Place place;
  {
    std::lock_guard lock(global().mutex);
    place = global().place;
  }
  return detail::rendezvous_world(group, place, timeout.count() > 0 ? timeout : comm::default_timeout());
}

std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group, comm::Options options) {
  detail::check_world(world, group);
  if (world.processes > 1 && detail::in_rendezvous()) return detail::rendezvous_communicator(world, group, options);
  return comm::make_communicator(group, options);
}

std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group,
                                                      std::vector<int> const& world_ranks, comm::Options options) {
  detail::check_world(world, group);
  detail::Subset const subset = detail::subset_of(world, world_ranks);
  if (subset.world.processes > 1)  // the rendezvous is collective over every process: no subset's exchange
    throw Error(Errc::invalid_argument, "a communicator over world ranks " + detail::ranks_text(world_ranks) +
                                            " across processes in a build without MPI (expected the ranks of one "
                                            "process: a subset across processes needs MGPU_WITH_MPI=ON, and MPI "
                                            "or Gloo in the job)");
  return comm::make_communicator(group, subset.locals, options);
}

}  // namespace mgpu::dist
