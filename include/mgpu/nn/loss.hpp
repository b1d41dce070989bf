// The training objectives every executor shares: softmax cross-entropy, per-token cross-entropy
// and mean squared error. A part of a split batch divides its summed loss by the whole batch's
// counted units, so the parts add up to the batch's mean (see docs/architecture.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::nn {

/// A training objective: a loss and the output's gradient from the output and targets. Stateless
/// and const: one Loss may serve every device at once.
class Loss {
 public:
  virtual ~Loss() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  /// Throws Error(invalid_argument), prefixed by `what`, unless `targets` fit a model output of
  /// shape `output` (dtype and shape). Reads no values.
  virtual void check(Shape const& output, Tensor const& targets, std::string const& what) const = 0;
  /// Throws Error(invalid_argument), prefixed by `what`, for an invalid value of host `targets`
  /// (device targets are checked inside the step).
  virtual void check_values(Shape const& /*output*/, Tensor const& /*targets*/, std::string const& /*what*/) const {}
  /// The counted units of `targets` (device targets are copied through `stream`, synchronizing it).
  [[nodiscard]] virtual std::int64_t count(Tensor const& targets, Stream& stream) const = 0;
  /// Enqueues loss (float32 [1]) = summed per-unit loss / divisor (>= 1, the whole batch's units)
  /// and doutput = grad_scale * d loss / d output.
  virtual void compute(Tensor const& output, Tensor const& targets, Tensor const& doutput, Tensor const& loss,
                       std::int64_t divisor, float grad_scale, Allocator& allocator, Stream& stream) const = 0;
};

/// Softmax cross-entropy of logits [N, C] against float32 class ids [N]; a unit is a row.
class SoftmaxCrossEntropy final : public Loss {
 public:
  std::string name() const override { return "softmax_cross_entropy"; }
  void check(Shape const& output, Tensor const& targets, std::string const& what) const override;
  void check_values(Shape const& output, Tensor const& targets, std::string const& what) const override;
  std::int64_t count(Tensor const& targets, Stream& stream) const override;
  void compute(Tensor const& output, Tensor const& targets, Tensor const& doutput, Tensor const& loss,
               std::int64_t divisor, float grad_scale, Allocator& allocator, Stream& stream) const override;
};

/// Per-token cross-entropy of logits [B, T, V] (or [N, V]) against int32 targets [B, T] (or [N]);
/// a unit is a token whose target is not `ignore_index`.
class TokenCrossEntropy final : public Loss {
 public:
  explicit TokenCrossEntropy(std::int32_t ignore_index = -100) : ignore_index_(ignore_index) {}
  std::string name() const override { return "token_cross_entropy"; }
  [[nodiscard]] std::int32_t ignore_index() const noexcept { return ignore_index_; }
  void check(Shape const& output, Tensor const& targets, std::string const& what) const override;
  void check_values(Shape const& output, Tensor const& targets, std::string const& what) const override;
  std::int64_t count(Tensor const& targets, Stream& stream) const override;
  void compute(Tensor const& output, Tensor const& targets, Tensor const& doutput, Tensor const& loss,
               std::int64_t divisor, float grad_scale, Allocator& allocator, Stream& stream) const override;

 private:
  std::int32_t ignore_index_;
};

/// Mean squared error against float32 targets of the output's shape; a unit is a row.
class MeanSquaredError final : public Loss {
 public:
  std::string name() const override { return "mse"; }
  void check(Shape const& output, Tensor const& targets, std::string const& what) const override;
  std::int64_t count(Tensor const& targets, Stream& stream) const override;
  void compute(Tensor const& output, Tensor const& targets, Tensor const& doutput, Tensor const& loss,
               std::int64_t divisor, float grad_scale, Allocator& allocator, Stream& stream) const override;
};

/// The loss executors use when none is given: a shared SoftmaxCrossEntropy.
[[nodiscard]] std::shared_ptr<Loss const> default_loss();

}  // namespace mgpu::nn
