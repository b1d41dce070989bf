// The shared-memory transport between two processes of one host (internal: not installed): an MPI
// shared-memory window over the pair holding each slice leader's counters and ring of pieces
// (SharedRings), through which the all-reduce by slices swaps its pieces instead of over MPI.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "dist/link.hpp"
#include "dist/mpi_runtime.hpp"

namespace mgpu::dist::detail {

// A slice goes between the two processes in pieces of this many elements: each piece is reduced
// inside the process, sent, and combined with the other process's piece while both are still in
// cache.
constexpr std::int64_t kSlicePiece = std::int64_t{1} << 16;

// The shared memory through which two processes on one host swap their all-reduces by slices: an
// MPI shared-memory window (MPI_Win_allocate_shared) over the pair, in which each process's segment
// holds, per local rank (a slice's leader), two counters and a ring of `slots` pieces. A leader
// reduces its process's piece straight into its ring and counts it ready; the other process's
// leader of that slice combines it from there and counts it consumed, which frees the slot. The
// counters only grow, over every call, in the same steps on both processes (the leaders' headers
// agree on each call's size first). A communicator takes a window another one between the same
// processes left, where both processes have the same one free (its work all done on both),
// else makes one; finalize() frees them.
class SharedRings {
 public:
  static constexpr std::int64_t slots = 4;

  // Collective over the two processes of `link`, after it is connected; null where they are on
  // different hosts or either turns shared memory off.
  static std::shared_ptr<SharedRings> make(Link const& link, int leaders);

  SharedRings(SharedRings const&) = delete;
  SharedRings& operator=(SharedRings const&) = delete;
  // Hands the window on: every call through it is done on this process.
  ~SharedRings();

  // Leader l's counter of the pieces it made ready, and of the other process's pieces it
  // consumed, in process p's segment.
  [[nodiscard]] std::uint64_t* ready(int p, int l) const { return counter(p, 2 * l); }
  [[nodiscard]] std::uint64_t* consumed(int p, int l) const { return counter(p, 2 * l + 1); }
  // The slot of leader l's ring in process p's segment that holds its piece number `piece`.
  [[nodiscard]] float* slot(int p, int l, std::uint64_t piece) const {
    return reinterpret_cast<float*>(window_->base[p] + header_) +
           (static_cast<std::int64_t>(l) * slots + static_cast<std::int64_t>(piece % slots)) * kSlicePiece;
  }
  // Leader l's pieces before this call (used by its stream alone).
  [[nodiscard]] std::uint64_t& pieces(int l) { return pieces_[static_cast<std::size_t>(l)]; }

 private:
  SharedRings(Global::SharedWindow* window, std::int64_t header, int leaders)
      : window_(window), header_(header), pieces_(static_cast<std::size_t>(leaders)) {}

  // A new window of `bytes` per process over the two processes of `link`; null where they do not
  // share memory after all (a host's name may not tell).
  static Global::SharedWindow* allocate(Link const& link, std::pair<int, int> processes, std::int64_t bytes);

  // Counters a cache line apart, so that each is written by one process only.
  static constexpr std::int64_t kCounterBytes = 64;
  static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free, "shared counters need lock-free atomics");

  [[nodiscard]] std::uint64_t* counter(int p, int index) const {
    return reinterpret_cast<std::uint64_t*>(window_->base[p] + index * kCounterBytes);
  }

  Global::SharedWindow* window_;
  std::int64_t header_;
  std::vector<std::uint64_t> pieces_;
};

}  // namespace mgpu::dist::detail
