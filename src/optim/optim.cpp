// Optimizers, schedules and clipping.
#include <mgpu/optim/optim.hpp>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::optim {
void Optimizer::step(Tensor const& params, Tensor const& grads, Allocator& allocator, Stream& stream, float lr_scale) {
  begin_step(params, allocator, stream);
  update(params, grads, 0, params.numel(), stream, lr_scale);
}

void Optimizer::begin_step(Tensor const& params, Allocator& allocator, Stream& stream) {
  prepare_state(params, allocator, stream);
  ++steps_;
}

void Optimizer::update(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end, Stream& stream,
                       float lr_scale) {
  auto const buffers = state();
  if (steps_ == 0 || buffers.empty() || buffers.front().second.numel() != params.numel())
    throw Error(Errc::invalid_argument, name() + " update of " + std::to_string(params.numel()) +
                                            " parameters without a step begun for them (expected begin_step(params, ...) first)");
  if (grads.numel() != params.numel() || params.rank() != 1 || grads.rank() != 1)
    throw Error(Errc::invalid_argument, name() + ": params " + to_string(params.shape()) + " and grads " + to_string(grads.shape()) +
                                            " (expected two flat buffers of one size)");
  if (begin < 0 || begin > end || end > params.numel())
    throw Error(Errc::invalid_argument, name() + " update of [" + std::to_string(begin) + ", " + std::to_string(end) +
                                            ") (expected a range within [0, " + std::to_string(params.numel()) + "))");
  update_slices(params, grads, begin, end, stream, lr_scale);
}

std::vector<NamedTensor> SGD::prepare_state(Tensor const& params, Allocator& allocator, Stream& stream) {
  if (!velocity_.defined()) velocity_ = ops::zeros(params.shape(), allocator, stream);
  return state();
}

std::vector<NamedTensor> SGD::state() const {
  if (!velocity_.defined()) return {};
  return {{"velocity", velocity_}};
}

void SGD::update_slices(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end, Stream& stream,
                        float lr_scale) {
  ops::sgd_update(params.slice(begin, end), grads.slice(begin, end), velocity_.slice(begin, end), options_.lr * lr_scale,
                  options_.momentum, options_.weight_decay, options_.nesterov, stream);
}

std::vector<NamedTensor> AdamW::prepare_state(Tensor const& params, Allocator& allocator, Stream& stream) {
  if (!m_.defined()) {
    m_ = ops::zeros(params.shape(), allocator, stream);
    v_ = ops::zeros(params.shape(), allocator, stream);
  }
  return state();
}

std::vector<NamedTensor> AdamW::state() const {
  if (!m_.defined()) return {};
  return {{"m", m_}, {"v", v_}};
}

AdamW::AdamW(AdamWOptions options) : options_(std::move(options)) {
  std::int64_t previous_end = 0;
  for (auto const& [b, e] : options_.decay_ranges) {
    if (b < previous_end || e <= b)
      throw Error(Errc::invalid_argument, "AdamW decay range [" + std::to_string(b) + ", " + std::to_string(e) +
                                              ") after one ending at " + std::to_string(previous_end) +
                                              " (expected sorted, non-empty, non-overlapping ranges of elements >= 0)");
    previous_end = e;
  }
}

void AdamW::update_slices(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end, Stream& stream,
                          float lr_scale) {
  auto const run = [&](std::int64_t b, std::int64_t e, float decay) {
    if (b >= e) return;
    ops::adamw_update(params.slice(b, e), grads.slice(b, e), m_.slice(b, e), v_.slice(b, e), options_.lr * lr_scale,
                      options_.beta1, options_.beta2, options_.eps, decay, steps(), stream);
  };
  if (options_.decay_ranges.empty()) {
    run(begin, end, options_.weight_decay);
    return;
  }
  std::int64_t at = begin;  // [begin, at) is done
  for (auto const& [b, e] : options_.decay_ranges) {
    std::int64_t const lo = std::max(b, at), hi = std::min(e, end);
    if (lo >= hi) continue;
    run(at, lo, 0.0f);
    run(lo, hi, options_.weight_decay);
    at = hi;
  }
  run(at, end, 0.0f);
}

LossScaler::LossScaler(float initial, float growth, float backoff, std::int64_t growth_interval)
    : scale_(initial), growth_(growth), backoff_(backoff), interval_(growth_interval) {
  if (!(initial > 0) || !(growth >= 1) || !(backoff > 0 && backoff < 1) || growth_interval < 1)
    throw Error(Errc::invalid_argument, "LossScaler(" + std::to_string(initial) + ", " + std::to_string(growth) + ", " +
                                            std::to_string(backoff) + ", " + std::to_string(growth_interval) +
                                            ") (expected initial > 0, growth >= 1, 0 < backoff < 1, interval >= 1)");
}

void LossScaler::set_state(State const& state) {
  if (!(state.scale > 0 && std::isfinite(state.scale)) || state.good_steps < 0 || state.good_steps >= interval_ || state.skipped < 0)
    throw Error(Errc::invalid_argument, "LossScaler state: scale " + std::to_string(state.scale) + ", " + std::to_string(state.good_steps) +
                                            " good steps, " + std::to_string(state.skipped) + " skipped (expected a finite scale > 0, 0 <= good steps < " +
                                            std::to_string(interval_) + ", skipped >= 0)");
  scale_ = state.scale;
  good_ = state.good_steps;
  skipped_ = state.skipped;
}

bool LossScaler::update(bool finite) {
  if (!finite) {
    scale_ = std::max(scale_ * backoff_, 1.0f / 65536.0f);
    good_ = 0;
    ++skipped_;
    return false;
  }
  if (++good_ >= interval_) {
    scale_ = std::min(scale_ * growth_, 1.0e30f);
    good_ = 0;
  }
  return true;
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

float global_norm(Tensor const& grads, Allocator& allocator, Stream& stream) {
  Tensor out = Tensor::empty({1}, DType::float32, allocator);
  ops::sum_squares(grads, out, stream);
  return std::sqrt(ops::item(out, stream));
}

float clip_grad_norm(Tensor const& grads, float max_norm, Allocator& allocator, Stream& stream) {
  float const norm = global_norm(grads, allocator, stream);
  if (!std::isfinite(norm)) throw Error(Errc::invalid_argument, "clip_grad_norm: the gradients hold NaN or Inf (expected finite gradients)");
  if (norm > max_norm && norm > 0) {
    ops::scale(grads, max_norm / norm, stream);
  }
  return norm;
}

}  // namespace mgpu::optim
