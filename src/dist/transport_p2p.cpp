// The point-to-point transport (transport_p2p.hpp): each message a Header and the data in one
// staging buffer, tagged by the pair of ranks on the link's p2p communicator; a received message
// checked against the receive's count and dtype before it is delivered.
#include "dist/transport_p2p.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace mgpu::dist::detail {

void PointToPoint::post(Call const& c) {
  Link const& l = *link_;
  int const peer_process = l.process_of(c.root);
  std::size_t const bytes = static_cast<std::size_t>(c.count) * size_of(c.dtype);
  auto message = buffer<std::byte>(sizeof(Header) + bytes);
  int const size = mpi_count(static_cast<std::int64_t>(message->size()), c.name(rank_));
  if (c.kind == OpKind::send) {
    Header const h{static_cast<std::int32_t>(c.kind), static_cast<std::int32_t>(c.dtype), 0, 0, c.count, c.seq};
    std::memcpy(message->data(), &h, sizeof h);
    if (bytes > 0) std::memcpy(message->data() + sizeof h, c.send.data(), bytes);
    int const tag = rank_ * l.world_size() + c.root;
    requests_.add(peer_process, Requests::Kind::send, message, "MPI_Isend", [&](MPI_Request* r) {
      return MPI_Isend(message->data(), size, MPI_BYTE, peer_process, tag, l.p2p, r);
    });
  } else {
    int const tag = c.root * l.world_size() + rank_;
    std::size_t const index = requests_.add(
        peer_process, Requests::Kind::receive, message, "MPI_Irecv",
        [&](MPI_Request* r) { return MPI_Irecv(message->data(), size, MPI_BYTE, peer_process, tag, l.p2p, r); });
    receives_.push_back({c, message, index});
  }
  calls_.push_back(c);
}

void PointToPoint::finish(Clock::time_point start) {
  Link const& l = *link_;
  std::string const what = calls_.size() == 1 ? calls_.front().name(rank_)
                                              : "rank " + std::to_string(rank_) + "'s group of sends and receives";
  l.wait(requests_, what, start, [&](std::vector<int> const& pending) {
    std::string text;
    for (Call const& c : calls_) {
      if (std::find(pending.begin(), pending.end(), l.process_of(c.root)) == pending.end()) continue;
      text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(c.root) + " of " +
              l.describe(l.process_of(c.root)) + (c.kind == OpKind::send ? " to receive" : " to send");
    }
    return text;
  });
  for (Receive const& r : receives_) {
    int received = 0;
    {
      std::lock_guard lock(global().mpi_mutex);
      MPI_Get_count(&requests_.status(r.index), MPI_BYTE, &received);
    }
    Header h{};
    if (received >= static_cast<int>(sizeof h)) std::memcpy(&h, r.message->data(), sizeof h);
    std::size_t const bytes = static_cast<std::size_t>(r.call.count) * size_of(r.call.dtype);
    if (received != static_cast<int>(sizeof h + bytes) || h.count != r.call.count ||
        h.dtype != static_cast<std::int32_t>(r.call.dtype))
      l.fail(Errc::invalid_argument,
             r.call.name(rank_) + ": rank " + std::to_string(r.call.root) + " sent " + std::to_string(h.count) + " " +
                 std::string(mgpu::to_string(static_cast<DType>(h.dtype))) + " elements, the recv takes " +
                 std::to_string(r.call.count) + " " + std::string(mgpu::to_string(r.call.dtype)) +
                 " (expected matching count and dtype)");
    if (bytes > 0) std::memcpy(r.call.recv.data(), r.message->data() + sizeof h, bytes);
  }
}

}  // namespace mgpu::dist::detail
