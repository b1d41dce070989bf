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
namespace {
// Throws Error(invalid_argument) naming `option` of `optimizer` unless `value` is finite and >= 0.
void check_non_negative(std::string const& optimizer, char const* option, float value) {
  if (!(std::isfinite(value) && value >= 0))
    throw Error(Errc::invalid_argument,
                optimizer + " " + option + " " + std::to_string(value) + " (expected a finite " + option + " >= 0)");
}
}  // namespace

void Optimizer::set_lr(float /*lr*/) {
  throw Error(Errc::invalid_argument, name() + ": set_lr on an optimizer without a learning rate (expected SGD, AdamW or an "
                                               "optimizer that overrides set_lr)");
}

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
  if (steps_ == 0 || buffers.empty() || buffers.front().second.numel() != state_elements(params))
    throw Error(Errc::invalid_argument, name() + " update of " + std::to_string(params.numel()) +
                                            " parameters without a step begun for them (expected begin_step(params, ...) first)");
  // grads packed over the state ranges, as the state is.
  bool const packed = !ranges_.empty() && grads.numel() == state_elements(params) && grads.numel() != params.numel();
  if ((grads.numel() != params.numel() && !packed) || params.rank() != 1 || grads.rank() != 1)
    throw Error(Errc::invalid_argument, name() + ": params " + to_string(params.shape()) + " and grads " + to_string(grads.shape()) +
                                            " (expected two flat buffers of one size, or grads packed over the " +
                                            std::to_string(state_elements(params)) + " elements of the state ranges)");
  if (begin < 0 || begin > end || end > params.numel())
    throw Error(Errc::invalid_argument, name() + " update of [" + std::to_string(begin) + ", " + std::to_string(end) +
                                            ") (expected a range within [0, " + std::to_string(params.numel()) + "))");
  if (ranges_.empty()) {
    update_slices(params.slice(begin, end), grads.slice(begin, end), begin, end, begin, stream, lr_scale);
    return;
  }
  std::int64_t const at = packed_offset(begin, end);
  update_slices(params.slice(begin, end), packed ? grads.slice(at, at + (end - begin)) : grads.slice(begin, end), begin, end, at,
                stream, lr_scale);
}

void Optimizer::update_packed(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end, Stream& stream,
                             float lr_scale) {
  auto const buffers = state();
  std::int64_t const packed = state_elements(params);
  if (ranges_.empty() || steps_ == 0 || buffers.empty() || buffers.front().second.numel() != packed)
    throw Error(Errc::invalid_argument, name() + " update_packed without state ranges and a step begun (expected set_state_ranges(...) "
                                                 "and begin_step(params, ...) first)");
  if (params.numel() != packed || grads.numel() != packed || params.rank() != 1 || grads.rank() != 1)
    throw Error(Errc::invalid_argument, name() + " update_packed: params " + to_string(params.shape()) + " and grads " +
                                            to_string(grads.shape()) + " (expected both packed over the " + std::to_string(packed) +
                                            " elements of the state ranges)");
  if (begin < 0 || begin > end)
    throw Error(Errc::invalid_argument, name() + " update_packed of [" + std::to_string(begin) + ", " + std::to_string(end) +
                                            ") (expected 0 <= begin <= end)");
  std::int64_t const at = packed_offset(begin, end);
  update_slices(params.slice(at, at + (end - begin)), grads.slice(at, at + (end - begin)), begin, end, at, stream, lr_scale);
}

std::int64_t Optimizer::packed_offset(std::int64_t begin, std::int64_t end) const {
  std::int64_t state_begin = 0;
  for (auto const& [b, e] : ranges_) {
    if (begin >= b && end <= e) return state_begin + (begin - b);
    state_begin += e - b;
  }
  throw Error(Errc::invalid_argument,
              name() + " update of [" + std::to_string(begin) + ", " + std::to_string(end) +
                  ") outside the ranges of its state (expected a range within one of them)");
}

std::int64_t Optimizer::state_elements(Tensor const& params) const noexcept {
  if (ranges_.empty()) return params.numel();
  std::int64_t n = 0;
  for (auto const& [b, e] : ranges_) n += e - b;
  return n;
}

void Optimizer::set_state_ranges(Tensor const& params, std::vector<std::pair<std::int64_t, std::int64_t>> ranges,
                                 Allocator& allocator, Stream& stream) {
  using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;
  Ranges layout;
  std::int64_t previous_end = 0;
  for (auto const& [b, e] : ranges) {
    if (b < previous_end || e < b || e > params.numel())
      throw Error(Errc::invalid_argument,
                  name() + " state over [" + std::to_string(b) + ", " + std::to_string(e) +
                      ") after a range ending at " + std::to_string(previous_end) +
                      " (expected sorted, non-overlapping ranges within [0, " + std::to_string(params.numel()) + "))");
    previous_end = e;
    if (b == e) continue;
    if (!layout.empty() && layout.back().second == b) {
      layout.back().second = e;
    } else {
      layout.emplace_back(b, e);
    }
  }
  if (layout == Ranges{{0, params.numel()}}) layout.clear();  // whole
  if (layout == ranges_) return;
  std::vector<NamedTensor> const before = state();
  auto const or_whole = [&](Ranges const& r) { return r.empty() ? Ranges{{0, params.numel()}} : r; };  // empty: whole
  Ranges const old_layout = or_whole(ranges_);
  ranges_ = std::move(layout);
  if (before.empty()) return;  // allocated in the new layout on first use
  reset_state();
  std::vector<NamedTensor> const after = prepare_state(params, allocator, stream);
  Ranges const new_layout = or_whole(ranges_);
  // Copy what both layouts hold: walk the two sorted lists of ranges with their packed offsets.
  std::size_t i = 0, j = 0;
  std::int64_t at_old = 0, at_new = 0;
  while (i < old_layout.size() && j < new_layout.size()) {
    auto const [ob, oe] = old_layout[i];
    auto const [nb, ne] = new_layout[j];
    std::int64_t const lo = std::max(ob, nb), hi = std::min(oe, ne);
    if (lo < hi) {
      for (std::size_t k = 0; k < after.size(); ++k)
        copy_async(after[k].second.slice(at_new + (lo - nb), at_new + (hi - nb)),
                   before[k].second.slice(at_old + (lo - ob), at_old + (hi - ob)), stream);
    }
    if (oe <= ne) {
      at_old += oe - ob;
      ++i;
    } else {
      at_new += ne - nb;
      ++j;
    }
  }
}

SGD::SGD(SgdOptions options) : options_(options) {
  check_non_negative("SGD", "lr", options_.lr);
  check_non_negative("SGD", "momentum", options_.momentum);
  check_non_negative("SGD", "weight_decay", options_.weight_decay);
  if (options_.nesterov && options_.momentum == 0)
    throw Error(Errc::invalid_argument, "SGD with nesterov and momentum 0 (expected a momentum > 0 for Nesterov momentum)");
}

void SGD::set_lr(float lr) {
  check_non_negative("SGD", "lr", lr);
  options_.lr = lr;
}

std::vector<NamedTensor> SGD::prepare_state(Tensor const& params, Allocator& allocator, Stream& stream) {
  if (!velocity_.defined()) velocity_ = ops::zeros({state_elements(params)}, allocator, stream);
  return state();
}

void SGD::reset_state() { velocity_ = Tensor{}; }

std::vector<NamedTensor> SGD::state() const {
  if (!velocity_.defined()) return {};
  return {{"velocity", velocity_}};
}

void SGD::update_slices(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end,
                        std::int64_t state_begin, Stream& stream, float lr_scale) {
  Tensor const velocity = velocity_.slice(state_begin, state_begin + (end - begin));
  ops::sgd_update(params, grads, velocity, options_.lr * lr_scale,
                  options_.momentum, options_.weight_decay, options_.nesterov, stream);
}

std::vector<NamedTensor> AdamW::prepare_state(Tensor const& params, Allocator& allocator, Stream& stream) {
  if (!m_.defined()) {
    m_ = ops::zeros({state_elements(params)}, allocator, stream);
    v_ = ops::zeros({state_elements(params)}, allocator, stream);
  }
  return state();
}

void AdamW::reset_state() {
  m_ = Tensor{};
  v_ = Tensor{};
}

std::vector<NamedTensor> AdamW::state() const {
  if (!m_.defined()) return {};
  return {{"m", m_}, {"v", v_}};
}

void AdamW::set_lr(float lr) {
  check_non_negative("AdamW", "lr", lr);
  options_.lr = lr;
}

AdamW::AdamW(AdamWOptions options) : options_(std::move(options)) {
  check_non_negative("AdamW", "lr", options_.lr);
  check_non_negative("AdamW", "weight_decay", options_.weight_decay);
  for (auto const& [option, beta] : {std::pair{"beta1", options_.beta1}, std::pair{"beta2", options_.beta2}})
    if (!(beta >= 0 && beta < 1))
      throw Error(Errc::invalid_argument, std::string("AdamW ") + option + " " + std::to_string(beta) + " (expected a " + option + " in [0, 1))");
  check_non_negative("AdamW", "eps", options_.eps);
  std::int64_t previous_end = 0;
  for (auto const& [b, e] : options_.decay_ranges) {
    if (b < previous_end || e <= b)
      throw Error(Errc::invalid_argument, "AdamW decay range [" + std::to_string(b) + ", " + std::to_string(e) +
                                              ") after one ending at " + std::to_string(previous_end) +
                                              " (expected sorted, non-empty, non-overlapping ranges of elements >= 0)");
    previous_end = e;
  }
}

void AdamW::update_slices(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end,
                          std::int64_t state_begin, Stream& stream, float lr_scale) {
  std::int64_t const shift = state_begin - begin;  // state index of a flat index
  auto const run = [&](std::int64_t b, std::int64_t e, float decay) {
    if (b >= e) return;
    ops::adamw_update(params.slice(b - begin, e - begin), grads.slice(b - begin, e - begin), m_.slice(b + shift, e + shift),
                      v_.slice(b + shift, e + shift), options_.lr * lr_scale, options_.beta1, options_.beta2,
                      options_.eps, decay, steps(), stream);
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
