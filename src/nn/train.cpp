// The classification step and evaluation.
#include <mgpu/nn/train.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/trace/timeline.hpp>

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
  std::int64_t const rows = x.defined() && x.rank() >= 1 ? x.dim(0) : 0;
  if (!labels.defined() || labels.numel() != rows)
    throw Error(Errc::invalid_argument, "classification_step: " + std::to_string(rows) + " rows and " +
                                            std::to_string(labels.defined() ? labels.numel() : 0) + " labels (expected one label per row)");
  std::int64_t const global_rows = options.global_rows > 0 ? options.global_rows : rows;
  if (rows > global_rows)
    throw Error(Errc::invalid_argument, "classification_step: a shard of " + std::to_string(rows) + " rows of a " +
                                            std::to_string(global_rows) + "-row batch (expected global_rows >= the shard's rows)");
  if (!(options.lr_scale >= 0 && std::isfinite(options.lr_scale)))
    throw Error(Errc::invalid_argument, "classification_step: lr_scale " + std::to_string(options.lr_scale) + " (expected a finite lr_scale >= 0)");
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument, "classification_step: clip_norm " + std::to_string(options.clip_norm) +
                                            " (expected 0 for no clipping, or a finite norm > 0)");
  Tensor const& masters = model.master_gradients();
  if (options.accumulate_only && options.accumulator == nullptr)
    throw Error(Errc::invalid_argument, "classification_step: accumulate_only without an accumulator (expected a float32 buffer)");
  if (options.accumulator != nullptr &&
      (options.accumulator->numel() != masters.numel() || options.accumulator->dtype() != DType::float32))
    throw Error(Errc::invalid_argument, "classification_step: an accumulator of " + std::to_string(options.accumulator->numel()) + " " +
                                            std::string(to_string(options.accumulator->dtype())) + " elements (expected " +
                                            std::to_string(masters.numel()) + " float32, one per parameter)");
  trace::Timeline* const timeline = options.timeline != nullptr && options.timeline->enabled() ? options.timeline : nullptr;
  float const loss_scale = options.scaler != nullptr ? options.scaler->scale() : 1.0f;
  StepResult result{Tensor::empty({1}, DType::float32, ctx.allocator), !options.accumulate_only};
  // Without a loss scaler or clipping nothing needs all gradients before the update: each layer
  // (bucket) is updated as soon as its gradients are (reduced and) ready, while they are in cache.
  bool const update_in_backward = !options.accumulate_only && options.scaler == nullptr && options.clip_norm <= 0;
  if (update_in_backward) optimizer.begin_step(model.master_parameters(), ctx.allocator, ctx.stream);
  RangeUpdate update;
  if (update_in_backward) {
    update = [&](std::int64_t begin, std::int64_t end, Stream& stream) {
      auto const apply = [&] {
        optimizer.update(model.master_parameters(), masters, begin, end, stream, options.lr_scale);
        model.sync_parameters(stream, begin, end);
      };
      if (timeline == nullptr) {
        apply();
      } else {
        int const lane = &stream == &ctx.stream ? trace::Lane::compute : trace::Lane::communication;
        timeline->stream_span(stream, "update [" + std::to_string(begin) + ", " + std::to_string(end) + ")", "update", options.rank, lane,
                              apply);
      }
    };
  }
  GradientSync* const sync = options.accumulate_only ? nullptr : options.sync;
  auto const last_mark = std::make_shared<std::int64_t>(0);  // where the next layer's backward span starts
  auto const mark = [&](std::string name) {
    ctx.stream.enqueue([timeline, last_mark, name = std::move(name), rank = options.rank] {
      std::int64_t const now = timeline->now_ns();
      if (!name.empty()) timeline->record({name, "backward", rank, trace::Lane::compute, *last_mark, now});
      *last_mark = now;
    });
  };
  // One layer's gradients are written: widen them into the float32 masters, accumulate, then
  // reduce (data parallel) and update.
  std::vector<ParameterRange> const ranges = model.parameter_ranges();
  auto const on_gradients = [&](std::int64_t begin, std::int64_t end) {
    ParameterRange const& range = *std::find_if(ranges.begin(), ranges.end(), [&](ParameterRange const& r) { return r.begin == begin; });
    if (timeline != nullptr) mark("backward " + model.layer(range.layer).name());
    model.unscale_gradients(1.0f / loss_scale, ctx.stream, begin, end);
    if (options.accumulator != nullptr) {
      Tensor const acc = options.accumulator->slice(begin, end);
      if (options.accumulate_only) {
        ops::add_scaled(acc, masters.slice(begin, end), 1.0f, ctx.stream);
        return;
      }
      ops::add_scaled(masters.slice(begin, end), acc, 1.0f, ctx.stream);
      fill_async(acc, 0.0f, ctx.stream);
    }
    if (sync != nullptr) {
      sync->ready(range, ctx.stream);
    } else if (update) {
      update(begin, end, ctx.stream);
    }
  };

  if (rows > 0) {
    float const grad_scale = loss_scale * options.grad_scale * static_cast<float>(static_cast<double>(rows) / static_cast<double>(global_rows));
    Tensor dlogits;
    auto const forward = [&] {
      Tensor const logits = model.forward(as_compute(model, x, ctx), ctx);
      dlogits = Tensor::empty(logits.shape(), logits.dtype(), ctx.allocator);
      ops::softmax_cross_entropy(logits, labels, dlogits, result.loss, ctx.stream, grad_scale);
    };
    if (timeline != nullptr) {
      timeline->stream_span(ctx.stream, "forward", "forward", options.rank, trace::Lane::compute, forward);
      mark("");
    } else {
      forward();
    }
    if (sync != nullptr) sync->begin(ctx.stream, update);
    model.backward(dlogits, ctx, false, on_gradients);
  } else {  // an empty shard contributes zero gradients, in the same ranges and order
    fill_async(result.loss, 0.0f, ctx.stream);
    fill_async(model.gradients(), 0.0f, ctx.stream);
    if (timeline != nullptr) mark("");
    if (sync != nullptr) sync->begin(ctx.stream, update);
    for (auto r = ranges.rbegin(); r != ranges.rend(); ++r) on_gradients(r->begin, r->end);
  }
  if (sync != nullptr) sync->finish(ctx.stream);
  if (options.accumulate_only || update_in_backward) return result;

  // The loss scaler's overflow check and the clipping norm read every (reduced) gradient, so every
  // data-parallel replica takes the same decision.
  if (options.scaler != nullptr) {
    Tensor bad = Tensor::empty({1}, DType::float32, ctx.allocator);
    ops::count_nonfinite(masters, bad, ctx.stream);
    result.applied = options.scaler->update(ops::item(bad, ctx.stream) == 0.0f);
    if (!result.applied) return result;
  }
  if (options.clip_norm > 0) optim::clip_grad_norm(masters, options.clip_norm, ctx.allocator, ctx.stream);
  auto const step = [&] {
    optimizer.step(model.master_parameters(), masters, ctx.allocator, ctx.stream, options.lr_scale);
    model.sync_parameters(ctx.stream);
  };
  if (timeline != nullptr) {
    timeline->stream_span(ctx.stream, "optimizer step", "update", options.rank, trace::Lane::compute, step);
  } else {
    step();
  }
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
