// The host backend: one participant per host device, all in one process. Ranks meet at counting
// barriers (poll briefly, yielding the core, then block, always with a deadline); each rank then reduces its 1/N slice
// straight from every peer's buffer and writes it into every peer's output, so each input is read
// once and each output written once. A small send is eager: it copies its data into the
// channel and completes without waiting for the receive.
#include "comm/host_communicator.hpp"
#include "core/backend.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include <mgpu/core/detail/reduce_slice.hpp>
#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/error.hpp>


namespace mgpu::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;

// A send on a point-to-point channel, waiting for its receive. An eager send owns a copy of its
// data (`copy`), is freed by the receive, and its sender does not wait; otherwise the receive
// copies from the sender's buffer and sets `taken`, which the sender waits for.
struct Message {
  void const* data;
  std::int64_t count;
  DType dtype;
  std::uint64_t seq;
  bool taken = false;  // set under the channel's mutex; read without it (atomic_ref) while spinning
  std::unique_ptr<std::byte[]> copy;
};

// Eager sends: a send of at most this many bytes copies its data and completes at once while its
// channel holds no more than this many bytes of eager messages (as NCCL's default 4 MiB buffer
// per peer), so a sender never waits for the receiver's turn on small messages; past that, the
// sender waits for its receive (rendezvous), which bounds what a channel holds.
constexpr std::size_t eager_bytes = std::size_t{4} << 20;

struct Channel {
  Channel() = default;
  Channel(Channel const&) = delete;
  Channel& operator=(Channel const&) = delete;
  ~Channel() {
    for (Message* m : queue) {
      if (m->copy) delete m;  // an eager send nobody received (the communicator was aborted)
    }
  }

  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Message*> queue;
  std::size_t eager_held = 0;  // bytes of the eager messages in `queue`
  std::atomic<std::size_t> queued{0};  // queue.size(), changed under `mutex`, read while spinning
};

}  // namespace

// Everything the enqueued work of a host communicator shares.
class HostState {
 public:
  HostState(int size, std::shared_ptr<SharedState> shared)
      : n_(size),
        shared_(std::move(shared)),
        posted_(static_cast<std::size_t>(size)),
        reached_(static_cast<std::size_t>(size)),
        barriers_(static_cast<std::size_t>(size), 0),
        channels_(static_cast<std::size_t>(size * size)) {
    for (auto& r : reached_) r.store(0);
  }

  void wake_all() {
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
    for (auto& c : channels_) {
      { std::lock_guard lock(c.mutex); }
      c.cv.notify_all();
    }
  }

  // Runs one rank's calls: sends are posted first and awaited last, so a group's sends and
  // receives cannot block each other.
  void execute(int rank, std::vector<Call> const& calls) {
    std::vector<std::pair<Message, Call const*>> sends;  // the rendezvous sends (none, usually: no allocation)
    for (Call const& c : calls) {
      if (c.kind == OpKind::send && !post_eager(rank, c)) sends.push_back({Message{c.send.data(), c.count, c.dtype, c.seq, false, nullptr}, &c});
    }
    for (auto& [message, call] : sends) post(rank, call->root, message);
    try {
      for (Call const& c : calls) {
        if (c.kind == OpKind::recv) {
          receive(rank, c);
        } else if (c.kind != OpKind::send) {
          collective(rank, c);
        }
      }
      for (auto& [message, call] : sends) await_taken(rank, *call, message);
    } catch (...) {
      for (auto& [message, call] : sends) withdraw(rank, call->root, message);
      throw;
    }
  }

 private:
  struct Posted {
    OpKind kind;
    std::uint64_t seq;
    std::int64_t count;
    DType dtype;
    ReduceOp op;
    int root;
    void const* send;
    void* recv;
  };

  Channel& channel(int from, int to) { return channels_[static_cast<std::size_t>(from * n_ + to)]; }

  // Polls for a moment until ready() holds, calling check() now and then; false if it did not. A
  // thread woken from sleep costs tens of microseconds, which a short wait would otherwise pay each
  // time. The core is yielded between polls: when it is free, this is a spin; when other threads
  // want it (more ranks than cores, or the ranks' compute streams beside their communication
  // streams), they run instead of a waiting rank burning it.
  template <class Ready, class Check>
  bool spin(Ready const& ready, Check const& check) const {
    auto const start = Clock::now();
    while (Clock::now() - start < std::chrono::microseconds(100)) {
      for (int k = 0; k < 64; ++k) {
        if (ready()) return true;
        std::this_thread::yield();
      }
      check();
    }
    return false;
  }

  // Waits until ready() holds or the deadline passes, polling first. On timeout, aborts with a
  // message naming what `missing()` reports.
  template <class Ready, class Missing>
  void wait(std::string const& what, Ready const& ready, Missing const& missing) {
    auto const start = Clock::now();
    if (spin(ready, [&] { shared_->throw_if_aborted(what); })) return;
    auto const deadline = start + shared_->timeout();
    std::unique_lock lock(mutex_);
    while (!ready()) {
      shared_->throw_if_aborted(what);
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !ready()) {
        std::string const message = what + " waited " + format_duration(Clock::now() - start) + " for " + missing();
        lock.unlock();
        shared_->abort(message);
        throw Error(Errc::timeout, message + " (expected them within the " + format_duration(shared_->timeout()) +
                                       " deadline; " + timeout_env_var + " sets it in seconds)");
      }
    }
  }

  void barrier(int rank, std::string const& what) {
    std::uint64_t const index = ++barriers_[static_cast<std::size_t>(rank)];
    reached_[static_cast<std::size_t>(rank)].store(index, std::memory_order_release);
    std::uint64_t const target = index * static_cast<std::uint64_t>(n_);
    if (arrivals_.fetch_add(1, std::memory_order_acq_rel) + 1 >= target) {
      { std::lock_guard lock(mutex_); }
      cv_.notify_all();
      return;
    }
    wait(
        what, [&] { return arrivals_.load(std::memory_order_acquire) >= target; },
        [&] {
          std::string ranks;
          for (int p = 0; p < n_; ++p) {
            if (reached_[static_cast<std::size_t>(p)].load() < index) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
          }
          return "rank(s) " + ranks;
        });
  }

  [[noreturn]] void mismatch(int rank, Call const& c, int other, std::string const& field, std::string const& mine,
                             std::string const& theirs) {
    std::string const message = c.name(rank) + ": rank " + std::to_string(other) + " passed " + field + " " + theirs +
                                ", rank " + std::to_string(rank) + " passed " + mine +
                                " (expected the same on every rank)";
    shared_->abort(message);
    throw Error(Errc::invalid_argument, message);
  }

  void check_match(int rank, Call const& c) {
    Posted const& me = posted_[static_cast<std::size_t>(rank)];
    for (int p = 0; p < n_; ++p) {
      Posted const& other = posted_[static_cast<std::size_t>(p)];
      if (other.kind != me.kind)
        mismatch(rank, c, p, "operation", std::string(to_string(me.kind)), std::string(to_string(other.kind)));
      if (other.count != me.count)
        mismatch(rank, c, p, "element count", std::to_string(me.count), std::to_string(other.count));
      if (other.dtype != me.dtype)
        mismatch(rank, c, p, "dtype", std::string(mgpu::to_string(me.dtype)), std::string(mgpu::to_string(other.dtype)));
      if (other.op != me.op) mismatch(rank, c, p, "reduce op", std::string(to_string(me.op)), std::string(to_string(other.op)));
      if (other.root != me.root) mismatch(rank, c, p, "root", std::to_string(me.root), std::to_string(other.root));
    }
  }

  template <Element T>
  void compute(int rank, Posted const& me) {
    auto const slice = [&](std::int64_t total) {
      std::int64_t const base = total / n_;
      std::int64_t const extra = total % n_;
      std::int64_t const begin = rank * base + std::min<std::int64_t>(rank, extra);
      return std::pair{begin, begin + base + (rank < extra ? 1 : 0)};
    };
    switch (me.kind) {
      case OpKind::all_reduce:
      case OpKind::reduce: {
        // Plain variables, not a structured binding: Clang before 16 cannot capture those.
        std::int64_t const begin = slice(me.count).first;
        std::int64_t const end = slice(me.count).second;
        mgpu::detail::visit_reduce_op(me.op, [&]<ReduceOp O>(std::integral_constant<ReduceOp, O>) {
          std::vector<T const*> in(static_cast<std::size_t>(n_));
          for (int p = 0; p < n_; ++p) in[static_cast<std::size_t>(p)] = static_cast<T const*>(posted_[static_cast<std::size_t>(p)].send);
          std::vector<T*> out;
          if (me.kind == OpKind::reduce) {
            out.push_back(static_cast<T*>(posted_[static_cast<std::size_t>(me.root)].recv));
          } else {
            for (int p = 0; p < n_; ++p) out.push_back(static_cast<T*>(posted_[static_cast<std::size_t>(p)].recv));
          }
          mgpu::detail::reduce_slice_host<T, O>({in, out}, begin, end);
        });
        break;
      }
      case OpKind::reduce_scatter: {
        mgpu::detail::visit_reduce_op(me.op, [&]<ReduceOp O>(std::integral_constant<ReduceOp, O>) {
          std::vector<T const*> in(static_cast<std::size_t>(n_));
          for (int p = 0; p < n_; ++p)
            in[static_cast<std::size_t>(p)] = static_cast<T const*>(posted_[static_cast<std::size_t>(p)].send) + rank * me.count;
          T* const out = static_cast<T*>(me.recv);
          mgpu::detail::reduce_slice_host<T, O>({in, std::span<T* const>(&out, 1)}, 0, me.count);
        });
        break;
      }
      case OpKind::all_gather:
        for (int p = 0; p < n_; ++p) {
          T* const to = static_cast<T*>(me.recv) + p * me.count;
          void const* const from = posted_[static_cast<std::size_t>(p)].send;
          if (to != from) std::memcpy(to, from, static_cast<std::size_t>(me.count) * sizeof(T));  // in place: already there
        }
        break;
      case OpKind::broadcast:
        if (rank != me.root)
          std::memcpy(me.recv, posted_[static_cast<std::size_t>(me.root)].send, static_cast<std::size_t>(me.count) * sizeof(T));
        break;
      default:
        break;
    }
  }

  void throw_if_aborted(int rank, Call const& c) const {
    if (shared_->aborted()) shared_->throw_if_aborted(c.name(rank));
  }

  void collective(int rank, Call const& c) {
    std::string const what = c.name(rank);
    shared_->throw_if_aborted(what);
    posted_[static_cast<std::size_t>(rank)] = {c.kind, c.seq, c.count, c.dtype, c.op, c.root, c.send.data(), c.recv.data()};
    barrier(rank, what);  // everyone has posted
    check_match(rank, c);
    if (c.count > 0) {
      mgpu::detail::visit_dtype(c.dtype, [&]<class T>(std::type_identity<T>) { compute<T>(rank, posted_[static_cast<std::size_t>(rank)]); });
    }
    barrier(rank, what);  // everyone is done with everyone's buffers
  }

  void post(int rank, int peer, Message& message) {
    Channel& ch = channel(rank, peer);
    {
      std::lock_guard lock(ch.mutex);
      ch.queue.push_back(&message);
      ch.queued.store(ch.queue.size(), std::memory_order_release);
    }
    ch.cv.notify_all();
  }

  // Posts `c` as an eager send if it is small enough and its channel has room; false if not.
  bool post_eager(int rank, Call const& c) {
    auto const bytes = static_cast<std::size_t>(c.count) * size_of(c.dtype);
    if (bytes > eager_bytes) return false;
    Channel& ch = channel(rank, c.root);
    {
      std::lock_guard lock(ch.mutex);
      if (ch.eager_held + bytes > eager_bytes) return false;
      ch.eager_held += bytes;
    }
    std::unique_ptr<Message> message;
    try {
      message = std::make_unique<Message>(Message{nullptr, c.count, c.dtype, c.seq, false, std::make_unique_for_overwrite<std::byte[]>(bytes)});
    } catch (...) {
      std::lock_guard lock(ch.mutex);
      ch.eager_held -= bytes;
      throw;
    }
    if (bytes > 0) std::memcpy(message->copy.get(), c.send.data(), bytes);
    message->data = message->copy.get();
    post(rank, c.root, *message.release());  // the receive frees it
    return true;
  }

  void withdraw(int rank, int peer, Message& message) noexcept {
    Channel& ch = channel(rank, peer);
    std::lock_guard lock(ch.mutex);
    std::erase(ch.queue, &message);
    ch.queued.store(ch.queue.size(), std::memory_order_release);
  }

  // Point-to-point waits spin briefly first, as collectives do; the call's name (a string) is
  // made only when it is needed for an error.
  void await_taken(int rank, Call const& c, Message& message) {
    Channel& ch = channel(rank, c.root);
    auto const start = Clock::now();
    auto const taken = [&] { return std::atomic_ref(message.taken).load(std::memory_order_acquire); };
    if (spin(taken, [&] { throw_if_aborted(rank, c); })) return;
    std::unique_lock lock(ch.mutex);
    while (!taken()) {
      throw_if_aborted(rank, c);
      if (ch.cv.wait_until(lock, start + shared_->timeout()) == std::cv_status::timeout && !taken()) {
        std::string const text = c.name(rank) + " waited " + format_duration(Clock::now() - start) + " for rank " +
                                 std::to_string(c.root) + " to receive it";
        lock.unlock();
        shared_->abort(text);
        throw Error(Errc::timeout, text + " (expected a matching recv within the " + format_duration(shared_->timeout()) + " deadline)");
      }
    }
  }

  void receive(int rank, Call const& c) {
    Channel& ch = channel(c.root, rank);
    auto const start = Clock::now();
    spin([&] { return ch.queued.load(std::memory_order_acquire) > 0; }, [&] { throw_if_aborted(rank, c); });
    std::unique_lock lock(ch.mutex);
    while (ch.queue.empty()) {
      throw_if_aborted(rank, c);
      if (ch.cv.wait_until(lock, start + shared_->timeout()) == std::cv_status::timeout && ch.queue.empty()) {
        std::string const text = c.name(rank) + " waited " + format_duration(Clock::now() - start) + " for rank " +
                                 std::to_string(c.root) + " to send";
        lock.unlock();
        shared_->abort(text);
        throw Error(Errc::timeout, text + " (expected a matching send within the " + format_duration(shared_->timeout()) + " deadline)");
      }
    }
    Message* m = ch.queue.front();
    if (m->count != c.count || m->dtype != c.dtype) {
      std::string const text = c.name(rank) + ": rank " + std::to_string(c.root) + " sent " + std::to_string(m->count) + " " +
                               std::string(mgpu::to_string(m->dtype)) + " elements, the recv takes " + std::to_string(c.count) +
                               " " + std::string(mgpu::to_string(c.dtype)) + " (expected matching count and dtype)";
      lock.unlock();
      shared_->abort(text);
      throw Error(Errc::invalid_argument, text);
    }
    ch.queue.pop_front();
    ch.queued.store(ch.queue.size(), std::memory_order_release);
    auto const bytes = static_cast<std::size_t>(c.count) * size_of(c.dtype);
    if (m->copy) {  // eager: nobody waits for it
      ch.eager_held -= bytes;
      lock.unlock();
      if (bytes > 0) std::memcpy(c.recv.data(), m->data, bytes);
      delete m;
      return;
    }
    if (bytes > 0) std::memcpy(c.recv.data(), m->data, bytes);
    std::atomic_ref(m->taken).store(true, std::memory_order_release);
    lock.unlock();
    ch.cv.notify_all();
  }

  int n_;
  std::shared_ptr<SharedState> shared_;
  std::vector<Posted> posted_;
  std::vector<std::atomic<std::uint64_t>> reached_;
  std::vector<std::uint64_t> barriers_;  // per rank, touched only by that rank's executing thread
  std::atomic<std::uint64_t> arrivals_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Channel> channels_;
};

HostCommunicator::HostCommunicator(DeviceGroup& group, std::chrono::milliseconds timeout)
    : HostCommunicator(group, group.size(), timeout) {}

HostCommunicator::HostCommunicator(DeviceGroup& group, int size, std::chrono::milliseconds timeout)
    : CommunicatorBase(group, size, Backend::host, timeout), host_(std::make_shared<HostState>(size, state())) {
  state()->on_abort([host = std::weak_ptr<HostState>(host_)] {
    if (auto h = host.lock()) h->wake_all();
  });
}

void HostCommunicator::check_device(int rank, Device device, std::string_view what, Call const& call) const {
  if (device.kind != DeviceKind::host)
    throw Error(Errc::invalid_argument, call.name(rank) + ": " + std::string(what) + " is on " + device.to_string() +
                                            " (expected host memory and a host stream: this is a host communicator)");
}

void HostCommunicator::launch(int rank, std::vector<Call> calls, Stream& stream) {
  // The work reaches the tensors through views that do not keep them; their use is recorded once
  // it is enqueued, so their blocks are reused in stream order as after any op (enqueue_using).
  std::vector<Tensor> used;
  for (Call& c : calls) {
    for (Tensor* t : {&c.send, &c.recv}) {
      if (!t->defined()) continue;
      used.push_back(*t);
      *t = mgpu::detail::BufferInternals::unowned(*t);
    }
  }
  mgpu::detail::ReleaseAfterOnExit const release(stream, used);
  state()->begin_operation();
  auto work = [host = host_, shared = state(), rank, calls = std::move(calls)](bool earlier_work_failed) {
    struct Done {
      SharedState& s;
      ~Done() { s.end_operation(); }
    } done{*shared};
    if (earlier_work_failed) {  // this rank's earlier work failed: the others must not wait for it
      shared->abort(calls.front().name(rank) + " was skipped because earlier work on the rank's stream failed");
      return;
    }
    host->execute(rank, calls);
  };
  try {
    mgpu::detail::StreamInternals::enqueue_even_after_failure(stream, std::move(work));
  } catch (...) {
    state()->end_operation();
    throw;
  }
}

}  // namespace mgpu::comm::detail
