// The all-reduce by slices between two processes with as many ranks each (internal: not
// installed): every local rank leads one slice of the buffer (SliceLeader), reducing its
// process's inputs, swapping its partial with the other process's leader of that slice (through
// shared memory on one host, else over MPI) and writing the combined slice into every local output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/comm/reduce_op.hpp>
#include <mgpu/core/tensor.hpp>

#include "comm/base.hpp"
#include "dist/link.hpp"
#include "dist/transport_shm.hpp"

namespace mgpu::dist::detail {

// What a local rank passes to an all-reduce by slices, for its process's slice leaders to read and
// write: posted on the rank's stream, read between two in-process barriers.
struct Posted {
  void const* send = nullptr;
  void* recv = nullptr;
  std::int64_t count = 0;
  DType dtype = DType::float32;
  comm::ReduceOp op = comm::ReduceOp::sum;
};

// One slice's all-reduce between two processes with as many ranks each, on the stream of the
// slice's leader (local rank `slice` of each process), between two in-process barriers: piece by
// piece, the leader reduces its process's ranks' inputs (`posted`) into its partial, swaps that
// with the other process's leader (through `rings` where the processes share a host, else over
// MPI) and writes both combined, in process order, into every local rank's output. Each element of
// the slice is read, sent and written by this leader alone.
struct SliceLeader {
  std::shared_ptr<Link> link;
  Call call;
  int rank;
  int first;  // the world rank of the process's first rank
  int slice;
  std::shared_ptr<std::vector<Posted>> posted;
  std::shared_ptr<SharedRings> rings;  // null: over MPI
  Tensor parts;                        // over MPI: float32, 2 slices: the processes' partials in process order
  std::int64_t begin;
  std::int64_t count;

  // Checks that every local rank posted the same count, dtype and op, then all-reduces elements
  // [begin, begin + count) of every posted buffer. Throws on a mismatch, a timeout or an MPI
  // failure, having aborted the communicator.
  void operator()() const;

 private:
  static constexpr comm::ReduceOp partial_op(comm::ReduceOp op) {
    return op == comm::ReduceOp::avg ? comm::ReduceOp::sum : op;
  }
  [[nodiscard]] std::int64_t length(std::int64_t k) const { return std::min(count - k * kSlicePiece, kSlicePiece); }

  template <class T, comm::ReduceOp O>
  void over_mpi(std::string const& what, Clock::time_point start, std::vector<T const*> const& in,
                std::vector<T*> const& out) const;

  // Up to SharedRings::slots pieces ahead of the combine, the leader reduces its pieces into its
  // ring once the other leader has consumed what the slot held; it combines each piece once the
  // other leader has made it ready.
  template <class T, comm::ReduceOp O>
  void through_rings(std::string const& what, Clock::time_point start, std::vector<T const*> const& in,
                     std::vector<T*> const& out) const;
};

}  // namespace mgpu::dist::detail
