// The pipeline executor and layer split.
#include <mgpu/parallel/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::pipeline {

Schedule layer_split(int devices) {
  Schedule s = gpipe(devices, 1);
  s.name = "layer-split";
  return s;
}

struct Executor::Impl {
  DeviceGroup* group = nullptr;
  Schedule schedule;
  std::vector<std::size_t> cuts;
  ExecutorOptions options;
  int replicas = 1;
  std::unique_ptr<comm::Communicator> comm;                     // every rank: the pipelines' transfers
  std::vector<std::unique_ptr<comm::Communicator>> stage_comms;  // per device of a pipeline, over its replicas
  std::vector<std::vector<nn::Sequential>> chunks;               // [replica][chunk]
  std::vector<std::vector<std::unique_ptr<optim::Optimizer>>> optimizers;
  double last_seconds = 0;

  // One device's actions for a step. Tensors move between actions through maps keyed by
  // (chunk, micro-batch); each map is touched by this device's thread only.
  struct Step {
    Tensor const* x;
    Tensor const* labels;
    std::int64_t total_rows;
    std::vector<std::int64_t> sizes, offsets;  // global rows of each micro-batch
    std::vector<std::vector<Shape>> input_shapes;  // [chunk][micro-batch], and [chunks()] the logits
    std::vector<Tensor> losses;                    // per micro-batch, on the last chunk's device
  };
  void run_device(int rank, Stream& stream, Step& step);
  // Chunk c of the replica that `rank` belongs to.
  nn::Sequential& chunk_of(int rank, int c) {
    return chunks[static_cast<std::size_t>(rank / schedule.devices)][static_cast<std::size_t>(c)];
  }
};

namespace {
using Key = std::pair<int, int>;  // (chunk, micro-batch)

Tensor take(std::map<Key, Tensor>& map, Key key, char const* what) {
  auto const it = map.find(key);
  if (it == map.end())
    throw Error(Errc::invalid_argument, std::string("no ") + what + " for chunk " + std::to_string(key.first) + ", micro-batch " +
                                            std::to_string(key.second) + " (expected the schedule to produce it first)");
  Tensor t = std::move(it->second);
  map.erase(it);
  return t;
}
}  // namespace

void Executor::Impl::run_device(int rank, Stream& stream, Step& step) {
  Schedule const& s = schedule;
  int const last = s.chunks() - 1;
  int const device = rank % s.devices;      // the device within its pipeline
  int const base = rank - device;           // the pipeline's first rank
  Allocator& allocator = group->allocator(rank);
  std::map<Key, Tensor> act_in, act_out, grad_in, grad_out;
  std::map<int, std::vector<std::uint64_t>> rng_start, rng_after;
  for (int c = device; c < s.chunks(); c += s.devices) {
    chunk_of(rank, c).zero_gradients(stream);
    rng_start[c] = chunk_of(rank, c).rng_state();
  }
  trace::Timeline* const timeline = options.timeline.get();
  auto const& list = s.actions[static_cast<std::size_t>(device)];
  auto const total = static_cast<double>(step.total_rows);
  for (std::size_t i = 0; i < list.size();) {
    Action const& a = list[i];
    std::string where = "pipeline device " + std::to_string(rank) + ", chunk " + std::to_string(a.chunk) + ", action " +
                        std::to_string(i) + " (" + to_string(a) + ")";
    try {
      if (is_transfer(a.kind)) {
        std::size_t end = i;
        std::string names;
        while (end < list.size() && is_transfer(list[end].kind)) names += (names.empty() ? "" : ", ") + to_string(list[end++]);
        auto transfers = [&] {
          comm->group_start(rank);
          for (std::size_t k = i; k < end; ++k) {
            Action const& t = list[k];
            where = "pipeline device " + std::to_string(rank) + ", chunk " + std::to_string(t.chunk) + ", action " + std::to_string(k) +
                    " (" + to_string(t) + ")";
            Key const key{t.chunk, t.micro_batch};
            auto const mb = static_cast<std::size_t>(t.micro_batch);
            switch (t.kind) {
              case ActionKind::send_activation:
                comm->send(rank, take(act_out, key, "activation"), base + s.device_of(t.chunk + 1), stream);
                break;
              case ActionKind::send_gradient:
                comm->send(rank, take(grad_in, key, "input gradient"), base + s.device_of(t.chunk - 1), stream);
                break;
              case ActionKind::recv_activation: {
                Tensor buffer = Tensor::empty(step.input_shapes[static_cast<std::size_t>(t.chunk)][mb], DType::float32, allocator);
                comm->recv(rank, buffer, base + s.device_of(t.chunk - 1), stream);
                act_in[key] = buffer;
                break;
              }
              default: {
                Tensor buffer = Tensor::empty(step.input_shapes[static_cast<std::size_t>(t.chunk) + 1][mb], DType::float32, allocator);
                comm->recv(rank, buffer, base + s.device_of(t.chunk + 1), stream);
                grad_out[key] = buffer;
              }
            }
          }
          comm->group_end(rank);
        };
        if (timeline != nullptr) {
          timeline->stream_span(stream, names, "pipeline", rank, trace::communication, transfers);
        } else {
          transfers();
        }
        i = end;
        continue;
      }
      nn::Sequential& chunk = chunk_of(rank, a.chunk);
      auto const mb = static_cast<std::size_t>(a.micro_batch);
      Key const key{a.chunk, a.micro_batch};
      nn::Context ctx{allocator, stream, step.offsets[mb], a.micro_batch, true};
      auto compute = [&] {
        switch (a.kind) {
          case ActionKind::forward: {
            // Enqueue no further ahead than the stream runs: the tensors of micro-batches whose
            // backward is done are then free before this forward allocates, so the allocator's
            // peak is the schedule's activations in flight.
            stream.synchronize();
            Tensor input;
            if (a.chunk == 0) {
              input = Tensor::empty(step.input_shapes[0][mb], DType::float32, allocator);
              copy_async(input, step.x->slice(step.offsets[mb], step.offsets[mb] + step.sizes[mb]), stream);
            } else if (s.device_of(a.chunk - 1) == device) {
              input = take(act_out, {a.chunk - 1, a.micro_batch}, "activation");
            } else {
              input = take(act_in, key, "received activation");
            }
            chunk.set_rng_state(rng_start[a.chunk]);
            Tensor const y = chunk.forward(input, ctx);
            rng_after[a.chunk] = chunk.rng_state();
            if (a.chunk < last) {
              act_out[key] = y;
              break;
            }
            Tensor const labels = Tensor::empty({step.sizes[mb]}, DType::float32, allocator);
            copy_async(labels, step.labels->slice(step.offsets[mb], step.offsets[mb] + step.sizes[mb]), stream);
            Tensor const dlogits = Tensor::empty(y.shape(), y.dtype(), allocator);
            step.losses[mb] = Tensor::empty({1}, DType::float32, allocator);
            // Each micro-batch's mean loss weighted by its share: the gradients add up to the batch mean's.
            ops::softmax_cross_entropy(y, labels, dlogits, step.losses[mb], stream, static_cast<float>(static_cast<double>(step.sizes[mb]) / total));
            grad_out[key] = dlogits;
            break;
          }
          case ActionKind::backward:
          case ActionKind::backward_input: {
            Tensor const dy = a.chunk < last && s.device_of(a.chunk + 1) == device ? take(grad_in, {a.chunk + 1, a.micro_batch}, "input gradient")
                                                                                 : take(grad_out, key, "output gradient");
            Tensor dx = a.kind == ActionKind::backward ? chunk.backward(dy, ctx, a.chunk > 0) : chunk.backward_input(dy, ctx, a.chunk > 0);
            if (a.chunk > 0) grad_in[key] = std::move(dx);
            break;
          }
          default: chunk.backward_weight(ctx);
        }
      };
      if (timeline != nullptr) {
        timeline->stream_span(stream, to_string(a), "pipeline", rank, trace::compute, compute);
      } else {
        compute();
      }
      ++i;
    } catch (Error const& e) {
      throw Error(e.category(), where + ": " + std::string(e.message()));
    }
  }
  for (auto& [c, state] : rng_after) chunk_of(rank, c).set_rng_state(state);
  if (replicas > 1) {  // the same chunk across replicas: sum of their batch-mean shares
    for (int c = device; c < s.chunks(); c += s.devices) {
      Tensor const& grads = chunk_of(rank, c).gradients();
      if (!grads.defined()) continue;
      auto reduce = [&] { stage_comms[static_cast<std::size_t>(device)]->all_reduce(rank / s.devices, grads, grads, comm::ReduceOp::sum, stream); };
      if (timeline != nullptr) {
        timeline->stream_span(stream, "all_reduce(chunk " + std::to_string(c) + ")", "pipeline", rank, trace::communication, reduce);
      } else {
        reduce();
      }
    }
  }
}

Executor::Executor(nn::Sequential const& model, DeviceGroup& group, std::vector<std::size_t> cuts, Schedule schedule,
                   OptimizerFactory make_optimizer, ExecutorOptions options)
    : impl_(std::make_unique<Impl>()) {
  validate(schedule);
  if (options.data_parallel < 1 || schedule.devices * options.data_parallel != group.size())
    throw Error(Errc::invalid_argument, "a schedule for " + std::to_string(schedule.devices) + " devices times " +
                                            std::to_string(options.data_parallel) + " data-parallel replicas on a group of " +
                                            std::to_string(group.size()) + " (expected devices x replicas = the group's size)");
  auto const units = model.cut_points().size() - 1;
  auto const chunks = static_cast<std::size_t>(schedule.chunks());
  if (chunks > units)
    throw Error(Errc::invalid_argument, std::to_string(chunks) + " pipeline stages for a model of " + std::to_string(units) +
                                            " units (expected at most one stage per unit; a Linear and its fused activation are one unit)");
  if (cuts.size() != chunks + 1 || cuts.front() != 0 || cuts.back() != model.size())
    throw Error(Errc::invalid_argument, std::to_string(cuts.size()) + " cut points (expected " + std::to_string(chunks + 1) +
                                            ": 0, one between each two of the " + std::to_string(chunks) + " stages, and " +
                                            std::to_string(model.size()) + ")");
  for (std::size_t c = 0; c < chunks; ++c) {
    if (cuts[c] >= cuts[c + 1])
      throw Error(Errc::invalid_argument, "cut points out of order: " + std::to_string(cuts[c + 1]) + " after " + std::to_string(cuts[c]) +
                                              " (expected strictly increasing layer indices)");
  }
  if (!make_optimizer) throw Error(Errc::invalid_argument, "a pipeline executor without an optimizer factory (expected one)");
  Impl& m = *impl_;
  m.group = &group;
  m.schedule = std::move(schedule);
  m.cuts = std::move(cuts);
  m.options = std::move(options);
  m.replicas = m.options.data_parallel;
  m.chunks.resize(static_cast<std::size_t>(m.replicas));
  m.optimizers.resize(static_cast<std::size_t>(m.replicas));
  for (int r = 0; r < m.replicas; ++r) {
    for (std::size_t c = 0; c < chunks; ++c) {
      m.chunks[static_cast<std::size_t>(r)].push_back(model.stage(m.cuts[c], m.cuts[c + 1]));
      m.optimizers[static_cast<std::size_t>(r)].push_back(make_optimizer());
    }
  }
  int const devices = m.schedule.devices;
  group.run([&](int rank, Device, Stream& stream) {
    nn::Context ctx{group.allocator(rank), stream};
    for (int c = rank % devices; c < m.schedule.chunks(); c += devices) m.chunk_of(rank, c).materialize(ctx, m.options.seed);
  });
  m.comm = comm::make_communicator(group, {comm::Backend::automatic, m.options.timeout});
  if (m.replicas > 1) {
    for (int d = 0; d < devices; ++d) {
      std::vector<int> ranks;
      for (int r = 0; r < m.replicas; ++r) ranks.push_back(r * devices + d);
      m.stage_comms.push_back(comm::make_communicator(group, ranks, {comm::Backend::automatic, m.options.timeout}));
    }
  }
}

Executor::~Executor() = default;

float Executor::compute_gradients(Tensor const& x, Tensor const& labels) {
  Impl& m = *impl_;
  int const mbs = m.schedule.micro_batches;
  if (x.rank() != 2 || x.dtype() != DType::float32)
    throw Error(Errc::invalid_argument, "a pipeline batch x of shape " + mgpu::to_string(x.shape()) + " and dtype " +
                                            std::string(mgpu::to_string(x.dtype())) + " (expected float32 [rows, features])");
  if (labels.numel() != x.dim(0) || labels.dtype() != DType::float32)
    throw Error(Errc::invalid_argument, "pipeline labels of shape " + mgpu::to_string(labels.shape()) + " for " + std::to_string(x.dim(0)) +
                                            " rows (expected one float32 class id per row)");
  if (x.dim(0) < static_cast<std::int64_t>(mbs) * m.replicas)
    throw Error(Errc::invalid_argument, "a batch of " + std::to_string(x.dim(0)) + " rows cannot be split into " + std::to_string(m.replicas) +
                                            " replica(s) x " + std::to_string(mbs) +
                                            " micro-batches (expected at least one row per micro-batch)");
  // Replica r takes the r-th shard of the batch, cut into the schedule's micro-batches.
  std::vector<Impl::Step> steps;
  std::int64_t offset = 0;
  for (std::int64_t const shard : shard_sizes(x.dim(0), m.replicas)) {
    Impl::Step step{&x, &labels, x.dim(0), shard_sizes(shard, mbs), {}, {}, std::vector<Tensor>(static_cast<std::size_t>(mbs))};
    for (std::int64_t n : step.sizes) {
      step.offsets.push_back(offset);
      offset += n;
    }
    step.input_shapes.resize(static_cast<std::size_t>(m.schedule.chunks()) + 1);
    for (std::int64_t n : step.sizes) {
      Shape shape{n, x.dim(1)};
      for (std::size_t c = 0; c < m.chunks[0].size(); ++c) {
        step.input_shapes[c].push_back(shape);
        shape = m.chunks[0][c].output_shape(shape);
      }
      step.input_shapes.back().push_back(shape);
    }
    steps.push_back(std::move(step));
  }
  auto const start = std::chrono::steady_clock::now();
  m.group->run([&](int rank, Device, Stream& stream) { m.run_device(rank, stream, steps[static_cast<std::size_t>(rank / m.schedule.devices)]); });
  m.last_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double loss = 0;
  for (int r = 0; r < m.replicas; ++r) {
    Impl::Step const& step = steps[static_cast<std::size_t>(r)];
    int const last_rank = r * m.schedule.devices + m.schedule.device_of(m.schedule.chunks() - 1);
    for (std::size_t k = 0; k < step.losses.size(); ++k)
      loss += ops::item(step.losses[k], m.group->stream(last_rank)) * static_cast<double>(step.sizes[k]) / static_cast<double>(x.dim(0));
  }
  return static_cast<float>(loss);
}

float Executor::step(Tensor const& x, Tensor const& labels, float lr_scale) {
  float const loss = compute_gradients(x, labels);
  Impl& m = *impl_;
  m.group->run([&](int rank, Device, Stream& stream) {
    int const devices = m.schedule.devices;
    for (int c = rank % devices; c < m.schedule.chunks(); c += devices) {
      nn::Sequential& chunk = m.chunk_of(rank, c);
      chunk.unscale_gradients(1.0f, stream);
      m.optimizers[static_cast<std::size_t>(rank / devices)][static_cast<std::size_t>(c)]->step(
          chunk.master_parameters(), chunk.master_gradients(), m.group->allocator(rank), stream, lr_scale);
      chunk.sync_parameters(stream);
    }
  });
  return loss;
}

Schedule const& Executor::schedule() const noexcept { return impl_->schedule; }
std::vector<std::size_t> const& Executor::cuts() const noexcept { return impl_->cuts; }
double Executor::last_step_seconds() const noexcept { return impl_->last_seconds; }

nn::Sequential& Executor::chunk(int c, int replica) {
  if (c < 0 || c >= impl_->schedule.chunks() || replica < 0 || replica >= impl_->replicas)
    throw Error(Errc::invalid_argument, "chunk " + std::to_string(c) + " of replica " + std::to_string(replica) + " (expected chunk in [0, " +
                                            std::to_string(impl_->schedule.chunks()) + ") and replica in [0, " +
                                            std::to_string(impl_->replicas) + "))");
  return impl_->chunks[static_cast<std::size_t>(replica)][static_cast<std::size_t>(c)];
}

}  // namespace mgpu::pipeline
