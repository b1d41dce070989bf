// The MPI runtime the dist module's MPI build shares (internal: not installed): the process's
// dist state (Global), MPI status codes and counts, the staging buffers, and the non-blocking
// requests polled against a deadline (Requests).
//
// Every MPI exchange is non-blocking and polled against a deadline (MPI_Test under one process-wide
// lock, so MPI_THREAD_SERIALIZED suffices), so no MPI wait outlasts the communicator's deadline.
// MPI never touches user tensors: data goes through staging buffers owned by the request set,
// which a failure hands to a process-wide list kept until the process ends (MPI may still write
// into them), and MPI_Finalize is then skipped.
#pragma once

#define OMPI_SKIP_MPICXX 1
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mpi.h>

#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

#include "comm/base.hpp"

namespace mgpu::dist::detail {

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

inline Global& global() {
  static Global g;
  return g;
}

// The text of MPI error `code`. Call with the MPI lock held.
std::string mpi_error_text(int code);

// Throws Error(communication) naming the call unless `code` is MPI_SUCCESS. Call with the MPI lock held.
void check(int code, char const* call);

// An element or byte count as MPI's int; Error(invalid_argument) when it does not fit.
int mpi_count(std::int64_t count, std::string const& what);

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

// Between polls of a wait: yield the core for the first `yields` polls (a reply is often
// microseconds away), then sleep, longer and longer: the processes may share few cores with the
// ranks' compute.
inline void back_off(int polls, int yields = 64) {
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

}  // namespace mgpu::dist::detail
