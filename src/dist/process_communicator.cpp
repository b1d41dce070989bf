// The dist module's communicator across processes (the MPI build): make_communicator over a world
// or a subset of its ranks (a subset's processes meet first and, over MPI, make an MPI
// communicator of their own; over Gloo their exchanges go through the job's context), the process
// communicator for host devices (ProcessCommunicator: the ranks inside each
// process through an in-process communicator, the exchanges between processes by the hierarchical
// leader, the all-reduce by slices between two processes and point-to-point), and one NCCL
// communicator over every process's GPUs (its unique id broadcast over MPI) or over a subset's
// ranks (the id sent over the subset's own exchange).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <mgpu/comm/reduce_op.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/dist/dist.hpp>

#include "comm/base.hpp"
#include "comm/cuda_communicators.hpp"
#include "core/backend.hpp"
#include "dist/allreduce_slices.hpp"
#include "dist/common.hpp"
#include "dist/gloo_runtime.hpp"
#include "dist/leader_collectives.hpp"
#include "dist/link.hpp"
#include "dist/mpi_runtime.hpp"
#include "dist/rendezvous.hpp"
#include "dist/transport_p2p.hpp"
#include "dist/transport_shm.hpp"

namespace mgpu::dist {
namespace detail {
namespace {

// A subset's processes meet (`link` is over the subset): each sends its list of world ranks
// (`world_size` + 1 ints: the count, then the ranks) to every other and checks theirs, polled
// against the deadline, so that a process that never makes the subset is named and a different
// list reported. Over MPI (`base`: Global::subsets, the job's processes) the lists go
// point-to-point there; else through the link's exchange, within twice the deadline (there this is
// where the members meet; see Link::connect).
void check_lists(Link const& link, detail::Subset const& subset, int world_size, MPI_Comm base) {
  std::string const what = "making a communicator over world ranks " + detail::ranks_text(subset.world_ranks);
  constexpr int tag = 1;  // the lists; MPI_Comm_create_group gets tag + 1
  auto const length = static_cast<std::size_t>(world_size) + 1;
  auto mine = buffer<int>(length);
  std::fill(mine->begin(), mine->end(), -1);
  (*mine)[0] = static_cast<int>(subset.world_ranks.size());
  std::copy(subset.world_ranks.begin(), subset.world_ranks.end(), mine->begin() + 1);
  int const P = link.processes();
  auto theirs = buffer<int>(length * static_cast<std::size_t>(P));
  if (base == MPI_COMM_NULL) {
    link.exchange().all_to_all_same(link, Step{what, Clock::now(), 0, kLists, 2},
                                    std::make_shared<std::pair<decltype(mine), decltype(theirs)>>(mine, theirs),
                                    mine->data(), theirs->data(), length * sizeof(int), tag, 64);
  } else {
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
  }
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
}

// A subset's processes meet over MPI (check_lists), then make an MPI communicator among
// themselves, in the subset's order of processes, from Global::subsets (MPI_Comm_create_group:
// blocking, but only once every member is known to be there). The caller frees it.
MPI_Comm join_members(Link const& link, detail::Subset const& subset, int world_size) {
  Global& g = global();
  MPI_Comm base = MPI_COMM_NULL;
  {
    std::lock_guard lock(g.mpi_mutex);
    base = g.subsets;
  }
  if (base == MPI_COMM_NULL)
    throw Error(Errc::invalid_argument, "making a communicator over world ranks " + detail::ranks_text(subset.world_ranks) +
                                            " before make_world (expected every process to call make_world first)");
  check_lists(link, subset, world_size, base);
  constexpr int tag = 1;
  int const P = link.processes();
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
    if (gloo_connected()) {  // the members meet: their lists, within twice the deadline
      link_->use(make_gloo_exchange(subset));
      check_lists(*link_, subset, world_size, MPI_COMM_NULL);
    } else if (whole) {
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
  [[nodiscard]] bool by_slices() const {
    return link_->exchange().slices() && link_->processes() == 2 && link_->local_size(0) == link_->local_size(1); }

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
    std::shared_ptr<Messages> messages = link_->exchange().messages(link_, rank);
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

// The NCCL id message (detail::nccl_id_message) in a fixed size, the length first (a long failure
// text is cut to fit), as one process sends it to the others.
struct IdMessage {
  std::uint32_t bytes;
  std::byte data[1020];
};

std::shared_ptr<IdMessage> id_message(bool mine) {
  auto message = std::make_shared<IdMessage>();
  message->bytes = 0;
  if (mine) {
    std::vector<std::byte> const id = detail::nccl_id_message();
    message->bytes = static_cast<std::uint32_t>(std::min(id.size(), sizeof message->data));
    std::memcpy(message->data, id.data(), message->bytes);
  }
  return message;
}

std::span<std::byte const> id_bytes(IdMessage const& message) {
  return {message.data, std::min<std::size_t>(message.bytes, sizeof message.data)};
}

// One NCCL communicator over every process's GPUs: process 0's id message broadcast over MPI, then
// each process creates its own ranks' communicators.
std::unique_ptr<comm::Communicator> nccl_world_communicator(World const& world, DeviceGroup& group,
                                                            std::chrono::milliseconds timeout) {
  auto message = id_message(world.process == 0);
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
  std::vector<std::byte> const id = detail::nccl_id_from(id_bytes(*message));
  return comm::detail::make_nccl_world_communicator(group, group_ranks(group), world.size(),
                                                    world.first_rank(world.process), id, timeout);
}

// One NCCL communicator over a subset's GPUs of several processes: its processes meet as a host
// subset's do (over Gloo where the job has it, else an MPI communicator of their own, in the
// subset's order of processes: no other process takes part), the subset's first process's id
// message goes to the others over that exchange, then each process creates the communicators of
// its own ranks of the subset (its ranks are next to each other in the list: subset_of).
std::unique_ptr<comm::Communicator> nccl_subset_communicator(detail::Subset const& subset, DeviceGroup& group,
                                                             std::chrono::milliseconds timeout, int world_size) {
  auto const link = std::make_shared<Link>(subset.world, subset.processes,
                                           std::make_shared<comm::detail::SharedState>(subset.world.size(), timeout));
  if (gloo_connected()) {
    link->use(make_gloo_exchange(subset));
    check_lists(*link, subset, world_size, MPI_COMM_NULL);
  } else {
    MPI_Comm members = join_members(*link, subset, world_size);
    link->connect(members);  // when it fails, MPI may still use `members`: it stays
    std::lock_guard lock(global().mpi_mutex);
    MPI_Comm_free(&members);
  }
  std::string const ranks = detail::ranks_text(subset.world_ranks);
  std::string const what = "sending the NCCL unique id of the communicator over world ranks " + ranks;
  auto message = id_message(subset.world.process == 0);
  link->exchange().broadcast(*link, Step{what, Clock::now(), 0, kData, 2}, message, message.get(), sizeof(IdMessage), 0);
  std::vector<std::byte> const id = detail::nccl_id_from(id_bytes(*message), ranks);
  return comm::detail::make_nccl_world_communicator(group, subset.locals, subset.world.size(),
                                                    subset.world.rank_of(0), id, timeout);
}

// Throws Error(invalid_argument) unless MPI is in use and `options` asks for the backend of the
// devices of `world` (several processes); returns the deadline.
std::chrono::milliseconds check_across(World const& world, comm::Options const& options) {
  bool mpi = false;
  {
    std::lock_guard lock(global().mutex);
    mpi = global().mpi && !global().finalized;
  }
  if (!mpi && !gloo_connected())
    throw Error(Errc::invalid_argument,
                "a world of " + std::to_string(world.processes) +
                    " processes, but neither MPI nor Gloo is in use (expected dist::init() under mpirun or srun, or "
                    "make_world in a torchrun-style job of a build with Gloo, MGPU_WITH_GLOO)");
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
}  // namespace detail

using detail::all_ranks;
using detail::check_across;
using detail::nccl_world_communicator;
using detail::ProcessCommunicator;

std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group, comm::Options options) {
  detail::check_world(world, group);
  if (world.processes == 1) return comm::make_communicator(group, options);
  bool const host = world.devices.front().device.kind == DeviceKind::host;  // check_world: one kind
  if (detail::in_rendezvous() && !(host && detail::gloo_connected()))
    return detail::rendezvous_communicator(world, group, options);
  std::chrono::milliseconds const timeout = check_across(world, options);
  if (host)
    return std::make_unique<ProcessCommunicator>(detail::subset_of(world, all_ranks(world)), group, timeout,
                                                 world.size(), true);
  return nccl_world_communicator(world, group, timeout);
}

std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group,
                                                      std::vector<int> const& world_ranks, comm::Options options) {
  detail::check_world(world, group);
  detail::Subset const subset = detail::subset_of(world, world_ranks);
  if (subset.world.processes == 1) return comm::make_communicator(group, subset.locals, options);
  std::chrono::milliseconds const timeout = check_across(subset.world, options);
  if (subset.world.devices.front().device.kind == DeviceKind::cuda)  // check_world: one kind
    return detail::nccl_subset_communicator(subset, group, timeout, world.size());
  return std::make_unique<ProcessCommunicator>(subset, group, timeout, world.size(), false);
}

}  // namespace mgpu::dist
