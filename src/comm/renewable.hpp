// A communicator that can be made anew in place after a failure aborted it: layers and executors
// keep holding the same object, which forwards every call to the communicator its factory made
// last. For an executor whose step failed; across processes every process renews its
// communicators in the order it made them. It also times its calls on each stream when an executor
// asks, for the metrics' time waiting on collectives (set_timed). Internal: not installed.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/stream.hpp>

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
    timed(rank, stream, [&] { inner_->all_reduce(rank, send, recv, op, stream); });
  }
  void reduce_scatter(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) override {
    timed(rank, stream, [&] { inner_->reduce_scatter(rank, send, recv, op, stream); });
  }
  void all_gather(int rank, Tensor const& send, Tensor const& recv, Stream& stream) override {
    timed(rank, stream, [&] { inner_->all_gather(rank, send, recv, stream); });
  }
  void broadcast(int rank, Tensor const& buffer, int root, Stream& stream) override {
    timed(rank, stream, [&] { inner_->broadcast(rank, buffer, root, stream); });
  }
  void reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, int root, Stream& stream) override {
    timed(rank, stream, [&] { inner_->reduce(rank, send, recv, op, root, stream); });
  }
  void send(int rank, Tensor const& send, int peer, Stream& stream) override {
    timed(rank, stream, [&] { inner_->send(rank, send, peer, stream); });
  }
  void recv(int rank, Tensor const& recv, int peer, Stream& stream) override {
    timed(rank, stream, [&] { inner_->recv(rank, recv, peer, stream); });
  }
  void barrier(int rank, Stream& stream) override {
    timed(rank, stream, [&] { inner_->barrier(rank, stream); });
  }
  void group_start(int rank) override;
  void group_end(int rank) override;
  void abort(std::string_view reason) noexcept override { inner_->abort(reason); }
  bool aborted() const noexcept override { return inner_->aborted(); }
  void finalize() override { inner_->finalize(); }

  /// Timing for an executor's metrics: while on, every call is marked by an event on its stream
  /// before and after it (a group_start/group_end group as one call, from its first call's start
  /// to group_end), and seconds(stream) sums the marked time of the calls on `stream` since the
  /// last set_timed(): the time the stream spent in this communicator's collectives and
  /// transfers, waiting for peers and moving data. Turning it on or off forgets what was marked.
  /// Call between steps only, when no call is in flight.
  void set_timed(bool on);
  /// See set_timed(); read when the streams have finished the calls (synchronized). 0 for a
  /// stream that made no call.
  [[nodiscard]] double seconds(Stream const& stream) const;

 private:
  // One stream's marks: events [2k, 2k + 1) around its k-th call.
  struct Marks {
    std::vector<Event> events;
    std::size_t used = 0;
    Stream* group_stream = nullptr;  // a group's first call's stream, marked again at group_end
  };
  // Marks of `stream` (made on first use), or null when timing is off.
  Marks* marks_of(Stream const& stream);
  template <class Call>
  void timed(int rank, Stream& stream, Call&& call) {
    Marks* const m = timed_.load(std::memory_order_relaxed) ? marks_of(stream) : nullptr;
    if (m == nullptr || in_group(rank, m, stream)) {
      std::forward<Call>(call)();
      return;
    }
    mark(*m, stream);
    std::forward<Call>(call)();
    mark(*m, stream);
  }
  static void mark(Marks& m, Stream& stream);
  // Within a group of `rank`: whether one is open (the group's first call marks its start).
  bool in_group(int rank, Marks* m, Stream& stream);

  Make make_;
  std::unique_ptr<Communicator> inner_;
  std::atomic<bool> timed_{false};  // set between steps, read by the ranks' threads
  mutable std::mutex mutex_;  // guards the maps (each Marks is touched by its stream's thread only)
  std::map<Stream const*, Marks> marks_;
  std::map<int, std::pair<int, Marks*>> groups_;  // per rank: open group depth, the marks it opened
};

/// A renewable communicator over every rank of `group`, made by `make` (empty:
/// comm::make_communicator) with `options`, starting with `first` where given.
std::unique_ptr<Renewable> make_renewable(DeviceGroup& group,
                                          std::function<std::unique_ptr<Communicator>(DeviceGroup&, Options)> make,
                                          Options options, std::unique_ptr<Communicator> first = nullptr);

}  // namespace mgpu::comm::detail
