// The shared-memory transport (transport_shm.hpp): making a pair's rings (both processes offer
// shared memory and a free window, then reuse one or allocate one with MPI_Win_allocate_shared),
// and handing the window on when a communicator is done with it.
#include "dist/transport_shm.hpp"

#include <cstdlib>
#include <cstring>
#include <string>

namespace mgpu::dist::detail {
namespace {

// Turns off the shared memory between two processes of one host (MGPU_DIST_SHM=0): their
// all-reduces by slices then go over MPI point-to-point as between servers.
constexpr char const* shm_env_var = "MGPU_DIST_SHM";

}  // namespace

std::shared_ptr<SharedRings> SharedRings::make(Link const& link, int leaders) {
  std::int64_t const header = static_cast<std::int64_t>(leaders) * 2 * kCounterBytes;
  std::int64_t const bytes = header + leaders * slots * kSlicePiece * static_cast<std::int64_t>(sizeof(float));
  std::pair<int, int> const processes{link.id(0), link.id(1)};
  char const* setting = std::getenv(shm_env_var);
  bool const wanted = !(setting != nullptr && std::string(setting) == "0") && link.host(0) == link.host(1);
  Global& g = global();
  Global::SharedWindow* spare = nullptr;  // the free window this process offers, held for the exchange
  if (wanted) {
    std::lock_guard lock(g.mpi_mutex);
    for (auto& w : g.windows) {
      if (!w->in_use && w->processes == processes && w->bytes == bytes && (spare == nullptr || w->id < spare->id))
        spare = w.get();
    }
    if (spare != nullptr) spare->in_use = true;
  }
  auto offers = buffer<int>(4);  // each process's: whether it wants shared memory, its spare window's id (-1: none)
  int const p = link.process();
  (*offers)[static_cast<std::size_t>(2 * p)] = wanted ? 1 : 0;
  (*offers)[static_cast<std::size_t>(2 * p + 1)] = spare != nullptr ? spare->id : -1;
  {
    Requests requests;
    requests.add(1 - p, Requests::Kind::collective, offers, "MPI_Iallgather", [&](MPI_Request* r) {
      return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, offers->data(), 2, MPI_INT, link.data, r);
    });
    link.wait(requests, "making a communicator across processes", Clock::now(),
              [&](std::vector<int> const& pending) { return link.describe(pending) + ", not heard from"; });
  }
  std::vector<int> const& o = *offers;
  bool const reuse = spare != nullptr && o[1] == o[3];
  if (spare != nullptr && !reuse) {
    std::lock_guard lock(g.mpi_mutex);
    spare->in_use = false;
  }
  if (o[0] == 0 || o[2] == 0) return nullptr;
  Global::SharedWindow* window = reuse ? spare : allocate(link, processes, bytes);
  if (window == nullptr) return nullptr;
  std::shared_ptr<SharedRings> rings(new SharedRings(window, header, leaders));
  std::memset(window->base[p], 0, static_cast<std::size_t>(header));
  // Both segments' counters are cleared before either process counts in them.
  Requests requests;
  requests.add(1 - p, Requests::Kind::collective, nullptr, "MPI_Ibarrier",
               [&](MPI_Request* r) { return MPI_Ibarrier(link.data, r); });
  link.wait(requests, "making a communicator across processes", Clock::now(),
            [&](std::vector<int> const& pending) { return link.describe(pending) + ", not heard from"; });
  return rings;
}

SharedRings::~SharedRings() {
  std::lock_guard lock(global().mpi_mutex);
  window_->in_use = false;
}

Global::SharedWindow* SharedRings::allocate(Link const& link, std::pair<int, int> processes, std::int64_t bytes) {
  Global& g = global();
  std::lock_guard lock(g.mpi_mutex);
  MPI_Comm pair = MPI_COMM_NULL;
  check(MPI_Comm_split_type(link.data, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &pair), "MPI_Comm_split_type");
  int size = 0;
  MPI_Comm_size(pair, &size);
  if (size != 2) {
    MPI_Comm_free(&pair);
    return nullptr;
  }
  auto w = std::make_unique<Global::SharedWindow>();
  w->processes = processes;
  w->bytes = bytes;
  for (auto const& other : g.windows) {
    if (other->processes == processes && other->bytes == bytes) ++w->id;
  }
  // Each segment on pages of its own, placed near the process that writes it.
  MPI_Info info = MPI_INFO_NULL;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* mine = nullptr;
  int const code = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, pair, &mine, &w->window);
  MPI_Info_free(&info);
  MPI_Comm_free(&pair);
  check(code, "MPI_Win_allocate_shared");
  for (int q = 0; q < 2; ++q) {
    MPI_Aint size_q = 0;
    int unit = 0;
    void* at = nullptr;
    check(MPI_Win_shared_query(w->window, q, &size_q, &unit, &at), "MPI_Win_shared_query");
    w->base[q] = static_cast<std::byte*>(at);
  }
  g.windows.push_back(std::move(w));
  return g.windows.back().get();
}

}  // namespace mgpu::dist::detail
