#include "parallel/peer_subset.hpp"

#include <set>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::parallel::detail {

PeerSubset::PeerSubset(comm::Communicator& parent, DeviceGroup& group, std::vector<int> ranks)
    : parent_(parent), group_(group), ranks_(std::move(ranks)) {
  if (ranks_.empty()) throw Error(Errc::invalid_argument, "a point-to-point subset over no ranks (expected at least one)");
  std::set<int> seen;
  int const first = parent_.first_rank();
  int last_local = -1;
  bool found = false;
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    int const r = ranks_[i];
    if (r < 0 || r >= parent_.size())
      throw Error(Errc::invalid_argument, "a point-to-point subset over rank " + std::to_string(r) + " (expected ranks in [0, " +
                                              std::to_string(parent_.size()) + "))");
    if (!seen.insert(r).second)
      throw Error(Errc::invalid_argument, "a point-to-point subset listing rank " + std::to_string(r) + " twice (expected distinct ranks)");
    if (r < first || r >= first + group_.size()) continue;
    if (found && last_local + 1 != static_cast<int>(i))
      throw Error(Errc::invalid_argument, "a point-to-point subset whose ranks of this process are apart (expected them next to each other)");
    if (!found) first_ = static_cast<int>(i);
    found = true;
    last_local = static_cast<int>(i);
  }
}

int PeerSubset::parent_rank(int rank, char const* call) const {
  if (rank < 0 || rank >= size())
    throw Error(Errc::invalid_argument, std::string("point-to-point subset ") + call + " on rank " + std::to_string(rank) +
                                            " (expected a rank in [0, " + std::to_string(size()) + "))");
  return ranks_[static_cast<std::size_t>(rank)];
}

void PeerSubset::unsupported(char const* call) const {
  throw Error(Errc::invalid_argument, std::string("point-to-point subset: ") + call +
                                          " (expected all_reduce with sum, send or recv: the others are not built)");
}

void PeerSubset::all_reduce(int rank, Tensor const& send, Tensor const& recv, comm::ReduceOp op, Stream& stream) {
  int const me = parent_rank(rank, "all_reduce");
  if (op != comm::ReduceOp::sum) unsupported("all_reduce with another operation than sum");
  if (send.numel() != recv.numel() || send.dtype() != recv.dtype())
    throw Error(Errc::invalid_argument, "point-to-point subset all_reduce of " + std::to_string(send.numel()) + " values into " +
                                            std::to_string(recv.numel()) + " (expected as many, of one type)");
  if (send.data() != recv.data()) copy_async(recv, send, stream);
  Tensor const& values = recv;
  if (rank != 0) {
    parent_.send(me, values, ranks_.front(), stream);
    parent_.recv(me, values, ranks_.front(), stream);
    return;
  }
  Allocator& allocator = group_.allocator(me - parent_.first_rank());
  bool const wide = values.dtype() == DType::float32;
  Tensor const sum = wide ? values : Tensor::empty(values.shape(), DType::float32, allocator);
  Tensor const other = Tensor::empty(values.shape(), values.dtype(), allocator);
  Tensor const other_wide = wide ? other : Tensor::empty(values.shape(), DType::float32, allocator);
  if (!wide) convert_async(sum, values, stream);
  for (std::size_t i = 1; i < ranks_.size(); ++i) {
    parent_.recv(me, other, ranks_[i], stream);
    if (!wide) convert_async(other_wide, other, stream);
    ops::add_scaled(sum, other_wide, 1.0f, stream);
  }
  if (!wide) convert_async(values, sum, stream);
  for (std::size_t i = 1; i < ranks_.size(); ++i) parent_.send(me, values, ranks_[i], stream);
}

void PeerSubset::send(int rank, Tensor const& send, int peer, Stream& stream) {
  parent_.send(parent_rank(rank, "send"), send, parent_rank(peer, "send to"), stream);
}

void PeerSubset::recv(int rank, Tensor const& recv, int peer, Stream& stream) {
  parent_.recv(parent_rank(rank, "recv"), recv, parent_rank(peer, "recv from"), stream);
}

void PeerSubset::reduce_scatter(int, Tensor const&, Tensor const&, comm::ReduceOp, Stream&) { unsupported("reduce_scatter"); }
void PeerSubset::all_gather(int, Tensor const&, Tensor const&, Stream&) { unsupported("all_gather"); }
void PeerSubset::broadcast(int, Tensor const&, int, Stream&) { unsupported("broadcast"); }
void PeerSubset::reduce(int, Tensor const&, Tensor const&, comm::ReduceOp, int, Stream&) { unsupported("reduce"); }
void PeerSubset::barrier(int, Stream&) { unsupported("barrier"); }
void PeerSubset::group_start(int rank) { parent_.group_start(parent_rank(rank, "group_start")); }
void PeerSubset::group_end(int rank) { parent_.group_end(parent_rank(rank, "group_end")); }

}  // namespace mgpu::parallel::detail
