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

/// Elements [begin, end) of a model's flat buffers that an update changes; `counted`: counted in
/// the global norm and the overflow check.
struct ElementRange {
  std::int64_t begin = 0, end = 0;
  bool counted = true;
};

/// A model or a part of one (a pipeline chunk) that an update changes, on `stream`'s device.
struct UpdatePart {
  Sequential* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  Allocator* allocator = nullptr;
  Stream* stream = nullptr;
  /// Elements that another part holds too (a tied embedding's copy), counted once in the norm.
  std::int64_t shared_begin = 0, shared_end = 0;
  /// The elements updated when not all (not overlapping, no shared range then); empty: every one.
  std::vector<ElementRange> ranges = {};
  /// The gradients the update reads and float32 parameters it writes (no compute-type copies), of
  /// `ranges` packed by start as optim state is; undefined: the model's master buffers.
  Tensor gradients = {}, parameters = {};
  /// Adds the part's float32 per-range values in place with other replicas', the same bits on each.
  std::function<void(Tensor const& values, Stream& stream)> combine = {};
  /// Work enqueued after an applied update of the part.
  std::function<void(Stream& stream)> after = {};
};

/// What happens to gradients between backward and the optimizer (data parallelism). The step calls
/// begin() before backward, ready() for each layer's master-gradient range (last layer first) once
/// its work is enqueued on `compute`, and finish() after backward, all from the step's thread. With
/// a non-empty `update` the sync applies it to each range of reduced gradients; else the step
/// updates after finish(). finish() must leave `compute` ordered after the sync's work.
/// before_layer() runs before each layer's forward and backward (Sequential::BeforeLayer).
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual void begin(Stream& compute, RangeUpdate update) = 0;
  virtual void ready(ParameterRange const& range, Stream& compute) = 0;
  virtual void finish(Stream& compute) = 0;
  /// The update of this replica, given the whole model's `part`: `part` by default. A sync sets
  /// its ranges, gradients, parameters, combine and after; `update`'s ranges read and write the
  /// gradients and parameters named here too.
  [[nodiscard]] virtual UpdatePart update_part(UpdatePart part) { return part; }
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

struct UpdateOptions {
  float lr_scale = 1.0f;                ///< learning-rate multiplier, finite and >= 0
  float clip_norm = 0.0f;               ///< global norm over all parts to clip to, > 0; 0: off
  optim::LossScaler* scaler = nullptr;  ///< dynamic loss scaling; nullptr for none
  /// Unscale the compute-type gradients into the master ones first (false: backward did).
  bool unscale = true;
};

/// Adds up the parts' values of the overflow count or the norm's squares, returning their total over
/// every part, replica and process. sums[i] (float32, on part i's stream) holds a value per range
/// of part i's update, 0 for a range not counted: one per UpdatePart::ranges; with none, three:
/// the elements before shared_begin, the shared ones, those after.
using PartTotal = std::function<double(std::span<Tensor const> sums)>;

/// The update every executor applies: unscale, count overflow (skipping the update on one),
/// clip by the global norm, step each optimizer, refresh compute-type parameters. Enqueues on each
/// part's stream, from one thread; synchronizes to read the counts and norm. The values add up with
/// `total` when set, else each part's combine, then in part order in double. Returns whether the
/// optimizers stepped. Throws Error(invalid_argument) for bad options, and when clipping meets NaN
/// or Inf gradients without a scaler.
bool apply_update(std::span<UpdatePart const> parts, UpdateOptions const& options, PartTotal const& total = {});

/// Rows of `x` whose predicted class equals the label, in evaluation mode (training mode after).
std::int64_t count_correct(Sequential& model, Tensor const& x, Tensor const& labels, Context& ctx, std::int64_t batch = 1024);

}  // namespace mgpu::nn
