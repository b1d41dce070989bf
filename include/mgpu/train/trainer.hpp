// The trainer: one front door to every layout of a GPT's training (docs/parallel-layouts.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/data/tokens.hpp>
#include <mgpu/dist/dist.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/memory_model.hpp>
#include <mgpu/parallel/mesh.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>
#include <mgpu/plan/planner.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::train {

/// How ParallelConfig::validate names what it refuses: by the config's fields ("dp 3", "compute
/// bf16") or by train_gpt's flags ("--dp 3", "--precision bf16").
enum class Spelling { fields, flags };

/// What ParallelConfig::validate checks a config against, besides the model.
struct LayoutChecks {
  std::int64_t batch_size = 0;  ///< rows of a step (0: not checked)
  int devices = 1;              ///< the devices (across processes, the world's)
  Spelling spelling = Spelling::fields;
  std::string devices_text{};  ///< how the devices were named ("host:3"), for the messages
};

/// How a GPT is spread over the devices: a pipeline when `schedule` is set or `stages` > 1 (of
/// tensor-parallel stages with `tp` > 1), else tensor parallelism when `tp` > 1, else data
/// parallelism over every device when there are several, else one device.
struct ParallelConfig {
  int dp = 1;      ///< data-parallel replicas (plain data parallelism: 1 or the device count)
  int tp = 1;      ///< tensor-parallel ranks per replica (n_head divisible by it)
  int stages = 1;  ///< pipeline stages (devices per pipeline)
  /// The pipeline schedule: layer-split, gpipe, 1f1b, interleaved or zb; empty: none, unless
  /// stages > 1 (then 1f1b).
  std::string schedule{};
  int micro_batches = 1;  ///< micro-batches per pipeline step
  int chunks = 2;         ///< model chunks per device of the interleaved schedule
  /// ZeRO stage over the data-parallel replicas, plain, of tensor-parallel shards (0 to 3) or of
  /// a pipeline (0 to 3, in every precision). Unset: 1 with several replicas, else 0.
  std::optional<int> zero{};
  /// The replicas' gradient bucket cap (0: the default); set, also plain data parallelism's ZeRO-3
  /// units (else one per block).
  std::size_t bucket_cap_bytes = 0;
  bool sequence_parallel = false;            ///< with tp >= 2: each rank 1/tp of the tokens between split regions
  std::optional<nn::Recompute> recompute{};  ///< activation recomputation (unset: the GptConfig's)
  DType compute = DType::float32;            ///< float32, bfloat16 or float16, with float32 master weights
  bool loss_scaler = false;                  ///< dynamic loss scaling (float16)
  float clip_norm = 0.0f;                    ///< the global gradient norm to clip to (0: off)
  std::vector<std::size_t> cuts{};           ///< the pipeline's cuts (empty: by each layer's FLOPs)

  /// The planner's choice as a config (a 1F1B pipeline when it has stages).
  [[nodiscard]] static ParallelConfig from_plan(plan::Layout const& layout);

  [[nodiscard]] bool pipelined() const noexcept { return !schedule.empty() || stages > 1; }
  /// The schedule a pipeline runs (1f1b when none is named).
  [[nodiscard]] std::string pipeline_schedule() const { return schedule.empty() ? "1f1b" : schedule; }
  /// The devices the layout spans: dp x tp (x stages when pipelined), a pipeline's stages x dp, else dp.
  [[nodiscard]] int devices() const noexcept;
  /// Throws Error(invalid_argument) naming the field (or flag) and the value expected for what
  /// cannot run: e.g. zero outside 0 to 3, zero 3 or a bucket cap with a pipeline, sequence parallelism without tp >= 2 dividing the block size, another device
  /// count than the layout's.
  void validate(nn::GptConfig const& model, LayoutChecks const& checks) const;
};

/// What a Trainer is built with besides the model and the layout.
struct TrainerOptions {
  std::uint64_t seed = 1;  ///< the weights (gpt(config).materialize(seed) in every layout) and dropout
  /// AdamW; its decay_ranges are replaced: each model part decays its own weight matrices.
  optim::AdamWOptions adamw{};
  std::vector<float> initial_parameters{};  ///< gpt(config)'s float32 parameters to start from (empty: the seed's)
  std::int64_t batch_size = 1;              ///< rows of a step: the pipeline's cuts and validation
  /// Span every process's devices (dist::make_world, collective; needs dist::init()); else this
  /// process's group only.
  bool across_processes = false;
  std::shared_ptr<trace::Timeline> timeline{};  ///< every rank's actions while enabled
  /// Non-empty: the executors report each rank's times to a metrics::Registry of this job and the
  /// trainer's layout (metrics()); timing costs a little per action, so empty times nothing.
  std::string metrics_job{};
  Spelling spelling = Spelling::fields;  ///< how refusals name the layout
  std::string devices_text{};            ///< how the devices were named, for refusals
};

/// One pipeline chunk as the trainer cut it.
struct ChunkInfo {
  std::size_t begin = 0, end = 0;  ///< its layers [begin, end)
  int device = 0;                  ///< the device (schedule rank) that runs it
  double flops = 0;                ///< forward + backward FLOPs per micro-batch
  double parameter_bytes = 0;
};

/// The layout a Trainer runs, resolved against its devices.
struct Layout {
  std::string schedule;  ///< the pipeline schedule's name, "data-parallel", "tensor-parallel" or "none"
  int dp = 1, tp = 1, stages = 1, micro_batches = 1;
  int zero = 0;  ///< the ZeRO stage over the data-parallel replicas, plain, tensor-parallel or a pipeline's (0 with one replica)
};

/// Trains nn::gpt(config) (per-token cross-entropy, AdamW) in the layout a ParallelConfig asks
/// for, with the one-device losses within float32 rounding. Across processes every call is collective.
class Trainer {
 public:
  /// Validates `parallel` (ParallelConfig::validate) before any work, then builds its mesh dp x
  /// tp x pp over `group` (across processes with options.across_processes), which places it:
  /// with tp > 1 and several tensor-parallel groups, each group on the best links of the link
  /// matrix. Throws Error(invalid_argument) naming what is refused, or as the executor's
  /// constructor does.
  Trainer(nn::GptConfig const& config, DeviceGroup group, ParallelConfig parallel, TrainerOptions options = {});
  /// The same over a mesh the caller built (in one process, or across processes with the
  /// dist factories; options.across_processes is the mesh's): its dimensions dp, tp and pp in
  /// that order, sized as `parallel` lays the model out (plain data parallelism: dp over every
  /// device; a missing dimension counts as size 1). The executors take every communicator from
  /// it. Throws Error(invalid_argument) naming the mesh and the layout expected for another one.
  Trainer(nn::GptConfig const& config, std::shared_ptr<parallel::Mesh> mesh, ParallelConfig parallel,
          TrainerOptions options = {});
  ~Trainer();
  Trainer(Trainer const&) = delete;
  Trainer& operator=(Trainer const&) = delete;

  struct StepResult {
    float loss = 0;        ///< the batch's mean per-token cross-entropy
    bool applied = true;   ///< false when the loss scaler skipped the update
  };
  /// One step on int32 ids and targets [B, T] (host or device memory): forward, backward, clipping,
  /// AdamW at lr x `lr_scale`. Across processes each passes the whole batch; data parallelism
  /// takes this process's rows by its devices' speeds. Synchronizes.
  StepResult step(Tensor const& inputs, Tensor const& targets, float lr_scale = 1.0f);
  /// data::evaluate_lm of the whole model over `windows` windows of `loader`.
  double evaluate(data::TokenLoader const& loader, std::int64_t windows);
  /// Saves the model, optimizer and `state` in the one checkpoint format (a folder across
  /// processes): any layout may load it.
  void save(std::filesystem::path const& path, io::TrainingState const& state);
  /// Loads save() of any layout, returning its state.
  io::TrainingState load(std::filesystem::path const& path);

  /// The whole model, float32 in a pipeline, gathered from the shards or chunks (collective across
  /// processes); valid until the next step, save or load. Data parallelism: replica 0.
  nn::Sequential& gather();
  /// gather()'s float32 master parameters on the host.
  std::vector<float> parameters();
  /// Sets every part's parameters from the whole model's float32 parameters. Throws
  /// Error(invalid_argument) for another count, and with data parallelism (its replicas start
  /// from TrainerOptions::initial_parameters or load()).
  void scatter(std::span<float const> whole);
  /// Where the whole model lives: its allocator and stream.
  [[nodiscard]] nn::Context& context() noexcept;

  /// This process's devices' allocators (one device: the trainer's), for peak memory.
  [[nodiscard]] std::vector<Allocator*> allocators();
  /// The memory model's peak per device (parallel::predict_gpt_memory) of this process's devices
  /// (allocators()' order), in every layout and precision, any schedule; null for a layout the
  /// model does not cover (none today).
  [[nodiscard]] std::optional<std::vector<parallel::GptMemory>> predicted_memory() const;
  [[nodiscard]] Layout const& layout() const noexcept;
  /// The registry of TrainerOptions::metrics_job (null without one).
  [[nodiscard]] std::shared_ptr<metrics::Registry> const& metrics() const noexcept;
  [[nodiscard]] ParallelConfig const& config() const noexcept;
  [[nodiscard]] nn::GptConfig const& model_config() const noexcept;
  /// A line saying how the model is laid out, e.g. "data parallel over 4 devices, ZeRO-1".
  [[nodiscard]] std::string describe() const;
  /// The tensor-parallel groups when placement reordered the devices ("host:0, host:2 | ..."),
  /// else empty.
  [[nodiscard]] std::string const& placement() const noexcept;
  /// A pipeline's chunks (empty without one).
  [[nodiscard]] std::vector<ChunkInfo> const& chunks() const noexcept;
  [[nodiscard]] DeviceGroup& group() noexcept;  ///< the devices as placed (the mesh's)
  /// The mesh the executors take their communicators from.
  [[nodiscard]] std::shared_ptr<parallel::Mesh> const& mesh() const noexcept;
  [[nodiscard]] dist::World const& world() const noexcept;
  [[nodiscard]] std::int64_t parameter_count() const;

  /// The executor underneath, for building-block users (null when another runs).
  [[nodiscard]] parallel::DataParallel* data_parallel() noexcept;
  [[nodiscard]] parallel::TensorParallel* tensor_parallel() noexcept;
  [[nodiscard]] pipeline::Executor* pipeline() noexcept;
  /// The last data-parallel step's result (null in other layouts).
  [[nodiscard]] parallel::DataParallelResult const* last_data_parallel_step() const noexcept;
  /// The loss scaler (every rank's decides alike; null without one).
  [[nodiscard]] optim::LossScaler const* loss_scaler() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Across processes, each of a pipeline's `stages` devices as the partitioner sees it: its
/// replicas' slowest device's speed relative to the world's fastest (world rank g runs stage
/// g % stages; free memory is not modelled across processes). Every process gets the same.
[[nodiscard]] std::vector<pipeline::StageDevice> stage_devices(dist::World const& world, int stages);

/// A model's float32 master parameters on the host (synchronizes `stream`).
[[nodiscard]] std::vector<float> host_parameters(nn::Sequential const& model, Stream& stream);
/// Sets a model's master parameters (and its compute-type copy) from float32 `values`; synchronizes.
void set_parameters(nn::Sequential& model, std::span<float const> values, Stream& stream);

}  // namespace mgpu::train
