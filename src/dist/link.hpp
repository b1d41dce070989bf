// What the work of one communicator across processes shares (internal: not installed): the
// Link, its transport (exchange.hpp), its three MPI communicators (under MPI) (the leaders' headers, their collectives, sends and
// receives), the processes' places and the waits against the communicator's deadline, and the
// Header every collective's leaders exchange before its data.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/dist/dist.hpp>

#include "comm/base.hpp"
#include "dist/exchange.hpp"
#include "dist/mpi_runtime.hpp"

namespace mgpu::dist::detail {

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

// A leader waiting for the others' headers yields longer before it sleeps: processes reach a
// collective a little apart, and waking from a sleep took longer than such a wait (2 processes of
// one device, 1 MiB all-reduce: 0.24 ms with 64 yields, 0.17 ms with 512).
constexpr int kHeaderYields = 512;

// What the MPI work of one communicator shares; it outlives the communicator while work runs.
class Link : public std::enable_shared_from_this<Link> {
 public:
  // `ids`: the job's process of each of `world`'s processes (a subset's), as messages name them.
  Link(World const& world, std::vector<int> ids, std::shared_ptr<comm::detail::SharedState> state);
  Link(Link const&) = delete;
  Link& operator=(Link const&) = delete;
  ~Link();

  // Duplicates `base` (MPI_COMM_WORLD, or an MPI communicator among a subset's processes, in their
  // order) three times (collective over its processes), within the deadline. A duplication left
  // pending keeps the link, which MPI will write into.
  void connect(MPI_Comm base);

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

  // The transport the leaders exchange through (MPI unless set).
  void use(std::shared_ptr<Exchange> exchange) { exchange_ = std::move(exchange); }
  [[nodiscard]] Exchange& exchange() const noexcept { return *exchange_; }

  [[nodiscard]] std::string const& host(int p) const { return hosts_[static_cast<std::size_t>(p)]; }
  // Process p's place in the job.
  [[nodiscard]] int id(int p) const { return ids_[static_cast<std::size_t>(p)]; }
  // "process 1 (host a, ranks 2-3)".
  [[nodiscard]] std::string describe(int p) const;
  [[nodiscard]] std::string describe(std::vector<int> const& ps) const;
  [[nodiscard]] std::vector<int> others() const;

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
  void exchange_headers(Call const& c, int rank, std::string const& what, Clock::time_point start, int tag = 0) const;

  // Waits for a data exchange that every process has joined (their headers came): every request,
  // or only request `only` where given.
  void wait_exchange(Requests& requests, std::string const& what, Clock::time_point start,
                     std::optional<std::size_t> only = std::nullopt) const;

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
  std::shared_ptr<Exchange> exchange_;
};

// The MPI transport of the leaders' exchanges (exchange_mpi.cpp).
std::shared_ptr<Exchange> make_mpi_exchange();

}  // namespace mgpu::dist::detail
