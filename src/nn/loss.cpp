// The losses every executor shares.
#include <cmath>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>

#include "core/backend.hpp"

namespace mgpu::nn {
namespace {

std::string shape_of(Tensor const& t) { return t.defined() ? to_string(t.shape()) : std::string("undefined"); }

// The loss of a part of `rows` rows out of `divisor` counted rows: the part's mean times its share.
float share(std::int64_t rows, std::int64_t divisor) {
  return static_cast<float>(static_cast<double>(rows) / static_cast<double>(divisor));
}

void check_divisor(std::int64_t divisor, std::string const& loss) {
  if (divisor < 1)
    throw Error(Errc::invalid_argument, loss + ": a divisor of " + std::to_string(divisor) +
                                            " (expected the counted units of the whole batch, at least 1)");
}

}  // namespace

void SoftmaxCrossEntropy::check(Shape const& output, Tensor const& targets, std::string const& what) const {
  if (output.size() != 2)
    throw Error(Errc::invalid_argument, what + ": a model output of shape " + to_string(output) +
                                            " (expected logits [rows, classes] for softmax cross-entropy)");
  std::int64_t const rows = output[0];
  if (!targets.defined() || targets.rank() != 1 || targets.numel() != rows)
    throw Error(Errc::invalid_argument, what + ": labels of shape " + shape_of(targets) + " for " +
                                            std::to_string(rows) + " rows (expected [" + std::to_string(rows) +
                                            "], one float32 class id per row)");
  if (targets.dtype() != DType::float32)
    throw Error(Errc::invalid_argument, what + ": labels of dtype " + std::string(to_string(targets.dtype())) +
                                            " (expected float32 class ids)");
}

void SoftmaxCrossEntropy::check_values(Shape const& output, Tensor const& targets, std::string const& what) const {
  if (targets.device().kind != DeviceKind::host) return;
  auto const values = targets.host_span<float>();
  for (std::size_t row = 0; row < values.size(); ++row) {
    float const v = values[row];
    if (!(v >= 0 && v < static_cast<float>(output[1])) || v != std::floor(v))
      throw Error(Errc::invalid_argument, what + ": label " + std::to_string(v) + " at row " + std::to_string(row) +
                                              " (expected a class id in [0, " + std::to_string(output[1]) + "))");
  }
}

std::int64_t SoftmaxCrossEntropy::count(Tensor const& targets, Stream& /*stream*/) const {
  return targets.rank() >= 1 ? targets.dim(0) : 0;
}

void SoftmaxCrossEntropy::compute(Tensor const& output, Tensor const& targets, Tensor const& doutput,
                                  Tensor const& loss, std::int64_t divisor, float grad_scale, Allocator& /*allocator*/,
                                  Stream& stream) const {
  check_divisor(divisor, name());
  std::int64_t const rows = output.rank() >= 1 ? output.dim(0) : 0;
  // The op writes the part's mean; its share of the whole batch's mean scales loss and gradient.
  float const part = share(rows, divisor);
  ops::softmax_cross_entropy(output, targets, doutput, loss, stream, grad_scale * part);
  if (part != 1.0f) ops::scale(loss, part, stream);
}

void TokenCrossEntropy::check(Shape const& output, Tensor const& targets, std::string const& what) const {
  if (output.size() < 2)
    throw Error(Errc::invalid_argument, what + ": a model output of shape " + to_string(output) +
                                            " (expected logits [B, T, vocab] or [N, vocab] for token cross-entropy)");
  Shape expected(output.begin(), output.end() - 1);
  if (!targets.defined() || targets.shape() != expected || targets.dtype() != DType::int32)
    throw Error(Errc::invalid_argument, what + ": targets of shape " + shape_of(targets) + " and dtype " +
                                            (targets.defined() ? std::string(to_string(targets.dtype())) : "none") +
                                            " for logits " + to_string(output) + " (expected int32 token ids " +
                                            to_string(expected) + ")");
}

void TokenCrossEntropy::check_values(Shape const& output, Tensor const& targets, std::string const& what) const {
  if (targets.device().kind != DeviceKind::host) return;
  std::int64_t const vocab = output.back();
  auto const values = targets.host_span<std::int32_t>();
  std::int64_t const per_row = targets.rank() >= 2 && targets.dim(0) > 0 ? targets.numel() / targets.dim(0) : 1;
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::int32_t const v = values[i];
    auto const at = static_cast<std::int64_t>(i);
    if (v != ignore_index_ && (v < 0 || v >= vocab))
      throw Error(Errc::invalid_argument, what + ": target " + std::to_string(v) + " at row " + std::to_string(at / per_row) +
                                              ", position " + std::to_string(at % per_row) + " of the batch (expected a token id in [0, " +
                                              std::to_string(vocab) + ") or the ignore index " + std::to_string(ignore_index_) + ")");
  }
}

std::int64_t TokenCrossEntropy::count(Tensor const& targets, Stream& stream) const {
  if (!targets.defined() || targets.dtype() != DType::int32)
    throw Error(Errc::invalid_argument, name() + ": counting targets of dtype " +
                                            (targets.defined() ? std::string(to_string(targets.dtype())) : "none") +
                                            " (expected int32 token ids)");
  Tensor host = targets;
  if (targets.device().kind != DeviceKind::host) {
    host = Tensor::empty(targets.shape(), DType::int32, mgpu::detail::host_staging_allocator());
    copy_async(host, targets, stream);
    stream.synchronize();
  }
  std::int64_t counted = 0;
  for (std::int32_t const v : host.host_span<std::int32_t>()) counted += v != ignore_index_ ? 1 : 0;
  return counted;
}

void TokenCrossEntropy::compute(Tensor const& output, Tensor const& targets, Tensor const& doutput, Tensor const& loss,
                                std::int64_t divisor, float grad_scale, Allocator& /*allocator*/,
                                Stream& stream) const {
  check_divisor(divisor, name());
  ops::token_cross_entropy(output, targets, doutput, loss, static_cast<float>(divisor), stream, ignore_index_,
                           grad_scale);
}

void MeanSquaredError::check(Shape const& output, Tensor const& targets, std::string const& what) const {
  if (output.empty())
    throw Error(Errc::invalid_argument, what + ": a model output of shape " + to_string(output) +
                                            " (expected [rows, ...] for mean squared error)");
  if (!targets.defined() || targets.shape() != output || targets.dtype() != DType::float32)
    throw Error(Errc::invalid_argument, what + ": targets of shape " + shape_of(targets) + " and dtype " +
                                            (targets.defined() ? std::string(to_string(targets.dtype())) : "none") +
                                            " (expected float32 " + to_string(output) + ", the model output's shape)");
}

std::int64_t MeanSquaredError::count(Tensor const& targets, Stream& /*stream*/) const {
  return targets.rank() >= 1 ? targets.dim(0) : 0;
}

void MeanSquaredError::compute(Tensor const& output, Tensor const& targets, Tensor const& doutput, Tensor const& loss,
                               std::int64_t divisor, float grad_scale, Allocator& allocator, Stream& stream) const {
  check_divisor(divisor, name());
  std::int64_t const rows = output.rank() >= 1 ? output.dim(0) : 0;
  Tensor target = targets;
  if (output.dtype() != targets.dtype()) {
    target = Tensor::empty(targets.shape(), output.dtype(), allocator);
    convert_async(target, targets, stream);
  }
  float const part = share(rows, divisor);
  ops::mse(output, target, doutput, loss, stream, grad_scale * part);
  if (part != 1.0f) ops::scale(loss, part, stream);
}

std::shared_ptr<Loss const> default_loss() {
  static auto const loss = std::make_shared<SoftmaxCrossEntropy const>();
  return loss;
}

}  // namespace mgpu::nn
