// DataParallel's state (DataParallel::Impl), shared by the executor (data_parallel.cpp) and its
// checkpoint records (data_parallel_checkpoint.cpp). Internal: not installed.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "comm/agreement.hpp"
#include "parallel/gradient_sync.hpp"

namespace mgpu::parallel {

// 64-bit values as pairs of 32-bit words, for all_gather_words.
using comm::detail::append_words;
using comm::detail::read_words;

struct DataParallel::Impl {
  struct Rank;
  // One step's split of the global batch over the used ranks, made once from the shard weights the
  // step starts with and passed down to the scatter, each rank's step, the loss and the rebalancing.
  struct ShardPlan {
    std::int64_t global_rows = 0;
    std::vector<std::int64_t> rows;     // per used rank
    std::vector<std::int64_t> offsets;  // each rank's first row in the global batch
    std::int64_t global_units = 0;      // what the loss counts in the global batch: its divisor
  };

  DeviceGroup* group = nullptr;
  std::unique_ptr<DeviceGroup> owned;
  std::vector<int> ranks;
  DataParallelOptions options;
  std::vector<double> weights;
  std::vector<std::unique_ptr<Rank>> state;
  std::unique_ptr<detail::GradientSync> sync;  // after state: destroyed first, draining its streams
  std::int64_t micro_steps = 0;
  // Across processes: each world rank's process (numbered in world rank order) and, with
  // rebalancing, its measured milliseconds per row (the exponentially weighted mean, 0 until it had
  // rows); the same on every process.
  std::vector<int> world_process;
  std::vector<double> world_ms_per_row;
  // Why the executor cannot be used (a step failed once updates had begun), or empty.
  std::string broken;
  void check_usable(std::string const& what) const;

  // Whether the communicator spans other processes' ranks too (see DataParallel's "Across processes").
  [[nodiscard]] bool across_processes() const;
  // Every used rank's `words` (as many on every rank), from every process, in communicator rank order.
  std::vector<std::int32_t> all_gather_words(std::vector<std::vector<std::int32_t>> const& words);

  // What a step changes before its first collective completes, put back when it fails before then.
  struct Before {
    std::vector<std::uint64_t> rng;
    std::int64_t optimizer_steps = 0;
    std::optional<optim::LossScaler::State> scaler;
  };
  [[noreturn]] void recover(std::exception_ptr failure, Before const& before, bool unobserved_updates);

  // The steps of step(), in order.
  [[nodiscard]] ShardPlan plan_shards(std::int64_t rows) const;
  // Across processes: the plan's offsets in the world's global batch and its units (`units`: this
  // process's), from every rank's row count and every process's units. Returns the first world
  // rank of the first process that `refused` its batch, or -1 when none did.
  int share_counts(ShardPlan& plan, std::int64_t units, bool refused);
  std::vector<nn::StepResult> run_ranks(ShardPlan const& plan, std::vector<Tensor> const& xs, std::vector<Tensor> const& ys, float lr_scale,
                                        bool accumulate_only);
  // Each rank's milliseconds per row in this step (its compute time, or rebalance_time's, over its
  // rows), 0 for a rank without rows.
  [[nodiscard]] std::vector<double> ms_per_row(ShardPlan const& plan) const;
  // Each rank's share of the step's loss: every rank of the world's, in rank order. Across
  // processes with rebalancing, every rank's `step_ms_per_row` goes with it into world_ms_per_row.
  std::vector<float> loss_shares(std::vector<nn::StepResult> const& results, std::vector<double> const& step_ms_per_row);
  void rebalance(std::vector<double> const& step_ms_per_row);
  [[nodiscard]] std::vector<optim::Optimizer*> optimizers() const;

  // Checkpoints: the executor's own records beside those of save_training, into `checkpoint`; with
  // `pieces` (a folder's shard) its rows of the per-rank records go there as pieces of the world's.
  void save_state(io::Checkpoint& checkpoint, io::ShardWriter* pieces = nullptr);
  struct Saved;
  Saved verify_state(io::Checkpoint const& checkpoint, std::string const& source) const;
  void restore_state(Saved const& saved);
  // Across processes or into a folder: every process writes its shard of `folder` (see save()).
  void save_shards(std::filesystem::path const& folder, io::TrainingState const& training);
  // load() of such a folder: each rank reads the optimizer state of the elements it owns.
  io::TrainingState load_shards(std::filesystem::path const& folder);
};

// One replica and what its rank keeps between steps besides its gradient sync.
struct DataParallel::Impl::Rank {
  Rank(nn::Sequential replica, std::unique_ptr<optim::Optimizer> opt) : model(std::move(replica)), optimizer(std::move(opt)) {}
  nn::Sequential model;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::optional<optim::LossScaler> scaler;
  Event start, stop;
  Tensor accumulator;
  double ms_per_row = 0;
};

// The executor's records of a checkpoint, verified against this executor.
struct DataParallel::Impl::Saved {
  std::int64_t position = 0;
  Tensor accumulator;  // flat [saved ranks x parameters], when position > 0
  std::optional<optim::LossScaler::State> scaler;
  Tensor hook_state;  // flat [saved ranks x parameters], for this executor's kind of hook
};

}  // namespace mgpu::parallel
