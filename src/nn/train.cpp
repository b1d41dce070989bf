// The training step, the update every executor applies, and evaluation.
#include <mgpu/nn/train.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::nn {
namespace {
// x in the model's compute type (a converted copy when it is not); token ids stay as they are.
Tensor as_compute(Sequential const& model, Tensor const& x, Context& ctx) {
  if (x.dtype() == model.compute_type() || x.dtype() == DType::int32) return x;
  Tensor converted = Tensor::empty(x.shape(), model.compute_type(), ctx.allocator);
  convert_async(converted, x, ctx.stream);
  return converted;
}

// The optimizer's update of [begin, end) of `part` from their (reduced) gradients (the master
// gradients, or the part's packed ones): of the model's master parameters and their compute-type
// copy, or of the part's packed parameters when defined.
void update_range(UpdatePart const& part, std::int64_t begin, std::int64_t end, Stream& stream, float lr_scale) {
  Tensor const& grads = part.gradients.defined() ? part.gradients : part.model->master_gradients();
  if (part.parameters.defined()) {
    part.optimizer->update_packed(part.parameters, grads, begin, end, stream, lr_scale);
    return;
  }
  part.optimizer->update(part.model->master_parameters(), grads, begin, end, stream, lr_scale);
  part.model->sync_parameters(stream, begin, end);
}
}  // namespace

Shape check_batch(std::span<Sequential const* const> parts, Loss const& loss, Tensor const& x, Tensor const& targets,
                  BatchCheck const& check, std::string const& what) {
  if (!(check.lr_scale >= 0 && std::isfinite(check.lr_scale)))
    throw Error(Errc::invalid_argument, what + ": lr_scale " + std::to_string(check.lr_scale) + " (expected a finite lr_scale >= 0)");
  if (!x.defined() || x.rank() < 1)
    throw Error(Errc::invalid_argument, what + ": x of shape " + (x.defined() ? to_string(x.shape()) : std::string("undefined")) +
                                            " (expected [rows, ...])");
  if (x.dim(0) < 1 && !check.part)
    throw Error(Errc::invalid_argument, what + ": an empty batch of shape " + to_string(x.shape()) + " (expected at least one row)");
  // The first layer with a say: a model (or a pipeline chunk) may start with layers that hold none.
  Layer const* first = nullptr;
  for (Sequential const* p : parts)
    if (first == nullptr && p != nullptr && p->size() > 0) first = &p->layer(0);
  std::int64_t const vocab = first != nullptr ? first->input_vocab() : 0;
  if (vocab > 0 && x.dtype() != DType::int32)
    throw Error(Errc::invalid_argument, what + ": x of dtype " + std::string(to_string(x.dtype())) + " for " + first->name() +
                                            " (expected int32 token ids in [0, " + std::to_string(vocab) + "))");
  if (vocab == 0 && x.dtype() != DType::float32 && x.dtype() != check.compute) {
    std::string const also = check.compute != DType::float32 ? " or " + std::string(to_string(check.compute)) + " (the compute type)" : "";
    std::string const layer = first != nullptr ? " for " + first->name() + ", which takes no token ids" : "";
    throw Error(Errc::invalid_argument, what + ": x of dtype " + std::string(to_string(x.dtype())) + layer + " (expected float32" + also + ")");
  }
  Shape output = x.shape();
  try {
    for (Sequential const* p : parts)
      if (p != nullptr) output = p->output_shape(output);
  } catch (Error const& e) {
    throw Error(Errc::invalid_argument, what + ": x of shape " + to_string(x.shape()) + ": " + std::string(e.message()));
  }
  if (vocab > 0 && check.values && x.device().kind == DeviceKind::host) {
    auto const ids = x.host_span<std::int32_t>();
    std::int64_t const per_row = x.dim(0) > 0 ? x.numel() / x.dim(0) : 1;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= 0 && ids[i] < vocab) continue;
      auto const at = static_cast<std::int64_t>(i);
      throw Error(Errc::invalid_argument, what + ": token id " + std::to_string(ids[i]) + " at row " + std::to_string(at / per_row) +
                                              ", position " + std::to_string(at % per_row) + " of the batch (expected an id in [0, " +
                                              std::to_string(vocab) + "))");
    }
  }
  loss.check(output, targets, what);
  if (check.values) loss.check_values(output, targets, what);
  return output;
}

Shape check_batch(Sequential const& model, Loss const& loss, Tensor const& x, Tensor const& targets, BatchCheck const& check,
                  std::string const& what) {
  Sequential const* const parts[] = {&model};
  return check_batch(parts, loss, x, targets, check, what);
}

namespace {
// What train_step's enqueue did before it threw: whether the step updates in backward, and whether
// an update of a range was enqueued.
struct Progress {
  bool in_backward = false;
  bool updated = false;
};

// `whole`: x is a whole batch (not a shard of a global one), which train_step waited to read.
StepResult enqueue_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& targets, Loss const& loss,
                        Context& ctx, StepOptions const& options, bool whole, Progress& progress) {
  if (!model.materialized())
    throw Error(Errc::invalid_argument, "train_step before materialize (expected model.materialize(ctx, seed) first)");
  std::int64_t const rows = x.defined() && x.rank() >= 1 ? x.dim(0) : 0;
  if (x.defined()) {
    check_batch(model, loss, x, targets, {options.lr_scale, model.compute_type(), !whole, whole}, "train_step");
  } else if (targets.defined() && targets.numel() != 0) {
    throw Error(Errc::invalid_argument, "train_step: no x and targets of shape " + to_string(targets.shape()) +
                                            " (expected no targets for an empty shard)");
  }
  if (options.global_rows > 0 && rows > options.global_rows)
    throw Error(Errc::invalid_argument, "train_step: a shard of " + std::to_string(rows) + " rows of a " +
                                            std::to_string(options.global_rows) + "-row batch (expected global_rows >= the shard's rows)");
  if (!(options.lr_scale >= 0 && std::isfinite(options.lr_scale)))
    throw Error(Errc::invalid_argument, "train_step: lr_scale " + std::to_string(options.lr_scale) + " (expected a finite lr_scale >= 0)");
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument, "train_step: clip_norm " + std::to_string(options.clip_norm) +
                                            " (expected 0 for no clipping, or a finite norm > 0)");
  // Where the update reads the gradients and writes the parameters: a sync may keep them itself (and
  // with the gradients, accumulate micro-batches).
  UpdatePart const full{&model, &optimizer, &ctx.allocator, &ctx.stream};
  UpdatePart const where = options.sync != nullptr ? options.sync->update_part(full) : full;
  bool const sharded_grads = where.gradients.defined();
  Tensor const& masters = sharded_grads ? where.gradients : model.master_gradients();
  if (options.accumulate_only && options.accumulator == nullptr && !sharded_grads)
    throw Error(Errc::invalid_argument, "train_step: accumulate_only without an accumulator (expected a float32 buffer)");
  if (options.accumulator != nullptr && sharded_grads)
    throw Error(Errc::invalid_argument,
                "train_step: an accumulator with a sync that shards the gradients (expected none: the sync accumulates them)");
  if (options.accumulator != nullptr &&
      (options.accumulator->numel() != masters.numel() || options.accumulator->dtype() != DType::float32))
    throw Error(Errc::invalid_argument, "train_step: an accumulator of " + std::to_string(options.accumulator->numel()) + " " +
                                            std::string(to_string(options.accumulator->dtype())) + " elements (expected " +
                                            std::to_string(masters.numel()) + " float32, one per parameter)");
  trace::Timeline* const timeline = options.timeline != nullptr && options.timeline->enabled() ? options.timeline : nullptr;
  float const loss_scale = options.scaler != nullptr ? options.scaler->scale() : 1.0f;
  StepResult result{Tensor::empty({1}, DType::float32, ctx.allocator), !options.accumulate_only};
  // Without a loss scaler or clipping nothing needs all gradients before the update: each layer
  // (bucket) is updated as soon as its gradients are (reduced and) ready, while they are in cache.
  bool const update_in_backward = !options.accumulate_only && options.scaler == nullptr && options.clip_norm <= 0;
  progress.in_backward = update_in_backward;
  if (update_in_backward)
    optimizer.begin_step(where.parameters.defined() ? where.parameters : model.master_parameters(), ctx.allocator, ctx.stream);
  RangeUpdate update;
  if (update_in_backward) {
    update = [&](std::int64_t begin, std::int64_t end, Stream& stream) {
      progress.updated = true;
      auto const apply = [&] { update_range(where, begin, end, stream, options.lr_scale); };
      if (timeline == nullptr) {
        apply();
      } else {
        int const lane = &stream == &ctx.stream ? trace::Lane::compute : trace::Lane::communication;
        timeline->stream_span(stream, "update [" + std::to_string(begin) + ", " + std::to_string(end) + ")", "update", options.rank, lane,
                              apply);
      }
    };
  }
  GradientSync* const sync = options.accumulate_only && !sharded_grads ? nullptr : options.sync;
  // Sharded parameters are gathered before each layer runs (the sync's, whether it reduces or not).
  Sequential::BeforeLayer before;
  if (options.sync != nullptr)
    before = [&](std::size_t layer, bool backward) { options.sync->before_layer(layer, backward, ctx.stream); };
  std::vector<ParameterRange> const ranges = model.parameter_ranges();
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
    // A batch without counted units (every token ignored) has loss 0 and zero gradients.
    std::int64_t const units = options.global_units > 0  ? options.global_units
                               : options.global_rows > 0 ? options.global_rows
                                                         : loss.count(targets, ctx.stream);
    float const grad_scale = loss_scale * options.grad_scale;
    Tensor doutput;
    auto const forward = [&] {
      Tensor const output = model.forward(as_compute(model, x, ctx), ctx, before);
      doutput = Tensor::empty(output.shape(), output.dtype(), ctx.allocator);
      loss.compute(output, targets, doutput, result.loss, std::max<std::int64_t>(units, 1), grad_scale, ctx.allocator, ctx.stream);
    };
    if (timeline != nullptr) {
      timeline->stream_span(ctx.stream, "forward", "forward", options.rank, trace::Lane::compute, forward);
      mark("");
    } else {
      forward();
    }
    if (sync != nullptr) sync->begin(ctx.stream, update);
    model.backward(doutput, ctx, false, on_gradients, before);
  } else {  // an empty shard contributes zero gradients, in the same ranges and order
    fill_async(result.loss, 0.0f, ctx.stream);
    if (before) {
      for (std::size_t layer = 0; layer < model.size(); ++layer) before(layer, false);
    }
    if (timeline != nullptr) mark("");
    if (sync != nullptr) sync->begin(ctx.stream, update);
    for (auto r = ranges.rbegin(); r != ranges.rend(); ++r) {
      if (before) before(r->layer, true);
      model.zero_gradients(ctx.stream, r->begin, r->end);  // where the sync bound them, with sharded gradients
      on_gradients(r->begin, r->end);
    }
  }
  if (sync != nullptr) sync->finish(ctx.stream);
  if (options.accumulate_only || update_in_backward) return result;

  // The loss scaler's overflow check and the clipping norm read every (reduced) gradient, so every
  // data-parallel replica takes the same decision.
  UpdatePart const part = sync != nullptr ? sync->update_part(full) : full;
  UpdateOptions const update_options{options.lr_scale, options.clip_norm, options.scaler, false};
  auto const apply = [&] { result.applied = apply_update({&part, 1}, update_options); };
  if (timeline != nullptr) {
    timeline->stream_span(ctx.stream, "optimizer step", "update", options.rank, trace::Lane::compute, apply);
  } else {
    apply();
  }
  return result;
}

}  // namespace

StepResult train_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& targets, Loss const& loss,
                      Context& ctx, StepOptions const& options) {
  bool const whole = options.global_units <= 0 && options.global_rows <= 0 && options.sync == nullptr;
  Sequential::StepRecord& record = model.step_record();
  // The last step's work failed after it returned (its stream skipped the mark it put last): what
  // it changed on the host goes back, so a run goes on as if it had not been called.
  auto const put_back_failed = [&] {
    if (record.done && !record.done->load(std::memory_order_acquire) && record.optimizer == &optimizer) {
      model.set_rng_state(record.rng);
      optimizer.set_steps(record.steps);
    }
    record.done.reset();
  };
  if (whole) {
    // A whole batch in host memory is read on the host: first the work before it (which may write
    // it, and shows whether the last step's work failed) is waited for.
    bool const host_inputs = (x.defined() && x.device().kind == DeviceKind::host) ||
                             (targets.defined() && targets.device().kind == DeviceKind::host);
    try {
      if (host_inputs) ctx.stream.synchronize();
    } catch (...) {
      put_back_failed();
      throw;
    }
    if (record.done && ctx.stream.query()) put_back_failed();
  }
  // What the enqueue changes on the host before the device runs anything, put back when it throws
  // before any update was enqueued (no memory for an activation, a layer refusing its input).
  std::vector<std::uint64_t> const rng = model.rng_state();
  std::int64_t const steps = optimizer.steps();
  std::optional<optim::LossScaler::State> const scaler =
      options.scaler != nullptr ? std::optional(options.scaler->state()) : std::nullopt;
  Progress progress;
  StepResult result;
  try {
    result = enqueue_step(model, optimizer, x, targets, loss, ctx, options, whole, progress);
  } catch (...) {
    if (progress.in_backward ? !progress.updated : optimizer.steps() == steps) {
      model.set_rng_state(rng);
      optimizer.set_steps(steps);
      if (scaler) options.scaler->set_state(*scaler);
    }
    throw;
  }
  if (whole) {  // the mark the next call checks, last on the stream
    auto done = std::make_shared<std::atomic<bool>>(false);
    record = {rng, steps, &optimizer, done};
    ctx.stream.enqueue([done] { done->store(true, std::memory_order_release); });
  }
  return result;
}

StepResult classification_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& labels, Context& ctx,
                               StepOptions const& options) {
  return train_step(model, optimizer, x, labels, SoftmaxCrossEntropy{}, ctx, options);
}

bool apply_update(std::span<UpdatePart const> parts, UpdateOptions const& options, PartTotal const& total) {
  if (!(options.lr_scale >= 0 && std::isfinite(options.lr_scale)))
    throw Error(Errc::invalid_argument, "apply_update: lr_scale " + std::to_string(options.lr_scale) + " (expected a finite lr_scale >= 0)");
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument, "apply_update: clip_norm " + std::to_string(options.clip_norm) +
                                            " (expected 0 for no clipping, or a finite norm > 0)");
  // Each part's ranges of its flat buffers: all of them (less a shared range, which it updates
  // but does not count), or the part's ranges.
  std::vector<std::vector<ElementRange>> ranges(parts.size());
  std::vector<bool> sharded(parts.size(), false);
  // Where each part's gradients are: its master gradients, or the part's packed ones, where a range
  // starts after the sizes of the ranges that start before it.
  auto const gradients = [&](std::size_t i, ElementRange const& r) {
    if (!parts[i].gradients.defined()) return parts[i].model->master_gradients().slice(r.begin, r.end);
    std::int64_t at = 0;
    for (ElementRange const& other : ranges[i])
      if (other.begin < r.begin) at += other.end - other.begin;
    return parts[i].gradients.slice(at, at + (r.end - r.begin));
  };
  for (std::size_t i = 0; i < parts.size(); ++i) {
    UpdatePart const& p = parts[i];
    if (p.model == nullptr || p.optimizer == nullptr || p.allocator == nullptr || p.stream == nullptr)
      throw Error(Errc::invalid_argument, "apply_update: part " + std::to_string(i) + " without a model, optimizer, allocator or stream (expected all four)");
    std::int64_t const n = p.model->parameter_count();
    if (p.shared_begin < 0 || p.shared_begin > p.shared_end || p.shared_end > n)
      throw Error(Errc::invalid_argument, "apply_update: part " + std::to_string(i) + " shares elements [" + std::to_string(p.shared_begin) +
                                              ", " + std::to_string(p.shared_end) + ") (expected a range within its " + std::to_string(n) + ")");
    ranges[i] = p.ranges;
    sharded[i] = !ranges[i].empty();
    if (sharded[i] && p.shared_begin < p.shared_end)
      throw Error(Errc::invalid_argument, "apply_update: part " + std::to_string(i) +
                                              " both shares elements and shards its update (expected one or the other)");
    if (!sharded[i]) ranges[i] = {{0, p.shared_begin, true}, {p.shared_begin, p.shared_end, false}, {p.shared_end, n, true}};
  }
  // The sum over every part's counted ranges (and, with its combine, over the replicas) of the
  // float32 scalar `op` writes for a range of master gradients, read once every part's work is
  // enqueued (so the devices compute them at once); or `total`'s of the ranges' values.
  auto const sum_over_parts = [&](auto&& op) {
    std::vector<Tensor> sums(parts.size());
    for (std::size_t i = 0; i < parts.size(); ++i) {
      UpdatePart const& p = parts[i];
      sums[i] = Tensor::empty({static_cast<std::int64_t>(ranges[i].size())}, DType::float32, *p.allocator);
      for (std::size_t j = 0; j < ranges[i].size(); ++j) {
        ElementRange const& r = ranges[i][j];
        Tensor const out = sums[i].slice(static_cast<std::int64_t>(j), static_cast<std::int64_t>(j) + 1);
        if (r.counted && r.begin < r.end) {
          op(gradients(i, r), out, *p.stream);
        } else {
          fill_async(out, 0.0f, *p.stream);
        }
      }
      if (p.combine && !total) p.combine(sums[i], *p.stream);
    }
    if (total) return total(sums);
    double sum = 0;
    for (std::size_t i = 0; i < parts.size(); ++i)
      for (std::int64_t j = 0; j < sums[i].numel(); ++j) sum += ops::item(sums[i].slice(j, j + 1), *parts[i].stream);
    return sum;
  };
  if (options.unscale) {
    float const factor = options.scaler != nullptr ? 1.0f / options.scaler->scale() : 1.0f;
    for (UpdatePart const& p : parts) p.model->unscale_gradients(factor, *p.stream);
  }
  if (options.scaler != nullptr) {
    double const bad = sum_over_parts([](Tensor const& grads, Tensor const& out, Stream& stream) { ops::count_nonfinite(grads, out, stream); });
    if (!options.scaler->update(bad == 0)) return false;
  }
  if (options.clip_norm > 0) {
    double const squares = sum_over_parts([](Tensor const& grads, Tensor const& out, Stream& stream) { ops::sum_squares(grads, out, stream); });
    float const norm = std::sqrt(static_cast<float>(squares));
    if (!std::isfinite(norm))
      throw Error(Errc::invalid_argument, "apply_update: clipping gradients that hold NaN or Inf (expected finite gradients)");
    if (norm > options.clip_norm && norm > 0) {
      for (std::size_t i = 0; i < parts.size(); ++i) {
        UpdatePart const& p = parts[i];
        Tensor const& grads = p.model->master_gradients();
        if (!sharded[i]) {
          ops::scale(grads, options.clip_norm / norm, *p.stream);
          continue;
        }
        for (ElementRange const& r : ranges[i])
          if (r.begin < r.end) ops::scale(gradients(i, r), options.clip_norm / norm, *p.stream);
      }
    }
  }
  for (std::size_t i = 0; i < parts.size(); ++i) {
    UpdatePart const& p = parts[i];
    if (!sharded[i]) {
      p.optimizer->step(p.model->master_parameters(), p.model->master_gradients(), *p.allocator, *p.stream, options.lr_scale);
      p.model->sync_parameters(*p.stream);
      if (p.after) p.after(*p.stream);
      continue;
    }
    p.optimizer->begin_step(p.parameters.defined() ? p.parameters : p.model->master_parameters(), *p.allocator, *p.stream);
    for (ElementRange const& r : ranges[i])
      if (r.begin < r.end) update_range(p, r.begin, r.end, *p.stream, options.lr_scale);
    if (p.after) p.after(*p.stream);
  }
  return true;
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
