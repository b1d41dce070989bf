// Optimizers over a model's flat buffers, learning-rate schedules, the linear scaling rule, and
// clipping by global norm.
#pragma once

#include <cstdint>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::optim {

struct SgdOptions {
  float lr = 0.1f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

/// SGD with momentum (PyTorch's formulation: v = m v + g + wd p; p -= lr (v, or g + m v with
/// Nesterov)), one fused pass over the flat buffers.
class SGD {
 public:
  explicit SGD(SgdOptions options = {}) : options_(options) {}
  /// Updates params from grads; the velocity buffer is allocated on first use in `allocator`.
  void step(Tensor const& params, Tensor const& grads, Allocator& allocator, Stream& stream, float lr_scale = 1.0f);
  [[nodiscard]] SgdOptions const& options() const noexcept { return options_; }
  [[nodiscard]] Tensor const& velocity() const noexcept { return velocity_; }

 private:
  SgdOptions options_;
  Tensor velocity_;
};

struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

/// AdamW (decoupled weight decay), one fused pass.
class AdamW {
 public:
  explicit AdamW(AdamWOptions options = {}) : options_(options) {}
  void step(Tensor const& params, Tensor const& grads, Allocator& allocator, Stream& stream, float lr_scale = 1.0f);
  [[nodiscard]] std::int64_t steps() const noexcept { return step_; }

 private:
  AdamWOptions options_;
  Tensor m_, v_;
  std::int64_t step_ = 0;
};

/// Learning-rate multipliers at a step.
float constant_lr(std::int64_t step);
/// gamma^(step / every).
float step_lr(std::int64_t step, std::int64_t every, float gamma);
/// Cosine from 1 down to `floor` over `total` steps.
float cosine_lr(std::int64_t step, std::int64_t total, float floor = 0.0f);
/// Linear warm-up from 1/warmup to 1 over `warmup` steps, then `after`.
float warmup_lr(std::int64_t step, std::int64_t warmup, float after);

/// The linear scaling rule: the learning rate for `batch` given one tuned for `base_batch`.
float linear_scaled_lr(float base_lr, std::int64_t base_batch, std::int64_t batch);

/// Scales grads so their global norm is at most max_norm; returns the norm before clipping.
/// Synchronizes the stream (the norm is needed on the host).
float clip_grad_norm(Tensor const& grads, float max_norm, Stream& stream);

}  // namespace mgpu::optim
