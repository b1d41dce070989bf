// The leaders' data movement between processes, behind one interface (internal: not installed):
// the process communicator's algorithms (leader_collectives.cpp, the subset lists, the headers)
// are written once against Exchange, and each transport implements it: MPI (exchange_mpi.cpp,
// over the Link's MPI communicators) and Gloo (exchange_gloo.cpp, over the job's Gloo context).
// Every call waits at most until the step's start plus the communicator's deadline; a process not
// heard from in time, or one whose connection broke, is named in the error, and the communicator
// is aborted (Link::fail).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/base.hpp"

namespace mgpu::dist::detail {

class Link;

// One exchange of a collective: what it is called in errors, when its deadline started, and which
// message it is (the call's number and its round within the call), which a transport without
// ordered channels (Gloo) uses to match messages; it waits `deadlines` times the communicator's
// deadline (two where a communicator is made: after a failed step, the process that failed gets
// there first, the others once they waited out the deadline).
struct Step {
  std::string const& what;
  std::chrono::steady_clock::time_point start;
  std::uint64_t seq = 0;
  int round = 0;
  int deadlines = 1;
};

// Rounds of a call, told apart by transports that match messages by their number.
enum Round : int {
  kHeaders = 0,   // the leaders' headers (Link::exchange_headers)
  kLists = 1,     // a subset's lists of world ranks
  kData = 2,      // a collective's first round of data
  kData2 = 3,     // its second round (an all-reduce by reduce-scatter and all-gather)
  kMessage = 4,   // point-to-point: a message's header
  kPayload = 5,   // point-to-point: its data
};

// The unit of the counts passed to the collectives below: float32 elements or bytes.
enum class Unit : int { byte = 1, float32 = 4 };

// Sends and receives between ranks of different processes (send/recv across processes).
class Messages {
 public:
  virtual ~Messages() = default;
  // Posts the send or receive `c` (c.root: the other rank).
  virtual void post(comm::detail::Call const& c) = 0;
  // Waits for every posted message (the deadline runs from `start`), then checks and delivers the
  // received ones: a count or dtype other than the receive's fails naming the sender.
  virtual void finish(std::chrono::steady_clock::time_point start) = 0;
};

class Exchange {
 public:
  virtual ~Exchange() = default;

  // Every process sends `bytes` from `mine` to every other one and receives each one's into
  // `theirs` + q * bytes (its own block untouched); fails naming the processes not heard from.
  // `tag` tells apart such exchanges that run at once (a slice leader's local rank).
  virtual void all_to_all_same(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* mine, void* theirs,
                               std::size_t bytes, int tag, int yields) = 0;

  // All-gather in place: process q's counts[q] units are at offsets[q] of `all` (this process's
  // already there) and end up there on every process.
  virtual void all_gather(Link const& l, Step const& s, std::shared_ptr<void> keep, void* all, Unit unit,
                          std::vector<std::int64_t> const& counts, std::vector<std::int64_t> const& offsets) = 0;

  // All-to-all: send_counts[q] units from send + send_offsets[q] go to process q, which receives
  // them at recv + recv_offsets[this process] (recv_counts[q] units from process q).
  virtual void all_to_all(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* send,
                          std::vector<std::int64_t> const& send_counts, std::vector<std::int64_t> const& send_offsets,
                          void* recv, std::vector<std::int64_t> const& recv_counts,
                          std::vector<std::int64_t> const& recv_offsets, Unit unit) = 0;

  // `bytes` of process `root`'s `data` into every process's.
  virtual void broadcast(Link const& l, Step const& s, std::shared_ptr<void> keep, void* data, std::int64_t bytes,
                         int root) = 0;

  // Every process's `count` units of `mine` into `all` (process q's at q * count) on process `root`.
  virtual void gather(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* mine, void* all,
                      std::int64_t count, Unit unit, int root) = 0;

  // Sends and receives between the ranks of this process and `rank`'s.
  virtual std::unique_ptr<Messages> messages(std::shared_ptr<Link> link, int rank) = 0;

  // Whether the all-reduce by slices between two processes (allreduce_slices.hpp) runs here.
  [[nodiscard]] virtual bool slices() const noexcept = 0;
};

}  // namespace mgpu::dist::detail
