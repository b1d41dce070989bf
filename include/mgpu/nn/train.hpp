// One supervised classification step and evaluation, with what a training loop needs around the
// model: mixed-precision input conversion, dynamic loss scaling with overflow skipping, clipping by
// global norm, the optimizer step and the refresh of compute-type weights.
#pragma once

#include <cstdint>

#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/optim.hpp>

namespace mgpu::nn {

struct StepOptions {
  /// Multiplies the optimizer's learning rate (schedules, warm-up).
  float lr_scale = 1.0f;
  /// Clip gradients to this global norm; 0 turns clipping off.
  float clip_norm = 0.0f;
  /// Dynamic loss scaling (float16 training); nullptr for none.
  optim::LossScaler* scaler = nullptr;
};

struct StepResult {
  /// The batch's mean loss, a one-element float32 tensor on the model's device (read it with
  /// ops::item; reading synchronizes, so a loop reads it only when it reports).
  Tensor loss;
  /// False when the loss scaler found NaN or Inf gradients and the update was skipped.
  bool applied = true;
};

/// Forward, softmax cross-entropy against `labels` (float32 class ids), backward, optimizer step.
/// `x` is float32 or the model's compute type, on ctx's device; the model must be in training mode.
StepResult classification_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& labels, Context& ctx,
                               StepOptions const& options = {});

/// Rows of `x` whose predicted class equals the label, counted in evaluation mode over batches of
/// `batch` rows (the model is put back in training mode after). Synchronizes ctx's stream.
std::int64_t count_correct(Sequential& model, Tensor const& x, Tensor const& labels, Context& ctx, std::int64_t batch = 1024);

}  // namespace mgpu::nn
