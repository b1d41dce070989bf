// CommunicatorBase: what every backend shares — argument checks, call numbering, groups, the
// aborted state, the deadline, and aborting when a rank of the group fails. Backends implement
// launch(), which enqueues a rank's calls on its stream.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <functional>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/deadline.hpp>

namespace mgpu::comm::detail {

enum class OpKind : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, reduce, send, recv, barrier };

std::string_view to_string(OpKind kind) noexcept;

/// One rank's call of one operation, checked and numbered.
struct Call {
  OpKind kind = OpKind::barrier;
  std::uint64_t seq = 0;     // collectives: the rank's n-th collective; send/recv: n-th with that peer
  Tensor send;               // input (all_reduce, reduce_scatter, all_gather, reduce, send, broadcast)
  Tensor recv;               // output (all_reduce, reduce_scatter, all_gather, reduce, recv, broadcast)
  ReduceOp op = ReduceOp::sum;
  int root = 0;              // broadcast/reduce root, or send/recv peer
  std::int64_t count = 0;    // elements per rank: all_reduce/reduce/broadcast/send/recv: all of them
  DType dtype = DType::float32;

  [[nodiscard]] std::string name(int rank) const;
};

/// The state shared by a communicator and the work it enqueued (which may outlive it).
class SharedState {
 public:
  explicit SharedState(int size, std::chrono::milliseconds timeout) : size_(size), timeout_(timeout) {}

  void abort(std::string_view reason) noexcept;
  [[nodiscard]] bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }
  [[nodiscard]] std::string reason() const;
  /// Throws Error(communication) naming `what` if aborted.
  void throw_if_aborted(std::string_view what) const;
  /// Registers a function called (once) on abort, to wake a backend's waiters.
  void on_abort(std::function<void()> wake);
  /// Forgets every on_abort function; returns once none of them runs any more.
  void clear_wakers() noexcept;

  void begin_operation() noexcept;
  void end_operation() noexcept;
  /// Waits until no operation is in flight, or `limit` has passed; true if none is.
  bool wait_idle(std::chrono::milliseconds limit);

  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 private:
  int size_;
  std::chrono::milliseconds timeout_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex mutex_;
  std::condition_variable idle_cv_;
  std::string reason_;
  std::mutex wake_mutex_;  // guards wakers_, held while they run
  std::vector<std::function<void()>> wakers_;
  std::int64_t in_flight_ = 0;
};

/// Durations in messages: core's format_duration (mgpu/core/deadline.hpp).
using mgpu::format_duration;

class CommunicatorBase : public Communicator {
 public:
  CommunicatorBase(DeviceGroup& group, Backend backend, std::chrono::milliseconds timeout);
  /// Over `size` of the group's ranks (a subset communicator); any failing rank of the group aborts it.
  CommunicatorBase(DeviceGroup& group, int size, Backend backend, std::chrono::milliseconds timeout);
  ~CommunicatorBase() override;

  [[nodiscard]] int size() const noexcept final { return state_->size(); }
  [[nodiscard]] Backend backend() const noexcept final { return backend_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept final { return state_->timeout(); }

  void all_reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) final;
  void reduce_scatter(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) final;
  void all_gather(int rank, Tensor const& send, Tensor const& recv, Stream& stream) final;
  void broadcast(int rank, Tensor const& buffer, int root, Stream& stream) final;
  void reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, int root, Stream& stream) final;
  void send(int rank, Tensor const& send, int peer, Stream& stream) final;
  void recv(int rank, Tensor const& recv, int peer, Stream& stream) final;
  void barrier(int rank, Stream& stream) final;
  void group_start(int rank) final;
  void group_end(int rank) final;
  void abort(std::string_view reason) noexcept final { state_->abort(reason); }
  [[nodiscard]] bool aborted() const noexcept final { return state_->aborted(); }
  void finalize() final;

 protected:
  /// Enqueues a rank's calls (one, or a whole group) on its stream.
  virtual void launch(int rank, std::vector<Call> calls, Stream& stream) = 0;
  /// Called by finalize() once no operation is being enqueued: waits, at most `limit`, for the
  /// device work of every operation enqueued so far, and aborts the communicator when it does not
  /// finish in time. Backends whose operations run on after launch() returns override it.
  virtual void finish_device_work(std::chrono::milliseconds limit) { (void)limit; }
  /// Ends the communicator while its backend is still whole: stops listening to the group's
  /// failures, waits (with the deadline) for operations being enqueued and then, unless aborted,
  /// for their device work (finish_device_work), aborting when either does not finish, and drops
  /// the backend's on_abort functions, which the shared state may outlive. Backends that register
  /// on_abort functions or whose device work outlives launch() call it first in their destructor;
  /// the base destructor calls it too. Only the first call acts.
  void shut_down() noexcept;
  /// Whether this process drives `rank` (a communicator across processes drives only its own
  /// ranks): finalize() checks that every send was received only between ranks it drives.
  [[nodiscard]] virtual bool drives(int rank) const noexcept {
    (void)rank;
    return true;
  }
  /// Checks that a tensor (or stream) of `rank` is somewhere this backend can use.
  virtual void check_device(int rank, Device device, std::string_view what, Call const& call) const = 0;

  [[nodiscard]] DeviceGroup& group() const noexcept { return *group_; }
  [[nodiscard]] std::shared_ptr<SharedState> const& state() const noexcept { return state_; }

 private:
  struct RankState {
    std::uint64_t collectives = 0;
    std::vector<std::uint64_t> sent;      // per peer
    std::vector<std::uint64_t> received;  // per peer
    bool in_group = false;
    std::vector<Call> grouped;
    Stream* group_stream = nullptr;
  };

  void submit(int rank, Call call, Stream& stream);
  [[noreturn]] void reject(Call const& call, int rank, std::string const& what);
  void check_tensor(int rank, Tensor const& t, std::string_view role, Call const& call);

  DeviceGroup* group_;
  Backend backend_;
  std::shared_ptr<SharedState> state_;
  std::vector<RankState> ranks_;
  int listener_ = -1;
  bool shut_down_ = false;
};

}  // namespace mgpu::comm::detail
