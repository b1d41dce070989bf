// One training step against any nn::Loss, evaluation, and the one update every executor applies
// (apply_update). The design notes are in docs/architecture.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>

namespace mgpu::trace {
class Timeline;
}

namespace mgpu::nn {

/// Applies the optimizer to master parameters [begin, end) on `stream`, where their gradients are.
using RangeUpdate = std::function<void(std::int64_t begin, std::int64_t end, Stream& stream)>;

/// Elements [begin, end) of the flat buffers that a data-parallel rank updates in a sharded update;
/// `counted`: this rank counts them in the global norm and the overflow check.
struct OwnedRange {
  std::int64_t begin = 0, end = 0;
  bool counted = true;
};

/// What happens to gradients between backward and the optimizer (data parallelism). The step calls
/// begin() before backward, ready() for each layer's master-gradient range (last layer first) once
/// its work is enqueued on `compute`, and finish() after backward, all from the step's thread. With
/// a non-empty `update` the sync applies it to each range of reduced gradients; else the step
/// updates after finish(). finish() must leave `compute` ordered after the sync's work. A sync may
/// shard the update (owned()), the gradients (owned_gradients()) and the parameters
/// (owned_parameters(), before_layer()): ZeRO-1 to 3.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual void begin(Stream& compute, RangeUpdate update) = 0;
  virtual void ready(ParameterRange const& range, Stream& compute) = 0;
  virtual void finish(Stream& compute) = 0;
  [[nodiscard]] virtual std::vector<OwnedRange> owned() const { return {}; }
  /// Sums float32 `values` over the ranks in place on `compute`, bitwise the same on every rank.
  virtual void sum_over_ranks(Tensor const& /*values*/, Stream& /*compute*/) {}
  virtual void gather_updated(Stream& /*compute*/) {}
  /// With sharded gradients, the reduced gradients of owned(), packed; else undefined.
  [[nodiscard]] virtual Tensor owned_gradients() const { return {}; }
  /// With sharded parameters, the float32 parameters of owned(), packed; else undefined.
  [[nodiscard]] virtual Tensor owned_parameters() const { return {}; }
  virtual void before_layer(std::size_t /*layer*/, bool /*backward*/, Stream& /*compute*/) {}
};

struct StepOptions {
  float lr_scale = 1.0f;                ///< learning-rate multiplier, finite and >= 0
  float clip_norm = 0.0f;               ///< global gradient norm to clip to, > 0; 0: off
  optim::LossScaler* scaler = nullptr;  ///< dynamic loss scaling; nullptr for none
  /// The counted units of the global batch that x is a shard of (0: x is the whole batch).
  std::int64_t global_units = 0;
  std::int64_t global_rows = 0;  ///< deprecated: global_units for a loss that counts rows
  float grad_scale = 1.0f;       ///< multiplies the loss gradient (e.g. 1/k for k micro-batches)
  /// Gradient accumulation (float32, the parameter count): `accumulate_only` adds into it without
  /// updating; otherwise it is added into the gradients and zeroed. None with sharded gradients.
  Tensor const* accumulator = nullptr;
  bool accumulate_only = false;
  GradientSync* sync = nullptr;         ///< between backward and update; nullptr on one device
  trace::Timeline* timeline = nullptr;  ///< records forward, backward and update spans for `rank`
  int rank = 0;
};

struct StepResult {
  /// The mean loss, float32 [1] on the model's device (a shard: its share of the global mean).
  Tensor loss;
  /// False when the scaler skipped the update on overflow, or the step only accumulated.
  bool applied = true;
};

/// What check_batch checks a step's batch against besides the model and the loss.
struct BatchCheck {
  float lr_scale = 1.0f;           ///< finite and >= 0
  DType compute = DType::float32;  ///< x of values may be float32 or this
  bool part = false;               ///< a part of a batch, which may have no rows
  bool values = true;              ///< read the values of host ids and targets
};

/// Checks a step's inputs on the host before any device work: x [rows >= 1 unless check.part, ...]
/// of token ids in [0, V) or float32 or the compute type, a shape the model parts take, targets
/// that fit its output with valid values, lr_scale. Returns the output shape. Throws
/// Error(invalid_argument) prefixed by `what`, naming the first bad value and its row and position.
Shape check_batch(std::span<Sequential const* const> parts, Loss const& loss, Tensor const& x, Tensor const& targets,
                  BatchCheck const& check, std::string const& what);
Shape check_batch(Sequential const& model, Loss const& loss, Tensor const& x, Tensor const& targets, BatchCheck const& check,
                  std::string const& what);

/// Forward, `loss` against `targets`, backward, and the update (apply_update), on ctx's device; the
/// model in training mode. x: float32, the compute type or int32 ids; 0 rows only for a shard.
/// Throws Error(invalid_argument) before any work, changing nothing, for a batch check_batch
/// refuses or bad options. A whole batch's step whose work fails on the stream later is put back
/// by the next call.
StepResult train_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& targets, Loss const& loss,
                      Context& ctx, StepOptions const& options = {});

/// train_step with softmax cross-entropy against `labels` (float32 class ids).
StepResult classification_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& labels, Context& ctx,
                               StepOptions const& options = {});

/// A model or a part of one (a pipeline chunk) that an update changes, on `stream`'s device.
struct UpdatePart {
  Sequential* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  Allocator* allocator = nullptr;
  Stream* stream = nullptr;
  /// Elements that another part holds too (a tied embedding's copy), counted once in the norm.
  std::int64_t shared_begin = 0, shared_end = 0;
  /// A replica whose sync shards the update; nullptr for a part that updates everything.
  GradientSync* sharded = nullptr;
};

struct UpdateOptions {
  float lr_scale = 1.0f;                ///< learning-rate multiplier, finite and >= 0
  float clip_norm = 0.0f;               ///< global norm over all parts to clip to, > 0; 0: off
  optim::LossScaler* scaler = nullptr;  ///< dynamic loss scaling; nullptr for none
  /// Unscale the compute-type gradients into the master ones first (false: backward did).
  bool unscale = true;
};

/// The update every executor applies: unscale, count overflow (skipping the update on one),
/// clip by the global norm, step each optimizer, refresh compute-type parameters. Enqueues on each
/// part's stream, from one thread; synchronizes to read the counts and norm. Returns whether the
/// optimizers stepped. Throws Error(invalid_argument) for bad options, and when clipping meets NaN
/// or Inf gradients without a scaler.
bool apply_update(std::span<UpdatePart const> parts, UpdateOptions const& options);

/// Rows of `x` whose predicted class equals the label, in evaluation mode (training mode after).
std::int64_t count_correct(Sequential& model, Tensor const& x, Tensor const& labels, Context& ctx, std::int64_t batch = 1024);

}  // namespace mgpu::nn
