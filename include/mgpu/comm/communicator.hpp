// Collectives between the ranks of a DeviceGroup; the design notes are in docs/architecture.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/comm/reduce_op.hpp>
#include <mgpu/core/deadline.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::comm {

/// Which implementation a communicator uses.
enum class Backend {
  automatic,  ///< host for host devices; NCCL for distinct GPUs; CUDA peer for GPUs shared by ranks or without NCCL
  host,       ///< in-process, one participant per host device
  nccl,       ///< NCCL, all GPUs of the group in one process
  cuda_peer,  ///< CUDA peer copies and reduction kernels (several logical devices on one GPU)
};

std::string_view to_string(Backend backend) noexcept;

/// core's default deadline ($MGPU_COMM_TIMEOUT seconds, else 300 s) under its comm names.
using mgpu::default_timeout;
using mgpu::timeout_env_var;

struct Options {
  Backend backend = Backend::automatic;
  /// A rank's wait for the others in one operation before the abort; zero: default_timeout().
  std::chrono::milliseconds timeout{0};
};

/// The backend Backend::automatic picks for `group`.
Backend choose_backend(DeviceGroup const& group);

/// A communicator over every rank of a DeviceGroup. Each rank calls an operation from its own
/// thread with its own stream; the call checks its arguments and enqueues the work. Every rank must
/// issue the same operations in the same order. When a rank fails or misses the deadline, the
/// others' streams fail with Error(communication) or Error(timeout) naming the operation, and later
/// calls throw Error(communication). Host results are bitwise deterministic.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(Communicator const&) = delete;
  Communicator& operator=(Communicator const&) = delete;

  [[nodiscard]] virtual int size() const noexcept = 0;
  [[nodiscard]] virtual Backend backend() const noexcept = 0;
  [[nodiscard]] virtual std::chrono::milliseconds timeout() const noexcept = 0;
  /// The world rank of this process's first device (0 within one process).
  [[nodiscard]] virtual int first_rank() const noexcept { return 0; }

  /// recv = op over ranks of send. send and recv have the same numel and dtype; recv may be send.
  virtual void all_reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) = 0;
  /// recv (n elements) = op over ranks of send's rank-th block of n (send has size()*n elements).
  /// recv may be that block of send (in place).
  virtual void reduce_scatter(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, Stream& stream) = 0;
  /// recv (size()*n elements) = every rank's send (n elements), in rank order. send may be recv's
  /// rank-th block (in place).
  virtual void all_gather(int rank, Tensor const& send, Tensor const& recv, Stream& stream) = 0;
  /// buffer = root's buffer, on every rank.
  virtual void broadcast(int rank, Tensor const& buffer, int root, Stream& stream) = 0;
  /// root's recv = op over ranks of send; recv is only written on root (other ranks may pass send).
  virtual void reduce(int rank, Tensor const& send, Tensor const& recv, ReduceOp op, int root, Stream& stream) = 0;
  /// Sends `send` to rank `peer`, which must post a matching recv (host sends up to 4 MiB are
  /// eager). finalize() reports sends that were never received.
  virtual void send(int rank, Tensor const& send, int peer, Stream& stream) = 0;
  /// Receives into `recv` what rank `peer` sends.
  virtual void recv(int rank, Tensor const& recv, int peer, Stream& stream) = 0;
  /// Returns on each rank's stream only when every rank has reached it.
  virtual void barrier(int rank, Stream& stream) = 0;

  /// The rank's operations between group_start and group_end launch together at group_end, so
  /// sends and receives in a group cannot deadlock each other.
  virtual void group_start(int rank) = 0;
  virtual void group_end(int rank) = 0;

  /// Aborts: operations waiting now and later fail with Error(communication). Never throws.
  virtual void abort(std::string_view reason) noexcept = 0;
  [[nodiscard]] virtual bool aborted() const noexcept = 0;
  /// Waits for every enqueued operation to finish, then throws Error(communication) if the
  /// communicator was aborted.
  virtual void finalize() = 0;

 protected:
  Communicator() = default;
};

/// A communicator for every rank of `group`. The group must outlive it. Throws
/// Error(invalid_argument) when the requested backend cannot serve the group's devices, and
/// Error(device) when it is not built in.
std::unique_ptr<Communicator> make_communicator(DeviceGroup& group, Options options = {});

/// A communicator over some ranks of `group`: its rank i is the group's rank ranks[i]. Throws
/// Error(invalid_argument) for an empty list, a repeated or out-of-range rank, or a backend that
/// cannot serve the subset's devices.
std::unique_ptr<Communicator> make_communicator(DeviceGroup& group, std::vector<int> const& ranks, Options options = {});

}  // namespace mgpu::comm
