// A communicator that can be made anew in place after a failure aborted it: layers and executors
// keep holding the same object, which forwards every call to the communicator its factory made
// last. For an executor whose step failed; across processes every process renews its
// communicators in the order it made them. Internal: not installed.
#pragma once

#include <functional>
#include <memory>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>

namespace mgpu::comm::detail {

class Renewable final : public Communicator {
 public:
  using Make = std::function<std::unique_ptr<Communicator>()>;
  /// Throws Error(invalid_argument) when `make` makes no communicator.
  explicit Renewable(Make make);
  /// Starts with `first` (made as `make` makes them).
  Renewable(std::unique_ptr<Communicator> first, Make make);

  /// Drops the communicator and makes a new one. Call only when no rank has work of the old one
  /// in flight (every stream that used it synchronized). Throws as the factory does.
  void renew();

  int size() const noexcept override { return inner_->size(); }
  Backend backend() const noexcept override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const noexcept override { return inner_->timeout(); }
  int first_rank() const noexcept override { return inner_->first_rank(); }
  void all_reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) override {
    inner_->all_reduce(rank, send, recv, op, stream);
  }
  void reduce_scatter(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) override {
    inner_->reduce_scatter(rank, send, recv, op, stream);
  }
  void all_gather(int rank, Tensor const& send, Tensor const& recv, Stream& stream) override {
    inner_->all_gather(rank, send, recv, stream);
  }
  void broadcast(int rank, Tensor const& buffer, int root, Stream& stream) override { inner_->broadcast(rank, buffer, root, stream); }
  void reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, int root, Stream& stream) override {
    inner_->reduce(rank, send, recv, op, root, stream);
  }
  void send(int rank, Tensor const& send, int peer, Stream& stream) override { inner_->send(rank, send, peer, stream); }
  void recv(int rank, Tensor const& recv, int peer, Stream& stream) override { inner_->recv(rank, recv, peer, stream); }
  void barrier(int rank, Stream& stream) override { inner_->barrier(rank, stream); }
  void group_start(int rank) override { inner_->group_start(rank); }
  void group_end(int rank) override { inner_->group_end(rank); }
  void abort(std::string_view reason) noexcept override { inner_->abort(reason); }
  bool aborted() const noexcept override { return inner_->aborted(); }
  void finalize() override { inner_->finalize(); }

 private:
  Make make_;
  std::unique_ptr<Communicator> inner_;
};

/// A renewable communicator over every rank of `group`, made by `make` (empty:
/// comm::make_communicator) with `options`, starting with `first` where given.
std::unique_ptr<Renewable> make_renewable(DeviceGroup& group,
                                          std::function<std::unique_ptr<Communicator>(DeviceGroup&, Options)> make,
                                          Options options, std::unique_ptr<Communicator> first = nullptr);

}  // namespace mgpu::comm::detail
