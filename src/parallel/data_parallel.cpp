// DataParallel: replicas, bucketed all-reduce overlapped with backward through a communication
// stream per rank, shard weights from the scheduler and from measured compute time.
#include <mgpu/parallel/data_parallel.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <numeric>
#include <string>

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
  ops::add_scaled(grads, slot.residual, 1.0f, stream);  // compensate: g + what was lost before
  convert_async(slot.wire, grads, stream);              // round to bfloat16
  ops::add_scaled(grads, slot.wire, -1.0f, stream);     // what rounding lost: compensated - rounded
  comm.all_reduce(rank, slot.wire, slot.wire, comm::ReduceOp::sum, stream);
  copy_async(slot.residual, grads, stream);  // after the reduce: a failed one skips this, keeping the residual
  convert_async(grads, slot.wire, stream);
}

void Bf16Compression::set_state(int rank, int bucket, Tensor const& values, Allocator& allocator, Stream& stream) {
  Slot& slot = slots_.at(static_cast<std::size_t>(rank)).at(static_cast<std::size_t>(bucket));
  std::int64_t const elements = elements_.at(static_cast<std::size_t>(bucket));
  if (values.dtype() != DType::float32 || values.numel() != elements)
    throw Error(Errc::invalid_argument, "Bf16Compression: a residual of " + std::to_string(values.numel()) + " " +
                                            std::string(to_string(values.dtype())) + " values for bucket " + std::to_string(bucket) +
                                            " (expected " + std::to_string(elements) + " float32)");
  if (!slot.residual.defined()) {
    slot.residual = Tensor::empty({elements}, DType::float32, allocator);
    slot.wire = Tensor::empty({elements}, DType::bfloat16, allocator);
  }
  copy_async(slot.residual, values, stream);
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

// x and the targets are checked before any rank starts, so a bad batch is reported as itself
// rather than as the aborted collectives it would cause on the other ranks.
void check_batch(nn::Sequential const& model, DType compute, Tensor const& x, Tensor const& targets, nn::Loss const& loss,
                 std::string const& what) {
  if (!x.defined() || x.rank() < 1)
    throw Error(Errc::invalid_argument, what + ": x of shape " + (x.defined() ? to_string(x.shape()) : std::string("undefined")) +
                                            " (expected [rows, ...])");
  if (x.dtype() != DType::float32 && x.dtype() != compute && x.dtype() != DType::int32) {
    std::string const also = compute != DType::float32 ? ", " + std::string(to_string(compute)) + " (the compute type)" : "";
    throw Error(Errc::invalid_argument,
                what + ": x of dtype " + std::string(to_string(x.dtype())) + " (expected float32" + also + " or int32 token ids)");
  }
  Shape output;
  try {
    output = model.output_shape(x.shape());
  } catch (Error const& e) {
    throw Error(Errc::invalid_argument, what + ": x of shape " + to_string(x.shape()) + ": " + std::string(e.message()));
  }
  loss.check(output, targets, what);
  loss.check_values(output, targets, what);
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
  // Why the executor cannot be used (a step failed once updates had begun), or empty.
  std::string broken;
  void check_usable(std::string const& what) const;

  // What a step changes before its first collective completes, put back when it fails before then.
  struct Before {
    std::vector<std::uint64_t> rng;
    std::int64_t optimizer_steps = 0;
    std::optional<optim::LossScaler::State> scaler;
  };
  [[noreturn]] void recover(std::exception_ptr failure, Before const& before, bool unobserved_updates);

  // Checkpoints: the executor's own records beside those of save_training.
  void save_state(io::Checkpoint& checkpoint);
  struct Saved;
  Saved verify_state(io::Checkpoint const& checkpoint, std::string const& source) const;
  void restore_state(Saved const& saved);

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
  // Set on the communication stream once a reduce of the current step has completed there (before
  // comm_stream, whose destruction runs what is left of its work).
  std::atomic<bool> reduced{false};
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
  auto const mark_reduced = [&st] { st.comm_stream.enqueue([&st] { st.reduced.store(true, std::memory_order_relaxed); }); };
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
    mark_reduced();
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
    mark_reduced();
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
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument,
                "DataParallel: clip_norm " + std::to_string(options.clip_norm) + " (expected 0 for no clipping, or a finite norm > 0)");
  if (!make_optimizer)
    throw Error(Errc::invalid_argument, "DataParallel without an optimizer factory (expected a function that makes an optimizer)");

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
  if (!im.options.loss) im.options.loss = nn::default_loss();
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
    std::unique_ptr<optim::Optimizer> optimizer = make_optimizer();
    if (!optimizer)
      throw Error(Errc::invalid_argument, "DataParallel: the optimizer factory returned no optimizer for replica " + std::to_string(r) +
                                              " (expected a new optimizer from every call)");
    im.state.push_back(std::make_unique<Impl::Rank>(im, r, std::move(replica), im.group->make_stream(r), std::move(optimizer)));
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
  im.check_usable("DataParallel::step");
  nn::Loss const& loss_fn = *im.options.loss;
  check_batch(im.state[0]->model, im.options.compute, x, labels, loss_fn, "DataParallel::step");
  std::int64_t const rows = x.dim(0);
  if (rows < 1) throw Error(Errc::invalid_argument, "DataParallel::step: an empty batch (expected at least one row)");
  if (!(lr_scale >= 0 && std::isfinite(lr_scale)))
    throw Error(Errc::invalid_argument, "DataParallel::step: lr_scale " + std::to_string(lr_scale) + " (expected a finite lr_scale >= 0)");
  int const n = static_cast<int>(im.ranks.size());
  std::vector<std::int64_t> const sizes = shard_sizes(rows, n, im.weights);
  if (!im.options.allow_empty_shards && std::find(sizes.begin(), sizes.end(), 0) != sizes.end())
    throw Error(Errc::invalid_argument, "DataParallel::step: a batch of " + std::to_string(rows) + " rows leaves a rank without rows (expected at least " +
                                            std::to_string(n) + " rows, one per used rank, since allow_empty_shards is off)");
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(n), 0);
  for (int r = 1; r < n; ++r) offsets[static_cast<std::size_t>(r)] = offsets[static_cast<std::size_t>(r - 1)] + sizes[static_cast<std::size_t>(r - 1)];

  // The loss's divisor: the counted units of the global batch (a shard's loss is its share of the mean).
  std::int64_t const units = std::max<std::int64_t>(1, loss_fn.count(labels, im.group->stream(0)));
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
  Impl::Before before{im.state[0]->model.rng_state(), im.state[0]->optimizer->steps(), {}};
  if (im.state[0]->scaler) before.scaler = im.state[0]->scaler->state();
  for (auto const& st : im.state) st->reduced.store(false, std::memory_order_relaxed);
  // With one device and no hook the update runs inside backward where no reduce marks it.
  bool const unobserved_updates = !accumulate_only && n == 1 && !im.options.comm_hook;
  try {
    im.group->run([&](int rank, Device, Stream& stream) {
      auto const r = static_cast<std::size_t>(rank);
      Impl::Rank& st = *im.state[r];
      nn::Context ctx{im.group->allocator(rank), stream, offsets[r]};
      nn::StepOptions options;
      options.lr_scale = lr_scale;
      options.clip_norm = im.options.clip_norm;
      options.scaler = st.scaler ? &*st.scaler : nullptr;
      options.global_units = units;
      options.grad_scale = 1.0f / static_cast<float>(k);
      options.accumulator = k > 1 ? &st.accumulator : nullptr;
      options.accumulate_only = accumulate_only;
      options.sync = n > 1 || im.options.comm_hook ? &st.sync : nullptr;
      options.timeline = timeline.get();
      options.rank = im.ranks[r];
      st.start.record(stream);
      try {
        results[r] = nn::train_step(st.model, *st.optimizer, xs[r], ys[r], loss_fn, ctx, options);
        if (options.sync == nullptr || accumulate_only) st.stop.record(stream);
        stream.synchronize();
      } catch (Error const& e) {
        // A compute stream that waited for a failed reduce knows only that it did (a device error);
        // the reduce's own error says what happened: a timeout with its deadline, or the abort
        // naming the rank that failed.
        if (e.category() == Errc::device) st.comm_stream.synchronize();
        throw;
      }
    });
  } catch (...) {
    im.recover(std::current_exception(), before, unobserved_updates);
  }
  ++im.micro_steps;

  DataParallelResult result;
  result.rows = sizes;
  result.applied = results[0].applied;
  double loss = 0;
  for (int r = 0; r < n; ++r) {
    auto const i = static_cast<std::size_t>(r);
    Impl::Rank const& st = *im.state[i];
    loss += static_cast<double>(ops::item(results[i].loss, im.group->stream(r)));
    result.compute_ms.push_back(Event::elapsed_ms(st.start, st.stop));
    bool const waited = im.group->device(r).kind == DeviceKind::host && (n > 1 || im.options.comm_hook) && !accumulate_only;
    result.wait_ms.push_back(waited ? static_cast<double>((*st.wait_marks)[1] - (*st.wait_marks)[0]) * 1e-6 : 0.0);
  }
  result.loss = static_cast<float>(loss);

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
  check_batch(im.state[0]->model, im.options.compute, x, labels, nn::SoftmaxCrossEntropy{}, "DataParallel::count_correct");
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

void DataParallel::Impl::check_usable(std::string const& what) const {
  if (!broken.empty()) throw Error(Errc::invalid_argument, what + ": " + broken);
}

void DataParallel::Impl::recover(std::exception_ptr failure, Before const& before, bool unobserved_updates) {
  bool changed = unobserved_updates;
  try {
    for (std::size_t r = 0; r < state.size(); ++r) {
      Rank& st = *state[r];
      for (Stream* stream : {&st.comm_stream, &group->stream(static_cast<int>(r))}) {
        try {
          stream->synchronize();
        } catch (Error const&) {  // the failure's own consequences, reported by it
        }
      }
      changed = changed || st.reduced.load(std::memory_order_relaxed);
    }
    comm = comm::make_communicator(*group, options.comm);  // the failure aborted the old one
    if (!changed) {
      for (std::size_t r = 0; r < state.size(); ++r) {
        Rank& st = *state[r];
        st.model.set_rng_state(before.rng);
        st.optimizer->set_steps(before.optimizer_steps);
        if (st.scaler) st.scaler->set_state(*before.scaler);
        if (st.accumulator.defined()) fill_async(st.accumulator, 0.0f, group->stream(static_cast<int>(r)));
      }
      group->synchronize();
    }
  } catch (Error const&) {
    changed = true;  // an executor that cannot be put back is as unusable as a partly updated one
  }
  micro_steps = 0;
  if (changed) {
    std::string cause = "an unknown error";
    try {
      std::rethrow_exception(failure);
    } catch (std::exception const& e) {
      cause = e.what();
    } catch (...) {  // only the message is wanted here; the failure itself is rethrown below
    }
    broken = "the executor cannot be used after a step failed once updates had begun, leaving the replicas partly updated "
             "(expected load() of a checkpoint first); the step failed with " + cause;
  }
  std::rethrow_exception(failure);
}

namespace {
constexpr char const* accumulation_record = "data_parallel.accumulation";
constexpr char const* accumulator_record = "data_parallel.accumulator";
constexpr char const* scaler_record = "data_parallel.loss_scaler";
constexpr char const* hook_record = "data_parallel.comm_hook";
constexpr char const* hook_state_record = "data_parallel.comm_hook.state";

// A float32 [ranks, parameters] record as one flat host tensor.
Tensor host_copy(io::Record const& record) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(record.data.size() / sizeof(float))}, DType::float32, mgpu::detail::host_staging_allocator());
  if (!record.data.empty()) std::memcpy(t.data(), record.data.data(), record.data.size());
  return t;
}
}  // namespace

void DataParallel::Impl::save_state(io::Checkpoint& checkpoint) {
  int const k = options.accumulation_steps;
  std::int64_t const position = micro_steps % k;
  checkpoint.put(accumulation_record, std::vector<std::int64_t>{k, position});
  auto const n = static_cast<std::int64_t>(state.size());
  std::int64_t const count = state[0]->model.parameter_count();
  Allocator& host = mgpu::detail::host_staging_allocator();
  if (position > 0) {  // each rank's share of the accumulated gradients
    Tensor const rows = Tensor::empty({n * count}, DType::float32, host);
    for (std::int64_t r = 0; r < n; ++r)
      copy_async(rows.slice(r * count, (r + 1) * count), state[static_cast<std::size_t>(r)]->accumulator, group->stream(static_cast<int>(r)));
    group->synchronize();
    checkpoint.put(accumulator_record, rows.reshape({n, count}), group->stream(0));
  }
  if (auto const& scaler = state[0]->scaler) {
    auto const s = scaler->state();
    checkpoint.put(scaler_record, std::vector<std::int64_t>{std::bit_cast<std::int32_t>(s.scale), s.good_steps, s.skipped});
  }
  if (CommHook* hook = options.comm_hook.get()) {
    Tensor const rows = Tensor::empty({n * count}, DType::float32, host);
    std::fill(rows.host_span<float>().begin(), rows.host_span<float>().end(), 0.0f);
    bool any = false;
    for (std::int64_t r = 0; r < n; ++r) {
      for (std::size_t b = 0; b < buckets.size(); ++b) {
        Tensor const values = hook->state(static_cast<int>(r), static_cast<int>(b));
        if (!values.defined()) continue;
        any = true;
        copy_async(rows.slice(r * count + buckets[b].first, r * count + buckets[b].second), values, group->stream(static_cast<int>(r)));
      }
    }
    if (any) {
      group->synchronize();
      checkpoint.put(hook_record, hook->name());
      checkpoint.put(hook_state_record, rows.reshape({n, count}), group->stream(0));
    }
  }
}

// The executor's records of a checkpoint, verified against this executor.
struct DataParallel::Impl::Saved {
  std::int64_t position = 0;
  Tensor accumulator;  // flat [saved ranks x parameters], when position > 0
  std::optional<optim::LossScaler::State> scaler;
  Tensor hook_state;  // flat [saved ranks x parameters], for this executor's kind of hook
};

DataParallel::Impl::Saved DataParallel::Impl::verify_state(io::Checkpoint const& c, std::string const& source) const {
  Saved saved;
  std::string const file = source + ": ";
  int const k = options.accumulation_steps;
  if (c.contains(accumulation_record)) {
    auto const cycle = c.get_int64(accumulation_record);
    if (cycle.size() != 2 || cycle[0] < 1 || cycle[1] < 0 || cycle[1] >= cycle[0])
      throw Error(Errc::corrupt_data, file + "malformed " + accumulation_record + " record (expected the cycle's length and position in it)");
    saved.position = cycle[1];
    if (saved.position > 0 && cycle[0] != k)
      throw Error(Errc::invalid_argument, file + "saved after " + std::to_string(saved.position) + " of " + std::to_string(cycle[0]) +
                                              " accumulated micro-batches (expected accumulation_steps = " + std::to_string(cycle[0]) +
                                              " to resume it, not " + std::to_string(k) + ", or a checkpoint saved at the end of a cycle)");
  }
  // Records sized by the model are checked only when its parameters fit: otherwise load_training
  // refuses the file and names the architecture.
  std::int64_t const count = state[0]->model.parameter_count();
  if (!c.contains("model.parameters") || c.get("model.parameters").shape != Shape{count}) return saved;
  auto const rows = [&](char const* name) {
    io::Record const& r = c.get(name);
    if (r.type != io::RecordType::float32 || r.shape.size() != 2 || r.shape[0] < 1 || r.shape[1] != count)
      throw Error(Errc::corrupt_data, file + "record '" + name + "' of shape " + to_string(r.shape) + " (expected float32 [ranks, " +
                                          std::to_string(count) + "], a row of the model's parameters per rank that saved it)");
    return host_copy(r);
  };
  if (saved.position > 0) saved.accumulator = rows(accumulator_record);
  if (state[0]->scaler && c.contains(scaler_record)) {
    auto const values = c.get_int64(scaler_record);
    if (values.size() != 3 || values[0] < std::numeric_limits<std::int32_t>::min() || values[0] > std::numeric_limits<std::int32_t>::max())
      throw Error(Errc::corrupt_data, file + "malformed " + scaler_record + " record (expected the scale's bits, good steps and skipped steps)");
    saved.scaler = optim::LossScaler::State{std::bit_cast<float>(static_cast<std::int32_t>(values[0])), values[1], values[2]};
    optim::LossScaler probe = *state[0]->scaler;
    try {
      probe.set_state(*saved.scaler);
    } catch (Error const& e) {
      throw Error(Errc::corrupt_data, file + std::string(e.message()));
    }
  }
  if (options.comm_hook && c.contains(hook_state_record) && c.get_text(hook_record) == options.comm_hook->name())
    saved.hook_state = rows(hook_state_record);
  return saved;
}

void DataParallel::Impl::restore_state(Saved const& saved) {
  auto const n = static_cast<std::int64_t>(state.size());
  std::int64_t const count = state[0]->model.parameter_count();
  Allocator& host = mgpu::detail::host_staging_allocator();
  Tensor const zeros = Tensor::empty({count}, DType::float32, host);
  std::fill(zeros.host_span<float>().begin(), zeros.host_span<float>().end(), 0.0f);
  // Rank r's row of what `ranks` ranks saved: its own on as many ranks; on another count, rank 0
  // takes the sum of the rows (what every rank would have added) and the others none.
  auto const share = [&](Tensor const& all, std::int64_t r) {
    std::int64_t const ranks = all.numel() / count;
    if (ranks == n) return all.slice(r * count, (r + 1) * count);
    if (r > 0) return zeros;
    Tensor const sum = Tensor::empty({count}, DType::float32, host);
    auto const in = all.host_span<float>();
    auto const out = sum.host_span<float>();
    for (std::int64_t i = 0; i < count; ++i) {
      float total = 0;
      for (std::int64_t row = 0; row < ranks; ++row) total += in[static_cast<std::size_t>(row * count + i)];
      out[static_cast<std::size_t>(i)] = total;
    }
    return sum;
  };
  for (std::int64_t r = 0; r < n; ++r) {
    Rank& st = *state[static_cast<std::size_t>(r)];
    Stream& stream = group->stream(static_cast<int>(r));
    if (st.accumulator.defined()) copy_async(st.accumulator, saved.position > 0 ? share(saved.accumulator, r) : zeros, stream);
    st.scaler = options.loss_scaler;
    if (st.scaler && saved.scaler) st.scaler->set_state(*saved.scaler);
    if (CommHook* hook = options.comm_hook.get()) {
      Tensor const values = saved.hook_state.defined() ? share(saved.hook_state, r) : zeros;
      for (std::size_t b = 0; b < buckets.size(); ++b) {
        hook->set_state(static_cast<int>(r), static_cast<int>(b), values.slice(buckets[b].first, buckets[b].second),
                        group->allocator(static_cast<int>(r)), st.comm_stream);
      }
    }
  }
  for (auto& st : state) st->comm_stream.synchronize();
  group->synchronize();
  micro_steps = saved.position;
}

void DataParallel::save(std::filesystem::path const& path, io::TrainingState const& state) {
  Impl& im = *impl_;
  im.check_usable("DataParallel::save");
  for (auto& st : im.state) st->comm_stream.synchronize();
  im.group->synchronize();
  im.gather_optimizer_state();
  io::Checkpoint checkpoint = io::training_checkpoint(im.state[0]->model, *im.state[0]->optimizer, state, im.group->stream(0));
  im.save_state(checkpoint);
  checkpoint.save(path);
}

io::TrainingState DataParallel::load(std::filesystem::path const& path) {
  Impl& im = *impl_;
  for (auto& st : im.state) st->comm_stream.synchronize();
  im.group->synchronize();
  io::Checkpoint const checkpoint = io::Checkpoint::load(path);
  Impl::Saved const saved = im.verify_state(checkpoint, path.string());
  io::TrainingState state;
  for (std::size_t r = 0; r < im.state.size(); ++r) {
    int const rank = static_cast<int>(r);
    state = io::load_training(checkpoint, path.string(), im.state[r]->model, *im.state[r]->optimizer, im.group->allocator(rank),
                              im.group->stream(rank));
  }
  im.restore_state(saved);
  im.broken.clear();
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
