// The dist module in a build without MPI: a job of one process.
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

#include "dist/common.hpp"

namespace mgpu::dist {

Place init() {
  Place place = parse_environment(detail::read_environment());
  if (place.size > 1)
    throw Error(Errc::invalid_argument,
                "a job of " + std::to_string(place.size) +
                    " processes (launcher: " + std::string(to_string(place.launcher)) +
                    "), but mgpu was built without MPI (expected 1 process, or a build with MGPU_WITH_MPI=ON)");
  place.host = detail::host_name();
  return place;
}

void finalize() noexcept {}

World make_world(DeviceGroup const& group, std::chrono::milliseconds) {
  return detail::single_process_world(group, detail::host_name());
}

std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group, comm::Options options) {
  detail::check_world(world, group);
  return comm::make_communicator(group, options);
}

}  // namespace mgpu::dist
