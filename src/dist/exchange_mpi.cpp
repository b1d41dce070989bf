// The leaders' exchanges over MPI (exchange.hpp): headers and lists by point-to-point on the
// Link's control communicator, the collectives by MPI's non-blocking collectives on its data
// communicator, every request polled against the deadline (Requests), sends and receives by
// PointToPoint (transport_p2p.hpp).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/exchange.hpp"
#include "dist/link.hpp"
#include "dist/mpi_runtime.hpp"
#include "dist/transport_p2p.hpp"

namespace mgpu::dist::detail {
namespace {

MPI_Datatype mpi_type(Unit unit) { return unit == Unit::float32 ? MPI_FLOAT : MPI_BYTE; }

std::vector<int> mpi_counts(std::vector<std::int64_t> const& counts, std::string const& what) {
  std::vector<int> out;
  out.reserve(counts.size());
  for (std::int64_t const c : counts) out.push_back(mpi_count(c, what));
  return out;
}

class MpiExchange final : public Exchange {
 public:
  void all_to_all_same(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* mine, void* theirs,
                       std::size_t bytes, int tag, int yields) override {
    int const count = mpi_count(static_cast<std::int64_t>(bytes), s.what);
    Requests requests;
    for (int const p : l.others()) {
      requests.add(p, Requests::Kind::receive, keep, "MPI_Irecv", [&](MPI_Request* r) {
        return MPI_Irecv(static_cast<std::byte*>(theirs) + static_cast<std::size_t>(p) * bytes, count, MPI_BYTE, p, tag,
                         l.control, r);
      });
      requests.add(p, Requests::Kind::send, keep, "MPI_Isend",
                   [&](MPI_Request* r) { return MPI_Isend(mine, count, MPI_BYTE, p, tag, l.control, r); });
    }
    l.wait(
        requests, s.what, s.start, [&](std::vector<int> const& pending) { return l.describe(pending) + ", not heard from"; },
        std::nullopt, yields);
  }

  void all_gather(Link const& l, Step const& s, std::shared_ptr<void> keep, void* all, Unit unit,
                  std::vector<std::int64_t> const& counts, std::vector<std::int64_t> const& offsets) override {
    std::vector<int> const c = mpi_counts(counts, s.what);
    std::vector<int> const o = mpi_counts(offsets, s.what);
    Requests requests;
    requests.add(-1, Requests::Kind::collective, std::move(keep), "MPI_Iallgatherv", [&](MPI_Request* r) {
      return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all, c.data(), o.data(), mpi_type(unit), l.data, r);
    });
    l.wait_exchange(requests, s.what, s.start);
  }

  void all_to_all(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* send,
                  std::vector<std::int64_t> const& send_counts, std::vector<std::int64_t> const& send_offsets, void* recv,
                  std::vector<std::int64_t> const& recv_counts, std::vector<std::int64_t> const& recv_offsets,
                  Unit unit) override {
    std::vector<int> const sc = mpi_counts(send_counts, s.what), so = mpi_counts(send_offsets, s.what);
    std::vector<int> const rc = mpi_counts(recv_counts, s.what), ro = mpi_counts(recv_offsets, s.what);
    Requests requests;
    requests.add(-1, Requests::Kind::collective, std::move(keep), "MPI_Ialltoallv", [&](MPI_Request* r) {
      return MPI_Ialltoallv(send, sc.data(), so.data(), mpi_type(unit), recv, rc.data(), ro.data(), mpi_type(unit),
                            l.data, r);
    });
    l.wait_exchange(requests, s.what, s.start);
  }

  void broadcast(Link const& l, Step const& s, std::shared_ptr<void> keep, void* data, std::int64_t bytes,
                 int root) override {
    int const count = mpi_count(bytes, s.what);
    Requests requests;
    requests.add(-1, Requests::Kind::collective, std::move(keep), "MPI_Ibcast",
                 [&](MPI_Request* r) { return MPI_Ibcast(data, count, MPI_BYTE, root, l.data, r); });
    l.wait_exchange(requests, s.what, s.start);
  }

  void gather(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* mine, void* all, std::int64_t count,
              Unit unit, int root) override {
    int const n = mpi_count(count, s.what);
    mpi_count(count * l.processes(), s.what);
    Requests requests;
    requests.add(-1, Requests::Kind::collective, std::move(keep), "MPI_Igather", [&](MPI_Request* r) {
      return MPI_Igather(mine, n, mpi_type(unit), all, n, mpi_type(unit), root, l.data, r);
    });
    l.wait_exchange(requests, s.what, s.start);
  }

  std::unique_ptr<Messages> messages(std::shared_ptr<Link> link, int rank) override {
    return std::make_unique<PointToPoint>(std::move(link), rank);
  }

  [[nodiscard]] bool slices() const noexcept override { return true; }
};

}  // namespace

std::shared_ptr<Exchange> make_mpi_exchange() { return std::make_shared<MpiExchange>(); }

}  // namespace mgpu::dist::detail
