// Model parallelism: a Sequential cut into chunks over a DeviceGroup, trained by running any valid
// pipeline Schedule. The partitioner and executor are described in docs/parallel-layouts.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/memory_model.hpp>
#include <mgpu/parallel/mesh.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/schedule.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::pipeline {

/// Layer split (plain model parallelism): one micro-batch through the devices in turn.
Schedule layer_split(int devices);

/// Where a model is cut: chunk c runs layers [cuts[c], cuts[c + 1]) on device device[c].
struct Partition {
  std::vector<std::size_t> cuts;
  std::vector<double> chunk_seconds;  ///< per chunk: one micro-batch's forward + backward
  std::vector<int> device;
  /// Per chunk: its peak bytes, and the free bytes it was fitted into (0 and infinity: unmodelled).
  std::vector<double> chunk_bytes;
  std::vector<double> free_bytes;
};

/// The plan as text, one line per chunk: device, layers, predicted time, memory against free.
std::string to_string(Partition const& plan);

/// Cuts `model` between units into `chunks` chunks minimizing the slowest's summed `layer_seconds`
/// (equal devices, no memory limits). Throws Error(invalid_argument) for fewer units than chunks
/// or costs that do not match the layers.
Partition partition(nn::Sequential const& model, int chunks, std::vector<double> const& layer_seconds);

/// A device as the partitioner sees it: its relative speed, and the bytes a pipeline may use on it.
struct StageDevice {
  double speed = 1.0;
  double free_bytes = std::numeric_limits<double>::infinity();
};

/// `group`'s `devices` pipeline devices (each its slowest replica rank, least free memory), from
/// sched::node_state(group). Throws Error(invalid_argument) unless `devices` divides group.size().
std::vector<StageDevice> stage_devices(DeviceGroup const& group, int devices);

/// Per-layer costs for partitioning, one entry per layer (a unit's cost sits on its first layer).
struct LayerProfile {
  std::vector<double> seconds;           ///< forward + backward of a micro-batch, speed-1 device
  std::vector<double> parameter_bytes;   ///< the layer's float32 parameters
  std::vector<double> activation_bytes;  ///< what a micro-batch's forward leaves until its backward
};

/// Returns the seconds `run` (a unit's forward + backward on rank 0) took; empty: the steady clock.
using ProfileTimer = std::function<double(std::function<void()> const& run)>;

/// Each unit's median time of `repeats` on `group`'s rank 0 (scaled to the fastest device) and
/// activation bytes.
LayerProfile profile_layers(nn::Sequential const& model, DeviceGroup& group, Shape const& input, int repeats = 3,
                            ProfileTimer const& timer = {});

struct PartitionOptions {
  /// float32 copies of the parameters the optimizer keeps (SGD: 0, with momentum 1; AdamW: 2).
  int optimizer_states = 1;
};

/// Cuts `model` between units into schedule.chunks() chunks on `devices` (one per schedule device),
/// minimizing the slowest chunk's time among the splits that fit (exact). Throws
/// Error(invalid_argument) for sizes that do not match, Error(out_of_memory) when no split fits,
/// naming the chunk and device that come closest, the bytes needed and free.
Partition partition(nn::Sequential const& model, Schedule const& schedule, LayerProfile const& profile,
                    std::vector<StageDevice> const& devices, PartitionOptions options = {});

/// Tensor-parallel pipeline stages: every stage split over `ranks` devices (see Executor).
struct TensorParallelStages {
  int ranks = 1;  ///< the ranks per stage (1: no tensor parallelism)
  /// Rank `rank`'s shard of the model's layers [begin, end), its collectives over `comm`.
  std::function<nn::Sequential(std::shared_ptr<comm::Communicator> const& comm, int rank, std::size_t begin,
                               std::size_t end)>
      stage{};
  /// The loss of rank `rank`'s last stage over `comm` (replaces ExecutorOptions::loss).
  std::function<std::shared_ptr<nn::Loss const>(std::shared_ptr<comm::Communicator> const& comm, int rank)> loss{};
  /// Sequence parallelism: LayerNorm gradients summed over the chunk's ranks.
  bool sequence_parallel = false;
  /// For each layer of stage(comm, rank, begin, end), the index of the model's layer it was made
  /// from (checkpoints name the chunk's tensors by it); empty: the stage's layers are the model's
  /// [begin, end), one for one.
  std::function<std::vector<std::size_t>(std::shared_ptr<comm::Communicator> const& comm, int rank, std::size_t begin,
                                         std::size_t end)>
      origins{};
};

/// `whole`'s (the executor's model's) tensor-parallel stages over `ranks` ranks per stage: rank r's
/// stage of layers [begin, end) holds the layers of parallelize(whole, plan) made from them; the
/// loss is `loss`'s (empty: vocab_parallel_loss). Throws Error(invalid_argument) for ranks < 1, as
/// vocab_parallel_loss does, and as parallelize() does when the executor makes the stages.
[[nodiscard]] TensorParallelStages tensor_parallel_stages(nn::Sequential const& whole,
                                                          parallel::TensorParallelPlan plan, int ranks,
                                                          parallel::MakeLoss loss = {});

struct ExecutorOptions {
  std::uint64_t seed = 0;  ///< the chunks initialised as the whole model's materialize(seed)
  /// Replicas of the pipeline: the group has devices x data_parallel x tensor_parallel.ranks ranks.
  int data_parallel = 1;
  /// ZeRO over the replicas (parallel::max_zero_stage; docs/parallel-layouts.md): 0 to 3; at 3 each
  /// unit gathered per pass (with zero bubble for the input half: the weight half reads no parameters).
  int zero_stage = 0;
  std::chrono::milliseconds timeout{0};  ///< the communicator's deadline (zero: comm::default_timeout())
  /// float32, or bfloat16/float16 with float32 masters: what chunks compute in and send.
  DType compute = DType::float32;
  /// Dynamic loss scaling (float16): a step with NaN or Inf in any chunk's gradients is skipped.
  std::optional<optim::LossScaler> loss_scaler{};
  float clip_norm = 0.0f;                       ///< the global norm over every chunk to clip to, > 0; 0: off
  std::shared_ptr<nn::Loss const> loss{};       ///< the last stage's loss (nullptr: nn::SoftmaxCrossEntropy)
  std::shared_ptr<trace::Timeline> timeline{};  ///< where every action is recorded; nullptr for none
  /// Tensor-parallel stages (ranks > 1: a data x tensor x pipeline grid, see Executor).
  TensorParallelStages tensor_parallel{};
  /// Every communicator's maker (dp x tp x pp over the group passed; its options, not `timeout`).
  std::shared_ptr<parallel::Mesh> mesh{};
  /// Makes the transfers' communicator (across processes dist::communicator_factory(world)).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> make_communicator{};
  /// Across processes with tensor-parallel stages or ZeRO: dist::subset_communicator_factory(world).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, std::vector<int> const&, comm::Options)>
      make_subset_communicator{};
  /// Where each device's compute and wait times are reported every step; nullptr: not measured.
  std::shared_ptr<metrics::Registry> metrics{};
};

/// Each device's compute actions in order, as the memory model walks them (parallel::GptLayout::passes).
[[nodiscard]] std::vector<std::vector<parallel::GptPass>> memory_passes(Schedule const& schedule);

/// Makes one optimizer (each chunk gets its own, for its own parameters).
using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>()>;
/// Makes the optimizer of one chunk, given the chunk (e.g. decay_ranges = chunk.matrix_ranges()).
using ChunkOptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(nn::Sequential const& chunk)>;

/// Runs a schedule over a DeviceGroup: chunk c on rank c % devices of each replica, optionally in a
/// data x tensor x pipeline grid and across processes. A failed step changes nothing, unless it
/// failed in the update: then step() and save() throw Error(invalid_argument) until load(). The
/// group must outlive it; call from one thread.
class Executor {
 public:
  /// Cuts `model` at `cuts` (schedule.chunks() + 1 increasing cut points from 0 to model.size()),
  /// for a schedule of group.size() devices. Throws Error(invalid_argument) naming what is wrong.
  Executor(nn::Sequential const& model, DeviceGroup& group, std::vector<std::size_t> cuts, Schedule schedule,
           OptimizerFactory make_optimizer, ExecutorOptions options = {});
  /// As above, with an optimizer made for each chunk from the chunk.
  Executor(nn::Sequential const& model, DeviceGroup& group, std::vector<std::size_t> cuts, Schedule schedule,
           ChunkOptimizerFactory make_optimizer, ExecutorOptions options = {});
  ~Executor();
  Executor(Executor const&) = delete;
  Executor& operator=(Executor const&) = delete;

  /// Forward and backward of every micro-batch, leaving the mean-loss float32 master gradients
  /// unscaled and summed over the replicas (zero_stage 1 to 3: the owned blocks); returns the mean loss.
  /// Throws Error(invalid_argument), before any action, for fewer rows than micro-batches, an x
  /// that does not fit the model, or labels the loss refuses.
  float compute_gradients(Tensor const& x, Tensor const& labels);
  /// compute_gradients(), then every chunk's update through nn::apply_update (none on overflow);
  /// synchronizes. Throws Error(invalid_argument) for an lr_scale that is not finite and >= 0.
  float step(Tensor const& x, Tensor const& labels, float lr_scale = 1.0f);
  /// Copies replica 0's master parameters into `whole` (on `stream`'s device). Throws
  /// Error(invalid_argument) for a model of another parameter count.
  void gather_parameters(nn::Sequential& whole, Stream& stream);
  /// Copies `whole`'s master parameters into every replica's chunks.
  void scatter_parameters(nn::Sequential const& whole, Stream& stream);
  /// Saves the model in io::save_training's format (across processes a folder; collective),
  /// atomically. Throws Error(invalid_argument) for chunks' unequal optimizer states, Error(io).
  void save(std::filesystem::path const& path, io::TrainingState const& state = {});
  /// Loads any layout's save into every replica (each rank its shard), verifying all first: on an
  /// error the executor is unchanged and the Error names the mismatch or damage (file and record).
  io::TrainingState load(std::filesystem::path const& path);
  /// load() of a folder already opened, reading only the pieces this process's chunks hold.
  io::TrainingState load(io::ShardedCheckpoint const& checkpoint);
  [[nodiscard]] bool last_step_applied() const noexcept;  ///< whether the last step() updated the parameters
  [[nodiscard]] optim::LossScaler const* loss_scaler() const noexcept;  ///< the loss scaler (nullptr without one)

  [[nodiscard]] Schedule const& schedule() const noexcept;
  [[nodiscard]] std::vector<std::size_t> const& cuts() const noexcept;
  /// Chunk c's layers, parameters and gradients in `replica`; read them after a step.
  [[nodiscard]] nn::Sequential& chunk(int c, int replica = 0);
  /// Wall seconds of the last step's schedule run (from the first action to the last device done).
  [[nodiscard]] double last_step_seconds() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu::pipeline
