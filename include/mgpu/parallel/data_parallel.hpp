// Data parallelism: a replica per device, the batch sharded, gradients reduced in buckets during
// backward, ZeRO-1 to 3. The design is described in docs/parallel-layouts.md.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/mesh.hpp>
#include <mgpu/sched/scheduler.hpp>
#include <mgpu/sched/types.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::parallel {

/// How a bucket's float32 gradients are summed across ranks: called on each rank's thread, in
/// bucket order, enqueuing on `stream` and leaving the sum in `grads`; default a sum all-reduce.
class CommHook {
 public:
  virtual ~CommHook() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  virtual void attach(int ranks, std::vector<std::int64_t> const& bucket_elements) = 0;  ///< before any reduce
  virtual void reduce(comm::Communicator& comm, int rank, int bucket, Tensor const& grads, Allocator& allocator, Stream& stream) = 0;
  /// What the hook carries between steps for a rank's bucket (float32), which checkpoints save.
  /// What the hook carries from one step to the next for a rank's bucket, which checkpoints save:
  /// float32, one value per element of the bucket, added to the bucket's gradients by the next
  /// reduce. Undefined when there is none (the default, and before the first reduce): zeros.
  [[nodiscard]] virtual Tensor state(int /*rank*/, int /*bucket*/) const { return {}; }
  /// Replaces that state with `values`, enqueued on `stream` (the default ignores it).
  virtual void set_state(int /*rank*/, int /*bucket*/, Tensor const& /*values*/, Allocator& /*allocator*/, Stream& /*stream*/) {}
};

/// bfloat16-compressed all-reduce with float32 error feedback (the residual, saved in checkpoints).
class Bf16Compression final : public CommHook {
 public:
  std::string name() const override { return "bf16-compression"; }
  void attach(int ranks, std::vector<std::int64_t> const& bucket_elements) override;
  void reduce(comm::Communicator& comm, int rank, int bucket, Tensor const& grads, Allocator& allocator, Stream& stream) override;
  [[nodiscard]] Tensor const& residual(int rank, int bucket) const;  ///< undefined before a reduce
  Tensor state(int rank, int bucket) const override { return residual(rank, bucket); }
  void set_state(int rank, int bucket, Tensor const& values, Allocator& allocator, Stream& stream) override;

 private:
  struct Slot {
    Tensor residual, wire;
  };
  std::vector<std::vector<Slot>> slots_;  // [rank][bucket]
  std::vector<std::int64_t> elements_;
};

/// A gradient bucket: layers first_layer to last_layer, elements [begin, end), one collective.
struct Bucket {
  std::size_t first_layer = 0;
  std::size_t last_layer = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
  [[nodiscard]] std::int64_t size() const noexcept { return end - begin; }  ///< elements in the bucket
  bool operator==(Bucket const&) const = default;
};

struct DataParallelOptions {
  /// Cap of one gradient bucket, and of the first (last layers') bucket.
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  bool overlap = true;  ///< reduce and update each bucket during backward (off: after backward)
  /// ZeRO stage: 0 replicated, 1 sharded optimizer state, 2 and gradients, 3 and parameters.
  /// Stages 2 and 3 (in any compute type: float32 masters) need overlap, no comm hook, and
  /// checkpoints at the end of an accumulation cycle (Error(invalid_argument) otherwise).
  int zero_stage = 1;
  /// ZeRO-2 and 3's buckets: the model's structure parts, a block each (false: the caps' buckets).
  /// Small buckets keep stage 2's gradient staging (two of the largest bucket) below stage 1's
  /// whole gradient buffer.
  bool zero3_block_units = true;
  bool deterministic = false;             ///< bitwise repeatable whatever the buckets and thread timing
  int accumulation_steps = 1;             ///< micro-batches accumulated locally per applied step
  std::shared_ptr<CommHook> comm_hook{};  ///< how buckets are reduced (nullptr: a sum all-reduce)
  std::vector<double> weights{};          ///< shard weights per used rank (empty: the scheduler's)
  /// Re-weight shards every step from each rank's measured compute time per row (an EWMA).
  bool rebalance = false;
  double rebalance_ewma = 0.5;
  /// The compute milliseconds rebalancing counts for a rank's step (empty: the measured time).
  std::function<double(int rank, std::int64_t rows, double measured_ms)> rebalance_time{};
  bool allow_empty_shards = true;  ///< whether a used rank may get no rows
  /// Which ranks to use: with a request the scheduler picks them over node_state(group); without
  /// one, every rank.
  std::optional<sched::Request> request{};
  std::shared_ptr<sched::Scheduler const> scheduler{};  ///< default profile when empty
  std::uint64_t seed = 1;                               ///< replicas materialized from it on rank 0 and broadcast
  DType compute = DType::float32;
  std::optional<optim::LossScaler> loss_scaler{};  ///< dynamic loss scaling (float16)
  float clip_norm = 0.0f;                  ///< the global norm of the reduced gradients to clip to, > 0 (0: off)
  std::shared_ptr<nn::Loss const> loss{};  ///< what step() minimizes (nullptr: SoftmaxCrossEntropy)
  comm::Options comm{};
  /// The mesh whose communicator over every rank the replicas reduce over (its group the one
  /// passed, no dimension but one of size >= 2; make_communicator and request empty); null: the
  /// executor makes its own.
  std::shared_ptr<Mesh> mesh{};
  /// Makes the communicator (empty: comm::make_communicator; across processes
  /// dist::communicator_factory(world), or a mesh).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> make_communicator{};
  std::shared_ptr<trace::Timeline> timeline{};   ///< every rank's actions when enabled
  std::shared_ptr<metrics::Registry> metrics{};  ///< each rank's times per step (nullptr: its own)
};

/// What one step did (across processes: `loss` is the world's, the per-rank lists this process's).
struct DataParallelResult {
  float loss = 0;                  ///< the global batch's mean loss
  bool applied = true;             ///< false while accumulating, or when the loss scaler skipped the step
  std::vector<std::int64_t> rows;  ///< rows each used rank got
  /// Per used rank: milliseconds of forward and backward, and of waiting for reduces (host).
  std::vector<double> compute_ms;
  std::vector<double> wait_ms;
};

/// Data-parallel training of a Sequential over a DeviceGroup (and across processes with
/// dist::communicator_factory). Call from one thread at a time; the group must outlive it and not
/// be used by others during step(). A bad batch is refused before any rank starts; a step failing
/// inside is undone when no reduce completed, else step() and save() throw Error(invalid_argument)
/// until load(). Across processes a request is refused (Error(invalid_argument)).
class DataParallel {
 public:
  /// `model` gives the architecture (and, materialized, the weights); `optimizer` is copied per replica.
  template <class Opt>
    requires std::derived_from<Opt, optim::Optimizer>
  DataParallel(nn::Sequential model, DeviceGroup& group, Opt const& optimizer, DataParallelOptions options = {})
      : DataParallel(std::move(model), group, [optimizer] { return std::unique_ptr<optim::Optimizer>(new Opt(optimizer)); },
                     std::move(options)) {}
  DataParallel(nn::Sequential model, DeviceGroup& group, std::function<std::unique_ptr<optim::Optimizer>()> const& make_optimizer,
               DataParallelOptions options);
  DataParallel(DataParallel const&) = delete;
  DataParallel& operator=(DataParallel const&) = delete;
  ~DataParallel();

  /// One training step on the global batch x [N, ...] and labels (the loss's targets), in any
  /// memory. Throws mgpu::Error naming the rank that failed, and Error(invalid_argument) before
  /// any work for x that does not fit the model, targets the loss refuses, or an lr_scale that is
  /// not finite and >= 0.
  DataParallelResult step(Tensor const& x, Tensor const& labels, float lr_scale = 1.0f);

  /// Rows whose predicted class is the label, on rank 0's replica. Throws Error(invalid_argument)
  /// for a label that is not a class id.
  std::int64_t count_correct(Tensor const& x, Tensor const& labels, std::int64_t batch = 1024);

  /// Saves, atomically and checksummed, what makes a resumed run equal the uninterrupted one (a
  /// folder of shards across processes, collective). Throws Error(invalid_argument) for a save mid
  /// accumulation cycle at zero_stage 2 or 3.
  void save(std::filesystem::path const& path, io::TrainingState const& state);
  /// Loads a checkpoint of save() on any device count into every replica, as a new executor would,
  /// and makes an unusable executor usable. Throws, leaving the executor as it was,
  /// Error(invalid_argument) naming the mismatch for another architecture or accumulation_steps.
  io::TrainingState load(std::filesystem::path const& path);

  /// Throws Error(invalid_argument) naming the first rank and layer that differ from rank 0's.
  void verify_replicas();

  /// The used ranks, their current shard weights, and the bucket layout (last layers first).
  [[nodiscard]] std::vector<int> const& ranks() const noexcept;
  [[nodiscard]] std::vector<double> const& weights() const noexcept;
  /// Every process's rows of a global batch of `rows`, the same on every process: by measured
  /// speed once rebalancing has measured, else by `weights`. Throws Error(invalid_argument) for
  /// rows < 0, or weights of another count than the processes, not finite and >= 0 with sum > 0.
  [[nodiscard]] std::vector<std::int64_t> process_rows(std::int64_t rows, std::vector<double> const& weights) const;
  [[nodiscard]] std::vector<Bucket> const& buckets() const noexcept;
  /// A replica (index into ranks()) and its optimizer, gathered whole first with ZeRO 1 to 3.
  [[nodiscard]] nn::Sequential& replica(int index);
  [[nodiscard]] optim::Optimizer& optimizer(int index);
  /// With the sharded update, frees what replica() and the others gathered whole. Throws
  /// Error(invalid_argument) on an executor that a failed step left unusable.
  void reshard();
  [[nodiscard]] optim::LossScaler const* loss_scaler() const;  ///< replica 0's (nullptr: none)
  [[nodiscard]] DeviceGroup& group() noexcept;                 ///< the group the replicas run on

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu::parallel
