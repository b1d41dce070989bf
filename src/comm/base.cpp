// CommunicatorBase and SharedState: argument checks, numbering, groups, abort and finalize.
#include "comm/base.hpp"

#include <cstdlib>
#include <exception>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>

namespace mgpu::comm::detail {

std::string_view to_string(OpKind kind) noexcept {
  switch (kind) {
    case OpKind::all_reduce: return "all_reduce";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::all_gather: return "all_gather";
    case OpKind::broadcast: return "broadcast";
    case OpKind::reduce: return "reduce";
    case OpKind::send: return "send";
    case OpKind::recv: return "recv";
    case OpKind::barrier: return "barrier";
  }
  return "unknown";
}

std::string Call::name(int rank) const {
  std::string text = "rank " + std::to_string(rank) + " " + std::string(to_string(kind)) + " #" + std::to_string(seq);
  if (kind == OpKind::send) text += " to rank " + std::to_string(root);
  if (kind == OpKind::recv) text += " from rank " + std::to_string(root);
  return text;
}

void SharedState::abort(std::string_view reason) noexcept {
  try {
    std::lock_guard lock(mutex_);
    if (aborted_.load(std::memory_order_relaxed)) return;
    reason_ = std::string(reason);
    aborted_.store(true, std::memory_order_release);
  } catch (...) {
    if (aborted_.exchange(true, std::memory_order_acq_rel)) return;  // the reason could not be kept; the state still changes
  }
  {
    // Held while they run, so clear_wakers() returns only after any running waker has finished. A
    // waker that aborts again returns above, before this lock.
    std::lock_guard wake_lock(wake_mutex_);
    for (auto const& wake : wakers_) wake();
  }
  std::lock_guard lock(mutex_);
  idle_cv_.notify_all();
}
std::string SharedState::reason() const {
  std::lock_guard lock(mutex_);
  return reason_;
}

void SharedState::throw_if_aborted(std::string_view what) const {
  if (aborted())
    throw Error(Errc::communication, std::string(what) + ": the communicator was aborted: " + reason());
}

void SharedState::on_abort(std::function<void()> wake) {
  std::lock_guard lock(wake_mutex_);
  wakers_.push_back(std::move(wake));
}

void SharedState::clear_wakers() noexcept {
  std::lock_guard lock(wake_mutex_);
  wakers_.clear();
}

void SharedState::begin_operation() noexcept {
  std::lock_guard lock(mutex_);
  ++in_flight_;
}

void SharedState::end_operation() noexcept {
  std::lock_guard lock(mutex_);
  if (--in_flight_ == 0) idle_cv_.notify_all();
}

bool SharedState::wait_idle(std::chrono::milliseconds limit) {
  std::unique_lock lock(mutex_);
  return idle_cv_.wait_for(lock, limit, [&] { return in_flight_ == 0; });
}

CommunicatorBase::CommunicatorBase(DeviceGroup& group, Backend backend, std::chrono::milliseconds timeout)
    : CommunicatorBase(group, group.size(), backend, timeout) {}

CommunicatorBase::CommunicatorBase(DeviceGroup& group, int size, Backend backend, std::chrono::milliseconds timeout)
    : group_(&group),
      backend_(backend),
      state_(std::make_shared<SharedState>(size, timeout)),
      ranks_(static_cast<std::size_t>(size)) {
  for (auto& r : ranks_) {
    r.sent.assign(ranks_.size(), 0);
    r.received.assign(ranks_.size(), 0);
  }
  listener_ = group.add_failure_listener([state = state_](int rank, std::string const& message) {
    state->abort("rank " + std::to_string(rank) + " failed: " + message);
  });
}

CommunicatorBase::~CommunicatorBase() { shut_down(); }

void CommunicatorBase::shut_down() noexcept {
  if (shut_down_) return;
  shut_down_ = true;
  group_->remove_failure_listener(listener_);
  // Let enqueued work finish; if it cannot within the deadline, abort so that it ends.
  try {
    if (!state_->wait_idle(state_->timeout())) {
      state_->abort("the communicator was destroyed with operations in flight");
    } else if (!state_->aborted()) {
      finish_device_work(state_->timeout());
    }
  } catch (std::exception const& e) {
    state_->abort(std::string("destroying the communicator failed: ") + e.what());
  }
  // Work that outlives the communicator may still abort the shared state: it must not reach the
  // backend's wakers, which point into the backend.
  state_->clear_wakers();
}

void CommunicatorBase::reject(Call const& call, int rank, std::string const& what) {
  std::string const message = call.name(rank) + ": " + what;
  state_->abort(message);  // the other ranks would wait for this call forever
  throw Error(Errc::invalid_argument, message);
}

void CommunicatorBase::check_tensor(int rank, Tensor const& t, std::string_view role, Call const& call) {
  if (!t.defined()) reject(call, rank, std::string(role) + " is an undefined tensor (expected a tensor from Tensor::empty)");
  if (t.dtype() == DType::int32) reject(call, rank, std::string(role) + " is int32 (expected float32, bfloat16 or float16)");
  if (t.dtype() != call.dtype)
    reject(call, rank, std::string(role) + " is " + std::string(mgpu::to_string(t.dtype())) + " (expected " +
                           std::string(mgpu::to_string(call.dtype)) + ", the send buffer's dtype)");
  check_device(rank, t.device(), role, call);
}

void CommunicatorBase::submit(int rank, Call call, Stream& stream) {
  check_device(rank, stream.device(), "the stream", call);
  if (state_->aborted()) state_->throw_if_aborted(call.name(rank));  // names the call only when it must
  RankState& r = ranks_[static_cast<std::size_t>(rank)];
  if (r.in_group) {
    if (r.group_stream != nullptr && r.group_stream != &stream)
      reject(call, rank, "a group's operations use different streams (expected one stream per group)");
    r.group_stream = &stream;
    r.grouped.push_back(std::move(call));
    return;
  }
  std::vector<Call> calls;
  calls.push_back(std::move(call));
  launch(rank, std::move(calls), stream);
}

namespace {
void check_rank_index(int rank, int size, OpKind kind) {
  if (rank < 0 || rank >= size)
    throw Error(Errc::invalid_argument, std::string(to_string(kind)) + " called as rank " + std::to_string(rank) +
                                            " (expected a rank in [0, " + std::to_string(size) + "))");
}
}  // namespace

void CommunicatorBase::all_reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) {
  check_rank_index(rank, size(), OpKind::all_reduce);
  Call call{OpKind::all_reduce, ranks_[static_cast<std::size_t>(rank)].collectives++, send, recv, op, 0, send.numel(), send.dtype()};
  check_tensor(rank, send, "send", call);
  check_tensor(rank, recv, "recv", call);
  if (recv.numel() != send.numel())
    reject(call, rank, "recv has " + std::to_string(recv.numel()) + " elements (expected " + std::to_string(send.numel()) + ", as send)");
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::reduce_scatter(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) {
  check_rank_index(rank, size(), OpKind::reduce_scatter);
  Call call{OpKind::reduce_scatter, ranks_[static_cast<std::size_t>(rank)].collectives++, send, recv, op, 0, recv.numel(), send.dtype()};
  check_tensor(rank, send, "send", call);
  check_tensor(rank, recv, "recv", call);
  if (send.numel() != recv.numel() * size())
    reject(call, rank, "send has " + std::to_string(send.numel()) + " elements (expected " + std::to_string(size()) +
                           " ranks x " + std::to_string(recv.numel()) + " recv elements = " +
                           std::to_string(recv.numel() * size()) + ")");
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::all_gather(int rank, Tensor const& send, Tensor const& recv, Stream& stream) {
  check_rank_index(rank, size(), OpKind::all_gather);
  Call call{OpKind::all_gather, ranks_[static_cast<std::size_t>(rank)].collectives++, send, recv, ReduceOp::sum, 0, send.numel(), send.dtype()};
  check_tensor(rank, send, "send", call);
  check_tensor(rank, recv, "recv", call);
  if (recv.numel() != send.numel() * size())
    reject(call, rank, "recv has " + std::to_string(recv.numel()) + " elements (expected " + std::to_string(size()) +
                           " ranks x " + std::to_string(send.numel()) + " send elements = " +
                           std::to_string(send.numel() * size()) + ")");
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::broadcast(int rank, Tensor const& buffer, int root, Stream& stream) {
  check_rank_index(rank, size(), OpKind::broadcast);
  Call call{OpKind::broadcast, ranks_[static_cast<std::size_t>(rank)].collectives++, buffer, buffer, ReduceOp::sum, root, buffer.numel(), buffer.dtype()};
  check_tensor(rank, buffer, "buffer", call);
  if (root < 0 || root >= size())
    reject(call, rank, "root " + std::to_string(root) + " (expected a rank in [0, " + std::to_string(size()) + "))");
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, int root, Stream& stream) {
  check_rank_index(rank, size(), OpKind::reduce);
  Call call{OpKind::reduce, ranks_[static_cast<std::size_t>(rank)].collectives++, send, recv, op, root, send.numel(), send.dtype()};
  check_tensor(rank, send, "send", call);
  if (root < 0 || root >= size())
    reject(call, rank, "root " + std::to_string(root) + " (expected a rank in [0, " + std::to_string(size()) + "))");
  if (rank == root) {
    check_tensor(rank, recv, "recv", call);
    if (recv.numel() != send.numel())
      reject(call, rank, "recv has " + std::to_string(recv.numel()) + " elements (expected " + std::to_string(send.numel()) + ", as send)");
  }
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::send(int rank, Tensor const& send, int peer, Stream& stream) {
  check_rank_index(rank, size(), OpKind::send);
  std::uint64_t const seq = (peer >= 0 && peer < size()) ? ranks_[static_cast<std::size_t>(rank)].sent[static_cast<std::size_t>(peer)]++ : 0;
  Call call{OpKind::send, seq, send, Tensor{}, ReduceOp::sum, peer, send.numel(), send.dtype()};
  check_tensor(rank, send, "send", call);
  if (peer < 0 || peer >= size() || peer == rank)
    reject(call, rank, "peer " + std::to_string(peer) + " (expected another rank in [0, " + std::to_string(size()) + "))");
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::recv(int rank, Tensor const& recv, int peer, Stream& stream) {
  check_rank_index(rank, size(), OpKind::recv);
  std::uint64_t const seq = (peer >= 0 && peer < size()) ? ranks_[static_cast<std::size_t>(rank)].received[static_cast<std::size_t>(peer)]++ : 0;
  Call call{OpKind::recv, seq, Tensor{}, recv, ReduceOp::sum, peer, recv.numel(), recv.dtype()};
  check_tensor(rank, recv, "recv", call);
  if (peer < 0 || peer >= size() || peer == rank)
    reject(call, rank, "peer " + std::to_string(peer) + " (expected another rank in [0, " + std::to_string(size()) + "))");
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::barrier(int rank, Stream& stream) {
  check_rank_index(rank, size(), OpKind::barrier);
  Call call{OpKind::barrier, ranks_[static_cast<std::size_t>(rank)].collectives++, Tensor{}, Tensor{}, ReduceOp::sum, 0, 0, DType::float32};
  submit(rank, std::move(call), stream);
}

void CommunicatorBase::group_start(int rank) {
  check_rank_index(rank, size(), OpKind::barrier);
  RankState& r = ranks_[static_cast<std::size_t>(rank)];
  if (r.in_group)
    throw Error(Errc::invalid_argument, "group_start on rank " + std::to_string(rank) + " inside a group (expected group_end first)");
  r.in_group = true;
  r.group_stream = nullptr;
  r.grouped.clear();
}

void CommunicatorBase::group_end(int rank) {
  check_rank_index(rank, size(), OpKind::barrier);
  RankState& r = ranks_[static_cast<std::size_t>(rank)];
  if (!r.in_group)
    throw Error(Errc::invalid_argument, "group_end on rank " + std::to_string(rank) + " without group_start (expected group_start first)");
  r.in_group = false;
  if (r.grouped.empty()) return;
  launch(rank, std::exchange(r.grouped, {}), *r.group_stream);
}

void CommunicatorBase::finalize() {
  if (!state_->wait_idle(state_->timeout() * 2)) {
    state_->abort("finalize waited " + format_duration(state_->timeout() * 2) + " for operations in flight");
  } else if (!state_->aborted()) {
    finish_device_work(state_->timeout() * 2);
  }
  if (!state_->aborted()) {  // an eager send completes without its recv: one that never came is lost data
    for (std::size_t from = 0; from < ranks_.size(); ++from) {
      for (std::size_t to = 0; to < ranks_.size(); ++to) {
        if (!drives(static_cast<int>(from)) || !drives(static_cast<int>(to))) continue;
        std::uint64_t const sent = ranks_[from].sent[to];
        std::uint64_t const received = ranks_[to].received[from];
        if (sent > received)
          state_->abort("rank " + std::to_string(from) + " sent " + std::to_string(sent - received) + " message(s) to rank " +
                        std::to_string(to) + " that it never received (expected a matching recv for every send)");
      }
    }
  }
  state_->throw_if_aborted("finalize");
}

}  // namespace mgpu::comm::detail
