// One supervised classification step and evaluation, with what a training loop needs around the
// model: mixed-precision input conversion, dynamic loss scaling with overflow skipping, clipping by
// global norm, the optimizer step and the refresh of compute-type weights.
#pragma once

#include <cstdint>
#include <functional>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/optim.hpp>

namespace mgpu::trace {
class Timeline;
}

namespace mgpu::nn {

/// Applies the optimizer to master parameters [begin, end) on `stream`, where their reduced
/// gradients are ready: what classification_step gives a GradientSync for the step.
using RangeUpdate = std::function<void(std::int64_t begin, std::int64_t end, Stream& stream)>;

/// What happens to gradients between backward and the optimizer: the seam through which
/// data-parallel training reduces them in buckets of its own while backward goes on. The step
/// calls begin() before backward, ready() for each layer's range of float32 master gradients (last
/// layer first) once the work writing them is enqueued on `compute`, and finish() after backward.
/// With a non-empty `update` the sync calls it once for each range of reduced gradients, on the
/// stream where they are ready (the step then updates nothing itself); with an empty one the step
/// updates every parameter after finish(). finish() must leave `compute` ordered after all of the
/// sync's work. All calls come from the thread running the step.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual void begin(Stream& compute, RangeUpdate update) = 0;
  virtual void ready(ParameterRange const& range, Stream& compute) = 0;
  virtual void finish(Stream& compute) = 0;
};

struct StepOptions {
  /// Multiplies the optimizer's learning rate (schedules, warm-up): finite and >= 0.
  float lr_scale = 1.0f;
  /// Clip gradients to this global norm, finite and > 0; 0 turns clipping off.
  float clip_norm = 0.0f;
  /// Dynamic loss scaling (float16 training); nullptr for none.
  optim::LossScaler* scaler = nullptr;
  /// Rows of the global batch that x is a shard of (0: x is the whole batch). The loss gradient
  /// is scaled by rows / global_rows, so summing the shards' gradients gives the gradient of the
  /// global batch's mean loss, for any shard sizes (empty shards included).
  std::int64_t global_rows = 0;
  /// Multiplies the loss gradient (e.g. 1/k for k accumulated micro-batches).
  float grad_scale = 1.0f;
  /// Gradient accumulation: a float32 buffer of the model's parameter count. With
  /// `accumulate_only` the step adds its gradients into it and does not update; otherwise the
  /// buffer is added into the step's gradients before they are reduced and applied, and zeroed.
  Tensor const* accumulator = nullptr;
  bool accumulate_only = false;
  /// Between backward and update (data parallelism); nullptr on one device.
  GradientSync* sync = nullptr;
  /// Records forward, backward and update spans for `rank` when set and enabled.
  trace::Timeline* timeline = nullptr;
  int rank = 0;
};

struct StepResult {
  /// The batch's mean loss, a one-element float32 tensor on the model's device (read it with
  /// ops::item; reading synchronizes, so a loop reads it only when it reports). For a shard, the
  /// shard's mean (0 for an empty shard).
  Tensor loss;
  /// False when the loss scaler found NaN or Inf gradients and the update was skipped, or when
  /// the step only accumulated.
  bool applied = true;
};

/// Forward, softmax cross-entropy against `labels` (float32 class ids), backward, optimizer step.
/// `x` is float32 or the model's compute type, on ctx's device; the model must be in training mode.
/// x may have 0 rows (an empty data-parallel shard): its gradients are zero. Without a loss
/// scaler and clipping, each layer is updated as soon as its (reduced) gradients are ready.
/// The same function runs one device and every replica of parallel::DataParallel.
StepResult classification_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& labels, Context& ctx,
                               StepOptions const& options = {});

/// Rows of `x` whose predicted class equals the label, counted in evaluation mode over batches of
/// `batch` rows (the model is put back in training mode after). Synchronizes ctx's stream.
std::int64_t count_correct(Sequential& model, Tensor const& x, Tensor const& labels, Context& ctx, std::int64_t batch = 1024);

}  // namespace mgpu::nn
