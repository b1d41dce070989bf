// The point-to-point transport between ranks of different processes over MPI (internal: not
// installed): a group's sends and receives posted at once and awaited together (PointToPoint).
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "comm/base.hpp"
#include "dist/exchange.hpp"
#include "dist/link.hpp"
#include "dist/mpi_runtime.hpp"

namespace mgpu::dist::detail {

// Sends and receives between ranks of different processes: each message is a Header (count,
// dtype, call number) and the data, tagged by the pair of ranks.
class PointToPoint final : public Messages {
 public:
  PointToPoint(std::shared_ptr<Link> link, int rank) : link_(std::move(link)), rank_(rank) {}

  // Posts the send or receive `c` (c.root: the other rank) to the other rank's process.
  void post(Call const& c) override;

  // Waits for every posted message (the deadline runs from `start`), then checks and delivers the
  // received ones.
  void finish(Clock::time_point start) override;

 private:
  struct Receive {
    Call call;
    std::shared_ptr<std::vector<std::byte>> message;
    std::size_t index;
  };
  std::shared_ptr<Link> link_;
  int rank_;
  Requests requests_;
  std::vector<Receive> receives_;
  std::vector<Call> calls_;
};

}  // namespace mgpu::dist::detail
