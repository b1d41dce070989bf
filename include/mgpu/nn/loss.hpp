// The training objectives every executor shares (nn::train_step on one device and on each
// parallel::DataParallel replica, and pipeline::Executor on its last stage): softmax cross-entropy
// over float32 class ids (the default everywhere), per-token cross-entropy over int32 targets with
// an ignore index (language models), and mean squared error.
//
// Counted units and the exact global mean. A loss is the mean of a per-unit loss over the units its
// targets count: rows for SoftmaxCrossEntropy and MeanSquaredError, tokens whose target is not the
// ignore index for TokenCrossEntropy. An executor that splits a batch (data-parallel shards,
// pipeline micro-batches, or both) counts the units of the whole batch on the host before any device
// starts and passes that count to every part as the divisor: each part's loss is its summed
// per-unit loss over that divisor, and its gradient that loss's, so the parts' losses and gradients
// add up to the whole batch's mean and its gradient for any split (uneven shards, ignored tokens,
// parts without a counted unit). A batch without counted units has loss 0 and zero gradients.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::nn {

/// A training objective: the model's output and the targets of its rows give a loss and the
/// gradient of the output. Targets are split along their first dimension with the batch.
/// Implementations are stateless and const, so one Loss may serve every device at once.
class Loss {
 public:
  virtual ~Loss() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  /// Throws Error(invalid_argument), prefixed by `what`, unless `targets` fit a model output of
  /// shape `output` (dtype and shape). Reads no values.
  virtual void check(Shape const& output, Tensor const& targets, std::string const& what) const = 0;
  /// Throws Error(invalid_argument), prefixed by `what`, for a value of `targets` (checked to fit
  /// `output`) that is not valid: a class id, or a token id or the ignore index. Reads targets in
  /// host memory at the call; targets in device memory are left to the op inside the step, which
  /// fails the stream. The executors call it on the whole batch before any device starts.
  virtual void check_values(Shape const& /*output*/, Tensor const& /*targets*/, std::string const& /*what*/) const {}
  /// The counted units of `targets`. TokenCrossEntropy reads the values: targets in host memory at
  /// the call; targets in device memory are copied to the host through `stream`, which
  /// synchronizes it.
  [[nodiscard]] virtual std::int64_t count(Tensor const& targets, Stream& stream) const = 0;
  /// Enqueues on `stream`: loss (float32, one element) = the part's summed per-unit loss / divisor,
  /// and doutput (the output's shape and dtype) = grad_scale * d loss / d output. `divisor` >= 1 is
  /// the counted units of the whole batch the part belongs to; scratch memory from `allocator`.
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

/// Per-token cross-entropy of logits [B, T, V] (or [N, V]) against int32 targets [B, T] (or [N]),
/// ops::token_cross_entropy; a unit is a token whose target is not `ignore_index` (padding, or
/// positions a prompt should not be trained on), which adds neither loss nor gradient.
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

/// Mean squared error against float32 targets of the output's shape: the mean over all elements
/// of (output - target)²; a unit is a row (every row has the same number of elements). With a
/// bfloat16 or float16 model the targets are rounded to the compute type first.
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
