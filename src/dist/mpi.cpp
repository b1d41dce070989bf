// The dist module over MPI: joining the job, the world's device list, and the communicator across
// processes for host devices.
//
// Every MPI exchange is non-blocking and polled against a deadline (MPI_Test under one process-wide
// lock, so MPI_THREAD_SERIALIZED suffices), so no MPI wait outlasts the communicator's deadline.
// MPI never touches user tensors: data goes through staging buffers owned by the request set,
// which a failure hands to a process-wide list kept until the process ends (MPI may still write
// into them), and MPI_Finalize is then skipped. Two processes on one host swap their all-reduces
// through an MPI shared-memory window instead (SharedRings), polled against the same deadline.
#define OMPI_SKIP_MPICXX 1
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

#include <mgpu/comm/reduce_op.hpp>
#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/reduce_slice.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

#include "comm/base.hpp"
#include "comm/cuda_communicators.hpp"
#include "core/backend.hpp"
#include "dist/common.hpp"
#include "dist/rendezvous.hpp"

namespace mgpu::dist {
namespace {

using Clock = std::chrono::steady_clock;
using comm::detail::Call;
using comm::detail::format_duration;
using comm::detail::OpKind;

// The process's dist state.
struct Global {
  std::mutex mutex;  // guards the fields below but `failed` and `abandoned`
  bool initialized = false;
  bool finalized = false;
  bool initialized_mpi = false;  // init() called MPI_Init_thread (so finalize() finalizes)
  bool mpi = false;              // MPI is in use
  Place place;
  std::atomic<bool> failed{false};  // an exchange failed: peers may never answer, so no MPI_Finalize
  // Abandoned requests MPI cannot end (collectives, which cannot be cancelled): while there is
  // one, a new communicator does not clear `failed`.
  std::atomic<int> stuck{0};
  // Every MPI call holds this lock: several threads (each rank's stream) call MPI, one at a time.
  std::mutex mpi_mutex;
  // The buffers of requests left pending by a failure (guarded by mpi_mutex): MPI may still write
  // into them, so they stay until the process ends.
  std::vector<std::shared_ptr<void>> abandoned;
  // What subset communicators across processes are made from (guarded by mpi_mutex): a duplicate of
  // MPI_COMM_WORLD, made by the first make_world (collective over every process, as making a
  // subset's MPI communicator is not).
  MPI_Comm subsets = MPI_COMM_NULL;
  // The shared-memory windows made so far (guarded by mpi_mutex), which finalize() frees in this
  // order (freeing one is collective, and a communicator's destructor is not). One no communicator
  // uses any more is free for the next one between the same two processes.
  struct SharedWindow {
    MPI_Win window = MPI_WIN_NULL;
    std::pair<int, int> processes;  // the job's
    std::int64_t bytes = 0;         // per process
    int id = 0;                     // its number among those of the same processes and bytes
    bool in_use = true;
    std::byte* base[2] = {nullptr, nullptr};  // each process's segment
  };
  std::vector<std::unique_ptr<SharedWindow>> windows;
};

Global& global() {
  static Global g;
  return g;
}

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

// Throws Error(communication) naming the call unless `code` is MPI_SUCCESS. Call with the MPI lock held.
void check(int code, char const* call) {
  if (code != MPI_SUCCESS) throw Error(Errc::communication, std::string(call) + " failed: " + mpi_error_text(code));
}

// An element or byte count as MPI's int; Error(invalid_argument) when it does not fit.
int mpi_count(std::int64_t count, std::string const& what) {
  if (count < 0 || count > INT_MAX)
    throw Error(Errc::invalid_argument, what + ": " + std::to_string(count) +
                                            " elements or bytes in one MPI exchange (expected at most " +
                                            std::to_string(INT_MAX) + ")");
  return static_cast<int>(count);
}

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "single";
    case MPI_THREAD_FUNNELED:
      return "funneled";
    case MPI_THREAD_SERIALIZED:
      return "serialized";
    case MPI_THREAD_MULTIPLE:
      return "multiple";
    default:
      return "level " + std::to_string(level);
  }
}

// Staging buffers are reused: one goes back to a free list of its element type when its last
// owner lets go (a failure's abandoned buffers never do), so collectives of a size seen before
// touch no fresh pages and clear nothing. The free lists live as long as the process (buffers may
// come back while static objects are destroyed), holding a few buffers each.
template <class T>
struct StagingPool {
  static constexpr std::size_t kept = 8;
  std::mutex mutex;
  std::vector<std::unique_ptr<std::vector<T>>> free;
};

template <class T>
StagingPool<T>& staging_pool() {
  static StagingPool<T>& pool = *new StagingPool<T>;
  return pool;
}

// A staging buffer of `size` elements; its contents are unspecified (the exchange overwrites them).
template <class T>
std::shared_ptr<std::vector<T>> buffer(std::size_t size) {
  StagingPool<T>& pool = staging_pool<T>();
  std::unique_ptr<std::vector<T>> v;
  {
    std::lock_guard lock(pool.mutex);
    auto best = pool.free.end();  // the smallest free buffer that holds `size`
    for (auto it = pool.free.begin(); it != pool.free.end(); ++it) {
      if ((*it)->capacity() >= size && (best == pool.free.end() || (*it)->capacity() < (*best)->capacity())) best = it;
    }
    if (best != pool.free.end()) {
      v = std::move(*best);
      pool.free.erase(best);
    }
  }
  if (!v) v = std::make_unique<std::vector<T>>();
  v->resize(size);
  return {v.release(), [](std::vector<T>* done) {
            std::unique_ptr<std::vector<T>> owned(done);
            StagingPool<T>& pool = staging_pool<T>();
            std::lock_guard lock(pool.mutex);
            if (pool.free.size() < StagingPool<T>::kept) pool.free.push_back(std::move(owned));
          }};
}

// A leader waiting for the others' headers yields longer before it sleeps: processes reach a
// collective a little apart, and waking from a sleep took longer than such a wait (2 processes of
// one device, 1 MiB all-reduce: 0.24 ms with 64 yields, 0.17 ms with 512).
constexpr int kHeaderYields = 512;

// Between polls of a wait: yield the core for the first `yields` polls (a reply is often
// microseconds away), then sleep, longer and longer: the processes may share few cores with the
// ranks' compute.
void back_off(int polls, int yields = 64) {
  if (polls < yields) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (polls - yields + 1))));
  }
}

// Non-blocking requests, each with the process it waits for and the buffers it uses, polled
// together against a deadline. Requests still pending when it goes are abandoned: receives are
// cancelled, and the buffers kept until the process ends.
class Requests {
 public:
  Requests() = default;
  Requests(Requests const&) = delete;
  Requests& operator=(Requests const&) = delete;
  ~Requests() { abandon(); }

  // Starts a request: `start(&request)` runs under the MPI lock and returns MPI's status code.
  // What a request is, which decides what abandoning it may do.
  enum class Kind { send, receive, collective };

  template <class Start>
  std::size_t add(int peer, Kind kind, std::shared_ptr<void> keep, char const* call, Start const& start) {
    entries_.push_back({MPI_REQUEST_NULL, MPI_Status{}, peer, kind, true, std::move(keep)});
    std::lock_guard lock(global().mpi_mutex);
    int const code = start(&entries_.back().request);
    if (code != MPI_SUCCESS) {
      entries_.back().pending = false;
      check(code, call);
    }
    return entries_.size() - 1;
  }

  // Polls until every request has completed, or only request `only` where given (true), or until
  // `deadline` passes or stop() holds (false), yielding for the first `yields` polls (back_off). A
  // request MPI failed ends the wait (true) with error() set.
  template <class Stop>
  bool wait(Clock::time_point deadline, Stop const& stop, std::optional<std::size_t> only = std::nullopt,
            int yields = 64) {
    for (int polls = 0;; ++polls) {
      bool done = true;
      {
        std::lock_guard lock(global().mpi_mutex);
        for (std::size_t i = only.value_or(0); i < (only ? *only + 1 : entries_.size()); ++i) {
          Entry& e = entries_[i];
          if (!e.pending) continue;
          int flag = 0;
          int const code = MPI_Test(&e.request, &flag, &e.status);
          if (code != MPI_SUCCESS) {
            e.pending = false;
            error_ = code;
            break;
          }
          if (flag) {
            e.pending = false;
          } else {
            done = false;
          }
        }
      }
      if (error_ != MPI_SUCCESS) return true;
      if (done) return true;
      if (stop() || Clock::now() >= deadline) return false;
      back_off(polls, yields);
    }
  }

  // The MPI error a request ended with (MPI_SUCCESS if none).
  [[nodiscard]] int error() const noexcept { return error_; }
  // The processes whose requests are still pending, ascending, each once.
  [[nodiscard]] std::vector<int> pending_peers() const {
    std::vector<int> peers;
    for (Entry const& e : entries_) {
      if (e.pending && std::find(peers.begin(), peers.end(), e.peer) == peers.end()) peers.push_back(e.peer);
    }
    std::sort(peers.begin(), peers.end());
    return peers;
  }
  [[nodiscard]] MPI_Status const& status(std::size_t index) const { return entries_[index].status; }

  // Cancels pending receives, lets pending sends finish on their own (MPI does not allow either
  // for a collective) and keeps every pending request's buffers until the process ends.
  void abandon() noexcept {
    Global& g = global();
    try {
      std::lock_guard lock(g.mpi_mutex);
      for (Entry& e : entries_) {
        if (!e.pending) continue;
        e.pending = false;
        g.failed.store(true);
        if (e.kind == Kind::receive) MPI_Cancel(&e.request);
        if (e.kind != Kind::collective) MPI_Request_free(&e.request);
        // A collective cannot end without every process. (A freed send does not hold MPI_Finalize
        // up: its receiver discards what it never received.)
        if (e.kind == Kind::collective) g.stuck.fetch_add(1);
        g.abandoned.push_back(std::move(e.keep));
      }
    } catch (...) {  // no room to keep a buffer: it leaks, which is safe
    }
  }

 private:
  struct Entry {
    MPI_Request request;
    MPI_Status status;
    int peer;
    Kind kind;
    bool pending;
    std::shared_ptr<void> keep;
  };
  std::vector<Entry> entries_;
  int error_ = MPI_SUCCESS;
};

// A collective's description, exchanged by the leaders before its data so that a mismatch is
// reported instead of corrupting an exchange.
struct Header {
  std::int32_t kind;
  std::int32_t dtype;
  std::int32_t op;
  std::int32_t root;
  std::int64_t count;
  std::uint64_t seq;
};

// Element conversions between a tensor's dtype and float32, where reductions happen.
void to_float(Tensor const& t, std::int64_t begin, std::int64_t count, float* out) {
  mgpu::detail::visit_dtype(t.dtype(), [&]<class T>(std::type_identity<T>) {
    T const* in = static_cast<T const*>(t.data()) + begin;
    for (std::int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(in[i]);
  });
}

void from_float(float const* in, Tensor const& t, std::int64_t begin, std::int64_t count) {
  mgpu::detail::visit_dtype(t.dtype(), [&]<class T>(std::type_identity<T>) {
    T* out = static_cast<T*>(t.data()) + begin;
    for (std::int64_t i = 0; i < count; ++i) out[i] = T(in[i]);
  });
}

// out[i] = parts[0][i] (+) parts[1][i] (+) ... in process order, `stride` apart; avg divides by
// the world's size (the processes' partials are sums).
void combine_parts(comm::ReduceOp op, float const* parts, int count, std::int64_t stride, std::int64_t n,
                   int world_size, float* out) {
  // In blocks that stay in L1, each element combined in process order; two parts (the all-reduce
  // between 2 processes) in one pass.
  mgpu::detail::visit_reduce_op(op, [&]<comm::ReduceOp O>(std::integral_constant<comm::ReduceOp, O>) {
    if (count == 2) {
      float const* second = parts + stride;
#if !defined(__clang__)
#pragma GCC ivdep
#endif
      for (std::int64_t i = 0; i < n; ++i) out[i] = mgpu::detail::finish<O>(mgpu::detail::combine<O>(parts[i], second[i]), world_size);
      return;
    }
    constexpr std::int64_t block = 1024;
    float acc[block];
    for (std::int64_t b = 0; b < n; b += block) {
      std::int64_t const len = std::min(block, n - b);
      std::copy_n(parts + b, len, acc);
      for (int p = 1; p < count; ++p) {
        float const* part = parts + p * stride + b;
        for (std::int64_t i = 0; i < len; ++i) acc[i] = mgpu::detail::combine<O>(acc[i], part[i]);
      }
      for (std::int64_t i = 0; i < len; ++i) out[b + i] = mgpu::detail::finish<O>(acc[i], world_size);
    }
  });
}

// Combines `count` float32 partials of `n` elements each, contiguous in process order, into `out`.
void combine_into(comm::ReduceOp op, float const* parts, int count, std::int64_t n, int world_size, Tensor const& out) {
  if (out.dtype() == DType::float32) {
    combine_parts(op, parts, count, n, n, world_size, static_cast<float*>(out.data()));
    return;
  }
  auto mine = buffer<float>(static_cast<std::size_t>(n));
  combine_parts(op, parts, count, n, n, world_size, mine->data());
  from_float(mine->data(), out, 0, n);
}

// What the MPI work of one communicator shares; it outlives the communicator while work runs.
class Link : public std::enable_shared_from_this<Link> {
 public:
  // `ids`: the job's process of each of `world`'s processes (a subset's), as messages name them.
  Link(World const& world, std::vector<int> ids, std::shared_ptr<comm::detail::SharedState> state)
      : process_(world.process),
        processes_(world.processes),
        world_size_(world.size()),
        ids_(std::move(ids)),
        state_(std::move(state)) {
    for (int p = 0; p <= processes_; ++p) first_.push_back(p < processes_ ? world.first_rank(p) : world_size_);
    for (int p = 0; p < processes_; ++p)
      hosts_.push_back(world.devices[static_cast<std::size_t>(first_[static_cast<std::size_t>(p)])].host);
  }
  Link(Link const&) = delete;
  Link& operator=(Link const&) = delete;
  ~Link() {
    Global& g = global();
    if (g.failed.load()) return;  // pending requests may still use the communicators
    std::lock_guard lock(g.mpi_mutex);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (MPI_Comm* c : {&control, &data, &p2p}) {
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
    }
  }

  // Duplicates `base` (MPI_COMM_WORLD, or an MPI communicator among a subset's processes, in their
  // order) three times (collective over its processes), within the deadline. A duplication left
  // pending keeps the link, which MPI will write into.
  void connect(MPI_Comm base) {
    Requests requests;
    for (MPI_Comm* c : {&control, &data, &p2p}) {
      requests.add(-1, Requests::Kind::collective, shared_from_this(), "MPI_Comm_idup",
                   [&](MPI_Request* r) { return MPI_Comm_idup(base, c, r); });
    }
    // Twice the deadline: after a failed step every process makes a new communicator, and the one
    // that failed gets here while the others may still wait out their deadline on the step.
    auto const start = Clock::now();
    if (!requests.wait(start + 2 * timeout(), [] { return false; })) {
      requests.abandon();
      throw Error(Errc::timeout,
                  "making a communicator across processes waited " + format_duration(Clock::now() - start) +
                      " for the other processes (expected every process to make it within twice the " +
                      format_duration(timeout()) + " deadline; " + comm::timeout_env_var + " sets it in seconds)");
    }
    std::lock_guard lock(global().mpi_mutex);
    check(requests.error(), "MPI_Comm_idup");
    // Every process made it: none waits for a failed one any more, and where no request was left
    // that MPI cannot end, the job may finish MPI as one that never failed.
    if (global().stuck.load() == 0) global().failed.store(false);
    int tag_limit = 0;
    int* value = nullptr;
    MPI_Comm_get_attr(p2p, MPI_TAG_UB, &value, &tag_limit);
    if (tag_limit && static_cast<std::int64_t>(world_size_) * world_size_ > *value)
      throw Error(Errc::invalid_argument, "a world of " + std::to_string(world_size_) + " devices (expected at most " +
                                              std::to_string(static_cast<int>(std::sqrt(static_cast<double>(*value)))) +
                                              ": MPI's tags name each pair of ranks)");
  }

  [[nodiscard]] int process() const noexcept { return process_; }
  [[nodiscard]] int processes() const noexcept { return processes_; }
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  [[nodiscard]] int first(int p) const { return first_[static_cast<std::size_t>(p)]; }
  [[nodiscard]] int local_size(int p) const { return first(p + 1) - first(p); }
  [[nodiscard]] int process_of(int rank) const {
    return static_cast<int>(std::upper_bound(first_.begin(), first_.end(), rank) - first_.begin()) - 1;
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return state_->timeout(); }
  [[nodiscard]] comm::detail::SharedState& state() const noexcept { return *state_; }

  [[nodiscard]] std::string const& host(int p) const { return hosts_[static_cast<std::size_t>(p)]; }
  // Process p's place in the job.
  [[nodiscard]] int id(int p) const { return ids_[static_cast<std::size_t>(p)]; }
  // "process 1 (host a, ranks 2-3)".
  [[nodiscard]] std::string describe(int p) const {
    int const a = first(p);
    int const b = first(p + 1) - 1;
    return "process " + std::to_string(ids_[static_cast<std::size_t>(p)]) + " (host " + hosts_[static_cast<std::size_t>(p)] + ", " +
           (a == b ? "rank " + std::to_string(a) : "ranks " + std::to_string(a) + "-" + std::to_string(b)) + ")";
  }
  [[nodiscard]] std::string describe(std::vector<int> const& ps) const {
    std::string text = ps.size() == 1 ? "" : "processes ";
    for (std::size_t i = 0; i < ps.size(); ++i) {
      std::string one = describe(ps[i]);
      text += (i ? ", " : "") + (ps.size() == 1 ? one : one.substr(std::string("process ").size()));
    }
    return text;
  }
  [[nodiscard]] std::vector<int> others() const {
    std::vector<int> ps;
    for (int p = 0; p < processes_; ++p) {
      if (p != process_) ps.push_back(p);
    }
    return ps;
  }

  // Aborts the communicator and throws.
  [[noreturn]] void fail(Errc category, std::string const& message) const {
    state_->abort(message);
    throw Error(category, message);
  }

  // Waits for `requests` until `deadline`; on a timeout fails naming `waited_for(pending peers)`,
  // on an abort throws the abort's error.
  template <class Describe>
  void wait(Requests& requests, std::string const& what, Clock::time_point start, Describe const& waited_for,
            std::optional<std::size_t> only = std::nullopt, int yields = 64) const {
    if (!requests.wait(start + timeout(), [&] { return state_->aborted(); }, only, yields)) {
      std::vector<int> const pending = requests.pending_peers();
      requests.abandon();
      state_->throw_if_aborted(what);
      fail(Errc::timeout, what + " waited " + format_duration(Clock::now() - start) + " for " + waited_for(pending) +
                              " (expected them within the " + format_duration(timeout()) + " deadline; " +
                              comm::timeout_env_var + " sets it in seconds)");
    }
    if (requests.error() != MPI_SUCCESS) {
      std::string text;
      {
        std::lock_guard lock(global().mpi_mutex);
        text = mpi_error_text(requests.error());
      }
      fail(Errc::communication, what + ": MPI failed: " + text);
    }
  }

  // Every leader sends its call's header to every other and checks theirs: the processes not
  // heard from by the deadline are named. `tag` tells apart the leaders of one process (a slice's
  // leader uses its local rank).
  void exchange_headers(Call const& c, int rank, std::string const& what, Clock::time_point start, int tag = 0) const {
    auto mine = std::make_shared<Header>(Header{static_cast<std::int32_t>(c.kind), static_cast<std::int32_t>(c.dtype),
                                                static_cast<std::int32_t>(c.op), c.root, c.count, c.seq});
    auto theirs = buffer<Header>(static_cast<std::size_t>(processes_));
    Requests requests;
    for (int const p : others()) {
      requests.add(p, Requests::Kind::receive, theirs, "MPI_Irecv", [&](MPI_Request* r) {
        return MPI_Irecv(&(*theirs)[static_cast<std::size_t>(p)], sizeof(Header), MPI_BYTE, p, tag, control, r);
      });
      requests.add(p, Requests::Kind::send, mine, "MPI_Isend",
                   [&](MPI_Request* r) { return MPI_Isend(mine.get(), sizeof(Header), MPI_BYTE, p, tag, control, r); });
    }
    wait(
        requests, what, start, [&](std::vector<int> const& pending) { return describe(pending) + ", not heard from"; },
        std::nullopt, kHeaderYields);
    for (int const p : others()) {
      Header const& h = (*theirs)[static_cast<std::size_t>(p)];
      auto const mismatch = [&](char const* field, std::string const& mine_text, std::string const& their_text) {
        fail(Errc::invalid_argument, what + ": " + describe(p) + " passed " + field + " " + their_text + ", rank " +
                                         std::to_string(rank) + " passed " + mine_text +
                                         " (expected the same on every rank)");
      };
      if (h.kind != mine->kind)
        mismatch("operation", std::string(to_string(c.kind)), std::string(to_string(static_cast<OpKind>(h.kind))));
      if (h.count != mine->count) mismatch("element count", std::to_string(c.count), std::to_string(h.count));
      if (h.dtype != mine->dtype)
        mismatch("dtype", std::string(mgpu::to_string(c.dtype)),
                 std::string(mgpu::to_string(static_cast<DType>(h.dtype))));
      if (h.op != mine->op)
        mismatch("reduce op", std::string(to_string(c.op)), std::string(to_string(static_cast<comm::ReduceOp>(h.op))));
      if (h.root != mine->root) mismatch("root", std::to_string(c.root), std::to_string(h.root));
      if (h.seq != mine->seq) mismatch("call number", std::to_string(c.seq), std::to_string(h.seq));
    }
  }

  // Waits for a data exchange that every process has joined (their headers came): every request,
  // or only request `only` where given.
  void wait_exchange(Requests& requests, std::string const& what, Clock::time_point start,
                     std::optional<std::size_t> only = std::nullopt) const {
    wait(
        requests, what, start, [&](std::vector<int> const&) { return describe(others()) + " to complete the exchange"; },
        only);
  }

  MPI_Comm control = MPI_COMM_NULL;  // the leaders' headers
  MPI_Comm data = MPI_COMM_NULL;     // the leaders' collectives
  MPI_Comm p2p = MPI_COMM_NULL;      // sends and receives between ranks

 private:
  int process_;
  int processes_;
  int world_size_;
  std::vector<int> ids_;
  std::vector<int> first_;  // per process, then the world's size
  std::vector<std::string> hosts_;
  std::shared_ptr<comm::detail::SharedState> state_;
};

// From this many elements on, an all-reduce among three or more leaders is a reduce-scatter and
// an all-gather (two rounds, 2 (P-1)/P of the data each way) instead of one all-gather of every
// partial ((P-1) times the data). Both combine each element in process order: the same bits.
constexpr std::int64_t kSplitAllReduce = std::int64_t{1} << 16;

// The leader's part of each collective: the exchange between processes, on the leader's stream
// after the in-process step. `local` holds the process's partial or data, as each kind needs.
struct Leader {
  std::shared_ptr<Link> link;
  Call call;
  int rank;

  void operator()() const {
    std::string const what = call.name(rank);
    Link const& l = *link;
    l.state().throw_if_aborted(what);
    auto const start = Clock::now();
    l.exchange_headers(call, rank, what, start);
    if (call.kind == OpKind::barrier) return;
    std::int64_t const n = call.count;
    int const P = l.processes();
    int const p = l.process();
    std::size_t const element = size_of(call.dtype);
    Requests requests;
    switch (call.kind) {
      case OpKind::all_reduce: {  // call.recv holds the process's partial
        if (P >= 3 && n >= kSplitAllReduce) {
          // Reduce-scatter then all-gather among the leaders: each receives every process's
          // partial of its 1/P block (all-to-all), combines it in process order and the blocks are
          // gathered: 2 (P-1)/P of the data in and out instead of (P-1) times it, in two rounds.
          auto mine = buffer<float>(static_cast<std::size_t>(n));
          to_float(call.recv, 0, n, mine->data());
          std::vector<int> counts, offsets;
          for (int q = 0; q < P; ++q) {
            offsets.push_back(mpi_count(n * q / P, what));
            counts.push_back(mpi_count(n * (q + 1) / P - n * q / P, what));
          }
          std::int64_t const own = counts[static_cast<std::size_t>(p)];
          auto parts = buffer<float>(static_cast<std::size_t>(own * P));
          std::vector<int> part_counts(static_cast<std::size_t>(P), static_cast<int>(own)), part_offsets;
          for (int q = 0; q < P; ++q) part_offsets.push_back(mpi_count(own * q, what));
          requests.add(-1, Requests::Kind::collective, std::make_shared<std::pair<decltype(mine), decltype(parts)>>(mine, parts),
                       "MPI_Ialltoallv", [&](MPI_Request* r) {
                         return MPI_Ialltoallv(mine->data(), counts.data(), offsets.data(), MPI_FLOAT, parts->data(),
                                               part_counts.data(), part_offsets.data(), MPI_FLOAT, l.data, r);
                       });
          l.wait_exchange(requests, what, start);
          combine_parts(call.op, parts->data(), P, own, own, l.world_size(), mine->data() + offsets[static_cast<std::size_t>(p)]);
          Requests gather;
          gather.add(-1, Requests::Kind::collective, mine, "MPI_Iallgatherv", [&](MPI_Request* r) {
            return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, mine->data(), counts.data(), offsets.data(), MPI_FLOAT,
                                   l.data, r);
          });
          l.wait_exchange(gather, what, start);
          from_float(mine->data(), call.recv, 0, n);
          break;
        }
        // Every process's partial gathered in place (this one's staged at its own offset), then
        // combined straight into call.recv when it holds float32.
        auto all = buffer<float>(static_cast<std::size_t>(n) * static_cast<std::size_t>(P));
        to_float(call.recv, 0, n, all->data() + static_cast<std::ptrdiff_t>(p) * n);
        int const count = mpi_count(n, what);
        mpi_count(n * P, what);
        requests.add(-1, Requests::Kind::collective, all, "MPI_Iallgather", [&](MPI_Request* r) {
          return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all->data(), count, MPI_FLOAT, l.data, r);
        });
        l.wait_exchange(requests, what, start);
        combine_into(call.op, all->data(), P, n, l.world_size(), call.recv);
        break;
      }
      case OpKind::reduce_scatter: {  // call.send: the partial over the world (W*n); call.recv: this process's blocks
                                      // (L*n)
        auto mine = buffer<float>(static_cast<std::size_t>(l.world_size() * n));
        std::int64_t const block = l.local_size(p) * n;
        auto all = buffer<float>(static_cast<std::size_t>(block * P));
        to_float(call.send, 0, l.world_size() * n, mine->data());
        std::vector<int> send_counts, send_offsets, recv_counts, recv_offsets;
        for (int q = 0; q < P; ++q) {
          send_counts.push_back(mpi_count(l.local_size(q) * n, what));
          send_offsets.push_back(mpi_count(l.first(q) * n, what));
          recv_counts.push_back(mpi_count(block, what));
          recv_offsets.push_back(mpi_count(q * block, what));
        }
        requests.add(
            -1, Requests::Kind::collective, std::make_shared<std::pair<decltype(mine), decltype(all)>>(mine, all),
            "MPI_Ialltoallv", [&](MPI_Request* r) {
              return MPI_Ialltoallv(mine->data(), send_counts.data(), send_offsets.data(), MPI_FLOAT, all->data(),
                                    recv_counts.data(), recv_offsets.data(), MPI_FLOAT, l.data, r);
            });
        l.wait_exchange(requests, what, start);
        combine_parts(call.op, all->data(), P, block, block, l.world_size(), mine->data());
        from_float(mine->data(), call.recv, 0, block);
        break;
      }
      case OpKind::all_gather: {  // call.recv: the whole result (W*n), this process's blocks filled
        std::int64_t const bytes = n * static_cast<std::int64_t>(element);
        auto mine = buffer<std::byte>(static_cast<std::size_t>(l.local_size(p) * bytes));
        auto all = buffer<std::byte>(static_cast<std::size_t>(l.world_size() * bytes));
        if (!mine->empty())
          std::memcpy(mine->data(), static_cast<std::byte const*>(call.recv.data()) + l.first(p) * bytes, mine->size());
        std::vector<int> counts, offsets;
        for (int q = 0; q < P; ++q) {
          counts.push_back(mpi_count(l.local_size(q) * bytes, what));
          offsets.push_back(mpi_count(l.first(q) * bytes, what));
        }
        requests.add(-1, Requests::Kind::collective,
                     std::make_shared<std::pair<decltype(mine), decltype(all)>>(mine, all), "MPI_Iallgatherv",
                     [&](MPI_Request* r) {
                       return MPI_Iallgatherv(mine->data(), counts[static_cast<std::size_t>(p)], MPI_BYTE, all->data(),
                                              counts.data(), offsets.data(), MPI_BYTE, l.data, r);
                     });
        l.wait_exchange(requests, what, start);
        if (!all->empty()) std::memcpy(call.recv.data(), all->data(), all->size());
        break;
      }
      case OpKind::broadcast: {  // call.root: the root's process; call.recv: the buffer
        auto data = buffer<std::byte>(static_cast<std::size_t>(n) * element);
        if (p == call.root && !data->empty()) std::memcpy(data->data(), call.recv.data(), data->size());
        int const bytes = mpi_count(static_cast<std::int64_t>(data->size()), what);
        requests.add(-1, Requests::Kind::collective, data, "MPI_Ibcast",
                     [&](MPI_Request* r) { return MPI_Ibcast(data->data(), bytes, MPI_BYTE, call.root, l.data, r); });
        l.wait_exchange(requests, what, start);
        if (p != call.root && !data->empty()) std::memcpy(call.recv.data(), data->data(), data->size());
        break;
      }
      case OpKind::reduce: {  // call.root: the root's process; call.recv: the partial, the result on the root's process
        auto mine = buffer<float>(static_cast<std::size_t>(n));
        auto all = buffer<float>(p == call.root ? static_cast<std::size_t>(n * P) : 0);
        to_float(call.recv, 0, n, mine->data());
        int const count = mpi_count(n, what);
        mpi_count(n * P, what);
        requests.add(
            -1, Requests::Kind::collective, std::make_shared<std::pair<decltype(mine), decltype(all)>>(mine, all),
            "MPI_Igather", [&](MPI_Request* r) {
              return MPI_Igather(mine->data(), count, MPI_FLOAT, all->data(), count, MPI_FLOAT, call.root, l.data, r);
            });
        l.wait_exchange(requests, what, start);
        if (p == call.root) {
          combine_parts(call.op, all->data(), P, n, n, l.world_size(), mine->data());
          from_float(mine->data(), call.recv, 0, n);
        }
        break;
      }
      default:
        break;
    }
  }
};

// A slice goes between the two processes in pieces of this many elements: each piece is reduced
// inside the process, sent, and combined with the other process's piece while both are still in
// cache.
constexpr std::int64_t kSlicePiece = std::int64_t{1} << 16;

// The number of pieces of a slice of n elements (an empty slice has one, empty).
std::int64_t piece_count(std::int64_t n) { return std::max<std::int64_t>(1, (n + kSlicePiece - 1) / kSlicePiece); }

// Turns off the shared memory between two processes of one host (MGPU_DIST_SHM=0): their
// all-reduces by slices then go over MPI point-to-point as between servers.
constexpr char const* shm_env_var = "MGPU_DIST_SHM";

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
  static std::shared_ptr<SharedRings> make(Link const& link, int leaders) {
    std::int64_t const header = static_cast<std::int64_t>(leaders) * 2 * kCounterBytes;
    std::int64_t const bytes = header + leaders * slots * kSlicePiece * static_cast<std::int64_t>(sizeof(float));
    std::pair<int, int> const processes{link.id(0), link.id(1)};
    char const* setting = std::getenv(shm_env_var);
    bool const wanted = !(setting != nullptr && std::string(setting) == "0") && link.host(0) == link.host(1);
    Global& g = global();
    Global::SharedWindow* spare = nullptr;  // the free window this process offers, held for the exchange
    if (wanted) {
      std::lock_guard lock(g.mpi_mutex);
      for (auto& w : g.windows) {
        if (!w->in_use && w->processes == processes && w->bytes == bytes && (spare == nullptr || w->id < spare->id))
          spare = w.get();
      }
      if (spare != nullptr) spare->in_use = true;
    }
    auto offers = buffer<int>(4);  // each process's: whether it wants shared memory, its spare window's id (-1: none)
    int const p = link.process();
    (*offers)[static_cast<std::size_t>(2 * p)] = wanted ? 1 : 0;
    (*offers)[static_cast<std::size_t>(2 * p + 1)] = spare != nullptr ? spare->id : -1;
    {
      Requests requests;
      requests.add(1 - p, Requests::Kind::collective, offers, "MPI_Iallgather", [&](MPI_Request* r) {
        return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, offers->data(), 2, MPI_INT, link.data, r);
      });
      link.wait(requests, "making a communicator across processes", Clock::now(),
                [&](std::vector<int> const& pending) { return link.describe(pending) + ", not heard from"; });
    }
    std::vector<int> const& o = *offers;
    bool const reuse = spare != nullptr && o[1] == o[3];
    if (spare != nullptr && !reuse) {
      std::lock_guard lock(g.mpi_mutex);
      spare->in_use = false;
    }
    if (o[0] == 0 || o[2] == 0) return nullptr;
    Global::SharedWindow* window = reuse ? spare : allocate(link, processes, bytes);
    if (window == nullptr) return nullptr;
    std::shared_ptr<SharedRings> rings(new SharedRings(window, header, leaders));
    std::memset(window->base[p], 0, static_cast<std::size_t>(header));
    // Both segments' counters are cleared before either process counts in them.
    Requests requests;
    requests.add(1 - p, Requests::Kind::collective, nullptr, "MPI_Ibarrier",
                 [&](MPI_Request* r) { return MPI_Ibarrier(link.data, r); });
    link.wait(requests, "making a communicator across processes", Clock::now(),
              [&](std::vector<int> const& pending) { return link.describe(pending) + ", not heard from"; });
    return rings;
  }

  SharedRings(SharedRings const&) = delete;
  SharedRings& operator=(SharedRings const&) = delete;
  // Hands the window on: every call through it is done on this process.
  ~SharedRings() {
    std::lock_guard lock(global().mpi_mutex);
    window_->in_use = false;
  }

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
  static Global::SharedWindow* allocate(Link const& link, std::pair<int, int> processes, std::int64_t bytes) {
    Global& g = global();
    std::lock_guard lock(g.mpi_mutex);
    MPI_Comm pair = MPI_COMM_NULL;
    check(MPI_Comm_split_type(link.data, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &pair), "MPI_Comm_split_type");
    int size = 0;
    MPI_Comm_size(pair, &size);
    if (size != 2) {
      MPI_Comm_free(&pair);
      return nullptr;
    }
    auto w = std::make_unique<Global::SharedWindow>();
    w->processes = processes;
    w->bytes = bytes;
    for (auto const& other : g.windows) {
      if (other->processes == processes && other->bytes == bytes) ++w->id;
    }
    // Each segment on pages of its own, placed near the process that writes it.
    MPI_Info info = MPI_INFO_NULL;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    void* mine = nullptr;
    int const code = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, pair, &mine, &w->window);
    MPI_Info_free(&info);
    MPI_Comm_free(&pair);
    check(code, "MPI_Win_allocate_shared");
    for (int q = 0; q < 2; ++q) {
      MPI_Aint size_q = 0;
      int unit = 0;
      void* at = nullptr;
      check(MPI_Win_shared_query(w->window, q, &size_q, &unit, &at), "MPI_Win_shared_query");
      w->base[q] = static_cast<std::byte*>(at);
    }
    g.windows.push_back(std::move(w));
    return g.windows.back().get();
  }

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

// What a local rank passes to an all-reduce by slices, for its process's slice leaders to read and
// write: posted on the rank's stream, read between two in-process barriers.
struct Posted {
  void const* send = nullptr;
  void* recv = nullptr;
  std::int64_t count = 0;
  DType dtype = DType::float32;
  comm::ReduceOp op = comm::ReduceOp::sum;
};

// out[i] = in[0][begin + i] (+) in[1][begin + i] (+) ... for i < n, in float32, in rank order.
template <class T, comm::ReduceOp O>
void reduce_local(std::vector<T const*> const& in, std::int64_t begin, std::int64_t n, float* out) {
  T const* first = in[0] + begin;
  if (in.size() == 1) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(first[i]);
    return;
  }
  T const* second = in[1] + begin;
  for (std::int64_t i = 0; i < n; ++i)
    out[i] = mgpu::detail::combine<O>(static_cast<float>(first[i]), static_cast<float>(second[i]));
  for (std::size_t q = 2; q < in.size(); ++q) {
    T const* part = in[q] + begin;
    for (std::int64_t i = 0; i < n; ++i) out[i] = mgpu::detail::combine<O>(out[i], static_cast<float>(part[i]));
  }
}

// out[q][begin + i] = finish(first[i] (+) second[i]) for every output q and i < n.
template <class T, comm::ReduceOp O>
void combine_two(float const* first, float const* second, std::int64_t begin, std::int64_t n, int world_size,
                 std::vector<T*> const& out) {
  constexpr std::int64_t block = 1024;
  float result[block];
  for (std::int64_t b = 0; b < n; b += block) {
    std::int64_t const len = std::min(block, n - b);
    for (std::int64_t i = 0; i < len; ++i)
      result[i] = mgpu::detail::finish<O>(mgpu::detail::combine<O>(first[b + i], second[b + i]), world_size);
    for (T* const o : out) {
      T* const to = o + begin + b;
      for (std::int64_t i = 0; i < len; ++i) to[i] = T(result[i]);
    }
  }
}

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

  void operator()() const {
    std::string const what = call.name(rank);
    Link const& l = *link;
    l.state().throw_if_aborted(what);
    auto const start = Clock::now();
    std::vector<Posted> const& all = *posted;
    for (std::size_t q = 0; q < all.size(); ++q) {
      Posted const& other = all[q];
      auto const mismatch = [&](char const* field, std::string const& theirs, std::string const& mine) {
        l.fail(Errc::invalid_argument, what + ": rank " + std::to_string(first + static_cast<int>(q)) + " passed " +
                                           field + " " + theirs + ", rank " + std::to_string(rank) + " passed " + mine +
                                           " (expected the same on every rank)");
      };
      if (other.count != call.count) mismatch("element count", std::to_string(other.count), std::to_string(call.count));
      if (other.dtype != call.dtype)
        mismatch("dtype", std::string(mgpu::to_string(other.dtype)), std::string(mgpu::to_string(call.dtype)));
      if (other.op != call.op)
        mismatch("reduce op", std::string(to_string(other.op)), std::string(to_string(call.op)));
    }
    mpi_count(count, what);
    mgpu::detail::visit_dtype(call.dtype, [&]<class T>(std::type_identity<T>) {
      std::vector<T const*> in;
      std::vector<T*> out;
      for (Posted const& r : all) {
        in.push_back(static_cast<T const*>(r.send) + begin);
        out.push_back(static_cast<T*>(r.recv) + begin);
      }
      mgpu::detail::visit_reduce_op(call.op, [&]<comm::ReduceOp O>(std::integral_constant<comm::ReduceOp, O>) {
        if (rings) {
          through_rings<T, O>(what, start, in, out);
        } else {
          over_mpi<T, O>(what, start, in, out);
        }
      });
    });
  }

 private:
  static constexpr comm::ReduceOp partial_op(comm::ReduceOp op) {
    return op == comm::ReduceOp::avg ? comm::ReduceOp::sum : op;
  }
  [[nodiscard]] std::int64_t length(std::int64_t k) const { return std::min(count - k * kSlicePiece, kSlicePiece); }

  template <class T, comm::ReduceOp O>
  void over_mpi(std::string const& what, Clock::time_point start, std::vector<T const*> const& in,
                std::vector<T*> const& out) const {
    Link const& l = *link;
    int const p = l.process();
    int const peer = 1 - p;
    float* const mine = static_cast<float*>(parts.data()) + p * count;
    float* const theirs = static_cast<float*>(parts.data()) + peer * count;
    std::int64_t const pieces = piece_count(count);
    auto keep = std::make_shared<Tensor>(parts);
    Requests requests;
    std::vector<std::size_t> received;  // each piece's receive
    auto const combine = [&](std::int64_t k) {
      l.wait_exchange(requests, what, start, received[static_cast<std::size_t>(k)]);
      std::int64_t const at = k * kSlicePiece;
      combine_two<T, O>(p == 0 ? mine + at : theirs + at, p == 0 ? theirs + at : mine + at, at, length(k),
                        l.world_size(), out);
    };
    for (std::int64_t k = 0; k < pieces; ++k) {
      std::int64_t const at = k * kSlicePiece;
      int const n = static_cast<int>(length(k));
      reduce_local<T, partial_op(O)>(in, at, n, mine + at);
      requests.add(peer, Requests::Kind::send, keep, "MPI_Isend",
                   [&](MPI_Request* r) { return MPI_Isend(mine + at, n, MPI_FLOAT, peer, slice, l.data, r); });
      received.push_back(requests.add(peer, Requests::Kind::receive, keep, "MPI_Irecv", [&](MPI_Request* r) {
        return MPI_Irecv(theirs + at, n, MPI_FLOAT, peer, slice, l.data, r);
      }));
      // The first piece is posted before the headers are checked, so the exchange takes one
      // round trip; a mismatch is named from the headers before any data is awaited.
      if (k == 0) l.exchange_headers(call, rank, what, start, slice);
      if (k > 0) combine(k - 1);
    }
    combine(pieces - 1);
    l.wait_exchange(requests, what, start);
  }

  // Up to SharedRings::slots pieces ahead of the combine, the leader reduces its pieces into its
  // ring once the other leader has consumed what the slot held; it combines each piece once the
  // other leader has made it ready.
  template <class T, comm::ReduceOp O>
  void through_rings(std::string const& what, Clock::time_point start, std::vector<T const*> const& in,
                     std::vector<T*> const& out) const {
    Link const& l = *link;
    SharedRings& r = *rings;
    int const p = l.process();
    int const peer = 1 - p;
    auto const pieces = static_cast<std::uint64_t>(piece_count(count));
    std::uint64_t const base = r.pieces(slice);
    std::atomic_ref<std::uint64_t> const my_ready(*r.ready(p, slice));
    std::atomic_ref<std::uint64_t> const my_consumed(*r.consumed(p, slice));
    std::atomic_ref<std::uint64_t> const their_ready(*r.ready(peer, slice));
    std::atomic_ref<std::uint64_t> const their_consumed(*r.consumed(peer, slice));
    std::uint64_t made = 0;
    std::uint64_t combined = 0;
    // Makes every piece it may: true if any.
    auto const make = [&] {
      bool any = false;
      while (made < pieces && made < combined + SharedRings::slots &&
             base + made < their_consumed.load(std::memory_order_acquire) + SharedRings::slots) {
        auto const k = static_cast<std::int64_t>(made);
        reduce_local<T, partial_op(O)>(in, k * kSlicePiece, length(k), r.slot(p, slice, base + made));
        my_ready.store(base + ++made, std::memory_order_release);
        any = true;
      }
      return any;
    };
    // The first pieces are made while the headers travel; neither process combines anything
    // before it has checked the other's header.
    make();
    l.exchange_headers(call, rank, what, start, slice);
    for (int polls = 0; combined < pieces;) {
      bool moved = make();
      if (combined < made && their_ready.load(std::memory_order_acquire) > base + combined) {
        auto const k = static_cast<std::int64_t>(combined);
        float const* const mine = r.slot(p, slice, base + combined);
        float const* const theirs = r.slot(peer, slice, base + combined);
        combine_two<T, O>(p == 0 ? mine : theirs, p == 0 ? theirs : mine, k * kSlicePiece, length(k), l.world_size(),
                          out);
        my_consumed.store(base + ++combined, std::memory_order_release);
        moved = true;
      }
      if (moved) {
        polls = 0;
        continue;
      }
      l.state().throw_if_aborted(what);
      if (Clock::now() >= start + l.timeout())
        l.fail(Errc::timeout, what + " waited " + format_duration(Clock::now() - start) + " for " + l.describe(peer) +
                                  " to share piece " + std::to_string(combined + 1) + " of " + std::to_string(pieces) +
                                  " (expected it within the " + format_duration(l.timeout()) + " deadline; " +
                                  comm::timeout_env_var + " sets it in seconds)");
      back_off(polls++);
    }
    r.pieces(slice) = base + pieces;
  }
};

// Sends and receives between ranks of different processes: each message is a Header (count,
// dtype, call number) and the data, tagged by the pair of ranks.
class PointToPoint {
 public:
  PointToPoint(std::shared_ptr<Link> link, int rank) : link_(std::move(link)), rank_(rank) {}

  void post(Call const& c) {
    Link const& l = *link_;
    int const peer_process = l.process_of(c.root);
    std::size_t const bytes = static_cast<std::size_t>(c.count) * size_of(c.dtype);
    auto message = buffer<std::byte>(sizeof(Header) + bytes);
    int const size = mpi_count(static_cast<std::int64_t>(message->size()), c.name(rank_));
    if (c.kind == OpKind::send) {
      Header const h{static_cast<std::int32_t>(c.kind), static_cast<std::int32_t>(c.dtype), 0, 0, c.count, c.seq};
      std::memcpy(message->data(), &h, sizeof h);
      if (bytes > 0) std::memcpy(message->data() + sizeof h, c.send.data(), bytes);
      int const tag = rank_ * l.world_size() + c.root;
      requests_.add(peer_process, Requests::Kind::send, message, "MPI_Isend", [&](MPI_Request* r) {
        return MPI_Isend(message->data(), size, MPI_BYTE, peer_process, tag, l.p2p, r);
      });
    } else {
      int const tag = c.root * l.world_size() + rank_;
      std::size_t const index = requests_.add(
          peer_process, Requests::Kind::receive, message, "MPI_Irecv",
          [&](MPI_Request* r) { return MPI_Irecv(message->data(), size, MPI_BYTE, peer_process, tag, l.p2p, r); });
      receives_.push_back({c, message, index});
    }
    calls_.push_back(c);
  }

  // Waits for every posted message (the deadline runs from `start`), then checks and delivers the
  // received ones.
  void finish(Clock::time_point start) {
    Link const& l = *link_;
    std::string const what = calls_.size() == 1 ? calls_.front().name(rank_)
                                                : "rank " + std::to_string(rank_) + "'s group of sends and receives";
    l.wait(requests_, what, start, [&](std::vector<int> const& pending) {
      std::string text;
      for (Call const& c : calls_) {
        if (std::find(pending.begin(), pending.end(), l.process_of(c.root)) == pending.end()) continue;
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(c.root) + " of " +
                l.describe(l.process_of(c.root)) + (c.kind == OpKind::send ? " to receive" : " to send");
      }
      return text;
    });
    for (Receive const& r : receives_) {
      int received = 0;
      {
        std::lock_guard lock(global().mpi_mutex);
        MPI_Get_count(&requests_.status(r.index), MPI_BYTE, &received);
      }
      Header h{};
      if (received >= static_cast<int>(sizeof h)) std::memcpy(&h, r.message->data(), sizeof h);
      std::size_t const bytes = static_cast<std::size_t>(r.call.count) * size_of(r.call.dtype);
      if (received != static_cast<int>(sizeof h + bytes) || h.count != r.call.count ||
          h.dtype != static_cast<std::int32_t>(r.call.dtype))
        l.fail(Errc::invalid_argument,
               r.call.name(rank_) + ": rank " + std::to_string(r.call.root) + " sent " + std::to_string(h.count) + " " +
                   std::string(mgpu::to_string(static_cast<DType>(h.dtype))) + " elements, the recv takes " +
                   std::to_string(r.call.count) + " " + std::string(mgpu::to_string(r.call.dtype)) +
                   " (expected matching count and dtype)");
      if (bytes > 0) std::memcpy(r.call.recv.data(), r.message->data() + sizeof h, bytes);
    }
  }

 private:
  struct Receive {
    Call call;
    std::shared_ptr<std::vector<std::byte>> message;
    std::size_t index;
  };
  std::shared_ptr<Link> link_;
  int rank_;
  Requests requests_;
  std::vector<Receive> receives_;
  std::vector<Call> calls_;
};

// A subset's processes meet (`link` is over the subset): each sends its list of world ranks
// (`world_size` + 1 ints: the count, then the ranks) to every other and checks theirs, polled
// against the deadline, so that a process that never makes the subset is named and a different
// list reported; then they make an MPI communicator among themselves, in the subset's order of
// processes, from Global::subsets (MPI_Comm_create_group: blocking, but only once every member is
// known to be there). The caller frees it.
MPI_Comm join_members(Link const& link, detail::Subset const& subset, int world_size) {
  std::string const what = "making a communicator over world ranks " + detail::ranks_text(subset.world_ranks);
  Global& g = global();
  MPI_Comm base = MPI_COMM_NULL;
  {
    std::lock_guard lock(g.mpi_mutex);
    base = g.subsets;
  }
  if (base == MPI_COMM_NULL)
    throw Error(Errc::invalid_argument, what + " before make_world (expected every process to call make_world first)");
  constexpr int tag = 1;  // the lists; MPI_Comm_create_group gets tag + 1
  auto const length = static_cast<std::size_t>(world_size) + 1;
  auto mine = buffer<int>(length);
  std::fill(mine->begin(), mine->end(), -1);
  (*mine)[0] = static_cast<int>(subset.world_ranks.size());
  std::copy(subset.world_ranks.begin(), subset.world_ranks.end(), mine->begin() + 1);
  int const P = link.processes();
  auto theirs = buffer<int>(length * static_cast<std::size_t>(P));
  int const count = mpi_count(static_cast<std::int64_t>(length), what);
  Requests requests;
  for (int const q : link.others()) {
    int const peer = subset.processes[static_cast<std::size_t>(q)];
    requests.add(q, Requests::Kind::receive, theirs, "MPI_Irecv", [&](MPI_Request* r) {
      return MPI_Irecv(theirs->data() + static_cast<std::size_t>(q) * length, count, MPI_INT, peer, tag, base, r);
    });
    requests.add(q, Requests::Kind::send, mine, "MPI_Isend",
                 [&](MPI_Request* r) { return MPI_Isend(mine->data(), count, MPI_INT, peer, tag, base, r); });
  }
  link.wait(requests, what, Clock::now(),
            [&](std::vector<int> const& pending) { return link.describe(pending) + ", not heard from"; });
  for (int const q : link.others()) {
    int const* list = theirs->data() + static_cast<std::size_t>(q) * length;
    if (!std::equal(mine->begin(), mine->end(), list)) {
      std::vector<int> const other(list + 1, list + 1 + std::clamp(list[0], 0, world_size));
      link.fail(Errc::invalid_argument, what + ": " + link.describe(q) + " passed world ranks " +
                                            detail::ranks_text(other) +
                                            " (expected the same list on every process of it, its subset "
                                            "communicators made in the same order)");
    }
  }
  std::lock_guard lock(g.mpi_mutex);
  MPI_Group all = MPI_GROUP_NULL;
  MPI_Group members = MPI_GROUP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  check(MPI_Comm_group(base, &all), "MPI_Comm_group");
  int code = MPI_Group_incl(all, P, subset.processes.data(), &members);
  if (code == MPI_SUCCESS) code = MPI_Comm_create_group(base, members, tag + 1, &comm);
  MPI_Group_free(&all);
  if (members != MPI_GROUP_NULL) MPI_Group_free(&members);
  check(code, "MPI_Comm_create_group");
  check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  return comm;
}

// The communicator across processes for host devices (see make_communicator in dist.hpp), over the
// world's ranks or a subset's (`whole`: the subset of every rank, over MPI_COMM_WORLD; else the
// subset's processes meet first). `world_size`: the whole world's.
class ProcessCommunicator final : public comm::detail::CommunicatorBase {
 public:
  ProcessCommunicator(detail::Subset const& subset, DeviceGroup& group, std::chrono::milliseconds timeout,
                      int world_size, bool whole)
      : CommunicatorBase(group, subset.world.size(), comm::Backend::host, timeout),
        first_(subset.world.rank_of(0)),
        local_(static_cast<int>(subset.locals.size())),
        locals_(subset.locals),
        link_(std::make_shared<Link>(subset.world, subset.processes, state())),
        inner_(whole ? comm::make_communicator(group, comm::Options{comm::Backend::host, timeout * 2})
                     : comm::make_communicator(group, locals_, comm::Options{comm::Backend::host, timeout * 2})) {
    if (whole) {
      link_->connect(MPI_COMM_WORLD);
    } else {
      MPI_Comm members = join_members(*link_, subset, world_size);
      link_->connect(members);  // when it fails, MPI may still use `members`: it stays
      std::lock_guard lock(global().mpi_mutex);
      MPI_Comm_free(&members);
    }
    if (by_slices()) rings_ = SharedRings::make(*link_, local_);
    state()->on_abort(
        [inner = std::weak_ptr<comm::Communicator>(inner_), state = std::weak_ptr<comm::detail::SharedState>(state())] {
          global().failed.store(true);  // peers may be left waiting: finalize() must not wait for them
          auto i = inner.lock();
          auto s = state.lock();
          if (i && s) i->abort(s->reason());
        });
  }
  ~ProcessCommunicator() override { shut_down(); }
  [[nodiscard]] int first_rank() const noexcept override { return first_; }

 protected:
  [[nodiscard]] bool drives(int rank) const noexcept override { return rank >= first_ && rank < first_ + local_; }

  void check_device(int rank, Device device, std::string_view what, Call const& call) const override {
    if (!drives(rank))
      throw Error(Errc::invalid_argument, call.name(rank) + ": rank " + std::to_string(rank) + " belongs to " +
                                              link_->describe(link_->process_of(rank)) +
                                              " (expected a rank this process drives, " + std::to_string(first_) +
                                              " to " + std::to_string(first_ + local_ - 1) + ")");
    if (device.kind != DeviceKind::host)
      throw Error(Errc::invalid_argument, call.name(rank) + ": " + std::string(what) + " is on " + device.to_string() +
                                              " (expected host memory and a host stream: this is a host communicator)");
  }

  void finish_device_work(std::chrono::milliseconds) override {
    try {
      inner_->finalize();
    } catch (Error const& e) {
      state()->abort(std::string("the ranks inside process ") + std::to_string(link_->process()) +
                     " failed: " + std::string(e.message()));
    }
  }

  void launch(int rank, std::vector<Call> calls, Stream& stream) override {
    int const l = rank - first_;
    bool const p2p_only = std::all_of(calls.begin(), calls.end(),
                                      [](Call const& c) { return c.kind == OpKind::send || c.kind == OpKind::recv; });
    if (calls.size() > 1 && !p2p_only) {
      std::string const message =
          calls.front().name(rank) +
          ": a collective inside group_start/group_end on a communicator across processes (expected only sends "
          "and receives in a group)";
      state()->abort(message);
      throw Error(Errc::invalid_argument, message);
    }
    if (p2p_only) return point_to_point(rank, l, calls, stream);
    Call const& c = calls.front();
    collective(rank, l, c, stream);
  }

 private:
  // Enqueues `fn` on the rank's stream, counted as an operation in flight, run even after earlier
  // work failed so that it aborts the communicator instead (the other processes must not wait).
  template <class Fn>
  void enqueue(int rank, Call const& c, Stream& stream, Fn fn) {
    state()->begin_operation();
    auto work = [shared = state(), rank, c, fn = std::move(fn)](bool earlier_work_failed) mutable {
      struct Done {
        comm::detail::SharedState& s;
        ~Done() { s.end_operation(); }
      } done{*shared};
      if (earlier_work_failed) {
        shared->abort(c.name(rank) + " was skipped because earlier work on the rank's stream failed");
        return;
      }
      fn();
    };
    try {
      mgpu::detail::StreamInternals::enqueue_even_after_failure(stream, std::move(work));
    } catch (...) {
      state()->end_operation();
      throw;
    }
  }

  Tensor scratch(int l, std::int64_t count, DType dtype) const {
    return Tensor::empty({count}, dtype, group().allocator(locals_[static_cast<std::size_t>(l)]));
  }

  void collective(int rank, int l, Call c, Stream& stream) {
    comm::Communicator& inner = *inner_;
    bool const leader = l == 0;
    comm::ReduceOp const partial_op = c.op == comm::ReduceOp::avg ? comm::ReduceOp::sum : c.op;
    Call exchange = c;  // what the leader's exchange reads and writes
    switch (c.kind) {
      case OpKind::all_reduce:
        if (by_slices()) {
          all_reduce_by_slices(rank, l, c, stream);
          break;
        }
        inner.reduce(l, c.send, c.recv, partial_op, 0, stream);
        if (leader) enqueue(rank, c, stream, Leader{link_, exchange, rank});
        inner.broadcast(l, c.recv, 0, stream);
        break;
      case OpKind::reduce_scatter: {
        std::int64_t const n = c.count;
        Tensor const partial = leader ? scratch(l, link_->world_size() * n, c.dtype) : c.send;
        inner.reduce(l, c.send, partial, partial_op, 0, stream);
        Tensor const blocks = (leader && local_ > 1) ? scratch(l, local_ * n, c.dtype) : c.recv;
        if (leader) {
          exchange.send = partial;
          exchange.recv = blocks;
          enqueue(rank, c, stream, Leader{link_, exchange, rank});
        }
        if (local_ > 1) {  // the leader hands each rank its block
          if (leader) {
            inner.group_start(0);
            for (int q = 1; q < local_; ++q) inner.send(0, blocks.slice(q * n, (q + 1) * n), q, stream);
            inner.group_end(0);
            enqueue(rank, c, stream, [blocks, recv = c.recv] {
              if (recv.nbytes() > 0) std::memcpy(recv.data(), blocks.data(), recv.nbytes());
            });
          } else {
            inner.recv(l, c.recv, 0, stream);
          }
        }
        break;
      }
      case OpKind::all_gather: {
        std::int64_t const n = c.count;
        Tensor const whole = c.recv.reshape({c.recv.numel()});
        inner.all_gather(l, c.send, whole.slice(first_ * n, (first_ + local_) * n), stream);
        if (leader) enqueue(rank, c, stream, Leader{link_, exchange, rank});
        inner.broadcast(l, c.recv, 0, stream);
        break;
      }
      case OpKind::broadcast: {
        int const root_process = link_->process_of(c.root);
        exchange.root = root_process;
        bool const here = root_process == link_->process();
        if (here) inner.broadcast(l, c.recv, c.root - first_, stream);
        if (leader) enqueue(rank, c, stream, Leader{link_, exchange, rank});
        if (!here) inner.broadcast(l, c.recv, 0, stream);
        break;
      }
      case OpKind::reduce: {
        int const root_process = link_->process_of(c.root);
        int const root_local = c.root - link_->first(root_process);
        bool const here = root_process == link_->process();
        Tensor const partial = !leader ? c.send : (here && root_local == 0) ? c.recv : scratch(l, c.count, c.dtype);
        inner.reduce(l, c.send, partial, partial_op, 0, stream);
        if (leader) {
          exchange.root = root_process;
          exchange.recv = partial;
          enqueue(rank, c, stream, Leader{link_, exchange, rank});
        }
        if (here && root_local != 0) {  // the leader hands the result to the root
          if (leader) inner.send(0, partial, root_local, stream);
          if (l == root_local) inner.recv(l, c.recv, 0, stream);
        }
        break;
      }
      case OpKind::barrier:
        inner.barrier(l, stream);
        if (leader) enqueue(rank, c, stream, Leader{link_, exchange, rank});
        inner.barrier(l, stream);
        break;
      default:
        break;
    }
  }

  // `count` float32 elements of rank l's staging for all-reduces by slices. Each rank has one
  // buffer, grown as needed and reused by every call (its stream runs them one at a time): a
  // buffer per call would be allocated when the call is enqueued, so calls queued together would
  // each touch their own, and none would stay in cache. An exchange that fails abandons the buffer
  // to MPI; the communicator is aborted then, so no later call touches it.
  Tensor staging(int l, std::int64_t count) {
    std::lock_guard lock(staging_mutex_);
    if (staging_.empty()) staging_.resize(static_cast<std::size_t>(local_));
    Tensor& t = staging_[static_cast<std::size_t>(l)];
    if (!t.defined() || t.numel() < count) t = scratch(l, count, DType::float32);
    return t.slice(0, count);
  }

  // Whether an all-reduce goes by slices: two processes with as many ranks each.
  [[nodiscard]] bool by_slices() const { return link_->processes() == 2 && link_->local_size(0) == link_->local_size(1); }

  // The all-reduce with every local rank leading one slice of the buffer (rank l: elements
  // [l b, (l + 1) b), b = n / L, the last rank's also the n % L after them): every rank posts its
  // buffers and, once all have, reduces its slice of every local input, swaps it with the same
  // rank of the other process and writes the combined slice into every local output
  // (SliceLeader); a second barrier keeps every output's writers ahead of its rank's next work.
  // Each process reads, sends and writes each element once, on all of its ranks at once, with one
  // round trip between the processes.
  void all_reduce_by_slices(int rank, int l, Call const& c, Stream& stream) {
    comm::Communicator& inner = *inner_;
    std::int64_t const n = c.count;
    std::int64_t const b = n / local_;
    std::int64_t const count = l == local_ - 1 ? n - b * (local_ - 1) : b;
    enqueue(rank, c, stream, [posted = posted_, l, mine = Posted{c.send.data(), c.recv.data(), c.count, c.dtype, c.op}] {
      (*posted)[static_cast<std::size_t>(l)] = mine;
    });
    inner.barrier(l, stream);
    enqueue(rank, c, stream,
            SliceLeader{link_, c, rank, first_, l, posted_, rings_, rings_ ? Tensor() : staging(l, 2 * count), l * b, count});
    inner.barrier(l, stream);
  }

  void point_to_point(int rank, int l, std::vector<Call> const& calls, Stream& stream) {
    std::vector<Call> remote;
    std::vector<Call> local;
    for (Call const& c : calls) (drives(c.root) ? local : remote).push_back(c);
    comm::Communicator& inner = *inner_;
    auto const run_local = [&] {
      if (local.size() > 1) inner.group_start(l);
      for (Call const& c : local) {
        if (c.kind == OpKind::send) {
          inner.send(l, c.send, c.root - first_, stream);
        } else {
          inner.recv(l, c.recv, c.root - first_, stream);
        }
      }
      if (local.size() > 1) inner.group_end(l);
    };
    if (remote.empty()) return run_local();
    // Remote messages are posted first and awaited after the local ones, so none waits for another.
    auto messages = std::make_shared<PointToPoint>(link_, rank);
    auto started = std::make_shared<Clock::time_point>();
    enqueue(rank, remote.front(), stream, [messages, started, remote] {
      *started = Clock::now();
      for (Call const& c : remote) messages->post(c);
    });
    run_local();
    enqueue(rank, remote.front(), stream, [messages, started] { messages->finish(*started); });
  }

  int first_;
  int local_;
  std::vector<int> locals_;  // the group's rank of each of this process's ranks
  std::shared_ptr<Link> link_;
  std::shared_ptr<comm::Communicator> inner_;
  std::mutex staging_mutex_;
  std::vector<Tensor> staging_;  // per local rank (staging())
  // Each local rank's buffers in the all-reduce by slices running now.
  std::shared_ptr<std::vector<Posted>> posted_ = std::make_shared<std::vector<Posted>>(static_cast<std::size_t>(local_));
  std::shared_ptr<SharedRings> rings_;  // all-reduces by slices through shared memory
};

}  // namespace

Place init() {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  if (g.initialized) return g.place;
  if (g.finalized)
    throw Error(Errc::invalid_argument,
                "dist::init() after dist::finalize() (expected one init per process: MPI cannot start again)");
  Place place = parse_environment(detail::read_environment());
  place.host = detail::host_name();
  bool const launched = place.launcher == Launcher::openmpi || place.launcher == Launcher::slurm;
  int already = 0;
  MPI_Initialized(&already);
  if (!launched && !already && place.size > 1) {
    detail::join_rendezvous(place, comm::default_timeout());  // torchrun-style: TCP, no MPI
  } else if (launched || already) {
    std::lock_guard mpi_lock(g.mpi_mutex);
    int provided = MPI_THREAD_SINGLE;
    if (already) {
      check(MPI_Query_thread(&provided), "MPI_Query_thread");
    } else {
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
      g.initialized_mpi = true;
    }
    place.mpi_thread_level = thread_level_name(provided);
    if (provided < MPI_THREAD_SERIALIZED)
      throw Error(Errc::communication,
                  "MPI gave thread support '" + place.mpi_thread_level +
                      "' (expected 'serialized' or 'multiple': mgpu calls MPI from each device's thread)");
    check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    int rank = 0;
    int size = 1;
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
    if (launched && (rank != place.rank || size != place.size))
      throw Error(Errc::invalid_argument, "MPI sees this process as rank " + std::to_string(rank) + " of " +
                                              std::to_string(size) + ", the " + std::string(to_string(place.launcher)) +
                                              " environment says " + std::to_string(place.rank) + " of " +
                                              std::to_string(place.size) +
                                              " (expected the same: launch with mpirun, or srun --mpi=pmix)");
    place.rank = rank;
    place.size = size;
    g.mpi = true;
  }
  g.place = place;
  g.initialized = true;
  return place;
}

void finalize() noexcept {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  if (!g.initialized || g.finalized) return;
  g.finalized = true;
  detail::leave_rendezvous();
  if (!g.initialized_mpi || g.failed.load()) return;  // MPI_Finalize would wait for the peers that failed
  std::lock_guard mpi_lock(g.mpi_mutex);
  for (auto& w : g.windows) MPI_Win_free(&w->window);
  MPI_Finalize();
}

World make_world(DeviceGroup const& group, std::chrono::milliseconds timeout) {
  Global& g = global();
  Place place;
  bool mpi = false;
  {
    std::lock_guard lock(g.mutex);
    if (!g.initialized || g.finalized)
      throw Error(Errc::invalid_argument,
                  "dist::make_world outside dist::init() and finalize() (expected init() first)");
    place = g.place;
    mpi = g.mpi;
  }
  if (timeout.count() <= 0) timeout = comm::default_timeout();
  if (detail::in_rendezvous()) return detail::rendezvous_world(group, place, timeout);
  if (!mpi) return detail::single_process_world(group, place.host);
  struct Entry {
    std::int32_t devices;
    char host[256];
  };
  struct Record {
    std::int32_t kind;
    std::int32_t index;
    double speed;
  };
  int const P = place.size;
  auto mine = std::make_shared<Entry>();
  mine->devices = group.size();
  std::snprintf(mine->host, sizeof mine->host, "%s", place.host.c_str());
  auto entries = buffer<Entry>(static_cast<std::size_t>(P));
  auto const start = Clock::now();
  auto const wait = [&](Requests& requests) {
    if (!requests.wait(start + timeout, [] { return false; })) {
      requests.abandon();
      throw Error(Errc::timeout,
                  "make_world waited " + format_duration(Clock::now() - start) +
                      " for the other processes' devices (expected every process to call it within the " +
                      format_duration(timeout) + " deadline; " + comm::timeout_env_var + " sets it in seconds)");
    }
    std::lock_guard lock(g.mpi_mutex);
    check(requests.error(), "make_world's MPI exchange");
  };
  {
    Requests requests;
    requests.add(-1, Requests::Kind::collective,
                 std::make_shared<std::pair<decltype(mine), decltype(entries)>>(mine, entries), "MPI_Iallgather",
                 [&](MPI_Request* r) {
                   return MPI_Iallgather(mine.get(), sizeof(Entry), MPI_BYTE, entries->data(), sizeof(Entry), MPI_BYTE,
                                         MPI_COMM_WORLD, r);
                 });
    bool duplicate = false;
    {
      std::lock_guard lock(g.mpi_mutex);
      duplicate = g.subsets == MPI_COMM_NULL;
    }
    if (duplicate)  // once per process, as every process's first make_world
      requests.add(-1, Requests::Kind::collective, nullptr, "MPI_Comm_idup",
                   [&](MPI_Request* r) { return MPI_Comm_idup(MPI_COMM_WORLD, &g.subsets, r); });
    wait(requests);
  }
  auto own = buffer<Record>(static_cast<std::size_t>(group.size()));
  for (int r = 0; r < group.size(); ++r) {
    Device const d = group.device(r);
    (*own)[static_cast<std::size_t>(r)] = {static_cast<std::int32_t>(d.kind), d.index, d.speed};
  }
  std::vector<int> counts, offsets;
  int total = 0;
  for (Entry const& e : *entries) {
    counts.push_back(e.devices * static_cast<int>(sizeof(Record)));
    offsets.push_back(total * static_cast<int>(sizeof(Record)));
    total += e.devices;
  }
  auto records = buffer<Record>(static_cast<std::size_t>(total));
  {
    Requests requests;
    requests.add(-1, Requests::Kind::collective,
                 std::make_shared<std::pair<decltype(own), decltype(records)>>(own, records), "MPI_Iallgatherv",
                 [&](MPI_Request* r) {
                   return MPI_Iallgatherv(own->data(), counts[static_cast<std::size_t>(place.rank)], MPI_BYTE,
                                          records->data(), counts.data(), offsets.data(), MPI_BYTE, MPI_COMM_WORLD, r);
                 });
    wait(requests);
  }
  World world;
  world.process = place.rank;
  world.processes = P;
  for (int p = 0, rank = 0; p < P; ++p) {
    Entry const& e = (*entries)[static_cast<std::size_t>(p)];
    for (int l = 0; l < e.devices; ++l, ++rank) {
      Record const& r = (*records)[static_cast<std::size_t>(rank)];
      Device device{static_cast<DeviceKind>(r.kind), r.index, r.speed};
      world.devices.push_back({rank, device, p, l, std::string(e.host, strnlen(e.host, sizeof e.host))});
    }
  }
  return world;
}

namespace {

// One NCCL communicator over every process's GPUs: process 0's id message (detail::nccl_id_message)
// broadcast over MPI, then each process creates its own ranks' communicators.
std::unique_ptr<comm::Communicator> nccl_world_communicator(World const& world, DeviceGroup& group,
                                                            std::chrono::milliseconds timeout) {
  // Broadcast in a fixed size, the length first (a long failure text is cut to fit).
  struct IdMessage {
    std::uint32_t bytes;
    std::byte data[1020];
  };
  auto message = std::make_shared<IdMessage>();
  if (world.process == 0) {
    std::vector<std::byte> const mine = detail::nccl_id_message();
    message->bytes = static_cast<std::uint32_t>(std::min(mine.size(), sizeof message->data));
    std::memcpy(message->data, mine.data(), message->bytes);
  }
  auto const start = Clock::now();
  {
    Requests requests;
    requests.add(-1, Requests::Kind::collective, message, "MPI_Ibcast", [&](MPI_Request* r) {
      return MPI_Ibcast(message.get(), sizeof(IdMessage), MPI_BYTE, 0, MPI_COMM_WORLD, r);
    });
    if (!requests.wait(start + timeout, [] { return false; })) {
      requests.abandon();
      throw Error(Errc::timeout, "waited " + format_duration(Clock::now() - start) +
                                     " for process 0's NCCL unique id (expected every process to make the "
                                     "communicator within the " + format_duration(timeout) + " deadline; " +
                                     comm::timeout_env_var + " sets it in seconds)");
    }
    std::lock_guard lock(global().mpi_mutex);
    check(requests.error(), "broadcasting the NCCL unique id");
  }
  std::vector<std::byte> const id =
      detail::nccl_id_from({message->data, std::min<std::size_t>(message->bytes, sizeof message->data)});
  return comm::detail::make_nccl_world_communicator(group, world.size(), world.first_rank(world.process), id, timeout);
}

// Throws Error(invalid_argument) unless MPI is in use and `options` asks for the backend of the
// devices of `world` (several processes); returns the deadline.
std::chrono::milliseconds check_across(World const& world, comm::Options const& options) {
  bool mpi = false;
  {
    std::lock_guard lock(global().mutex);
    mpi = global().mpi && !global().finalized;
  }
  if (!mpi)
    throw Error(Errc::invalid_argument,
                "a world of " + std::to_string(world.processes) +
                    " processes, but MPI is not in use (expected dist::init() under mpirun or srun)");
  bool const gpus = world.devices.front().device.kind == DeviceKind::cuda;  // check_world: one kind
  comm::Backend const wanted = gpus ? comm::Backend::nccl : comm::Backend::host;
  if (options.backend != comm::Backend::automatic && options.backend != wanted)
    throw Error(Errc::invalid_argument, "the " + std::string(comm::to_string(options.backend)) +
                                            " backend across processes of " + (gpus ? "CUDA GPUs" : "host devices") +
                                            " (expected automatic or " + std::string(comm::to_string(wanted)) + ")");
  return options.timeout.count() > 0 ? options.timeout : comm::default_timeout();
}

std::vector<int> all_ranks(World const& world) {
  std::vector<int> ranks(static_cast<std::size_t>(world.size()));
  for (std::size_t r = 0; r < ranks.size(); ++r) ranks[r] = static_cast<int>(r);
  return ranks;
}

}  // namespace

std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group, comm::Options options) {
  detail::check_world(world, group);
  if (world.processes == 1) return comm::make_communicator(group, options);
  if (detail::in_rendezvous()) return detail::rendezvous_communicator(world, group, options);
  std::chrono::milliseconds const timeout = check_across(world, options);
  if (world.devices.front().device.kind == DeviceKind::host)  // check_world: one kind
    return std::make_unique<ProcessCommunicator>(detail::subset_of(world, all_ranks(world)), group, timeout,
                                                 world.size(), true);
  return nccl_world_communicator(world, group, timeout);
}

std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group,
                                                      std::vector<int> const& world_ranks, comm::Options options) {
  detail::check_world(world, group);
  detail::Subset const subset = detail::subset_of(world, world_ranks);
  if (subset.world.processes == 1) return comm::make_communicator(group, subset.locals, options);
  detail::check_subset_devices(subset);
  std::chrono::milliseconds const timeout = check_across(subset.world, options);
  return std::make_unique<ProcessCommunicator>(subset, group, timeout, world.size(), false);
}

}  // namespace mgpu::dist
