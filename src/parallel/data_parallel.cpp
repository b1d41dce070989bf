// DataParallel: replicas, bucketed all-reduce overlapped with backward through a communication
// stream per rank, shard weights from the scheduler and from measured compute time.
#include <mgpu/parallel/data_parallel.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstring>
#include <numeric>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/planning.hpp>

#include "core/host_staging.hpp"

namespace mgpu::parallel {

void Bf16Compression::attach(int ranks, std::vector<std::int64_t> const& bucket_elements) {
  elements_ = bucket_elements;
  slots_.assign(static_cast<std::size_t>(ranks), std::vector<Slot>(bucket_elements.size()));
}

void Bf16Compression::reduce(comm::Communicator& comm, int rank, int bucket, Tensor const& grads, Allocator& allocator,
                             Stream& stream) {
  Slot& slot = slots_.at(static_cast<std::size_t>(rank)).at(static_cast<std::size_t>(bucket));
  if (!slot.residual.defined()) {
    slot.residual = ops::zeros({grads.numel()}, allocator, stream);
    slot.wire = Tensor::empty({grads.numel()}, DType::bfloat16, allocator);
  }
  ops::add_scaled(grads, slot.residual, 1.0f, stream);     // compensate: g + what was lost before
  convert_async(slot.wire, grads, stream);                 // round to bfloat16
  copy_async(slot.residual, grads, stream);                // residual = compensated - rounded
  ops::add_scaled(slot.residual, slot.wire, -1.0f, stream);
  comm.all_reduce(rank, slot.wire, slot.wire, comm::ReduceOp::sum, stream);
  convert_async(grads, slot.wire, stream);
}

Tensor const& Bf16Compression::residual(int rank, int bucket) const {
  return slots_.at(static_cast<std::size_t>(rank)).at(static_cast<std::size_t>(bucket)).residual;
}

namespace {

using Clock = std::chrono::steady_clock;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Buckets of whole layers, last layer first: the first up to first_cap bytes, the rest up to cap.
std::vector<std::pair<std::int64_t, std::int64_t>> plan_buckets(nn::Sequential const& model, std::size_t first_cap, std::size_t cap) {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < model.size(); ++i) {
    std::int64_t const count = model.layer(i).parameter_count();
    if (count > 0) ranges.emplace_back(offset, offset + count);
    offset += count;
  }
  auto const bytes = [](std::int64_t begin, std::int64_t end) { return static_cast<std::size_t>(end - begin) * sizeof(float); };
  std::vector<std::pair<std::int64_t, std::int64_t>> buckets;
  for (auto r = ranges.rbegin(); r != ranges.rend(); ++r) {
    if (!buckets.empty() && bytes(r->first, buckets.back().second) <= (buckets.size() == 1 ? first_cap : cap)) {
      buckets.back().first = r->first;  // the layer joins the open bucket
    } else {
      buckets.emplace_back(r->first, r->second);
    }
  }
  return buckets;
}

// Labels in host memory are checked before any rank starts, so a bad one is reported as itself
// rather than as the aborted collectives it would cause on the other ranks.
void check_labels(nn::Sequential const& model, Tensor const& labels) {
  if (labels.device().kind != DeviceKind::host || labels.dtype() != DType::float32) return;
  std::int64_t classes = 0;
  for (std::size_t i = model.size(); i-- > 0 && classes == 0;) {
    if (auto const* linear = dynamic_cast<nn::Linear const*>(&model.layer(i))) classes = linear->weight().dim(1);
  }
  if (classes == 0) return;
  auto const values = labels.host_span<float>();
  for (std::size_t row = 0; row < values.size(); ++row) {
    float const v = values[row];
    if (!(v >= 0 && v < static_cast<float>(classes)) || v != std::floor(v))
      throw Error(Errc::invalid_argument, "DataParallel::step: label " + std::to_string(v) + " at row " + std::to_string(row) +
                                              " (expected a class id in [0, " + std::to_string(classes) + "))");
  }
}

}  // namespace

struct DataParallel::Impl {
  class RankSync;
  struct Rank;

  DeviceGroup* group = nullptr;
  std::unique_ptr<DeviceGroup> owned;
  std::vector<int> ranks;
  DataParallelOptions options;
  std::vector<double> weights;
  std::vector<std::pair<std::int64_t, std::int64_t>> buckets;
  std::unique_ptr<comm::Communicator> comm;
  std::vector<std::unique_ptr<Rank>> state;
  std::int64_t micro_steps = 0;

  // The sharded update's blocks: per bucket, the elements each rank owns, rank r owning
  // [r * block, (r + 1) * block) of the bucket; 0 where buckets are all-reduced.
  std::vector<std::int64_t> blocks;
  void plan_blocks();
  void launch(int rank, std::size_t bucket, Stream& compute, nn::GradientSync::Reduced const& reduced);
  void gather_optimizer_state();
  std::atomic<bool> state_scattered{false};  // some optimizer state is current only in its owner's blocks
};

// One rank's half of the bucketed all-reduce: counts the layers backward reports and launches a
// bucket's reduce on the communication stream once its last (lowest) layer is written.
class DataParallel::Impl::RankSync final : public nn::GradientSync {
 public:
  RankSync(Impl& impl, int rank) : impl_(impl), rank_(rank) {}
  void begin(Stream& /*compute*/) override { next_ = 0; }
  void ready(std::int64_t begin, std::int64_t /*end*/, Stream& compute, Reduced const& reduced) override {
    if (next_ < impl_.buckets.size() && begin == impl_.buckets[next_].first) {
      if (impl_.options.overlap) impl_.launch(rank_, next_, compute, reduced);
      ++next_;
    }
  }
  void finish(Stream& compute, Reduced const& reduced) override;

 private:
  Impl& impl_;
  int rank_;
  std::size_t next_ = 0;
};

struct DataParallel::Impl::Rank {
  Rank(Impl& impl, int index, nn::Sequential replica, Stream comm, std::unique_ptr<optim::Optimizer> opt)
      : model(std::move(replica)), optimizer(std::move(opt)), comm_stream(std::move(comm)), sync(impl, index) {}
  nn::Sequential model;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::optional<optim::LossScaler> scaler;
  Stream comm_stream;
  RankSync sync;
  std::vector<Event> bucket_events;
  Event done, start, stop;
  Tensor accumulator;
  Tensor gathered;  // deterministic reduce on non-host backends
  double ms_per_row = 0;
  // Host timestamps written by marker tasks on the compute stream (wait for the reduces).
  std::shared_ptr<std::array<std::int64_t, 2>> wait_marks = std::make_shared<std::array<std::int64_t, 2>>();
};

void DataParallel::Impl::plan_blocks() {
  int const n = comm->size();
  blocks.assign(buckets.size(), 0);
  if (!options.shard_update || n < 2) return;
  for (std::size_t b = 0; b < buckets.size(); ++b) blocks[b] = (buckets[b].second - buckets[b].first) / n;
}

void DataParallel::Impl::launch(int rank, std::size_t bucket, Stream& compute, nn::GradientSync::Reduced const& reduced) {
  Rank& st = *state[static_cast<std::size_t>(rank)];
  // Plain variables, not a structured binding: Clang before 16 cannot capture those.
  std::int64_t const begin = buckets[bucket].first;
  std::int64_t const end = buckets[bucket].second;
  st.bucket_events[bucket].record(compute);
  st.bucket_events[bucket].wait(st.comm_stream);
  Tensor const grads = st.model.master_gradients().slice(begin, end);
  Tensor const params = st.model.master_parameters().slice(begin, end);
  bool const traced = options.timeline && options.timeline->enabled();
  int const who = ranks[static_cast<std::size_t>(rank)];
  auto const span = [&](std::string name, auto&& enqueue) {
    if (traced) {
      options.timeline->stream_span(st.comm_stream, std::move(name) + " bucket " + std::to_string(bucket), "communication", who,
                                    trace::Lane::communication, enqueue);
    } else {
      enqueue();
    }
  };
  // With the sharded update and a plain sum, the bucket is reduce-scattered.
  std::int64_t const block = reduced ? blocks[bucket] : 0;
  bool const scatter = block > 0 && !options.comm_hook && !(options.deterministic && comm->backend() != comm::Backend::host);
  if (!scatter) {
    span("all-reduce", [&] {
      if (options.comm_hook) {
        options.comm_hook->reduce(*comm, rank, static_cast<int>(bucket), grads, group->allocator(rank), st.comm_stream);
      } else if (options.deterministic && comm->backend() != comm::Backend::host && comm->size() > 1) {
        std::int64_t const n = grads.numel();
        if (!st.gathered.defined() || st.gathered.numel() < n * comm->size())
          st.gathered = Tensor::empty({n * comm->size()}, DType::float32, group->allocator(rank));
        comm->all_gather(rank, grads, st.gathered.slice(0, n * comm->size()), st.comm_stream);
        copy_async(grads, st.gathered.slice(0, n), st.comm_stream);
        for (int r = 1; r < comm->size(); ++r) ops::add_scaled(grads, st.gathered.slice(r * n, (r + 1) * n), 1.0f, st.comm_stream);
      } else {
        comm->all_reduce(rank, grads, grads, comm::ReduceOp::sum, st.comm_stream);
      }
    });
  }
  if (!reduced) return;
  if (block == 0) {
    reduced(begin, end, st.comm_stream);
    return;
  }
  // Sharded update: this rank's block of the bucket is reduced and updated, then every rank's
  // updated block is gathered. The few elements past the blocks (fewer than the ranks) are reduced
  // and updated everywhere.
  int const n = comm->size();
  std::int64_t const mine = rank * block;
  std::int64_t const body = block * n;
  if (scatter) {
    span("reduce-scatter", [&] {
      comm->reduce_scatter(rank, grads.slice(0, body), grads.slice(mine, mine + block), comm::ReduceOp::sum, st.comm_stream);
      if (body < grads.numel()) comm->all_reduce(rank, grads.slice(body, grads.numel()), grads.slice(body, grads.numel()), comm::ReduceOp::sum, st.comm_stream);
    });
  }
  reduced(begin + mine, begin + mine + block, st.comm_stream);
  if (body < grads.numel()) reduced(begin + body, end, st.comm_stream);
  span("all-gather", [&] {
    comm->all_gather(rank, params.slice(mine, mine + block), params.slice(0, body), st.comm_stream);
    st.model.sync_parameters(st.comm_stream, begin, begin + body);
  });
  state_scattered.store(true, std::memory_order_relaxed);
}

// Every rank's blocks of every optimizer state buffer to every rank (the sharded update leaves each
// rank's state current in its own blocks only).
void DataParallel::Impl::gather_optimizer_state() {
  if (!state_scattered.load(std::memory_order_relaxed)) return;
  int const n = comm->size();
  group->run([&](int rank, Device, Stream& stream) {
    Rank& st = *state[static_cast<std::size_t>(rank)];
    for (auto const& named : st.optimizer->state()) {
      for (std::size_t b = 0; b < buckets.size(); ++b) {
        std::int64_t const block = blocks[b];
        if (block == 0) continue;
        Tensor const part = named.second.slice(buckets[b].first, buckets[b].first + block * n);
        comm->all_gather(rank, part.slice(rank * block, (rank + 1) * block), part, stream);
      }
    }
  });
  group->synchronize();
  state_scattered.store(false, std::memory_order_relaxed);
}

void DataParallel::Impl::RankSync::finish(Stream& compute, Reduced const& reduced) {
  if (!impl_.options.overlap) {
    for (std::size_t b = 0; b < impl_.buckets.size(); ++b) impl_.launch(rank_, b, compute, reduced);
  }
  Rank& st = *impl_.state[static_cast<std::size_t>(rank_)];
  st.stop.record(compute);
  bool const host = compute.device().kind == DeviceKind::host;
  if (host) compute.enqueue([marks = st.wait_marks] { (*marks)[0] = now_ns(); });
  st.done.record(st.comm_stream);
  auto const wait = [&] { st.done.wait(compute); };
  if (impl_.options.timeline && impl_.options.timeline->enabled()) {
    impl_.options.timeline->stream_span(compute, "wait for reduces", "communication", impl_.ranks[static_cast<std::size_t>(rank_)],
                                        trace::Lane::compute, wait);
  } else {
    wait();
  }
  if (host) compute.enqueue([marks = st.wait_marks] { (*marks)[1] = now_ns(); });
}

DataParallel::DataParallel(nn::Sequential model, DeviceGroup& group, std::function<std::unique_ptr<optim::Optimizer>()> const& make_optimizer,
                           DataParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  if (options.bucket_cap_bytes == 0 || options.first_bucket_cap_bytes == 0)
    throw Error(Errc::invalid_argument, "DataParallel: a bucket cap of 0 bytes (expected bucket_cap_bytes and first_bucket_cap_bytes >= 1)");
  if (options.accumulation_steps < 1)
    throw Error(Errc::invalid_argument, "DataParallel: accumulation_steps " + std::to_string(options.accumulation_steps) + " (expected >= 1)");
  if (!(options.rebalance_ewma > 0 && options.rebalance_ewma <= 1))
    throw Error(Errc::invalid_argument, "DataParallel: rebalance_ewma " + std::to_string(options.rebalance_ewma) + " (expected in (0, 1])");
  if (model.parameter_count() == 0) throw Error(Errc::invalid_argument, "DataParallel: a model without parameters (expected at least one layer with parameters)");

  // Which ranks: the scheduler's choice for the request, else all of them.
  sched::NodeState const node = sched::node_state(group);
  if (options.request) {
    sched::Request request = *options.request;
    if (request.name.empty()) request.name = "data-parallel replicas";
    auto const scheduler = options.scheduler ? options.scheduler : std::make_shared<sched::Scheduler const>(sched::Scheduler::default_profile());
    auto const placement = scheduler->place(request, node);
    if (!placement)
      throw Error(Errc::out_of_memory, "DataParallel: no " + std::to_string(static_cast<int>(request.devices)) + " devices of " + std::to_string(group.size()) +
                                           " can hold a replica of " + format_bytes(static_cast<std::size_t>(request.memory_bytes)) +
                                           " (expected devices with that much free memory)");
    im.ranks = placement->devices;
    std::sort(im.ranks.begin(), im.ranks.end());
  } else {
    im.ranks.resize(static_cast<std::size_t>(group.size()));
    std::iota(im.ranks.begin(), im.ranks.end(), 0);
  }
  int const n = static_cast<int>(im.ranks.size());
  if (!options.weights.empty()) {
    if (options.weights.size() != im.ranks.size())
      throw Error(Errc::invalid_argument, "DataParallel: " + std::to_string(options.weights.size()) + " shard weights (expected " + std::to_string(n) +
                                              ", one per used rank)");
    (void)shard_sizes(1, n, options.weights);  // validates them
    im.weights = options.weights;
  } else {
    im.weights = sched::shard_weights(node, im.ranks);
  }
  if (n == group.size()) {
    im.group = &group;
  } else {
    std::vector<Device> devices;
    for (int const r : im.ranks) devices.push_back(group.device(r));
    im.owned = std::make_unique<DeviceGroup>(std::move(devices));
    im.group = im.owned.get();
  }
  im.buckets = plan_buckets(model, options.first_bucket_cap_bytes, options.bucket_cap_bytes);
  im.options = std::move(options);
  im.comm = comm::make_communicator(*im.group, im.options.comm);
  im.plan_blocks();
  if (im.options.comm_hook) {
    std::vector<std::int64_t> sizes;
    for (auto const& [b, e] : im.buckets) sizes.push_back(e - b);
    im.options.comm_hook->attach(n, sizes);
  }

  // Replicas: the same architecture on every rank; rank 0's weights (the given model's when it is
  // materialized) broadcast to the others.
  for (int r = 0; r < n; ++r) {
    nn::Context ctx{im.group->allocator(r), im.group->stream(r)};
    nn::Sequential replica = model.clone();
    replica.materialize(ctx, im.options.seed, im.options.compute);
    if (r == 0 && model.parameters().defined()) {
      copy_async(replica.master_parameters(), model.master_parameters(), ctx.stream);
      replica.sync_parameters(ctx.stream);
      replica.set_rng_state(model.rng_state());
    }
    im.state.push_back(std::make_unique<Impl::Rank>(im, r, std::move(replica), im.group->make_stream(r), make_optimizer()));
    Impl::Rank& st = *im.state.back();
    st.bucket_events.resize(im.buckets.size());
    st.scaler = im.options.loss_scaler;
    if (im.options.accumulation_steps > 1) st.accumulator = ops::zeros({model.parameter_count()}, ctx.allocator, ctx.stream);
  }
  im.group->synchronize();
  if (n > 1) {
    std::vector<std::uint64_t> const rng = im.state[0]->model.rng_state();
    for (auto& st : im.state) st->model.set_rng_state(rng);
    im.group->run([&](int rank, Device, Stream& stream) {
      nn::Sequential& replica = im.state[static_cast<std::size_t>(rank)]->model;
      im.comm->broadcast(rank, replica.master_parameters(), 0, stream);
      replica.sync_parameters(stream);
    });
#ifndef NDEBUG
    verify_replicas();  // debug builds check that every replica starts from rank 0's weights
#endif
  }
}

DataParallel::~DataParallel() {
  if (!impl_) return;
  try {
    impl_->group->synchronize();
  } catch (...) {  // a failed step's error was reported by step()
  }
}

std::vector<int> const& DataParallel::ranks() const noexcept { return impl_->ranks; }
std::vector<double> const& DataParallel::weights() const noexcept { return impl_->weights; }
std::vector<std::pair<std::int64_t, std::int64_t>> const& DataParallel::buckets() const noexcept { return impl_->buckets; }
DeviceGroup& DataParallel::group() noexcept { return *impl_->group; }

nn::Sequential& DataParallel::replica(int index) {
  if (index < 0 || index >= static_cast<int>(impl_->state.size()))
    throw Error(Errc::invalid_argument, "DataParallel: replica " + std::to_string(index) + " (expected 0 <= index < " +
                                            std::to_string(impl_->state.size()) + ")");
  return impl_->state[static_cast<std::size_t>(index)]->model;
}

optim::Optimizer& DataParallel::optimizer(int index) {
  (void)replica(index);
  impl_->gather_optimizer_state();
  return *impl_->state[static_cast<std::size_t>(index)]->optimizer;
}

optim::LossScaler const* DataParallel::loss_scaler() const {
  auto const& scaler = impl_->state.front()->scaler;
  return scaler ? &*scaler : nullptr;
}

DataParallelResult DataParallel::step(Tensor const& x, Tensor const& labels, float lr_scale) {
  Impl& im = *impl_;
  if (!x.defined() || x.rank() != 2)
    throw Error(Errc::invalid_argument, "DataParallel::step: x of shape " + (x.defined() ? to_string(x.shape()) : std::string("undefined")) +
                                            " (expected [rows, features])");
  std::int64_t const rows = x.dim(0);
  if (!labels.defined() || labels.rank() != 1 || labels.numel() != rows)
    throw Error(Errc::invalid_argument, "DataParallel::step: labels of shape " + (labels.defined() ? to_string(labels.shape()) : std::string("undefined")) +
                                            " for " + std::to_string(rows) + " rows (expected [" + std::to_string(rows) + "])");
  if (rows < 1) throw Error(Errc::invalid_argument, "DataParallel::step: an empty batch (expected at least one row)");
  check_labels(im.state[0]->model, labels);
  int const n = static_cast<int>(im.ranks.size());
  std::vector<std::int64_t> const sizes = shard_sizes(rows, n, im.weights);
  if (!im.options.allow_empty_shards && std::find(sizes.begin(), sizes.end(), 0) != sizes.end())
    throw Error(Errc::invalid_argument, "DataParallel::step: a batch of " + std::to_string(rows) + " rows leaves a rank without rows (expected at least " +
                                            std::to_string(n) + " rows, one per used rank, since allow_empty_shards is off)");
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(n), 0);
  for (int r = 1; r < n; ++r) offsets[static_cast<std::size_t>(r)] = offsets[static_cast<std::size_t>(r - 1)] + sizes[static_cast<std::size_t>(r - 1)];

  int const k = im.options.accumulation_steps;
  bool const accumulate_only = k > 1 && (im.micro_steps + 1) % k != 0;
  std::shared_ptr<trace::Timeline> const& timeline = im.options.timeline;
  std::vector<Tensor> xs, ys;
  {
    trace::Timeline::Scope scope(timeline.get(), "scatter", "copy", 0, trace::Lane::host);
    xs = im.group->scatter(x, im.weights);
    ys = im.group->scatter(labels, im.weights);
  }
  std::vector<nn::StepResult> results(static_cast<std::size_t>(n));
  im.group->run([&](int rank, Device, Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    Impl::Rank& st = *im.state[r];
    nn::Context ctx{im.group->allocator(rank), stream, offsets[r]};
    nn::StepOptions options;
    options.lr_scale = lr_scale;
    options.clip_norm = im.options.clip_norm;
    options.scaler = st.scaler ? &*st.scaler : nullptr;
    options.global_rows = rows;
    options.grad_scale = 1.0f / static_cast<float>(k);
    options.accumulator = k > 1 ? &st.accumulator : nullptr;
    options.accumulate_only = accumulate_only;
    options.sync = n > 1 || im.options.comm_hook ? &st.sync : nullptr;
    options.timeline = timeline.get();
    options.rank = im.ranks[r];
    st.start.record(stream);
    results[r] = nn::classification_step(st.model, *st.optimizer, xs[r], ys[r], ctx, options);
    if (options.sync == nullptr || accumulate_only) st.stop.record(stream);
  });
  ++im.micro_steps;

  DataParallelResult result;
  result.rows = sizes;
  result.applied = results[0].applied;
  double loss = 0;
  for (int r = 0; r < n; ++r) {
    auto const i = static_cast<std::size_t>(r);
    Impl::Rank const& st = *im.state[i];
    loss += static_cast<double>(ops::item(results[i].loss, im.group->stream(r))) * static_cast<double>(sizes[i]);
    result.compute_ms.push_back(Event::elapsed_ms(st.start, st.stop));
    bool const waited = im.group->device(r).kind == DeviceKind::host && (n > 1 || im.options.comm_hook) && !accumulate_only;
    result.wait_ms.push_back(waited ? static_cast<double>((*st.wait_marks)[1] - (*st.wait_marks)[0]) * 1e-6 : 0.0);
  }
  result.loss = static_cast<float>(loss / static_cast<double>(rows));

  if (im.options.rebalance && n > 1) {
    // Weights follow the measured speed (rows per millisecond) of every rank that had rows, scaled
    // so that those ranks keep their total weight (ranks without rows keep theirs).
    double const a = im.options.rebalance_ewma;
    double old_total = 0;
    double new_total = 0;
    for (int r = 0; r < n; ++r) {
      auto const i = static_cast<std::size_t>(r);
      Impl::Rank& st = *im.state[i];
      double const ms = im.options.rebalance_time ? im.options.rebalance_time(r, sizes[i], result.compute_ms[i])
                                                  : result.compute_ms[i];
      if (sizes[i] == 0 || !(ms > 0)) continue;
      double const per_row = ms / static_cast<double>(sizes[i]);
      st.ms_per_row = st.ms_per_row == 0 ? per_row : a * per_row + (1 - a) * st.ms_per_row;
    }
    std::vector<double> speed(static_cast<std::size_t>(n), 0.0);
    for (int r = 0; r < n; ++r) {
      auto const i = static_cast<std::size_t>(r);
      if (im.state[i]->ms_per_row > 0) {
        speed[i] = 1.0 / im.state[i]->ms_per_row;
        old_total += im.weights[i];
        new_total += speed[i];
      }
    }
    if (new_total > 0) {
      for (std::size_t i = 0; i < speed.size(); ++i) {
        if (speed[i] > 0) im.weights[i] = speed[i] * old_total / new_total;
      }
    }
  }
  return result;
}

std::int64_t DataParallel::count_correct(Tensor const& x, Tensor const& labels, std::int64_t batch) {
  Impl& im = *impl_;
  Stream& stream = im.group->stream(0);
  Allocator& allocator = im.group->allocator(0);
  auto const local = [&](Tensor const& t) {
    if (!t.defined() || t.device() == im.group->device(0)) return t;
    Tensor copy = Tensor::empty(t.shape(), t.dtype(), allocator);
    copy_async(copy, t, stream);
    return copy;
  };
  nn::Context ctx{allocator, stream};
  return nn::count_correct(im.state[0]->model, local(x), local(labels), ctx, batch);
}

void DataParallel::save(std::filesystem::path const& path, io::TrainingState const& state) {
  Impl& im = *impl_;
  im.group->synchronize();
  im.gather_optimizer_state();
  io::save_training(path, im.state[0]->model, *im.state[0]->optimizer, state, im.group->stream(0));
}

io::TrainingState DataParallel::load(std::filesystem::path const& path) {
  Impl& im = *impl_;
  im.group->synchronize();
  io::TrainingState state;
  for (std::size_t r = 0; r < im.state.size(); ++r) {
    int const rank = static_cast<int>(r);
    state = io::load_training(path, im.state[r]->model, *im.state[r]->optimizer, im.group->allocator(rank), im.group->stream(rank));
  }
  im.micro_steps = 0;
  im.state_scattered.store(false, std::memory_order_relaxed);  // every rank loaded the whole state
  return state;
}

void DataParallel::verify_replicas() {
  Impl& im = *impl_;
  im.group->synchronize();
  nn::Sequential const& first = im.state[0]->model;
  auto const host_copy = [&](std::size_t r) {
    Tensor const& params = im.state[r]->model.master_parameters();
    Tensor copy = Tensor::empty(params.shape(), params.dtype(), mgpu::detail::host_staging_allocator());
    copy_async(copy, params, im.group->stream(static_cast<int>(r)));
    im.group->stream(static_cast<int>(r)).synchronize();
    return copy;
  };
  Tensor const reference = host_copy(0);
  for (std::size_t r = 1; r < im.state.size(); ++r) {
    nn::Sequential const& other = im.state[r]->model;
    std::string const who = "DataParallel: replica on rank " + std::to_string(im.ranks[r]);
    if (other.size() != first.size())
      throw Error(Errc::invalid_argument, who + " has " + std::to_string(other.size()) + " layers (expected " + std::to_string(first.size()) + " as on rank " +
                                              std::to_string(im.ranks[0]) + ")");
    for (std::size_t l = 0; l < first.size(); ++l) {
      if (other.layer(l).name() != first.layer(l).name())
        throw Error(Errc::invalid_argument, who + " layer " + std::to_string(l) + " is " + other.layer(l).name() + " (expected " + first.layer(l).name() + ")");
    }
    Tensor const params = host_copy(r);
    auto const a = reference.host_span<float>();
    auto const b = params.host_span<float>();
    std::int64_t offset = 0;
    for (std::size_t l = 0; l < first.size(); ++l) {
      auto const count = static_cast<std::size_t>(first.layer(l).parameter_count());
      if (std::memcmp(a.data() + offset, b.data() + offset, count * sizeof(float)) != 0)
        throw Error(Errc::invalid_argument, who + " layer " + std::to_string(l) + " (" + first.layer(l).name() +
                                                ") holds other parameters (expected replicas bitwise equal to rank " + std::to_string(im.ranks[0]) + "'s)");
      offset += static_cast<std::int64_t>(count);
    }
  }
}

}  // namespace mgpu::parallel
