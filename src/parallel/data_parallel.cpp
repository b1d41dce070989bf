// DataParallel's executor: replicas, one shard plan per step, shard weights from the scheduler and
// from measured compute time, recovery from a failed step, and the check that replicas agree. The
// gradient sync (buckets, their reduces and the sharded update) is gradient_sync.cpp, the
// checkpoint records data_parallel_checkpoint.cpp.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <numeric>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/planning.hpp>

#include "core/backend.hpp"
#include "parallel/data_parallel_impl.hpp"
#include "parallel/gradient_sync.hpp"

namespace mgpu::parallel {


std::vector<optim::Optimizer*> DataParallel::Impl::optimizers() const {
  std::vector<optim::Optimizer*> all;
  for (auto const& st : state) all.push_back(st->optimizer.get());
  return all;
}

bool DataParallel::Impl::across_processes() const {
  return sync->communicator().size() != static_cast<int>(ranks.size());
}

std::vector<std::int32_t> DataParallel::Impl::all_gather_words(std::vector<std::vector<std::int32_t>> const& words) {
  return comm::detail::all_gather_words(sync->communicator(), *group, words);
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
  detail::check_zero_stage(options, "DataParallel");
  if (!make_optimizer)
    throw Error(Errc::invalid_argument, "DataParallel without an optimizer factory (expected a function that makes an optimizer)");
  if (options.mesh) {  // the mesh's communicator in place of the executor's own
    if (options.make_communicator || options.request)
      throw Error(Errc::invalid_argument, std::string("DataParallel: a mesh with ") +
                                              (options.request ? "a request" : "make_communicator") +
                                              " (expected the mesh alone: its communicator spans every rank)");
    options.mesh->check(group, comm::DeviceMesh({{"dp", options.mesh->layout().size()}}), "DataParallel");
    options.make_communicator = Mesh::factory(options.mesh);
  }
  if (options.request && options.make_communicator)
    throw Error(Errc::invalid_argument,
                "DataParallel: a request with make_communicator (expected one of them: a communicator "
                "across processes spans every device of every process)");

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
  std::vector<Bucket> buckets = detail::plan_buckets(model, options);
  im.options = std::move(options);
  if (!im.options.loss) im.options.loss = nn::default_loss();
  if (!im.options.metrics) im.options.metrics = std::make_shared<metrics::Registry>("data_parallel");
  im.sync = std::make_unique<detail::GradientSync>(*im.group, std::move(buckets), im.options, im.ranks);
  im.sync->unit_compute_gradients();  // nn::train_step unscales each layer's 16-bit gradients as backward writes them

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
    im.state.push_back(std::make_unique<Impl::Rank>(std::move(replica), std::move(optimizer)));
    Impl::Rank& st = *im.state.back();
    im.sync->add_rank(st.model);
    st.scaler = im.options.loss_scaler;
    // With sharded gradients the sync accumulates the micro-batches' reduced gradients itself.
    bool const sharded_gradients = im.sync->rank(r).owned_gradients().defined();
    if (im.options.accumulation_steps > 1 && !sharded_gradients)
      st.accumulator = ops::zeros({model.parameter_count()}, ctx.allocator, ctx.stream);
  }
  im.group->synchronize();
  comm::Communicator& comm = im.sync->communicator();
  if (comm.size() > 1) {
    std::vector<std::uint64_t> rng = im.state[0]->model.rng_state();
    if (im.across_processes()) {  // world rank 0's RNG state, and every rank's process (by its first rank)
      std::vector<std::int32_t> words;
      for (std::uint64_t const v : rng) append_words(words, v);
      words.push_back(comm.first_rank());
      std::vector<std::int32_t> const all =
          im.all_gather_words(std::vector<std::vector<std::int32_t>>(im.state.size(), words));
      for (std::size_t i = 0; i < rng.size(); ++i) rng[i] = read_words<std::uint64_t>(all, 2 * i);
      for (std::size_t w = 0; w < all.size() / words.size(); ++w) {
        std::int32_t const first = all[(w + 1) * words.size() - 1];
        bool const next = w == 0 || first != all[w * words.size() - 1];
        im.world_process.push_back(w == 0 ? 0 : im.world_process.back() + (next ? 1 : 0));
      }
      im.world_ms_per_row.assign(im.world_process.size(), 0.0);
    }
    for (auto& st : im.state) st->model.set_rng_state(rng);
    im.group->run([&](int rank, Device, Stream& stream) {
      nn::Sequential& replica = im.state[static_cast<std::size_t>(rank)]->model;
      comm.broadcast(comm.first_rank() + rank, replica.master_parameters(), 0, stream);
      replica.sync_parameters(stream);
    });
#ifndef NDEBUG
    verify_replicas();  // debug builds check that every replica starts from rank 0's weights
#endif
  }
  im.sync->shard_parameters(im.optimizers());  // zero_stage 3: each rank keeps its owned parameters only
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

std::vector<std::int64_t> DataParallel::process_rows(std::int64_t rows, std::vector<double> const& weights) const {
  Impl const& im = *impl_;
  if (rows < 0)
    throw Error(Errc::invalid_argument, "DataParallel::process_rows of " + std::to_string(rows) + " rows (expected rows >= 0)");
  if (im.world_process.empty()) return {rows};  // one process
  int const processes = im.world_process.back() + 1;
  if (static_cast<int>(weights.size()) != processes)
    throw Error(Errc::invalid_argument, "DataParallel::process_rows with " + std::to_string(weights.size()) +
                                            " weights (expected one per process: " + std::to_string(processes) + ")");
  bool const measured = im.options.rebalance && std::all_of(im.world_ms_per_row.begin(), im.world_ms_per_row.end(),
                                                            [](double ms) { return ms > 0; });
  if (!measured) return shard_sizes(rows, processes, weights);
  std::vector<double> speeds(static_cast<std::size_t>(processes), 0.0);
  for (std::size_t w = 0; w < im.world_process.size(); ++w)
    speeds[static_cast<std::size_t>(im.world_process[w])] += 1.0 / im.world_ms_per_row[w];
  return shard_sizes(rows, processes, speeds);
}
std::vector<Bucket> const& DataParallel::buckets() const noexcept { return impl_->sync->buckets(); }
DeviceGroup& DataParallel::group() noexcept { return *impl_->group; }

nn::Sequential& DataParallel::replica(int index) {
  if (index < 0 || index >= static_cast<int>(impl_->state.size()))
    throw Error(Errc::invalid_argument, "DataParallel: replica " + std::to_string(index) + " (expected 0 <= index < " +
                                            std::to_string(impl_->state.size()) + ")");
  impl_->sync->gather_whole();
  return impl_->state[static_cast<std::size_t>(index)]->model;
}

optim::Optimizer& DataParallel::optimizer(int index) {
  (void)replica(index);
  impl_->sync->gather_optimizer_state(impl_->optimizers());
  return *impl_->state[static_cast<std::size_t>(index)]->optimizer;
}

void DataParallel::reshard() {
  Impl& im = *impl_;
  im.check_usable("DataParallel::reshard");
  im.group->run([&](int rank, Device, Stream& stream) {
    Impl::Rank& st = *im.state[static_cast<std::size_t>(rank)];
    im.sync->rank(rank).shard_optimizer_state(*st.optimizer, im.group->allocator(rank), stream);
  });
  im.sync->shard_parameters(im.optimizers());  // zero_stage 3 (synchronizes the group)
  im.group->synchronize();
}

optim::LossScaler const* DataParallel::loss_scaler() const {
  auto const& scaler = impl_->state.front()->scaler;
  return scaler ? &*scaler : nullptr;
}

DataParallel::Impl::ShardPlan DataParallel::Impl::plan_shards(std::int64_t rows) const {
  int const n = static_cast<int>(ranks.size());
  ShardPlan plan{rows, shard_sizes(rows, n, weights), std::vector<std::int64_t>(static_cast<std::size_t>(n), 0)};
  if (!options.allow_empty_shards && std::find(plan.rows.begin(), plan.rows.end(), 0) != plan.rows.end())
    throw Error(Errc::invalid_argument, "DataParallel::step: a batch of " + std::to_string(rows) + " rows leaves a rank without rows (expected at least " +
                                            std::to_string(n) + " rows, one per used rank, since allow_empty_shards is off)");
  for (std::size_t r = 1; r < plan.offsets.size(); ++r) plan.offsets[r] = plan.offsets[r - 1] + plan.rows[r - 1];
  return plan;
}

int DataParallel::Impl::share_counts(ShardPlan& plan, std::int64_t units, bool refused) {
  // Per rank: its rows, its process's units (on the process's first rank), whether it refused.
  std::size_t constexpr per_rank = 5;
  std::vector<std::vector<std::int32_t>> words(ranks.size());
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    append_words(words[r], plan.rows[r]);
    append_words(words[r], r == 0 ? units : std::int64_t{0});
    words[r].push_back(refused ? 1 : 0);
  }
  std::vector<std::int32_t> const all = all_gather_words(words);
  auto const first = static_cast<std::size_t>(sync->communicator().first_rank());
  std::int64_t rows = 0;
  std::int64_t total_units = 0;
  int refused_by = -1;
  for (std::size_t w = 0; per_rank * w < all.size(); ++w) {
    if (w >= first && w - first < ranks.size()) plan.offsets[w - first] = rows;
    rows += read_words<std::int64_t>(all, per_rank * w);
    total_units += read_words<std::int64_t>(all, per_rank * w + 2);
    if (refused_by < 0 && all[per_rank * w + 4] != 0) refused_by = static_cast<int>(w);
  }
  plan.global_rows = rows;
  plan.global_units = std::max<std::int64_t>(1, total_units);
  return refused_by;
}

namespace {
// Thrown inside step() when a process refused its batch: every process leaves the step at once.
struct Refused {};

// An exponentially weighted mean of milliseconds per row, with weight `a` for a new measurement
// (none when it is 0: no rows).
void fold(double& mean, double measured, double a) {
  if (measured > 0) mean = mean == 0 ? measured : a * measured + (1 - a) * mean;
}
}  // namespace

std::vector<float> DataParallel::Impl::loss_shares(std::vector<nn::StepResult> const& results,
                                                   std::vector<double> const& step_ms_per_row) {
  std::vector<float> shares;
  for (std::size_t r = 0; r < results.size(); ++r)
    shares.push_back(ops::item(results[r].loss, group->stream(static_cast<int>(r))));
  if (!across_processes()) return shares;
  bool const speeds = options.rebalance;
  std::vector<std::vector<std::int32_t>> words(ranks.size());
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    words[r].push_back(std::bit_cast<std::int32_t>(shares[r]));
    if (speeds) append_words(words[r], step_ms_per_row[r]);
  }
  std::vector<std::int32_t> const all = all_gather_words(words);
  std::size_t const per_rank = words[0].size();
  shares.clear();
  for (std::size_t w = 0; per_rank * w < all.size(); ++w) {
    shares.push_back(std::bit_cast<float>(all[per_rank * w]));
    if (speeds) fold(world_ms_per_row[w], read_words<double>(all, per_rank * w + 1), options.rebalance_ewma);
  }
  return shares;
}

std::vector<double> DataParallel::Impl::ms_per_row(ShardPlan const& plan) const {
  std::vector<double> out;
  for (std::size_t i = 0; i < state.size(); ++i) {
    std::int64_t const rows = plan.rows[i];
    std::optional<metrics::DeviceTimes> const times = options.metrics->reported_times(ranks[i]);
    double const measured_ms = times ? times->compute_seconds * 1e3 : 0.0;
    double const ms = options.rebalance_time ? options.rebalance_time(static_cast<int>(i), rows, measured_ms) : measured_ms;
    out.push_back(rows == 0 || !(ms > 0) ? 0.0 : ms / static_cast<double>(rows));
  }
  return out;
}

// Every used rank's train_step on its shard, at once; the gradient sync joins them when
// there is more than one rank or a comm hook.
std::vector<nn::StepResult> DataParallel::Impl::run_ranks(ShardPlan const& plan, std::vector<Tensor> const& xs, std::vector<Tensor> const& ys,
                                                          float lr_scale, bool accumulate_only) {
  int const k = options.accumulation_steps;
  bool const synced = sync->communicator().size() > 1 || options.comm_hook;
  int const first = sync->communicator().first_rank();
  std::vector<nn::StepResult> results(ranks.size());
  group->run([&](int rank, Device, Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    Rank& st = *state[r];
    detail::RankSync& rank_sync = sync->rank(rank);
    nn::Context ctx{group->allocator(rank), stream, plan.offsets[r]};
    nn::StepOptions step;
    step.lr_scale = lr_scale;
    step.clip_norm = options.clip_norm;
    step.scaler = st.scaler ? &*st.scaler : nullptr;
    step.global_units = plan.global_units;
    step.grad_scale = 1.0f / static_cast<float>(k);
    step.accumulator = st.accumulator.defined() ? &st.accumulator : nullptr;
    step.accumulate_only = accumulate_only;
    step.sync = synced ? &rank_sync : nullptr;
    step.timeline = options.timeline.get();
    step.rank = first + ranks[r];
    st.start.record(stream);
    try {
      if (synced && !accumulate_only) rank_sync.shard_optimizer_state(*st.optimizer, ctx.allocator, stream);
      rank_sync.shard_parameters(*st.optimizer, ctx.allocator, stream);  // zero_stage 3, when gathered whole
      results[r] = nn::train_step(st.model, *st.optimizer, xs[r], ys[r], *options.loss, ctx, step);
      if (!synced || accumulate_only) st.stop.record(stream);  // else the sync's backward_end()
      stream.synchronize();
    } catch (Error const& e) {
      // A compute stream that waited for a failed reduce knows only that it did (a device error);
      // the reduce's own error says what happened: a timeout with its deadline, or the abort
      // naming the rank that failed.
      if (e.category() == Errc::device) rank_sync.comm_stream().synchronize();
      throw;
    }
  });
  return results;
}

// Weights follow the measured speed (rows per millisecond) of every rank that had rows, scaled so
// that those ranks keep their total weight (ranks without rows keep theirs).
void DataParallel::Impl::rebalance(std::vector<double> const& step_ms_per_row) {
  for (std::size_t i = 0; i < state.size(); ++i) fold(state[i]->ms_per_row, step_ms_per_row[i], options.rebalance_ewma);
  double old_total = 0;
  double new_total = 0;
  std::vector<double> speed(state.size(), 0.0);
  for (std::size_t i = 0; i < state.size(); ++i) {
    if (state[i]->ms_per_row > 0) {
      speed[i] = 1.0 / state[i]->ms_per_row;
      old_total += weights[i];
      new_total += speed[i];
    }
  }
  if (new_total > 0) {
    for (std::size_t i = 0; i < speed.size(); ++i) {
      if (speed[i] > 0) weights[i] = speed[i] * old_total / new_total;
    }
  }
}

DataParallelResult DataParallel::step(Tensor const& x, Tensor const& labels, float lr_scale) {
  Impl& im = *impl_;
  im.check_usable("DataParallel::step");
  nn::Loss const& loss_fn = *im.options.loss;
  bool const across = im.across_processes();
  // Before any rank starts, so a bad batch is refused as itself rather than as the aborted
  // collectives it would cause on the other ranks. Across processes a process may have no rows of
  // a global batch (its ranks contribute zero gradients), and a process that refuses its rows
  // still meets the others in share_counts(), so that every process refuses the step at once.
  Impl::ShardPlan plan;
  std::int64_t units = 0;  // the counted units of this process's batch
  std::exception_ptr refused;
  try {
    nn::check_batch(im.state[0]->model, loss_fn, x, labels, {lr_scale, im.options.compute, across}, "DataParallel::step");
    plan = im.plan_shards(x.dim(0));
    units = loss_fn.count(labels, im.group->stream(0));
  } catch (Error const&) {
    if (!across) throw;
    refused = std::current_exception();
    plan.rows.assign(im.ranks.size(), 0);  // no rows, whatever allow_empty_shards says: the step stops at share_counts()
    plan.offsets.assign(im.ranks.size(), 0);
  }
  // The loss's divisor: the counted units of the global batch (a shard's loss is its share of the
  // mean); across processes the sum of every process's, which share_counts() exchanges.
  plan.global_units = std::max<std::int64_t>(1, units);
  int const k = im.options.accumulation_steps;
  bool const accumulate_only = k > 1 && (im.micro_steps + 1) % k != 0;

  std::vector<Tensor> xs, ys;
  if (!refused) {
    trace::Timeline::Scope scope(im.options.timeline.get(), "scatter", "copy", 0, trace::Lane::host);
    xs = im.group->scatter(x, plan.rows);
    ys = im.group->scatter(labels, plan.rows);
  }

  int const n = static_cast<int>(im.ranks.size());
  int const world = im.sync->communicator().size();
  Impl::Before before{im.state[0]->model.rng_state(), im.state[0]->optimizer->steps(), {}};
  if (im.state[0]->scaler) before.scaler = im.state[0]->scaler->state();
  im.sync->start_step(im.micro_steps % k != 0);  // sharded gradients: add to the cycle's so far
  // With one device and no hook the update runs inside backward where no reduce marks it.
  bool const unobserved_updates = !accumulate_only && world == 1 && !im.options.comm_hook;
  std::vector<nn::StepResult> results;
  DataParallelResult result;
  bool const synced = (world > 1 || im.options.comm_hook) && !accumulate_only;
  std::vector<double> step_ms_per_row;
  std::vector<float> shares;
  int refused_by = -1;  // across processes: the first world rank of the first process that refused its batch
  try {
    if (across) refused_by = im.share_counts(plan, units, refused != nullptr);
    if (refused_by >= 0) throw Refused{};
    results = im.run_ranks(plan, xs, ys, lr_scale, accumulate_only);
    std::vector<metrics::DeviceTimes> times;
    for (int r = 0; r < n; ++r) {
      auto const i = static_cast<std::size_t>(r);
      detail::RankSync const& rank_sync = im.sync->rank(r);
      result.compute_ms.push_back(Event::elapsed_ms(im.state[i]->start, synced ? rank_sync.backward_end() : im.state[i]->stop));
      bool const host = im.group->device(r).kind == DeviceKind::host;
      result.wait_ms.push_back(synced && host ? rank_sync.wait_ms() : 0.0);
      times.push_back({.rank = im.ranks[i],
                       .device = im.group->device(r),
                       .compute_seconds = std::max(0.0, result.compute_ms.back()) / 1e3,
                       .wait_seconds = host ? std::optional<double>(result.wait_ms.back() / 1e3) : std::nullopt});
    }
    im.options.metrics->report_times(times);
    if (im.options.rebalance) step_ms_per_row = im.ms_per_row(plan);
    shares = im.loss_shares(results, step_ms_per_row);
  } catch (Refused const&) {  // nothing ran: every process refuses the step, changing nothing
    if (refused) std::rethrow_exception(refused);
    throw Error(Errc::invalid_argument, "DataParallel::step: the process of world rank " + std::to_string(refused_by) +
                                            " refused its part of the batch (its error names the bad value; expected a "
                                            "batch every process accepts): the step changed nothing");
  } catch (...) {
    im.recover(std::current_exception(), before, unobserved_updates);
  }
  ++im.micro_steps;

  result.rows = plan.rows;
  result.applied = results[0].applied;
  double loss = 0;
  for (float const share : shares) loss += static_cast<double>(share);
  result.loss = static_cast<float>(loss);
  if (im.options.rebalance && n > 1) im.rebalance(step_ms_per_row);
  return result;
}

std::int64_t DataParallel::count_correct(Tensor const& x, Tensor const& labels, std::int64_t batch) {
  Impl& im = *impl_;
  nn::check_batch(im.state[0]->model, nn::SoftmaxCrossEntropy{}, x, labels, {1.0f, im.options.compute, false},
                  "DataParallel::count_correct");
  im.sync->gather_whole();
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
  bool renewed = false;
  try {
    for (int r = 0; r < static_cast<int>(state.size()); ++r) {
      detail::RankSync& rank_sync = sync->rank(r);
      for (Stream* stream : {&rank_sync.comm_stream(), &group->stream(r)}) {
        try {
          stream->synchronize();
        } catch (Error const&) {  // the failure's own consequences, reported by it
        }
      }
      changed = changed || rank_sync.reduced();
    }
    // The failure aborted the communicator. Across processes every process makes the new one in
    // its own recover(): a failure in one makes the others' steps fail too (at the latest at their
    // deadline); a process that is gone makes it time out.
    sync->renew_communicator();
    renewed = true;
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
    std::string const cause = describe(failure);
    broken = renewed ? "the executor cannot be used after a step failed once updates had begun, leaving the replicas partly "
                       "updated (expected load() of a checkpoint first); the step failed with " +
                           cause
                     : "the executor cannot be used after a step failed and its communicator could not be made again "
                       "(across processes: a process may be gone; expected a new job); the step failed with " +
                           cause;
  }
  std::rethrow_exception(failure);
}

void DataParallel::verify_replicas() {
  Impl& im = *impl_;
  im.group->synchronize();
  im.sync->gather_whole();
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
    for (nn::ParameterRange const& range : first.parameter_ranges()) {
      auto const at = static_cast<std::size_t>(range.begin);
      if (std::memcmp(a.data() + at, b.data() + at, static_cast<std::size_t>(range.size()) * sizeof(float)) != 0)
        throw Error(Errc::invalid_argument, who + " layer " + std::to_string(range.layer) + " (" + first.layer(range.layer).name() +
                                                ") holds other parameters (expected replicas bitwise equal to rank " + std::to_string(im.ranks[0]) + "'s)");
    }
  }
}

}  // namespace mgpu::parallel
