// The classification step and evaluation.
#include <mgpu/nn/train.hpp>

#include <cmath>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::nn {
namespace {
// x in the model's compute type (a converted copy when it is not).
Tensor as_compute(Sequential const& model, Tensor const& x, Context& ctx) {
  if (x.dtype() == model.compute_type()) return x;
  Tensor converted = Tensor::empty(x.shape(), model.compute_type(), ctx.allocator);
  convert_async(converted, x, ctx.stream);
  return converted;
}
}  // namespace

StepResult classification_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& labels, Context& ctx,
                               StepOptions const& options) {
  if (!model.parameters().defined())
    throw Error(Errc::invalid_argument, "classification_step before materialize (expected model.materialize(ctx, seed) first)");
  float const loss_scale = options.scaler != nullptr ? options.scaler->scale() : 1.0f;
  Tensor const logits = model.forward(as_compute(model, x, ctx), ctx);
  Tensor const dlogits = Tensor::empty(logits.shape(), logits.dtype(), ctx.allocator);
  StepResult result{Tensor::empty({1}, DType::float32, ctx.allocator), true};
  ops::softmax_cross_entropy(logits, labels, dlogits, result.loss, ctx.stream, loss_scale);
  if (options.scaler == nullptr && options.clip_norm <= 0) {
    // Nothing needs all gradients before the update: each layer is updated (and, for 16-bit
    // compute, its gradients widened and its weights rounded) as soon as its gradients are
    // written, while they are still in cache.
    optimizer.begin_step(model.master_parameters(), ctx.allocator, ctx.stream);
    model.backward(dlogits, ctx, false, [&](std::int64_t begin, std::int64_t end) {
      model.unscale_gradients(1.0f, ctx.stream, begin, end);
      optimizer.update(model.master_parameters(), model.master_gradients(), begin, end, ctx.stream, options.lr_scale);
      model.sync_parameters(ctx.stream, begin, end);
    });
    return result;
  }
  model.backward(dlogits, ctx, false);
  model.unscale_gradients(1.0f / loss_scale, ctx.stream);
  Tensor const& grads = model.master_gradients();
  if (options.scaler != nullptr) {
    Tensor bad = Tensor::empty({1}, DType::float32, ctx.allocator);
    ops::count_nonfinite(grads, bad, ctx.stream);
    result.applied = options.scaler->update(ops::item(bad, ctx.stream) == 0.0f);
    if (!result.applied) return result;
  }
  if (options.clip_norm > 0) optim::clip_grad_norm(grads, options.clip_norm, ctx.allocator, ctx.stream);
  optimizer.step(model.master_parameters(), grads, ctx.allocator, ctx.stream, options.lr_scale);
  model.sync_parameters(ctx.stream);
  return result;
}

std::int64_t count_correct(Sequential& model, Tensor const& x, Tensor const& labels, Context& ctx, std::int64_t batch) {
  if (batch < 1) throw Error(Errc::invalid_argument, "count_correct with batch " + std::to_string(batch) + " (expected >= 1)");
  if (x.rank() < 1 || labels.numel() != x.dim(0))
    throw Error(Errc::invalid_argument, "count_correct: x " + to_string(x.shape()) + " and labels " + to_string(labels.shape()) +
                                            " (expected one label per row)");
  model.train(false);
  std::vector<Tensor> counts;
  try {
    for (std::int64_t begin = 0; begin < x.dim(0); begin += batch) {
      std::int64_t const end = std::min(x.dim(0), begin + batch);
      Tensor const logits = model.forward(as_compute(model, x.slice(begin, end), ctx), ctx);
      counts.push_back(Tensor::empty({1}, DType::float32, ctx.allocator));
      ops::count_correct(logits, labels.slice(begin, end), counts.back(), ctx.stream);
    }
  } catch (...) {
    model.train(true);
    throw;
  }
  model.train(true);
  std::int64_t correct = 0;
  for (Tensor const& c : counts) correct += std::llround(ops::item(c, ctx.stream));
  return correct;
}

}  // namespace mgpu::nn
