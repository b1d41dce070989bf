// The leaders' exchanges over Gloo (exchange.hpp): every exchange is point-to-point messages
// through Gloo's unbound buffers on the job's context (gloo_runtime.hpp), matched by slot, each
// awaited against the deadline. Gloo's own timeouts would fail the whole context, so a wait has no
// timeout of Gloo's: an alarm thread ends it (abortWaitRecv/abortWaitSend) at the deadline, or
// every 100 ms to see whether the communicator was aborted. A peer whose connection broke makes
// Gloo throw, which names it; buffers a failed exchange leaves behind are kept until the process
// ends (Gloo may still write into them).
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mgpu/core/error.hpp>

#include "dist/gloo_runtime.hpp"
#include "dist/link.hpp"

namespace mgpu::dist::detail {
namespace {

using Buffer = gloo::transport::UnboundBuffer;

// Ends waits on unbound buffers when their time is due.
class Alarm {
 public:
  Alarm() : thread_([this] { run(); }) {}
  Alarm(Alarm const&) = delete;
  Alarm& operator=(Alarm const&) = delete;
  ~Alarm() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  // Rings `when` (within a few milliseconds): the thread is woken only for an alarm due before it
  // wakes anyway, so that the usual alarm, 100 ms out and disarmed long before, costs no switch.
  std::uint64_t arm(Buffer* buffer, bool send, Clock::time_point when) {
    std::lock_guard lock(mutex_);
    std::uint64_t const id = ++ids_;
    due_.emplace(std::make_pair(when, id), Entry{buffer, send});
    if (when < waking_) wake_.notify_one();
    return id;
  }
  // After it returns, the alarm `id` set will not ring.
  void disarm(Clock::time_point when, std::uint64_t id) {
    std::lock_guard lock(mutex_);
    due_.erase(std::make_pair(when, id));
  }

 private:
  struct Entry {
    Buffer* buffer;
    bool send;
  };
  void run() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      auto const now = Clock::now();
      auto const next = due_.empty() ? now + kIdle : std::min(due_.begin()->first.first, now + kIdle);
      if (now < next) {
        waking_ = next;
        wake_.wait_until(lock, next);
        waking_ = Clock::time_point::min();  // awake: arm() need not wake it
        continue;
      }
      Entry const e = due_.begin()->second;
      due_.erase(due_.begin());
      if (e.send) {
        e.buffer->abortWaitSend();
      } else {
        e.buffer->abortWaitRecv();
      }
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<std::pair<Clock::time_point, std::uint64_t>, Entry> due_;
  static constexpr auto kIdle = std::chrono::milliseconds(50);  // the longest the thread sleeps
  std::uint64_t ids_ = 0;
  Clock::time_point waking_ = Clock::time_point::min();  // when the sleeping thread wakes
  bool stop_ = false;
  std::thread thread_;
};

Alarm& alarm() {
  static Alarm a;
  return a;
}

// What failed exchanges leave behind, kept until the process ends.
struct Abandoned {
  std::mutex mutex;
  std::vector<std::shared_ptr<void>> kept;
};
Abandoned& abandoned() {
  static Abandoned& a = *new Abandoned;
  return a;
}

// Posted sends and receives of one exchange, awaited together.
class Batch {
 public:
  Batch(gloo::Context& context, std::vector<int> const& ranks, std::shared_ptr<void> keep)
      : context_(context), ranks_(ranks), keep_(std::move(keep)) {}
  Batch(Batch const&) = delete;
  Batch& operator=(Batch const&) = delete;
  ~Batch() {
    if (ops_.empty()) return;
    // Still pending: Gloo may write into or read from them.
    std::lock_guard lock(abandoned().mutex);
    abandoned().kept.push_back(std::make_shared<std::vector<Op>>(std::move(ops_)));
    abandoned().kept.push_back(std::move(keep_));
  }

  // Process p (the link's) of `bytes` at `data`, in slot `slot`.
  void send(int p, void const* data, std::size_t bytes, std::uint64_t slot) { post(p, const_cast<void*>(data), bytes, slot, true); }
  void recv(int p, void* data, std::size_t bytes, std::uint64_t slot) { post(p, data, bytes, slot, false); }

  // Waits for every posted message until the step's deadline; fails naming `waited_for(the
  // processes still pending)`, or the process whose connection broke.
  template <class Describe>
  void wait(Link const& l, Step const& s, Describe const& waited_for) {
    auto const deadline = s.start + s.deadlines * l.timeout();
    if (broken_) fail_broken(l, s, broken_->first, broken_->second);
    std::vector<int> pending;
    for (std::size_t i = 0; i < ops_.size(); ++i) {
      Op& op = ops_[i];
      // Once one timed out, the others get a moment only: they arrived, or are pending too.
      auto const until = pending.empty() ? deadline : Clock::now() + std::chrono::milliseconds(10);
      bool done = false;
      try {
        done = wait_one(op, until, l);
      } catch (gloo::Exception const& e) {
        fail_broken(l, s, op.process, e.what());
      }
      if (!done) {
        l.state().throw_if_aborted(s.what);
        if (std::find(pending.begin(), pending.end(), op.process) == pending.end()) pending.push_back(op.process);
      }
    }
    if (!pending.empty()) {
      std::sort(pending.begin(), pending.end());
      l.fail(Errc::timeout, s.what + " waited " + format_duration(Clock::now() - s.start) + " for " + waited_for(pending) +
                                " (expected them within " + (s.deadlines > 1 ? "twice " : "") + "the " +
                                format_duration(l.timeout()) + " deadline; " +
                                comm::timeout_env_var + " sets it in seconds)");
    }
    ops_.clear();
  }

 private:
  struct Op {
    std::unique_ptr<Buffer> buffer;
    int process;
    bool send;
  };
  void post(int p, void* data, std::size_t bytes, std::uint64_t slot, bool send) {
    if (bytes == 0 || broken_) return;
    try {
      auto buffer = context_.createUnboundBuffer(data, bytes);
      int const rank = ranks_[static_cast<std::size_t>(p)];
      if (send) {
        buffer->send(rank, slot);
      } else {
        buffer->recv(rank, slot);
      }
      ops_.push_back({std::move(buffer), p, send});
    } catch (gloo::Exception const& e) {  // the connection broke earlier: wait() names it
      broken_ = std::make_pair(p, std::string(e.what()));
    }
  }
  [[noreturn]] void fail_broken(Link const& l, Step const& s, int p, std::string const& error) const {
    l.state().throw_if_aborted(s.what);
    l.fail(Errc::communication, s.what + ": " + l.describe(p) + " broke its connection (did it exit?): " + error);
  }
  // Whether `op` completed by `until`; false too when the communicator was aborted.
  static bool wait_one(Op& op, Clock::time_point until, Link const& l) {
    constexpr auto never = std::chrono::hours(24 * 30);
    while (true) {
      auto const now = Clock::now();
      if (l.state().aborted() || now >= until) return false;
      auto const when = std::min(until, now + std::chrono::milliseconds(100));
      std::uint64_t const id = alarm().arm(op.buffer.get(), op.send, when);
      struct Disarm {
        Clock::time_point when;
        std::uint64_t id;
        ~Disarm() { alarm().disarm(when, id); }
      } disarm{when, id};
      if (op.send ? op.buffer->waitSend(nullptr, never) : op.buffer->waitRecv(nullptr, never)) return true;
    }
  }

  gloo::Context& context_;
  std::vector<int> const& ranks_;
  std::shared_ptr<void> keep_;
  std::vector<Op> ops_;
  std::optional<std::pair<int, std::string>> broken_;  // a post that failed: its process and Gloo's error
};

class GlooExchange final : public Exchange, public std::enable_shared_from_this<GlooExchange> {
 public:
  GlooExchange(std::shared_ptr<gloo::Context> context, std::vector<int> ranks, std::uint64_t id)
      : context_(std::move(context)), ranks_(std::move(ranks)), id_(id) {}

  // The slot of round `round` of call `seq`, or of point-to-point message `seq`.
  [[nodiscard]] std::uint64_t slot(int round, std::uint64_t seq) const {
    return (id_ << 40) | (static_cast<std::uint64_t>(round) << 32) | (seq & 0xffffffffU);
  }

  void all_to_all_same(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* mine, void* theirs,
                       std::size_t bytes, int, int) override {
    Batch b(*context_, ranks_, std::move(keep));
    for (int const p : l.others()) {
      b.recv(p, static_cast<std::byte*>(theirs) + static_cast<std::size_t>(p) * bytes, bytes, slot(s.round, s.seq));
      b.send(p, mine, bytes, slot(s.round, s.seq));
    }
    b.wait(l, s, [&](std::vector<int> const& pending) { return l.describe(pending) + ", not heard from"; });
  }

  void all_gather(Link const& l, Step const& s, std::shared_ptr<void> keep, void* all, Unit unit,
                  std::vector<std::int64_t> const& counts, std::vector<std::int64_t> const& offsets) override {
    auto const at = [&](std::int64_t units) { return static_cast<std::byte*>(all) + units * static_cast<int>(unit); };
    auto const size = [&](std::int64_t units) { return static_cast<std::size_t>(units) * static_cast<std::size_t>(unit); };
    int const p = l.process();
    Batch b(*context_, ranks_, std::move(keep));
    for (int const q : l.others()) {
      auto const qi = static_cast<std::size_t>(q);
      b.recv(q, at(offsets[qi]), size(counts[qi]), slot(s.round, s.seq));
      b.send(q, at(offsets[static_cast<std::size_t>(p)]), size(counts[static_cast<std::size_t>(p)]), slot(s.round, s.seq));
    }
    b.wait(l, s, [&](std::vector<int> const& pending) { return l.describe(pending) + " to complete the exchange"; });
  }

  void all_to_all(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* send,
                  std::vector<std::int64_t> const& send_counts, std::vector<std::int64_t> const& send_offsets, void* recv,
                  std::vector<std::int64_t> const& recv_counts, std::vector<std::int64_t> const& recv_offsets,
                  Unit unit) override {
    auto const u = static_cast<std::size_t>(unit);
    int const p = l.process();
    auto const pi = static_cast<std::size_t>(p);
    std::memcpy(static_cast<std::byte*>(recv) + static_cast<std::size_t>(recv_offsets[pi]) * u,
                static_cast<std::byte const*>(send) + static_cast<std::size_t>(send_offsets[pi]) * u,
                static_cast<std::size_t>(send_counts[pi]) * u);
    Batch b(*context_, ranks_, std::move(keep));
    for (int const q : l.others()) {
      auto const qi = static_cast<std::size_t>(q);
      b.recv(q, static_cast<std::byte*>(recv) + static_cast<std::size_t>(recv_offsets[qi]) * u,
             static_cast<std::size_t>(recv_counts[qi]) * u, slot(s.round, s.seq));
      b.send(q, static_cast<std::byte const*>(send) + static_cast<std::size_t>(send_offsets[qi]) * u,
             static_cast<std::size_t>(send_counts[qi]) * u, slot(s.round, s.seq));
    }
    b.wait(l, s, [&](std::vector<int> const& pending) { return l.describe(pending) + " to complete the exchange"; });
  }

  void broadcast(Link const& l, Step const& s, std::shared_ptr<void> keep, void* data, std::int64_t bytes,
                 int root) override {
    Batch b(*context_, ranks_, std::move(keep));
    if (l.process() == root) {
      for (int const q : l.others()) b.send(q, data, static_cast<std::size_t>(bytes), slot(s.round, s.seq));
    } else {
      b.recv(root, data, static_cast<std::size_t>(bytes), slot(s.round, s.seq));
    }
    b.wait(l, s, [&](std::vector<int> const& pending) { return l.describe(pending) + " to complete the exchange"; });
  }

  void gather(Link const& l, Step const& s, std::shared_ptr<void> keep, void const* mine, void* all, std::int64_t count,
              Unit unit, int root) override {
    std::size_t const bytes = static_cast<std::size_t>(count) * static_cast<std::size_t>(unit);
    Batch b(*context_, ranks_, std::move(keep));
    if (l.process() == root) {
      std::memcpy(static_cast<std::byte*>(all) + static_cast<std::size_t>(root) * bytes, mine, bytes);
      for (int const q : l.others()) b.recv(q, static_cast<std::byte*>(all) + static_cast<std::size_t>(q) * bytes, bytes, slot(s.round, s.seq));
    } else {
      b.send(root, mine, bytes, slot(s.round, s.seq));
    }
    b.wait(l, s, [&](std::vector<int> const& pending) { return l.describe(pending) + " to complete the exchange"; });
  }

  std::unique_ptr<Messages> messages(std::shared_ptr<Link> link, int rank) override;

  [[nodiscard]] bool slices() const noexcept override { return false; }

  std::shared_ptr<gloo::Context> context_;
  std::vector<int> ranks_;  // the context's rank of each of the link's processes
  std::uint64_t id_;
};

// Sends and receives between ranks over Gloo: each message a Header (in round kMessage) and its
// data (kPayload), in the slot of its pair of ranks; a receive takes the data once the header
// matched its count and dtype.
class GlooMessages final : public Messages {
 public:
  GlooMessages(std::shared_ptr<GlooExchange> exchange, std::shared_ptr<Link> link, int rank)
      : x_(std::move(exchange)), link_(std::move(link)), rank_(rank) {}

  void post(Call const& c) override {
    Link const& l = *link_;
    int const peer = l.process_of(c.root);
    std::size_t const bytes = static_cast<std::size_t>(c.count) * size_of(c.dtype);
    auto entry = std::make_shared<Entry>(Entry{c, peer, {}, {}});
    entry->header = Header{static_cast<std::int32_t>(c.kind), static_cast<std::int32_t>(c.dtype), 0, 0, c.count, c.seq};
    if (c.kind == OpKind::send) {
      entry->data.resize(bytes);
      if (bytes > 0) std::memcpy(entry->data.data(), c.send.data(), bytes);
      std::uint64_t const pair = static_cast<std::uint64_t>(rank_) * static_cast<std::uint64_t>(l.world_size()) +
                                 static_cast<std::uint64_t>(c.root);
      headers_.send(peer, &entry->header, sizeof(Header), x_->slot(kMessage, pair));
      data_.send(peer, entry->data.data(), bytes, x_->slot(kPayload, pair));
    } else {
      std::uint64_t const pair = static_cast<std::uint64_t>(c.root) * static_cast<std::uint64_t>(l.world_size()) +
                                 static_cast<std::uint64_t>(rank_);
      entry->pair = pair;
      headers_.recv(peer, &entry->header, sizeof(Header), x_->slot(kMessage, pair));
    }
    entries_.push_back(std::move(entry));
    keep_->push_back(entries_.back());
  }

  void finish(Clock::time_point start) override {
    Link const& l = *link_;
    std::string const what = entries_.size() == 1 ? entries_.front()->call.name(rank_)
                                                  : "rank " + std::to_string(rank_) + "'s group of sends and receives";
    auto const waited_for = [&](std::vector<int> const& pending) {
      std::string text;
      for (auto const& e : entries_) {
        if (std::find(pending.begin(), pending.end(), e->process) == pending.end()) continue;
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(e->call.root) + " of " +
                l.describe(e->process) + (e->call.kind == OpKind::send ? " to receive" : " to send");
      }
      return text;
    };
    Step const s{what, start, 0, kMessage};
    headers_.wait(l, s, waited_for);
    for (auto const& e : entries_) {
      if (e->call.kind != OpKind::recv) continue;
      Header const& h = e->header;
      if (h.count != e->call.count || h.dtype != static_cast<std::int32_t>(e->call.dtype))
        l.fail(Errc::invalid_argument,
               e->call.name(rank_) + ": rank " + std::to_string(e->call.root) + " sent " + std::to_string(h.count) + " " +
                   std::string(mgpu::to_string(static_cast<DType>(h.dtype))) + " elements, the recv takes " +
                   std::to_string(e->call.count) + " " + std::string(mgpu::to_string(e->call.dtype)) +
                   " (expected matching count and dtype)");
      std::size_t const bytes = static_cast<std::size_t>(e->call.count) * size_of(e->call.dtype);
      if (bytes > 0) data_.recv(e->process, e->call.recv.data(), bytes, x_->slot(kPayload, e->pair));
    }
    data_.wait(l, s, waited_for);
  }

 private:
  struct Entry {
    Call call;
    int process;
    Header header;
    std::vector<std::byte> data;
    std::uint64_t pair = 0;
  };
  std::shared_ptr<GlooExchange> x_;
  std::shared_ptr<Link> link_;
  int rank_;
  std::vector<std::shared_ptr<Entry>> entries_;
  std::shared_ptr<std::vector<std::shared_ptr<Entry>>> keep_ = std::make_shared<std::vector<std::shared_ptr<Entry>>>();
  Batch headers_{*x_->context_, x_->ranks_, keep_};
  Batch data_{*x_->context_, x_->ranks_, keep_};
};

std::unique_ptr<Messages> GlooExchange::messages(std::shared_ptr<Link> link, int rank) {
  return std::make_unique<GlooMessages>(shared_from_this(), std::move(link), rank);
}

// How many communicators over each list of world ranks this process made.
struct Made {
  std::mutex mutex;
  std::map<std::vector<int>, std::uint64_t> count;
};
Made& made() {
  static Made& m = *new Made;
  return m;
}

}  // namespace

std::shared_ptr<Exchange> make_gloo_exchange(Subset const& subset) {
  std::shared_ptr<gloo::Context> context = gloo_context();
  if (!context)
    throw Error(Errc::invalid_argument,
                "a communicator across processes over Gloo before make_world (expected every process to call "
                "make_world first)");
  std::uint64_t k = 0;
  {
    std::lock_guard lock(made().mutex);
    k = made().count[subset.world_ranks]++;
  }
  // FNV-1a over the list and k: the same on every member, another for each list and remake.
  std::uint64_t h = 0xcbf29ce484222325ULL;
  auto const mix = [&](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ULL;
    }
  };
  for (int const r : subset.world_ranks) mix(static_cast<std::uint64_t>(r));
  mix(k);
  return std::make_shared<GlooExchange>(std::move(context), subset.processes, h & 0xffffffU);
}

}  // namespace mgpu::dist::detail
