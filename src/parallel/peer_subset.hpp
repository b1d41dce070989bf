// A communicator over some ranks of another, through that one's sends and receives: where no
// communicator over a subset of the world's ranks can be made (CUDA GPUs across processes), e.g. a
// pipeline's replicas' gradient sum over its transfers' communicator. Internal: not installed.
#pragma once

#include <chrono>
#include <string_view>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::parallel::detail {

/// Rank i is `parent`'s rank ranks[i]; `group` holds this process's ranks of `parent` (its rank
/// parent.first_rank() + l is group rank l), whose allocators hold the sum's buffers. This
/// process's ranks must be next to each other in `ranks`. all_reduce with ReduceOp::sum: the first
/// rank adds the others' values in rank order in float32, rounding to the values' type once, and
/// sends the sum back, so every rank holds the same bits. send and recv go to the parent. Other
/// collectives throw Error(invalid_argument). Abort and its state are the parent's, whose
/// operations carry the sums. `parent` and `group` must outlive it.
class PeerSubset final : public comm::Communicator {
 public:
  /// Throws Error(invalid_argument) for no ranks, a repeated or out-of-range one, or this
  /// process's ranks apart.
  PeerSubset(comm::Communicator& parent, DeviceGroup& group, std::vector<int> ranks);

  [[nodiscard]] int size() const noexcept override { return static_cast<int>(ranks_.size()); }
  [[nodiscard]] comm::Backend backend() const noexcept override { return parent_.backend(); }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept override { return parent_.timeout(); }
  /// The index in ranks of this process's first rank (0 when it has none).
  [[nodiscard]] int first_rank() const noexcept override { return first_; }

  void all_reduce(int rank, Tensor const& send, Tensor const& recv, comm::ReduceOp op, Stream& stream) override;
  void reduce_scatter(int rank, Tensor const& send, Tensor const& recv, comm::ReduceOp op, Stream& stream) override;
  void all_gather(int rank, Tensor const& send, Tensor const& recv, Stream& stream) override;
  void broadcast(int rank, Tensor const& buffer, int root, Stream& stream) override;
  void reduce(int rank, Tensor const& send, Tensor const& recv, comm::ReduceOp op, int root, Stream& stream) override;
  void send(int rank, Tensor const& send, int peer, Stream& stream) override;
  void recv(int rank, Tensor const& recv, int peer, Stream& stream) override;
  void barrier(int rank, Stream& stream) override;
  void group_start(int rank) override;
  void group_end(int rank) override;
  void abort(std::string_view reason) noexcept override { parent_.abort(reason); }
  [[nodiscard]] bool aborted() const noexcept override { return parent_.aborted(); }
  void finalize() override {}  // the parent's operations: its owner finalizes it

 private:
  // The parent's rank of `rank` (checked).
  [[nodiscard]] int parent_rank(int rank, char const* call) const;
  [[noreturn]] void unsupported(char const* call) const;

  comm::Communicator& parent_;
  DeviceGroup& group_;
  std::vector<int> ranks_;
  int first_ = 0;
};

}  // namespace mgpu::parallel::detail
