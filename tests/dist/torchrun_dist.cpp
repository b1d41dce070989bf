// A torchrun-style job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no MPI), started by
// torchrun.sh: `torchrun_dist COUNTS` joins the TCP rendezvous, makes the world from process p's
// host:COUNTS[p] and checks it against COUNTS (every process, in process order, with its local
// ranks and this server's host name), and makes a communicator over the host devices (over Gloo),
// or, in a build without Gloo, checks that it is refused naming the fix (Gloo or MPI; GPUs would
// get NCCL). Exits 0 when all holds, 1 with the error otherwise.
#include <cstdio>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

namespace {

std::vector<int> parse_counts(std::string const& text) {
  std::vector<int> counts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) counts.push_back(std::stoi(part));
  return counts;
}

void expect(bool holds, std::string const& what) {
  if (!holds) throw std::runtime_error("expected " + what);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: torchrun_dist COUNTS (under torchrun.sh)\n");
    return 2;
  }
  try {
    std::vector<int> const counts = parse_counts(argv[1]);
    mgpu::dist::Session session;
    auto const& place = session.place();
    expect(place.launcher == mgpu::dist::Launcher::torchrun, "a torchrun-style place");
    expect(place.size == static_cast<int>(counts.size()), "WORLD_SIZE to be the number of counts");
    mgpu::DeviceGroup group("host:" + std::to_string(counts[static_cast<std::size_t>(place.rank)]));
    auto const world = mgpu::dist::make_world(group);
    expect(world.process == place.rank && world.processes == place.size, "the world's process and size");
    int rank = 0;
    for (int p = 0; p < place.size; ++p) {
      for (int l = 0; l < counts[static_cast<std::size_t>(p)]; ++l, ++rank) {
        expect(rank < world.size(), "world rank " + std::to_string(rank) + " to exist");
        auto const& d = world.devices[static_cast<std::size_t>(rank)];
        expect(d.rank == rank && d.process == p && d.local_rank == l &&
                   d.device == mgpu::Device{mgpu::DeviceKind::host, l} && d.host == place.host,
               "world rank " + std::to_string(rank) + " to be process " + std::to_string(p) + "'s host:" +
                   std::to_string(l) + " on " + place.host);
      }
    }
    expect(world.size() == rank, "no more world ranks than the counts give");
    if constexpr (mgpu::built_with_gloo) {  // host devices over Gloo (mpi_dist's modes check the collectives)
      auto comm = mgpu::dist::make_communicator(world, group);
      expect(comm->size() == world.size() && comm->first_rank() == world.rank_of(0),
             "a communicator over the world's " + std::to_string(world.size()) + " devices, this process's from rank " +
                 std::to_string(world.rank_of(0)));
    } else {
      try {
        auto comm = mgpu::dist::make_communicator(world, group);
        expect(false, "a communicator over host devices across torchrun-style processes to be refused");
      } catch (mgpu::Error const& e) {
        expect(e.category() == mgpu::Errc::invalid_argument &&
                   std::string(e.what()).find("host devices across processes need Gloo (MGPU_WITH_GLOO) or MPI") !=
                       std::string::npos,
               "the refusal to name Gloo and mpirun, got: " + std::string(e.what()));
      }
    }
    std::printf("process %d of %d: a world of %d devices, as expected\n", place.rank, place.size, world.size());
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "torchrun_dist: %s\n", e.what());
    return 1;
  }
}
