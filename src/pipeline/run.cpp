// One step's work on every device: each device's actions of the schedule (run_device), the sum of a
// tied wte and its copy, the replicas' reduce (through the data-parallel gradient sync), and,
// across processes or with ZeRO, the world's total of the update's overflow count and norm
// (world_total, for nn::apply_update).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "pipeline/executor_impl.hpp"

namespace mgpu::pipeline {

namespace {
Tensor take(std::vector<Tensor>& slots, int chunk, int micro_batch, int micro_batches, char const* what) {
  Tensor& slot = slots[static_cast<std::size_t>(chunk * micro_batches + micro_batch)];
  if (!slot.defined())
    throw Error(Errc::invalid_argument, std::string("no ") + what + " for chunk " + std::to_string(chunk) + ", micro-batch " +
                                            std::to_string(micro_batch) + " (expected the schedule to produce it first)");
  return std::exchange(slot, Tensor{});
}

// "pipeline device 1, chunk 2, action 7 (forward(mb 3, chunk 2))": where an error happened.
std::string where(int rank, std::size_t index, Action const& a) {
  return "pipeline device " + std::to_string(rank) + ", chunk " + std::to_string(a.chunk) + ", action " + std::to_string(index) + " (" +
         to_string(a) + ")";
}
}  // namespace

void Executor::Impl::run_device(int rank, Stream& stream, Step& step) {
  Schedule const& s = schedule;
  int const last = s.chunks() - 1;
  int const mbs = s.micro_batches;
  int const device = device_in_pipeline(rank);
  int const pipeline = pipeline_of(rank);
  Allocator& allocator = group->allocator(rank - first);
  DType const dtype = options.compute;  // of activations and their gradients
  DeviceState& st = devices[static_cast<std::size_t>(rank)];
  auto const slot = [mbs](int chunk, int mb) { return static_cast<std::size_t>(chunk * mbs + mb); };
  for (int c = device; c < s.chunks(); c += s.devices) {
    chunk_of(rank, c).zero_gradients(stream);
    st.rng_start[static_cast<std::size_t>(c)] = chunk_of(rank, c).rng_state();
  }
  std::fill(st.ran_forward.begin(), st.ran_forward.end(), false);
  st.regions = 0;
  trace::Timeline* const timeline = options.timeline.get();
  auto const& list = s.actions[static_cast<std::size_t>(device)];
  std::size_t current = 0;  // the action running, for the error message
  try {
    for (std::size_t i = 0; i < list.size();) {
      Action const& a = list[i];
      current = i;
      // Timeline names are made only while the timeline records.
      bool const tracing = timeline != nullptr && timeline->enabled();
      if (is_transfer(a.kind)) {
        std::size_t end = i;
        while (end < list.size() && is_transfer(list[end].kind)) ++end;
        auto transfers = [&] {
          comm->group_start(rank);
          for (std::size_t k = i; k < end; ++k) {
            Action const& t = list[k];
            current = k;
            auto const mb = static_cast<std::size_t>(t.micro_batch);
            switch (t.kind) {
              case ActionKind::send_activation:
                comm->send(rank, take(st.act_out, t.chunk, t.micro_batch, mbs, "activation"),
                           rank_at(pipeline, s.device_of(t.chunk + 1)), stream);
                break;
              case ActionKind::send_gradient:
                comm->send(rank, take(st.grad_in, t.chunk, t.micro_batch, mbs, "input gradient"),
                           rank_at(pipeline, s.device_of(t.chunk - 1)), stream);
                break;
              case ActionKind::recv_activation: {
                Tensor buffer = Tensor::empty(step.input_shapes[static_cast<std::size_t>(t.chunk)][mb], dtype, allocator);
                comm->recv(rank, buffer, rank_at(pipeline, s.device_of(t.chunk - 1)), stream);
                st.act_in[slot(t.chunk, t.micro_batch)] = std::move(buffer);
                break;
              }
              default: {
                Tensor buffer = Tensor::empty(step.input_shapes[static_cast<std::size_t>(t.chunk) + 1][mb], dtype, allocator);
                comm->recv(rank, buffer, rank_at(pipeline, s.device_of(t.chunk + 1)), stream);
                st.grad_out[slot(t.chunk, t.micro_batch)] = std::move(buffer);
              }
            }
          }
          comm->group_end(rank);
        };
        timed(st, stream, Region::wait, [&] {
          if (tracing) {
            std::string names;
            for (std::size_t k = i; k < end; ++k) names += (names.empty() ? "" : ", ") + to_string(list[k]);
            timeline->stream_span(stream, std::move(names), "pipeline", rank, trace::communication, transfers);
          } else {
            transfers();
          }
        });
        i = end;
        continue;
      }
      nn::Sequential& chunk = chunk_of(rank, a.chunk);
      auto const mb = static_cast<std::size_t>(a.micro_batch);
      auto const c = static_cast<std::size_t>(a.chunk);
      nn::Context ctx{allocator, stream, step.offsets[mb], a.micro_batch, true};
      // ZeRO-3: the replicas' sync gathers the chunk's units as the pass reaches them.
      parallel::detail::RankSync* const sharded = options.zero_stage == 3 ? replica_sync(rank, a.chunk) : nullptr;
      nn::Sequential::BeforeLayer before;
      if (sharded != nullptr) before = [&](std::size_t layer, bool backward) { sharded->before_layer(layer, backward, stream); };
      if (a.kind == ActionKind::forward) {
        // Enqueue no further ahead than the stream runs: once the compute action before this one
        // has run, the tensors of micro-batches whose backward is done are free before this
        // forward allocates, so the allocator's peak is the schedule's activations in flight.
        // Transfers enqueued since need not have run: the thread enqueues this forward while
        // its stream waits for a peer, and the stream starts it as soon as the input arrives.
        try {
          st.compute_done.synchronize();
        } catch (Error const&) {
          stream.synchronize();  // rethrows what failed on the stream, rather than the event's report
          throw;
        }
      }
      auto compute = [&] {
        switch (a.kind) {
          case ActionKind::forward: {
            Tensor input;
            if (a.chunk == 0) {
              input = Tensor::empty(step.input_shapes[0][mb], step.x->dtype(), allocator);
              copy_async(input, step.x->slice(step.offsets[mb], step.offsets[mb] + step.sizes[mb]), stream);
              if (input.dtype() == DType::float32 && dtype != DType::float32) {
                Tensor const rows = std::exchange(input, Tensor::empty(step.input_shapes[0][mb], dtype, allocator));
                convert_async(input, rows, stream);
              }
            } else if (s.device_of(a.chunk - 1) == device) {
              input = take(st.act_out, a.chunk - 1, a.micro_batch, mbs, "activation");
            } else {
              input = take(st.act_in, a.chunk, a.micro_batch, mbs, "received activation");
            }
            chunk.set_rng_state(st.rng_start[c]);
            if (sharded != nullptr) sharded->begin_pass(false, stream);
            Tensor const y = chunk.forward(input, ctx, before);
            if (sharded != nullptr) sharded->end_pass(stream);
            if (!st.ran_forward[c]) {  // every micro-batch draws from the step's start; keep where one ends
              st.rng_after[c] = chunk.rng_state();
              st.ran_forward[c] = true;
            }
            if (a.chunk < last) {
              st.act_out[slot(a.chunk, a.micro_batch)] = y;
              break;
            }
            Shape target_shape = step.labels->shape();
            target_shape[0] = step.sizes[mb];
            Tensor const targets = Tensor::empty(target_shape, step.labels->dtype(), allocator);
            copy_async(targets, step.labels->slice(step.offsets[mb], step.offsets[mb] + step.sizes[mb]), stream);
            Tensor const dlogits = Tensor::empty(y.shape(), y.dtype(), allocator);
            step.losses[mb] = Tensor::empty({1}, DType::float32, allocator);
            // Each micro-batch's share of the batch's mean: the losses and gradients add up to the batch mean's.
            losses[static_cast<std::size_t>(pipeline)]->compute(y, targets, dlogits, step.losses[mb], step.units,
                                                                step.loss_scale, allocator, stream);
            st.grad_out[slot(a.chunk, a.micro_batch)] = dlogits;
            break;
          }
          case ActionKind::backward:
          case ActionKind::backward_input: {
            Tensor const dy = a.chunk < last && s.device_of(a.chunk + 1) == device
                                  ? take(st.grad_in, a.chunk + 1, a.micro_batch, mbs, "input gradient")
                                  : take(st.grad_out, a.chunk, a.micro_batch, mbs, "output gradient");
            // Zero bubble's weight half reads no parameters: only the input half gathers them.
            if (sharded != nullptr) sharded->begin_pass(true, stream);
            Tensor dx = a.kind == ActionKind::backward ? chunk.backward(dy, ctx, a.chunk > 0, {}, before)
                                                       : chunk.backward_input(dy, ctx, a.chunk > 0, before);
            if (sharded != nullptr) sharded->end_pass(stream);
            if (a.chunk > 0) st.grad_in[slot(a.chunk, a.micro_batch)] = std::move(dx);
            break;
          }
          default: chunk.backward_weight(ctx);
        }
      };
      timed(st, stream, Region::compute, [&] {
        if (tracing) {
          timeline->stream_span(stream, to_string(a), "pipeline", rank, trace::compute, compute);
        } else {
          compute();
        }
      });
      ++i;
      std::size_t next = i;
      while (next < list.size() && is_transfer(list[next].kind)) ++next;
      if (next < list.size() && list[next].kind == ActionKind::forward) st.compute_done.record(stream);
    }
  } catch (Error const& e) {
    throw Error(e.category(), where(rank, current, list[current]) + ": " + std::string(e.message()));
  }
  for (int c = device; c < s.chunks(); c += s.devices) {
    if (st.ran_forward[static_cast<std::size_t>(c)]) chunk_of(rank, c).set_rng_state(st.rng_after[static_cast<std::size_t>(c)]);
  }
  if (!partials.empty()) {  // sequence parallelism: each rank's tokens' part of the LayerNorms' gradients
    for (int c = device; c < s.chunks(); c += s.devices) {
      auto const index = static_cast<std::size_t>(pipeline * s.chunks() + c);
      Tensor const& grads = chunk_of(rank, c).gradients();
      timed(st, stream, Region::tensor_parallel_sum, [&] {
        for (nn::ParameterRange const& range : partials[index]) {
          Tensor const part = grads.slice(range.begin, range.end);
          tp_comm(pipeline, c).all_reduce(tp_index(pipeline), part, part, comm::ReduceOp::sum, stream);
        }
      });
    }
  }
  // The float32 master gradients are summed and reduced (the update does not unscale).
  for (int c = device; c < s.chunks(); c += s.devices)
    if (chunk_of(rank, c).parameter_count() > 0) chunk_of(rank, c).unscale_gradients(1.0f / step.loss_scale, stream);
  // The tied wte and its copy first: each replica's sum, which the replicas' reduce then adds up.
  timed(st, stream, Region::wait, [&] { sum_tied(rank, stream, false); });
  if (replicas > tp) {  // the same chunk across replicas: sum of their batch-mean shares
    for (int c = device; c < s.chunks(); c += s.devices) {
      Tensor const& grads = chunk_of(rank, c).master_gradients();
      if (!grads.defined()) continue;
      auto reduce = [&] {  // every bucket, its reduce awaited
        parallel::detail::RankSync* const sync = replica_sync(rank, c);
        sync->begin(stream, nullptr);
        sync->finish(stream);
      };
      timed(st, stream, Region::wait, [&] {
        if (timeline != nullptr && timeline->enabled()) {
          timeline->stream_span(stream, "all_reduce(chunk " + std::to_string(c) + ")", "pipeline", rank, trace::communication, reduce);
        } else {
          reduce();
        }
      });
    }
  }
}

void Executor::Impl::time_tensor_parallel() {
  if (!options.metrics) return;
  for (auto const& c : tp_comms)  // another process's chunks' stand-ins are not renewable: never called
    if (auto* const timed = dynamic_cast<comm::detail::Renewable*>(c.get())) timed->set_timed(true);
}

void Executor::Impl::report_times() {
  if (!options.metrics) return;
  std::vector<metrics::DeviceTimes> times;
  for (int local = 0; local < group->size(); ++local) {
    DeviceState const& st = devices[static_cast<std::size_t>(first + local)];
    double compute_ms = 0, wait_ms = 0, partial_ms = 0;
    for (std::size_t k = 0; k < st.regions; ++k) {
      double const ms = std::max(0.0, Event::elapsed_ms(st.marks[2 * k], st.marks[2 * k + 1]));
      (st.kinds[k] == Region::compute ? compute_ms : st.kinds[k] == Region::wait ? wait_ms : partial_ms) += ms;
    }
    // Every tensor-parallel call of the device, inside compute actions or the partial sums.
    double tensor_parallel_ms = 0;
    for (auto const& c : tp_comms)
      if (auto const* const timed = dynamic_cast<comm::detail::Renewable const*>(c.get()))
        tensor_parallel_ms += timed->seconds(group->stream(local)) * 1e3;
    double const inside_compute = std::clamp(tensor_parallel_ms - partial_ms, 0.0, compute_ms);
    times.push_back({.rank = local,
                     .device = group->device(local),
                     .compute_seconds = (compute_ms - inside_compute) / 1e3,
                     .wait_seconds = (wait_ms + partial_ms + inside_compute) / 1e3});
  }
  options.metrics->report_times(times);
}

void Executor::Impl::sum_tied(int rank, Stream& stream, bool parameters) {
  if (!tie) return;
  int const device = device_in_pipeline(rank);
  int const embedding_device = schedule.device_of(tie->embedding_chunk);
  int const head_device = schedule.device_of(tie->head_chunk);
  if (device != embedding_device && device != head_device) return;
  int const pipeline = pipeline_of(rank);
  std::int64_t const elements = tie_elements[static_cast<std::size_t>(pipeline)];
  auto const part = [&](int c, std::int64_t offset) {
    nn::Sequential const& chunk = chunk_of(rank, c);
    return (parameters ? chunk.master_parameters() : chunk.master_gradients()).slice(offset, offset + elements);
  };
  if (embedding_device == head_device) {
    Tensor const wte = part(tie->embedding_chunk, tie->embedding_offset);
    Tensor const copy = part(tie->head_chunk, tie->head_offset);
    ops::add_scaled(wte, copy, 1.0f, stream);
    copy_async(copy, wte, stream);
  } else {
    Tensor const mine = device == embedding_device ? part(tie->embedding_chunk, tie->embedding_offset)
                                                   : part(tie->head_chunk, tie->head_offset);
    tie_comms[static_cast<std::size_t>(pipeline)]->all_reduce(device == embedding_device ? 0 : 1, mine, mine,
                                                             comm::ReduceOp::sum, stream);
  }
  if (!parameters) return;
  for (auto const& [c, offset] : {std::pair{tie->embedding_chunk, tie->embedding_offset}, std::pair{tie->head_chunk, tie->head_offset}}) {
    if (schedule.device_of(c) == device) chunk_of(rank, c).sync_parameters(stream, offset, offset + elements);
  }
}

double Executor::Impl::world_total(std::span<nn::UpdatePart const> parts, std::span<Tensor const> sums) {
  // Each rank's slots: per chunk it runs, in chunk order, with ZeRO one (the sum of its replica's
  // values), else one per range of the chunk's update (as nn::PartTotal lays them out: the
  // tensor-parallel norm ranges, or three); as many on every rank (the most any rank has), zero
  // where it has fewer. Pipeline r's chunk c ([r * chunks + c]): its first slot.
  auto const chunks = static_cast<std::size_t>(schedule.chunks());
  bool const sharded = !sharded_updates.empty();
  auto const count = [&](int r, int c) -> std::int64_t {
    if (sharded) return 1;
    if (tp > 1) {  // the pipeline's norm ranges (three, as a part without them, where there are none)
      auto const n = static_cast<std::int64_t>(norms[static_cast<std::size_t>(r) * chunks + static_cast<std::size_t>(c)]->update_part({}).ranges.size());
      return n > 0 ? n : 3;
    }
    return 3;
  };
  std::vector<std::int64_t> first_slot(static_cast<std::size_t>(replicas) * chunks, 0);
  std::int64_t per_rank = 1;
  for (int r = 0; r < replicas; ++r) {
    for (int d = 0; d < schedule.devices; ++d) {
      std::int64_t slot = 0;
      for (int c = d; c < schedule.chunks(); c += schedule.devices) {
        first_slot[static_cast<std::size_t>(r) * chunks + static_cast<std::size_t>(c)] = slot;
        slot += count(r, c);
      }
      per_rank = std::max(per_rank, slot);
    }
  }
  std::vector<Tensor> gathered(static_cast<std::size_t>(group->size()));
  group->run([&](int local, Device, Stream& stream) {
    int const rank = first + local;
    Tensor& all = gathered[static_cast<std::size_t>(local)];
    all = Tensor::empty({comm->size() * per_rank}, DType::float32, group->allocator(local));
    Tensor const mine = all.slice(rank * per_rank, (rank + 1) * per_rank);
    fill_async(mine, 0.0f, stream);
    for (std::size_t i = 0; i < parts.size(); ++i) {
      for (int c = device_in_pipeline(rank); c < schedule.chunks(); c += schedule.devices) {
        if (parts[i].model != &chunk_of(rank, c)) continue;
        std::int64_t const at = first_slot[static_cast<std::size_t>(pipeline_of(rank)) * chunks + static_cast<std::size_t>(c)];
        if (sharded) {
          ops::sum(sums[i], mine.slice(at, at + 1), stream);
        } else {
          copy_async(mine.slice(at, at + count(pipeline_of(rank), c)), sums[i], stream);
        }
      }
    }
    comm->all_gather(rank, mine, all, stream);
  });
  double sum = 0;  // in chunk order, each chunk's pipelines in order
  for (int c = 0; c < schedule.chunks(); ++c) {
    for (int r = 0; r < replicas; ++r) {
      std::int64_t const begin =
          rank_at(r, schedule.device_of(c)) * per_rank + first_slot[static_cast<std::size_t>(r) * chunks + static_cast<std::size_t>(c)];
      for (std::int64_t k = begin; k < begin + count(r, c); ++k) sum += ops::item(gathered[0].slice(k, k + 1), group->stream(0));
    }
  }
  return sum;
}

}  // namespace mgpu::pipeline
