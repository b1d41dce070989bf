// The Link of a communicator across processes over MPI (link.hpp): its MPI communicators made
// within the deadline, the processes named in messages, and the leaders' exchange of headers.
#include "dist/link.hpp"

#include <cmath>
#include <string>
#include <utility>

#include <mgpu/comm/reduce_op.hpp>

namespace mgpu::dist::detail {

Link::Link(World const& world, std::vector<int> ids, std::shared_ptr<comm::detail::SharedState> state)
    : process_(world.process),
      processes_(world.processes),
      world_size_(world.size()),
      ids_(std::move(ids)),
      state_(std::move(state)),
      exchange_(make_mpi_exchange()) {
  for (int p = 0; p <= processes_; ++p) first_.push_back(p < processes_ ? world.first_rank(p) : world_size_);
  for (int p = 0; p < processes_; ++p)
    hosts_.push_back(world.devices[static_cast<std::size_t>(first_[static_cast<std::size_t>(p)])].host);
}

Link::~Link() {
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

void Link::connect(MPI_Comm base) {
  // Twice the deadline: after a failed step every process makes a new communicator, and the one
  // that failed gets here while the others may still wait out their deadline on the step.
  auto const start = Clock::now();
  // One duplicate at a time: Open MPI agrees on the context ids of duplicates of one communicator
  // in flight together in an order of its own on each process, so that where they are started
  // together one process can finish them while another waits for a round that never comes.
  Requests requests;
  bool made = true;
  for (MPI_Comm* c : {&control, &data, &p2p}) {
    std::size_t const index = requests.add(-1, Requests::Kind::collective, shared_from_this(), "MPI_Comm_idup",
                                           [&](MPI_Request* r) { return MPI_Comm_idup(base, c, r); });
    made = requests.wait(start + 2 * timeout(), [] { return false; }, index);
    if (!made || requests.error() != MPI_SUCCESS) break;
  }
  if (!made) {
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

std::string Link::describe(int p) const {
  int const a = first(p);
  int const b = first(p + 1) - 1;
  return "process " + std::to_string(ids_[static_cast<std::size_t>(p)]) + " (host " + hosts_[static_cast<std::size_t>(p)] + ", " +
         (a == b ? "rank " + std::to_string(a) : "ranks " + std::to_string(a) + "-" + std::to_string(b)) + ")";
}

std::string Link::describe(std::vector<int> const& ps) const {
  std::string text = ps.size() == 1 ? "" : "processes ";
  for (std::size_t i = 0; i < ps.size(); ++i) {
    std::string one = describe(ps[i]);
    text += (i ? ", " : "") + (ps.size() == 1 ? one : one.substr(std::string("process ").size()));
  }
  return text;
}

std::vector<int> Link::others() const {
  std::vector<int> ps;
  for (int p = 0; p < processes_; ++p) {
    if (p != process_) ps.push_back(p);
  }
  return ps;
}

void Link::exchange_headers(Call const& c, int rank, std::string const& what, Clock::time_point start, int tag) const {
  auto mine = std::make_shared<Header>(Header{static_cast<std::int32_t>(c.kind), static_cast<std::int32_t>(c.dtype),
                                              static_cast<std::int32_t>(c.op), c.root, c.count, c.seq});
  auto theirs = buffer<Header>(static_cast<std::size_t>(processes_));
  exchange().all_to_all_same(*this, Step{what, start, c.seq, kHeaders},
                             std::make_shared<std::pair<decltype(mine), decltype(theirs)>>(mine, theirs), mine.get(),
                             theirs->data(), sizeof(Header), tag, kHeaderYields);
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

void Link::wait_exchange(Requests& requests, std::string const& what, Clock::time_point start,
                         std::optional<std::size_t> only) const {
  wait(
      requests, what, start, [&](std::vector<int> const&) { return describe(others()) + " to complete the exchange"; },
      only);
}

}  // namespace mgpu::dist::detail
