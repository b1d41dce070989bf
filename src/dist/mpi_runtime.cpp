// The dist module over MPI, its runtime: joining the job (init, finalize: MPI's thread level, the
// launcher's view checked against MPI's) and the world's device list (make_world), with what the
// MPI build's other files share (mpi_runtime.hpp). The communicator across processes is made in
// process_communicator.cpp.
#include "dist/mpi_runtime.hpp"

#include <climits>
#include <cstdio>
#include <cstring>

#include "dist/common.hpp"
#include "dist/gloo_runtime.hpp"
#include "dist/rendezvous.hpp"

namespace mgpu::dist {
namespace detail {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

void check(int code, char const* call) {
  if (code != MPI_SUCCESS) throw Error(Errc::communication, std::string(call) + " failed: " + mpi_error_text(code));
}

int mpi_count(std::int64_t count, std::string const& what) {
  if (count < 0 || count > INT_MAX)
    throw Error(Errc::invalid_argument, what + ": " + std::to_string(count) +
                                            " elements or bytes in one MPI exchange (expected at most " +
                                            std::to_string(INT_MAX) + ")");
  return static_cast<int>(count);
}

}  // namespace detail

namespace {

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "single";
    case MPI_THREAD_FUNNELED:
      return "funneled";
    case MPI_THREAD_SERIALIZED:
      return "serialized";
    case MPI_THREAD_MULTIPLE:
      return "multiple";
    default:
      return "level " + std::to_string(level);
  }
}

}  // namespace

using detail::buffer;
using detail::check;
using detail::Clock;
using detail::format_duration;
using detail::Global;
using detail::global;
using detail::Requests;

Place init() {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  if (g.initialized) return g.place;
  if (g.finalized)
    throw Error(Errc::invalid_argument,
                "dist::init() after dist::finalize() (expected one init per process: MPI cannot start again)");
  Place place = parse_environment(detail::read_environment());
  place.host = detail::host_name();
  bool const launched = place.launcher == Launcher::openmpi || place.launcher == Launcher::slurm;
  int already = 0;
  MPI_Initialized(&already);
  if (!launched && !already && place.size > 1) {
    detail::join_rendezvous(place, comm::default_timeout());  // torchrun-style: TCP, no MPI
  } else if (launched || already) {
    std::lock_guard mpi_lock(g.mpi_mutex);
    int provided = MPI_THREAD_SINGLE;
    if (already) {
      check(MPI_Query_thread(&provided), "MPI_Query_thread");
    } else {
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
      g.initialized_mpi = true;
    }
    place.mpi_thread_level = thread_level_name(provided);
    if (provided < MPI_THREAD_SERIALIZED)
      throw Error(Errc::communication,
                  "MPI gave thread support '" + place.mpi_thread_level +
                      "' (expected 'serialized' or 'multiple': mgpu calls MPI from each device's thread)");
    check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    int rank = 0;
    int size = 1;
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
    if (launched && (rank != place.rank || size != place.size))
      throw Error(Errc::invalid_argument, "MPI sees this process as rank " + std::to_string(rank) + " of " +
                                              std::to_string(size) + ", the " + std::string(to_string(place.launcher)) +
                                              " environment says " + std::to_string(place.rank) + " of " +
                                              std::to_string(place.size) +
                                              " (expected the same: launch with mpirun, or srun --mpi=pmix)");
    place.rank = rank;
    place.size = size;
    g.mpi = true;
  }
  detail::gloo_wanted(place);  // a bad MGPU_DIST_BACKEND is refused here, before any exchange
  g.place = place;
  g.initialized = true;
  return place;
}

void finalize() noexcept {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  if (!g.initialized || g.finalized) return;
  g.finalized = true;
  detail::gloo_leave(g.failed.load());
  detail::leave_rendezvous();
  if (!g.initialized_mpi || g.failed.load()) return;  // MPI_Finalize would wait for the peers that failed
  std::lock_guard mpi_lock(g.mpi_mutex);
  for (auto& w : g.windows) MPI_Win_free(&w->window);
  MPI_Finalize();
}

namespace {

// Every process's bytes in process order over MPI (Gloo's store under mpirun), within `timeout`.
std::vector<std::vector<std::byte>> mpi_all_gather(std::span<std::byte const> mine, std::chrono::milliseconds timeout) {
  Global& g = global();
  int const P = g.place.size;
  auto const start = Clock::now();
  auto const wait = [&](Requests& requests) {
    if (!requests.wait(start + timeout, [] { return false; })) {
      requests.abandon();
      throw Error(Errc::timeout, "connecting Gloo waited " + format_duration(Clock::now() - start) +
                                     " for the other processes (expected every process to call make_world within the " +
                                     format_duration(timeout) + " deadline; " + comm::timeout_env_var +
                                     " sets it in seconds)");
    }
    std::lock_guard lock(g.mpi_mutex);
    check(requests.error(), "connecting Gloo's MPI exchange");
  };
  auto size = std::make_shared<int>(detail::mpi_count(static_cast<std::int64_t>(mine.size()), "connecting Gloo"));
  auto sizes = buffer<int>(static_cast<std::size_t>(P));
  {
    Requests requests;
    requests.add(-1, Requests::Kind::collective, std::make_shared<std::pair<decltype(size), decltype(sizes)>>(size, sizes),
                 "MPI_Iallgather", [&](MPI_Request* r) {
                   return MPI_Iallgather(size.get(), 1, MPI_INT, sizes->data(), 1, MPI_INT, MPI_COMM_WORLD, r);
                 });
    wait(requests);
  }
  std::vector<int> offsets;
  int total = 0;
  for (int const n : *sizes) {
    offsets.push_back(total);
    total += n;
  }
  auto own = std::make_shared<std::vector<std::byte>>(mine.begin(), mine.end());
  auto all = buffer<std::byte>(static_cast<std::size_t>(total));
  {
    Requests requests;
    requests.add(-1, Requests::Kind::collective, std::make_shared<std::pair<decltype(own), decltype(all)>>(own, all),
                 "MPI_Iallgatherv", [&](MPI_Request* r) {
                   return MPI_Iallgatherv(own->data(), *size, MPI_BYTE, all->data(), sizes->data(), offsets.data(),
                                          MPI_BYTE, MPI_COMM_WORLD, r);
                 });
    wait(requests);
  }
  std::vector<std::vector<std::byte>> out;
  for (int q = 0; q < P; ++q) {
    auto const* at = all->data() + offsets[static_cast<std::size_t>(q)];
    out.emplace_back(at, at + (*sizes)[static_cast<std::size_t>(q)]);
  }
  return out;
}

World make_world_of(DeviceGroup const& group, Place const& place, bool mpi, std::chrono::milliseconds timeout);

}  // namespace

World make_world(DeviceGroup const& group, std::chrono::milliseconds timeout) {
  Global& g = global();
  Place place;
  bool mpi = false;
  {
    std::lock_guard lock(g.mutex);
    if (!g.initialized || g.finalized)
      throw Error(Errc::invalid_argument,
                  "dist::make_world outside dist::init() and finalize() (expected init() first)");
    place = g.place;
    mpi = g.mpi;
  }
  if (timeout.count() <= 0) timeout = comm::default_timeout();
  World world = make_world_of(group, place, mpi, timeout);
  // Where the job wants Gloo, every process connects the job's context at its first make_world:
  // host devices' bytes go over it, and the members of a subset communicator of GPUs meet over it
  // (the rendezvous is collective over every process).
  if (world.processes > 1 && !detail::gloo_connected() && detail::gloo_wanted(place)) {
    if (detail::in_rendezvous()) {
      detail::gloo_connect(place, detail::rendezvous_address(),
                           [timeout](std::span<std::byte const> mine) { return detail::rendezvous_all_gather(mine, timeout); },
                           timeout);
    } else {
      detail::gloo_connect(place, place.host,
                           [timeout](std::span<std::byte const> mine) { return mpi_all_gather(mine, timeout); }, timeout);
    }
  }
  return world;
}

namespace {

World make_world_of(DeviceGroup const& group, Place const& place, bool mpi, std::chrono::milliseconds timeout) {
  Global& g = global();
  if (detail::in_rendezvous()) return detail::rendezvous_world(group, place, timeout);
  if (!mpi) return detail::single_process_world(group, place.host);
  struct Entry {
    std::int32_t devices;
    char host[256];
  };
  struct Record {
    std::int32_t kind;
    std::int32_t index;
    double speed;
  };
  int const P = place.size;
  auto mine = std::make_shared<Entry>();
  mine->devices = group.size();
  std::snprintf(mine->host, sizeof mine->host, "%s", place.host.c_str());
  auto entries = buffer<Entry>(static_cast<std::size_t>(P));
  auto const start = Clock::now();
  auto const wait = [&](Requests& requests) {
    if (!requests.wait(start + timeout, [] { return false; })) {
      requests.abandon();
      throw Error(Errc::timeout,
                  "make_world waited " + format_duration(Clock::now() - start) +
                      " for the other processes' devices (expected every process to call it within the " +
                      format_duration(timeout) + " deadline; " + comm::timeout_env_var + " sets it in seconds)");
    }
    std::lock_guard lock(g.mpi_mutex);
    check(requests.error(), "make_world's MPI exchange");
  };
  {
    Requests requests;
    requests.add(-1, Requests::Kind::collective,
                 std::make_shared<std::pair<decltype(mine), decltype(entries)>>(mine, entries), "MPI_Iallgather",
                 [&](MPI_Request* r) {
                   return MPI_Iallgather(mine.get(), sizeof(Entry), MPI_BYTE, entries->data(), sizeof(Entry), MPI_BYTE,
                                         MPI_COMM_WORLD, r);
                 });
    bool duplicate = false;
    {
      std::lock_guard lock(g.mpi_mutex);
      duplicate = g.subsets == MPI_COMM_NULL;
    }
    if (duplicate)  // once per process, as every process's first make_world
      requests.add(-1, Requests::Kind::collective, nullptr, "MPI_Comm_idup",
                   [&](MPI_Request* r) { return MPI_Comm_idup(MPI_COMM_WORLD, &g.subsets, r); });
    wait(requests);
  }
  auto own = buffer<Record>(static_cast<std::size_t>(group.size()));
  for (int r = 0; r < group.size(); ++r) {
    Device const d = group.device(r);
    (*own)[static_cast<std::size_t>(r)] = {static_cast<std::int32_t>(d.kind), d.index, d.speed};
  }
  std::vector<int> counts, offsets;
  int total = 0;
  for (Entry const& e : *entries) {
    counts.push_back(e.devices * static_cast<int>(sizeof(Record)));
    offsets.push_back(total * static_cast<int>(sizeof(Record)));
    total += e.devices;
  }
  auto records = buffer<Record>(static_cast<std::size_t>(total));
  {
    Requests requests;
    requests.add(-1, Requests::Kind::collective,
                 std::make_shared<std::pair<decltype(own), decltype(records)>>(own, records), "MPI_Iallgatherv",
                 [&](MPI_Request* r) {
                   return MPI_Iallgatherv(own->data(), counts[static_cast<std::size_t>(place.rank)], MPI_BYTE,
                                          records->data(), counts.data(), offsets.data(), MPI_BYTE, MPI_COMM_WORLD, r);
                 });
    wait(requests);
  }
  World world;
  world.process = place.rank;
  world.processes = P;
  for (int p = 0, rank = 0; p < P; ++p) {
    Entry const& e = (*entries)[static_cast<std::size_t>(p)];
    for (int l = 0; l < e.devices; ++l, ++rank) {
      Record const& r = (*records)[static_cast<std::size_t>(rank)];
      Device device{static_cast<DeviceKind>(r.kind), r.index, r.speed};
      world.devices.push_back({rank, device, p, l, std::string(e.host, strnlen(e.host, sizeof e.host))});
    }
  }
  return world;
}

}  // namespace

}  // namespace mgpu::dist
