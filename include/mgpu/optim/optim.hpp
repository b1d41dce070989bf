// Optimizers over a model's flat buffers, learning-rate schedules, the linear scaling rule, and
// clipping by global norm.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

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

/// A named state tensor of an optimizer (checkpoints save and restore them).
using NamedTensor = std::pair<std::string, Tensor>;

/// An optimizer over a model's flat float32 master buffers. Its state is allocated (zeroed) on the
/// first step or load; one value per parameter, or after set_state_ranges() one per element of the
/// ranges, packed. Which ranges (a data-parallel rank's share) is the caller's choice.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  /// One update of params from grads with the learning rate times `lr_scale`: begin_step(), then
  /// update() over every element.
  void step(Tensor const& params, Tensor const& grads, Allocator& allocator, Stream& stream, float lr_scale = 1.0f);
  /// Starts a step: allocates the state for `params` on first use and counts the step.
  void begin_step(Tensor const& params, Allocator& allocator, Stream& stream);
  /// Applies the step begun last to elements [begin, end); one step's ranges must not overlap and
  /// should cover every element the state holds, each within one state range. After
  /// set_state_ranges(), `grads` may hold the ranges' gradients only, packed as the state is.
  void update(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end, Stream& stream,
              float lr_scale = 1.0f);
  /// update() with `params` and `grads` holding the state ranges' elements only, packed. Throws
  /// Error(invalid_argument) without state ranges, for other sizes, or a range outside them.
  void update_packed(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end, Stream& stream,
                    float lr_scale = 1.0f);
  /// The learning rate (before a step's lr_scale), and setting it for the steps that follow.
  /// set_lr throws Error(invalid_argument), changing nothing, for a rate that is not finite and
  /// >= 0. An optimizer without a learning rate returns 0 and refuses set_lr.
  [[nodiscard]] virtual float lr() const noexcept { return 0.0f; }
  virtual void set_lr(float lr);
  /// Steps taken so far.
  [[nodiscard]] std::int64_t steps() const noexcept { return steps_; }
  /// The state buffers with their names (none before the first step or prepare_state).
  [[nodiscard]] virtual std::vector<NamedTensor> state() const = 0;
  /// Allocates the state for `params` (if not yet there: state_elements(params) values per buffer)
  /// and returns it for filling, e.g. from a checkpoint.
  virtual std::vector<NamedTensor> prepare_state(Tensor const& params, Allocator& allocator, Stream& stream) = 0;
  void set_steps(std::int64_t steps) noexcept { steps_ = steps; }

  /// Keeps state only for the elements of `ranges` ([begin, end) ranges of the flat buffers of
  /// `params`, sorted, not overlapping, empty ones allowed), or, with no non-empty one, for every
  /// element. State already allocated is laid out anew on `stream`: the values of elements in both
  /// layouts are kept, the others start at zero. Throws Error(invalid_argument) for ranges outside
  /// `params`, unsorted or overlapping.
  void set_state_ranges(Tensor const& params, std::vector<std::pair<std::int64_t, std::int64_t>> ranges, Allocator& allocator,
                        Stream& stream);
  /// The state's ranges (non-empty ones, adjacent ones merged); empty when the state is whole.
  [[nodiscard]] std::vector<std::pair<std::int64_t, std::int64_t>> const& state_ranges() const noexcept { return ranges_; }
  /// Values per state buffer for `params`: its elements, or the state ranges' after set_state_ranges().
  [[nodiscard]] std::int64_t state_elements(Tensor const& params) const noexcept;

 protected:
  /// update() over its checked range [begin, end) of the flat buffers: `params` and `grads` hold
  /// that range's parameters and gradients only (end - begin values each), and each state buffer
  /// as many values from `state_begin` (begin itself when the state is whole).
  virtual void update_slices(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end,
                             std::int64_t state_begin, Stream& stream, float lr_scale) = 0;
  /// Drops the state buffers (set_state_ranges() then allocates them in the new layout).
  virtual void reset_state() = 0;

 private:
  // Where the state of [begin, end) starts in the packed buffers of a state over ranges; throws
  // Error(invalid_argument) when the range lies within no state range.
  [[nodiscard]] std::int64_t packed_offset(std::int64_t begin, std::int64_t end) const;
  std::int64_t steps_ = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges_;
};

/// SGD with momentum (PyTorch's formulation: v = m v + g + wd p; p -= lr (v, or g + m v with
/// Nesterov)), one fused pass over the flat buffers. Throws Error(invalid_argument) naming the
/// option for a learning rate, momentum or weight decay that is not finite and >= 0, and for
/// Nesterov without momentum.
class SGD final : public Optimizer {
 public:
  explicit SGD(SgdOptions options = {});
  std::string name() const override { return "sgd"; }
  float lr() const noexcept override { return options_.lr; }
  void set_lr(float lr) override;
  std::vector<NamedTensor> state() const override;
  std::vector<NamedTensor> prepare_state(Tensor const& params, Allocator& allocator, Stream& stream) override;
  [[nodiscard]] SgdOptions const& options() const noexcept { return options_; }
  [[nodiscard]] Tensor const& velocity() const noexcept { return velocity_; }

 private:
  void update_slices(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end,
                     std::int64_t state_begin, Stream& stream, float lr_scale) override;
  void reset_state() override;

  SgdOptions options_;
  Tensor velocity_;
};

struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  /// Parameter groups: when not empty, weight_decay applies only to the elements of these [begin,
  /// end) ranges of the flat buffers (sorted, not overlapping), and the others get none (e.g. decay
  /// on a GPT's 2-D weights only: nn::gpt_decay_ranges).
  std::vector<std::pair<std::int64_t, std::int64_t>> decay_ranges = {};
};

/// AdamW (decoupled weight decay), one fused pass per range of equal decay. Throws
/// Error(invalid_argument) naming the option for a learning rate, eps or weight decay that is not
/// finite and >= 0, betas outside [0, 1), and decay ranges that are empty, negative, unsorted or
/// overlapping.
class AdamW final : public Optimizer {
 public:
  explicit AdamW(AdamWOptions options = {});
  std::string name() const override { return "adamw"; }
  float lr() const noexcept override { return options_.lr; }
  void set_lr(float lr) override;
  std::vector<NamedTensor> state() const override;
  std::vector<NamedTensor> prepare_state(Tensor const& params, Allocator& allocator, Stream& stream) override;

 private:
  void update_slices(Tensor const& params, Tensor const& grads, std::int64_t begin, std::int64_t end,
                     std::int64_t state_begin, Stream& stream, float lr_scale) override;
  void reset_state() override;

  AdamWOptions options_;
  Tensor m_, v_;
};

/// Dynamic loss scaling for float16 training: the loss gradient is multiplied by scale(); after
/// backward, update() is given whether the unscaled gradients were all finite. On overflow the step
/// must be skipped and the scale is multiplied by `backoff`; after `growth_interval` finite steps in
/// a row it is multiplied by `growth`.
class LossScaler {
 public:
  explicit LossScaler(float initial = 65536.0f, float growth = 2.0f, float backoff = 0.5f, std::int64_t growth_interval = 2000);
  [[nodiscard]] float scale() const noexcept { return scale_; }
  /// Records one step's outcome; returns true when the optimizer step should be taken.
  bool update(bool finite);
  [[nodiscard]] std::int64_t skipped() const noexcept { return skipped_; }

  /// What changes from step to step (checkpoints save it): the scale, the finite steps since the
  /// last change of scale, and the steps skipped so far.
  struct State {
    float scale = 0;
    std::int64_t good_steps = 0;
    std::int64_t skipped = 0;
    bool operator==(State const&) const = default;
  };
  [[nodiscard]] State state() const noexcept { return {scale_, good_, skipped_}; }
  /// Restores a state() (the configuration, growth, backoff and interval, stays). Throws
  /// Error(invalid_argument) for a scale that is not finite and > 0, or negative counts, or
  /// good_steps not below the growth interval.
  void set_state(State const& state);

 private:
  float scale_, growth_, backoff_;
  std::int64_t interval_, good_ = 0, skipped_ = 0;
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

/// The global L2 norm of `grads` (synchronizes the stream: the value is needed on the host).
/// Returns NaN or Inf when an element is not finite.
float global_norm(Tensor const& grads, Allocator& allocator, Stream& stream);
/// Scales grads so their global norm is at most max_norm; returns the norm before clipping.
/// Throws Error(invalid_argument) when the gradients hold NaN or Inf.
float clip_grad_norm(Tensor const& grads, float max_norm, Allocator& allocator, Stream& stream);

}  // namespace mgpu::optim
