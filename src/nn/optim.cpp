// Optimizers, schedules and clipping.
#include <mgpu/nn/optim.hpp>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::optim {
namespace {
Tensor zeros_like(Tensor const& t, Allocator& allocator) {
  Tensor z = Tensor::empty(t.shape(), t.dtype(), allocator);
  std::fill(z.host_span<float>().begin(), z.host_span<float>().end(), 0.0f);
  return z;
}
}  // namespace

void SGD::step(Tensor const& params, Tensor const& grads, Allocator& allocator, Stream& stream, float lr_scale) {
  if (!velocity_.defined()) velocity_ = zeros_like(params, allocator);
  ops::sgd_update(params, grads, velocity_, options_.lr * lr_scale, options_.momentum, options_.weight_decay, options_.nesterov, stream);
}

void AdamW::step(Tensor const& params, Tensor const& grads, Allocator& allocator, Stream& stream, float lr_scale) {
  if (!m_.defined()) {
    m_ = zeros_like(params, allocator);
    v_ = zeros_like(params, allocator);
  }
  ++step_;
  ops::adamw_update(params, grads, m_, v_, options_.lr * lr_scale, options_.beta1, options_.beta2, options_.eps,
                    options_.weight_decay, step_, stream);
}

float constant_lr(std::int64_t) { return 1.0f; }

float step_lr(std::int64_t step, std::int64_t every, float gamma) {
  if (every < 1) throw Error(Errc::invalid_argument, "step_lr every " + std::to_string(every) + " steps (expected >= 1)");
  return std::pow(gamma, static_cast<float>(step / every));
}

float cosine_lr(std::int64_t step, std::int64_t total, float floor) {
  if (total < 1) throw Error(Errc::invalid_argument, "cosine_lr over " + std::to_string(total) + " steps (expected >= 1)");
  double const progress = std::clamp(static_cast<double>(step) / static_cast<double>(total), 0.0, 1.0);
  return floor + (1.0f - floor) * static_cast<float>(0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
}

float warmup_lr(std::int64_t step, std::int64_t warmup, float after) {
  if (warmup < 1 || step >= warmup) return after;
  return after * static_cast<float>(step + 1) / static_cast<float>(warmup);
}

float linear_scaled_lr(float base_lr, std::int64_t base_batch, std::int64_t batch) {
  if (base_batch < 1 || batch < 1)
    throw Error(Errc::invalid_argument, "linear_scaled_lr with batches " + std::to_string(base_batch) + " and " +
                                            std::to_string(batch) + " (expected both >= 1)");
  return base_lr * static_cast<float>(batch) / static_cast<float>(base_batch);
}

float clip_grad_norm(Tensor const& grads, float max_norm, Stream& stream) {
  float norm = 0;
  bool finite = true;
  ops::global_norm(grads, &norm, &finite, stream);
  stream.synchronize();
  if (!finite) throw Error(Errc::invalid_argument, "clip_grad_norm: the gradients hold NaN or Inf (expected finite gradients)");
  if (norm > max_norm && norm > 0) {
    ops::scale(grads, max_norm / norm, stream);
  }
  return norm;
}

}  // namespace mgpu::optim
