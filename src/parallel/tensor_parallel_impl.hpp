// TensorParallel's state, shared by its steps (tensor_parallel.cpp) and its moves of the whole
// model and checkpoints (tensor_parallel_checkpoint.cpp).
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/comm/mesh.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "comm/renewable.hpp"

namespace mgpu::parallel {

namespace detail {
// The gradient sync of a rank's shard (tensor_parallel.cpp).
class TensorParallelSync;
class GradientSync;
// `t`'s float32 values on the host, once `stream` has written them.
std::vector<float> host_copy(Tensor const& t, Stream& stream);
}  // namespace detail

struct TensorParallel::Impl {
  DeviceGroup* group = nullptr;
  nn::Sequential whole;  // the architecture
  // Rank `rank`'s shard over `comm`'s ranks: parallelize(whole) with the options' styles.
  std::function<nn::Sequential(std::shared_ptr<comm::Communicator> comm, int rank)> make_shard;
  TensorParallelOptions options;
  int replicas = 1, ranks = 1;  // A and T
  comm::DeviceMesh mesh{{{"tp", 1}}};  // dp A x tp T over the grid's ranks
  int first = 0;                // the grid rank of the group's rank 0 (across processes, its world rank)
  // Across processes: over every rank of the world (null in one process).
  std::shared_ptr<comm::Communicator> world;
  // Each replica's tensor-parallel group, and (A > 1) each tensor-parallel index's replicas; across
  // processes null where this process drives none of the ranks.
  std::vector<std::shared_ptr<comm::Communicator>> comms;
  std::vector<std::shared_ptr<comm::detail::Renewable>> data;
  // Over every rank (the world's across processes; comms[0] for one replica): the step's commit point.
  std::shared_ptr<comm::Communicator> all;
  std::vector<nn::Sequential> shards;
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers;
  std::vector<std::optional<optim::LossScaler>> scalers;  // per rank of this process, alike
  std::vector<std::unique_ptr<detail::TensorParallelSync>> syncs;
  // With replicas: per tensor-parallel index, the data-parallel gradient sync of its replicas (null
  // where this process drives none of them).
  std::vector<std::unique_ptr<detail::GradientSync>> data_syncs;
  // Every data-parallel sync's optimizer state whole again (before a save or load; the next step
  // shards it again); with zero_stage 3 the parameters too.
  void gather_optimizer_state();
  // zero_stage 3: every shard's parameters whole (gather_whole), or each rank keeping its owned
  // ones only (shard_parameters); nothing otherwise. Collective over each tensor-parallel index's replicas.
  void gather_whole();
  void shard_parameters();
  // Checkpoint folders (tensor_parallel_checkpoint.cpp): each rank of replica 0 writes its boxes of
  // the named tensors; every rank reads the boxes it holds from a folder of any layout.
  void save_boxes(std::filesystem::path const& path, io::TrainingState const& state);
  io::TrainingState load_boxes(io::ShardedCheckpoint const& checkpoint);
  // The optimizers of this process's ranks of tensor-parallel index t, in replica order.
  [[nodiscard]] std::vector<optim::Optimizer*> replica_optimizers(std::size_t t) const;
  std::vector<std::unique_ptr<nn::Loss>> losses;  // per rank of this process
  // The communicators above, in the order they were made, made anew after a failed step.
  std::vector<comm::detail::Renewable*> renewable;
  // Why the executor cannot be used (empty: it can).
  std::string broken;
  // With options.metrics: each local rank's step, between events at its start and end.
  std::vector<Event> step_start, step_end;
  void report_times();
  // After a step failed inside: waits for every stream; when no rank had passed the step's commit
  // point (TensorParallelSync::finish), makes the communicators anew (across processes with the
  // other processes) and puts back `before`; otherwise the executor cannot be used. Rethrows `failure`.
  // What a failed step puts back: per rank, the shard's RNG, the optimizer's step count and the
  // loss scaler's state, as the step found them.
  struct Before {
    std::vector<std::vector<std::uint64_t>> rng;
    std::vector<std::int64_t> steps;
    std::vector<std::optional<optim::LossScaler::State>> scalers;
  };
  [[noreturn]] void recover(std::exception_ptr failure, Before const& before);
  // A float32 buffer laid out as each rank's shard's parameters (the master parameters, or an
  // optimizer state buffer): `buffer(rank)` gives this process's rank's.
  using ShardBuffer = std::function<Tensor(int rank)>;
  // The buffers of replica 0's ranks put together in the whole model's flat layout (the split parts
  // from every rank, the replicated ones from rank 0), on every process: across processes every
  // rank's is all-gathered over the world, so every process calls it.
  [[nodiscard]] std::vector<float> to_whole(ShardBuffer const& buffer);
  // Fills each of this process's ranks' buffers with its part of `whole` (the whole model's layout).
  void from_whole(std::span<float const> whole, ShardBuffer const& buffer);
};

}  // namespace mgpu::parallel
