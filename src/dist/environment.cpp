// The launcher's environment: which launcher, and this process's place in the job.
#include <array>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

#include <unistd.h>

#include <mgpu/config.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

#include "dist/common.hpp"
#include "dist/gloo_runtime.hpp"

namespace mgpu::dist {
namespace {

// One launcher's variables.
struct Variables {
  Launcher launcher;
  char const* rank;
  char const* size;
  char const* local_rank;
};

constexpr std::array<Variables, 3> launchers{{
    {Launcher::openmpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {Launcher::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
    {Launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"},
}};

std::optional<std::string> lookup(Environment const& environment, char const* name) {
  auto const found = environment.find(name);
  if (found == environment.end()) return std::nullopt;
  return found->second;
}

// The whole number in `text` in [low, high]; Error(invalid_argument) naming the variable otherwise.
int whole_number(char const* name, std::string const& text, long low, long high, std::string const& expected) {
  bool valid = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos && text.size() <= 9;
  long value = valid ? std::strtol(text.c_str(), nullptr, 10) : 0;
  if (!valid || value < low || value > high)
    throw Error(Errc::invalid_argument, std::string(name) + "='" + text + "' (expected " + expected + ")");
  return static_cast<int>(value);
}

}  // namespace

std::string_view to_string(Launcher launcher) noexcept {
  switch (launcher) {
    case Launcher::none:
      return "none";
    case Launcher::openmpi:
      return "openmpi";
    case Launcher::slurm:
      return "slurm";
    case Launcher::torchrun:
      return "torchrun";
  }
  return "unknown";
}

std::vector<std::string> const& environment_variables() {
  static std::vector<std::string> const names = [] {
    std::vector<std::string> list;
    for (Variables const& v : launchers) list.insert(list.end(), {v.rank, v.size, v.local_rank});
    list.insert(list.end(), {"MASTER_ADDR", "MASTER_PORT"});
    return list;
  }();
  return names;
}

Place parse_environment(Environment const& environment) {
  Place place;
  for (Variables const& v : launchers) {
    auto const rank = lookup(environment, v.rank);
    auto const size = lookup(environment, v.size);
    if (!rank && !size) continue;
    if (!rank)
      throw Error(Errc::invalid_argument,
                  std::string(v.size) + " is set but " + v.rank + " is not (expected both, or neither)");
    if (!size)
      throw Error(Errc::invalid_argument,
                  std::string(v.rank) + " is set but " + v.size + " is not (expected both, or neither)");
    int const limit = std::numeric_limits<int>::max();
    place.launcher = v.launcher;
    place.size = whole_number(v.size, *size, 1, limit, "a whole number of processes >= 1");
    std::string const in_range =
        "a whole number in [0, " + std::to_string(place.size) + "), " + v.size + " being " + *size;
    place.rank = whole_number(v.rank, *rank, 0, place.size - 1, in_range);
    if (auto const local = lookup(environment, v.local_rank))
      place.local_rank = whole_number(v.local_rank, *local, 0, place.size - 1, in_range);
    if (v.launcher == Launcher::torchrun) {
      if (auto const address = lookup(environment, "MASTER_ADDR")) {
        if (address->empty())
          throw Error(Errc::invalid_argument, "MASTER_ADDR='' (expected the rendezvous host's name or address)");
        place.master_addr = *address;
      }
      if (auto const port = lookup(environment, "MASTER_PORT"))
        place.master_port = whole_number("MASTER_PORT", *port, 1, 65535, "a port in [1, 65535]");
    }
    return place;
  }
  return place;
}

namespace detail {

Environment read_environment() {
  Environment environment;
  for (std::string const& name : environment_variables()) {
    if (char const* value = std::getenv(name.c_str())) environment.emplace(name, value);
  }
  return environment;
}

std::string host_name() {
  std::array<char, 256> name{};
  if (gethostname(name.data(), name.size() - 1) != 0 || name[0] == '\0') return "unknown";
  return name.data();
}

bool gloo_wanted(Place const& place) {
  char const* value = std::getenv(backend_env_var);
  std::string const backend = value ? value : "";
  bool const torchrun = place.launcher == Launcher::torchrun;
  if (backend.empty() || backend == "auto") return torchrun && place.size > 1 && built_with_gloo;
  if (backend == "mpi") {
    if (torchrun && place.size > 1)
      throw Error(Errc::invalid_argument, std::string(backend_env_var) +
                                              "=mpi in a torchrun-style job (expected gloo or auto: MPI needs mpirun or srun)");
    return false;
  }
  if (backend == "gloo") {
    if (!built_with_gloo)
      throw Error(Errc::invalid_argument, std::string(backend_env_var) +
                                              "=gloo, but mgpu was built without Gloo (expected mpi or auto, or a build "
                                              "with MGPU_WITH_GLOO)");
    return place.size > 1;
  }
  throw Error(Errc::invalid_argument, std::string(backend_env_var) + "='" + backend + "' (expected gloo, mpi or auto)");
}

}  // namespace detail
}  // namespace mgpu::dist
