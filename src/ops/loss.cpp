// The losses (softmax cross-entropy, mean squared error) and accuracy, with the label check
// they share.
#include <mgpu/ops/ops.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <memory>
#include <string>

#include "core/backend.hpp"
#include "ops/op_support.hpp"

namespace mgpu::ops {

namespace {
// Fails the stream, with the first bad row, unless every label is a class id in [0, c).
void fail_on_bad_label(char const* op, Tensor const& labels, std::int64_t n, std::int64_t c, Stream& stream) {
  auto const bad_label = [op, c](float label, std::int64_t row) {
    return Error(Errc::invalid_argument, std::string(op) + ": label " + std::to_string(label) + " in row " + std::to_string(row) +
                                             " (expected a class id in [0, " + std::to_string(c) + "))");
  };
  if (stream.device().kind == DeviceKind::host) {
    mgpu::detail::enqueue_using(stream, [y = ptr<float>(labels), n, c, bad_label] {
      for (std::int64_t i = 0; i < n; ++i) {
        auto const label = static_cast<std::int64_t>(y[i]);
        if (!(y[i] >= 0.0f) || label >= c || static_cast<float>(label) != y[i]) throw bad_label(y[i], i);
      }
    }, labels);
  } else {
#if MGPU_CUDA_ENABLED
    // The GPU finds the first bad row; a host callback reads it back and fails the stream with the
    // host's error.
    auto found = std::make_shared<Buffer>(mgpu::detail::host_staging_allocator().allocate_pinned(sizeof(std::uint64_t)));
    {
      // Its kernel and its copy into `found`, also when a later step of the search fails.
      mgpu::detail::ReleaseAfterOnExit const release(stream, labels, *found);
      mgpu::detail::StreamScratch scratch(stream, labels);
      kernels::find_bad_label(stream.device().index, ptr<float>(labels), n, c,
                              static_cast<std::uint64_t*>(found->data()), scratch, stream.native_handle());
    }
    stream.enqueue([found, bad_label] {
      std::uint64_t const code = *static_cast<std::uint64_t const*>(found->data());
      if (code == ~std::uint64_t{0}) return;
      throw bad_label(std::bit_cast<float>(static_cast<std::uint32_t>(code)), static_cast<std::int64_t>(code >> 32));
    });
#endif
  }
}
}  // namespace

void softmax_cross_entropy(Tensor const& logits, Tensor const& labels, Tensor const& dlogits, Tensor const& loss, Stream& stream,
                           float grad_scale) {
  char const* op = "softmax_cross_entropy";
  check(logits, op, "logits", stream);
  check(labels, op, "labels", stream);
  check(dlogits, op, "dlogits", stream);
  check_scalar(loss, op, stream);
  check_same(logits, dlogits, op);
  check_dtype(labels, DType::float32, op, "labels");
  if (logits.rank() != 2 || labels.numel() != logits.dim(0) || logits.dim(1) < 1)
    throw Error(Errc::invalid_argument, std::string(op) + ": logits " + to_string(logits.shape()) + ", labels " +
                                            to_string(labels.shape()) + " (expected logits [N, C] with C >= 1 and N labels)");
  std::int64_t const n = logits.dim(0);
  std::int64_t const c = logits.dim(1);
  fail_on_bad_label(op, labels, n, c, stream);
  float const mean = n > 0 ? 1.0f / static_cast<float>(n) : 0.0f;
  visit(logits.dtype(), [&]<class T>(T) {
    detail::SoftmaxCrossEntropyRow<T> const row{ptr<T>(logits), ptr<float>(labels), ptr<T>(dlogits), c, grad_scale * mean};
    run_reduce(stream, HostOpFamily::loss, n, row, loss, mean, {logits, labels, dlogits});
  });
}

void mse(Tensor const& pred, Tensor const& target, Tensor const& dpred, Tensor const& loss, Stream& stream, float grad_scale) {
  check(pred, "mse", "pred", stream);
  check(target, "mse", "target", stream);
  check(dpred, "mse", "dpred", stream);
  check_scalar(loss, "mse", stream);
  check_same(pred, target, "mse");
  check_same(pred, dpred, "mse");
  float const mean = 1.0f / static_cast<float>(std::max<std::int64_t>(1, pred.numel()));
  visit(pred.dtype(), [&]<class T>(T) {
    run_reduce(stream, HostOpFamily::loss, pred.numel(),
               detail::SquaredErrorOp<T>{ptr<T>(pred), ptr<T>(target), ptr<T>(dpred), grad_scale * mean}, loss, mean,
               {pred, target, dpred});
  });
}

void count_correct(Tensor const& logits, Tensor const& labels, Tensor const& out, Stream& stream) {
  check(logits, "count_correct", "logits", stream);
  check(labels, "count_correct", "labels", stream);
  check_scalar(out, "count_correct", stream);
  check_dtype(labels, DType::float32, "count_correct", "labels");
  if (logits.rank() != 2 || labels.numel() != logits.dim(0))
    throw Error(Errc::invalid_argument, "count_correct: logits " + to_string(logits.shape()) + ", labels " + to_string(labels.shape()) +
                                            " (expected logits [N, C] and N labels)");
  fail_on_bad_label("count_correct", labels, logits.dim(0), logits.dim(1), stream);
  visit(logits.dtype(), [&]<class T>(T) {
    run_reduce(stream, HostOpFamily::loss, logits.dim(0),
               detail::CorrectRow<T>{ptr<T>(logits), ptr<float>(labels), logits.dim(1)}, out, 1.0f, {logits, labels});
  });
}

}  // namespace mgpu::ops
