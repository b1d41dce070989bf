// The TensorParallel executor: the grid's communicators, its gradient sync and commit point, a
// step and its recovery, and moving the whole model to and from the shards.
#include <mgpu/parallel/tensor_parallel.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <numeric>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>

#include "comm/renewable.hpp"

namespace mgpu::parallel {

namespace {

// `t`'s float32 values on the host, once `stream` has written them.
std::vector<float> host_copy(Tensor const& t, Stream& stream) {
  auto const host = Allocator::create({DeviceKind::host, 0});
  Tensor const copy = Tensor::empty(t.shape(), DType::float32, *host);
  copy_async(copy, t, stream);
  stream.synchronize();
  auto const span = copy.host_span<float>();
  return {span.begin(), span.end()};
}

// Within a replica nothing is left to reduce between backward and the update (the blocks'
// all-reduces leave every gradient complete on its rank); across replicas (`data`, when set) each
// layer's gradients are summed over the ranks of the same tensor-parallel index as backward writes
// them (every replica's loss is divided by the whole batch's count). For apply_update, the rank's
// whole buffer as owned ranges, split ranges counted on every rank and replicated ones on the
// replica's rank 0 only, and sums over the replica's ranks by all-reduce: the replicas hold the
// same gradients, so each computes the same global norm. With sequence parallelism the LayerNorms'
// gradients (the blocks' partial_ranges() and the final LayerNorm) are each rank's tokens' part:
// ready() first sums them over the replica's ranks.
class TensorParallelSync final : public nn::GradientSync {
 public:
  TensorParallelSync(nn::Sequential const& shard, comm::Communicator& comm, int rank, comm::Communicator* data,
                     int data_rank, comm::Communicator& all, int all_rank, bool sequence_parallel)
      : shard_(shard),
        comm_(comm),
        rank_(rank),
        data_(data),
        data_rank_(data_rank),
        all_(all),
        all_rank_(all_rank),
        owned_(norm_ranges(shard, true, rank == 0)) {
    for (nn::ParameterRange const& partial : partial_ranges(shard, sequence_parallel))
      partial_[partial.layer].emplace_back(partial.begin, partial.end);
  }
  /// Before a step: nothing updated yet (begin() comes only once forward has been enqueued).
  void start_step() noexcept { updated_.store(false, std::memory_order_relaxed); }
  void begin(Stream& /*compute*/, nn::RangeUpdate update) override {
    update_ = std::move(update);
    pending_.clear();
  }
  /// Whether the step's updates may have begun on this rank (every rank had finished its backward).
  [[nodiscard]] bool updated() const noexcept { return updated_.load(std::memory_order_acquire); }
  void ready(nn::ParameterRange const& range, Stream& compute) override {
    if (auto const it = partial_.find(range.layer); it != partial_.end()) {
      for (auto const& [begin, end] : it->second) {
        Tensor const grads = shard_.master_gradients().slice(begin, end);
        comm_.all_reduce(rank_, grads, grads, ReduceOp::sum, compute);
      }
    }
    if (data_ != nullptr) {
      Tensor const grads = shard_.master_gradients().slice(range.begin, range.end);
      data_->all_reduce(data_rank_, grads, grads, ReduceOp::sum, compute);
    }
    if (update_) pending_.emplace_back(range.begin, range.end);
  }
  // The commit point: a barrier over every rank, so the updates (here, or apply_update's after it)
  // run on every rank or, when any rank failed before it, on none (a failed stream skips them).
  void finish(Stream& compute) override {
    all_.barrier(all_rank_, compute);
    // On a host stream the mark runs only if the barrier did; a CUDA stream runs later kernels
    // after a failed callback, so there the updates count as begun once enqueued.
    if (compute.device().kind == DeviceKind::host) {
      compute.enqueue([this] { updated_.store(true, std::memory_order_release); });
    } else {
      updated_.store(true, std::memory_order_release);
    }
    for (auto const& [begin, end] : pending_) update_(begin, end, compute);
    pending_.clear();
  }
  std::vector<nn::OwnedRange> owned() const override { return owned_; }
  void sum_over_ranks(Tensor const& values, Stream& compute) override {
    comm_.all_reduce(rank_, values, values, ReduceOp::sum, compute);
  }

 private:
  nn::Sequential const& shard_;
  comm::Communicator& comm_;
  int rank_;
  comm::Communicator* data_;  // over the replicas' ranks of this tensor-parallel index; null for one replica
  int data_rank_;
  comm::Communicator& all_;  // over every rank of the grid
  int all_rank_;
  std::vector<nn::OwnedRange> owned_;
  std::map<std::size_t, std::vector<std::pair<std::int64_t, std::int64_t>>> partial_;  // by layer
  nn::RangeUpdate update_;
  std::vector<std::pair<std::int64_t, std::int64_t>> pending_;  // ranges whose update waits for finish()
  std::atomic<bool> updated_{false};
};

}  // namespace

struct TensorParallel::Impl {
  DeviceGroup* group = nullptr;
  nn::GptConfig config;
  TensorParallelOptions options;
  int replicas = 1, ranks = 1;  // A and T
  int first = 0;                // the grid rank of the group's rank 0 (across processes, its world rank)
  // Across processes: over every rank of the world (null in one process).
  std::shared_ptr<comm::Communicator> world;
  // Each replica's tensor-parallel group, and (A > 1) each tensor-parallel index's replicas; across
  // processes null where this process drives none of the ranks.
  std::vector<std::shared_ptr<comm::Communicator>> comms;
  std::vector<std::unique_ptr<comm::Communicator>> data;
  // Over every rank (the world's across processes; comms[0] for one replica): the step's commit point.
  std::shared_ptr<comm::Communicator> all;
  std::vector<nn::Sequential> shards;
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers;
  std::vector<std::unique_ptr<TensorParallelSync>> syncs;
  std::vector<VocabParallelCrossEntropy> losses;
  // The communicators above, in the order they were made, made anew after a failed step.
  std::vector<comm::detail::Renewable*> renewable;
  // Why the executor cannot be used (empty: it can).
  std::string broken;
  // With options.metrics: each local rank's step, between events at its start and end.
  std::vector<Event> step_start, step_end;
  void report_times();
  // After a step failed inside: waits for every stream; when no rank had passed the step's commit
  // point (TensorParallelSync::finish), makes the communicators anew (across processes with the
  // other processes) and puts back the shards' RNG and the optimizers' step counts (`rng`, `steps`:
  // as the step found them); otherwise the executor cannot be used. Rethrows `failure`.
  [[noreturn]] void recover(std::exception_ptr failure, std::vector<std::vector<std::uint64_t>> const& rng,
                            std::vector<std::int64_t> const& steps);
};

void TensorParallel::Impl::recover(std::exception_ptr failure, std::vector<std::vector<std::uint64_t>> const& rng,
                                   std::vector<std::int64_t> const& steps) {
  std::string const cause = describe(failure);
  try {
    group->drain();
    bool updated = false;  // past the step's commit point somewhere
    for (auto const& sync : syncs) updated = updated || sync->updated();
    if (updated) {
      broken = "the executor cannot be used after a step failed once updates had begun, leaving the shards partly updated "
               "(expected a new executor); the step failed with " + cause;
    } else {
      // The failure aborted them. Across processes a failure in one makes the others' steps fail
      // too (at the latest at their deadline), and every process makes them anew here, in the
      // order they were made; a process that is gone makes that time out.
      for (comm::detail::Renewable* comm : renewable) comm->renew();
      for (std::size_t r = 0; r < shards.size(); ++r) {
        shards[r].set_rng_state(rng[r]);
        optimizers[r]->set_steps(steps[r]);
      }
    }
  } catch (Error const& e) {  // an executor that cannot be put back is as unusable as a partly updated one
    broken = "the executor cannot be used after a step failed and it could not be put back (" + std::string(e.what()) +
             "); the step failed with " + cause;
  }
  std::rethrow_exception(failure);
}

TensorParallel::TensorParallel(DeviceGroup& group, nn::GptConfig const& config, TensorParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  if (!options.adamw.decay_ranges.empty())
    throw Error(Errc::invalid_argument, "TensorParallel: AdamW with " +
                                            std::to_string(options.adamw.decay_ranges.size()) +
                                            " decay ranges (expected none: each rank decays its shard's 2-D weights)");
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument, "TensorParallel: clip_norm " + std::to_string(options.clip_norm) +
                                            " (expected 0 for no clipping, or a finite norm > 0)");
  int const replicas = options.data_parallel;
  bool const across = static_cast<bool>(options.make_communicator);
  if (across) {
    auto made = std::make_shared<comm::detail::Renewable>(
        options.make_communicator(group, options.comm),
        [&group, make = options.make_communicator, comm = options.comm]() { return make(group, comm); });
    im.renewable.push_back(made.get());
    im.world = std::move(made);
    im.first = im.world->first_rank();
  }
  int const size = across ? im.world->size() : group.size();
  if (replicas < 1 || size % replicas != 0)
    throw Error(Errc::invalid_argument, "TensorParallel: data_parallel " + std::to_string(replicas) + " over " +
                                            (across ? "the world's " : "a group of ") + std::to_string(size) +
                                            " devices (expected a replica count >= 1 dividing the " +
                                            (across ? "world's" : "group") + " size)");
  if (across && replicas > 1 && !options.make_subset_communicator)
    throw Error(Errc::invalid_argument, "TensorParallel: data_parallel " + std::to_string(replicas) +
                                            " across processes without make_subset_communicator (expected "
                                            "dist::subset_communicator_factory(world) with make_communicator)");
  im.group = &group;
  im.config = config;
  im.options = std::move(options);
  im.replicas = replicas;
  im.ranks = size / replicas;
  // A communicator over the grid ranks `ranks` (across processes, made only where this process
  // drives one of them).
  auto const subset = [&](std::vector<int> const& ranks) -> std::unique_ptr<comm::Communicator> {
    if (!across) {
      auto made = std::make_unique<comm::detail::Renewable>(
          [g = &group, ranks, options = im.options.comm] { return comm::make_communicator(*g, ranks, options); });
      im.renewable.push_back(made.get());
      return made;
    }
    bool const here = std::any_of(ranks.begin(), ranks.end(), [&](int r) { return r >= im.first && r < im.first + group.size(); });
    if (!here) return nullptr;
    auto made = std::make_unique<comm::detail::Renewable>(
        [&group, make = im.options.make_subset_communicator, ranks, options = im.options.comm] { return make(group, ranks, options); });
    im.renewable.push_back(made.get());
    return made;
  };
  if (replicas == 1) {
    if (across) {
      im.comms.push_back(im.world);
    } else {
      auto made = std::make_shared<comm::detail::Renewable>(
          [g = &group, options = im.options.comm] { return comm::make_communicator(*g, options); });
      im.renewable.push_back(made.get());
      im.comms.push_back(std::move(made));
    }
  } else {
    for (int a = 0; a < replicas; ++a) {
      std::vector<int> ranks;
      for (int t = 0; t < im.ranks; ++t) ranks.push_back(a * im.ranks + t);
      im.comms.push_back(subset(ranks));
    }
    for (int t = 0; t < im.ranks; ++t) {
      std::vector<int> ranks;
      for (int a = 0; a < replicas; ++a) ranks.push_back(a * im.ranks + t);
      im.data.push_back(subset(ranks));
    }
  }
  if (across) {
    im.all = im.world;
  } else if (replicas == 1) {
    im.all = im.comms[0];
  } else {
    std::vector<int> ranks(static_cast<std::size_t>(size));
    std::iota(ranks.begin(), ranks.end(), 0);
    im.all = subset(ranks);
  }
  im.shards.reserve(static_cast<std::size_t>(group.size()));  // the syncs keep references
  for (int r = 0; r < group.size(); ++r) {
    int const a = (im.first + r) / im.ranks, t = (im.first + r) % im.ranks;
    std::shared_ptr<comm::Communicator> const& comm = im.comms[static_cast<std::size_t>(a)];
    im.shards.push_back(tensor_parallel_gpt(config, comm, t, im.options.sequence_parallel));
    if (im.options.optimizer) {
      im.optimizers.push_back(im.options.optimizer(im.shards.back()));
    } else {
      optim::AdamWOptions adamw = im.options.adamw;
      adamw.decay_ranges = im.shards.back().matrix_ranges();
      im.optimizers.push_back(std::make_unique<optim::AdamW>(adamw));
    }
    comm::Communicator* const data = replicas > 1 ? im.data[static_cast<std::size_t>(t)].get() : nullptr;
    im.syncs.push_back(
        std::make_unique<TensorParallelSync>(im.shards.back(), *comm, t, data, a, *im.all, im.first + r, im.options.sequence_parallel));
    im.losses.emplace_back(config.vocab, comm, t);
  }
  group.run([&](int rank, Device /*device*/, Stream& stream) {
    nn::Context ctx{group.allocator(rank), stream};
    im.shards[static_cast<std::size_t>(rank)].materialize(ctx, im.options.seed);
  });
}

TensorParallel::~TensorParallel() = default;

int TensorParallel::size() const noexcept { return impl_->replicas * impl_->ranks; }
int TensorParallel::data_parallel() const noexcept { return impl_->replicas; }
int TensorParallel::tensor_parallel() const noexcept { return impl_->ranks; }

nn::Sequential& TensorParallel::shard(int rank) { return impl_->shards.at(static_cast<std::size_t>(rank)); }

void TensorParallel::Impl::report_times() {
  std::vector<metrics::DeviceTimes> times;
  for (int rank = 0; rank < group->size(); ++rank) {
    auto const r = static_cast<std::size_t>(rank);
    double wait = 0;
    for (comm::detail::Renewable const* comm : renewable) wait += comm->seconds(group->stream(rank));
    double const total = std::max(0.0, Event::elapsed_ms(step_start[r], step_end[r]) / 1e3);
    wait = std::min(wait, total);  // both from the same stream's events; rounding aside
    times.push_back({.rank = rank, .device = group->device(rank), .compute_seconds = total - wait, .wait_seconds = wait});
  }
  options.metrics->report_times(times);
}

TensorParallel::StepResult TensorParallel::step(Tensor const& ids, Tensor const& targets, float lr_scale) {
  Impl& im = *impl_;
  if (!im.broken.empty()) throw Error(Errc::invalid_argument, "TensorParallel::step: " + im.broken);
  nn::Loss const& loss = im.losses[0];
  // Before any rank starts: a bad batch found inside the step would abort the communicators.
  nn::check_batch(im.shards[0], loss, ids, targets, {lr_scale, DType::float32, false}, "TensorParallel::step");
  std::int64_t const rows = ids.rank() > 0 ? ids.dim(0) : 0;
  if (rows < im.replicas)
    throw Error(Errc::invalid_argument, "TensorParallel::step: a batch of " + std::to_string(rows) + " rows over " +
                                            std::to_string(im.replicas) +
                                            " data-parallel replicas (expected at least one row per replica)");
  std::int64_t const units = loss.count(targets, im.group->stream(0));
  // Replica a's rows [offsets[a], offsets[a + 1]): the first rows mod A replicas take one more.
  std::vector<std::int64_t> offsets{0};
  for (std::int64_t const n : shard_sizes(rows, im.replicas)) offsets.push_back(offsets.back() + n);
  std::vector<double> shares(static_cast<std::size_t>(size()), 0.0);  // each grid rank's: its replica's part of the mean
  StepResult result;
  std::vector<std::vector<std::uint64_t>> rng;  // what a failed step puts back
  std::vector<std::int64_t> steps;
  for (std::size_t r = 0; r < im.shards.size(); ++r) {
    rng.push_back(im.shards[r].rng_state());
    steps.push_back(im.optimizers[r]->steps());
    im.syncs[r]->start_step();
  }
  bool const timed = im.options.metrics != nullptr;
  if (timed) {
    for (comm::detail::Renewable* comm : im.renewable) comm->set_timed(true);  // forgets the last step's marks
    im.step_start.resize(im.shards.size()), im.step_end.resize(im.shards.size());
  }
  try {
    im.group->run([&](int rank, Device device, Stream& stream) {
      if (timed) im.step_start[static_cast<std::size_t>(rank)].record(stream);
      Allocator& allocator = im.group->allocator(rank);
      int const g = im.first + rank;
      auto const a = static_cast<std::size_t>(g / im.ranks);
      auto const local = [&](Tensor const& t) {
        Tensor const rows_of = im.replicas == 1 ? t : t.slice(offsets[a], offsets[a + 1]);
        if (rows_of.device() == device) return rows_of;
        Tensor copy = Tensor::empty(rows_of.shape(), rows_of.dtype(), allocator);
        copy_async(copy, rows_of, stream);
        return copy;
      };
      auto const r = static_cast<std::size_t>(rank);
      nn::Context ctx{allocator, stream, offsets[a]};
      nn::StepResult const step =
          nn::train_step(im.shards[r], *im.optimizers[r], local(ids), local(targets), im.losses[r], ctx,
                         {.lr_scale = lr_scale,
                          .clip_norm = im.options.clip_norm,
                          .global_units = units,
                          .sync = im.syncs[r].get(),
                          .rank = g});
      if (im.world) {  // across processes: every rank's share, from every process
        Tensor const all = Tensor::empty({size()}, DType::float32, allocator);
        im.world->all_gather(g, step.loss.reshape({1}), all, stream);
        if (rank == 0) {
          std::vector<float> const values = host_copy(all, stream);
          std::copy(values.begin(), values.end(), shares.begin());
        }
      } else if (g % im.ranks == 0) {
        shares[static_cast<std::size_t>(g)] = ops::item(step.loss, stream);
      }
      if (rank == 0) result.applied = step.applied;  // the same on every rank
      if (timed) im.step_end[static_cast<std::size_t>(rank)].record(stream);
    });
  } catch (...) {
    im.recover(std::current_exception(), rng, steps);
  }
  if (timed) im.report_times();
  for (int a = 0; a < im.replicas; ++a) result.loss += shares[static_cast<std::size_t>(a * im.ranks)];
  return result;
}

namespace {

// Calls fn(whole layer span, shard layer span, sharded layer or nullptr) for each layer with
// parameters.
template <typename Fn>
void for_each_layer(nn::Sequential const& shard, std::span<float> params,
                    std::vector<nn::ParameterRange> const& whole_ranges, std::span<float> whole, Fn&& fn) {
  std::vector<nn::ParameterRange> const ranges = shard.parameter_ranges();
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    nn::ParameterRange const& s = ranges[i];
    nn::ParameterRange const& w = whole_ranges[i];
    fn(whole.subspan(static_cast<std::size_t>(w.begin), static_cast<std::size_t>(w.size())),
       params.subspan(static_cast<std::size_t>(s.begin), static_cast<std::size_t>(s.size())),
       dynamic_cast<ShardedLayer const*>(&shard.layer(s.layer)));
  }
}

}  // namespace

std::vector<float> TensorParallel::gather_parameters() {
  Impl& im = *impl_;
  nn::Sequential const whole_model = nn::gpt(im.config);
  std::vector<float> whole(static_cast<std::size_t>(whole_model.parameter_count()));
  // Replica 0's shards: in one process its own; across processes every rank's shard (padded to the
  // largest) all-gathered over the world, laid out by shards made here for each index.
  std::vector<nn::Sequential> layouts;
  std::vector<float> gathered;
  std::int64_t padded = 0;
  if (im.world) {
    std::shared_ptr<comm::Communicator> const& comm = im.comms[static_cast<std::size_t>(im.first / im.ranks)];
    for (int t = 0; t < im.ranks; ++t) {
      layouts.push_back(tensor_parallel_gpt(im.config, comm, t, im.options.sequence_parallel));
      padded = std::max(padded, layouts.back().parameter_count());
    }
    im.group->run([&](int rank, Device /*device*/, Stream& stream) {
      Allocator& allocator = im.group->allocator(rank);
      nn::Sequential const& shard = im.shards[static_cast<std::size_t>(rank)];
      Tensor const mine = Tensor::empty({padded}, DType::float32, allocator);
      fill_async(mine, 0.0f, stream);
      copy_async(mine.slice(0, shard.parameter_count()), shard.master_parameters(), stream);
      Tensor const all = Tensor::empty({padded * size()}, DType::float32, allocator);
      im.world->all_gather(im.first + rank, mine, all, stream);
      if (rank == 0) gathered = host_copy(all, stream);
    });
  }
  // Rank 0 last, so the replicated parameters are its.
  for (int rank = im.ranks - 1; rank >= 0; --rank) {
    nn::Sequential const& shard = im.world ? layouts[static_cast<std::size_t>(rank)] : im.shards[static_cast<std::size_t>(rank)];
    std::vector<float> values;
    if (im.world) {
      auto const begin = gathered.begin() + static_cast<std::ptrdiff_t>(rank * padded);
      values.assign(begin, begin + static_cast<std::ptrdiff_t>(shard.parameter_count()));
    } else {
      values = host_copy(shard.master_parameters(), im.group->stream(rank));
    }
    for_each_layer(shard, values, whole_model.parameter_ranges(), whole,
                   [](std::span<float> w, std::span<float> s, ShardedLayer const* sharded) {
                     if (sharded != nullptr) {
                       sharded->copy_shard(w, s, false);
                     } else {
                       std::copy(s.begin(), s.end(), w.begin());
                     }
                   });
  }
  return whole;
}

void TensorParallel::scatter_parameters(std::span<float const> values) {
  Impl& im = *impl_;
  nn::Sequential const whole_model = nn::gpt(im.config);
  if (values.size() != static_cast<std::size_t>(whole_model.parameter_count()))
    throw Error(Errc::invalid_argument, "TensorParallel::scatter_parameters: " + std::to_string(values.size()) +
                                            " values (expected gpt(config)'s " +
                                            std::to_string(whole_model.parameter_count()) + ")");
  std::vector<float> whole(values.begin(), values.end());
  auto const host = Allocator::create({DeviceKind::host, 0});
  for (int rank = 0; rank < im.group->size(); ++rank) {
    nn::Sequential& shard = im.shards[static_cast<std::size_t>(rank)];
    Tensor const params = Tensor::empty({shard.parameter_count()}, DType::float32, *host);
    for_each_layer(shard, params.host_span<float>(), whole_model.parameter_ranges(), whole,
                   [](std::span<float> w, std::span<float> s, ShardedLayer const* sharded) {
                     if (sharded != nullptr) {
                       sharded->copy_shard(w, s, true);
                     } else {
                       std::copy(w.begin(), w.end(), s.begin());
                     }
                   });
    Stream& stream = im.group->stream(rank);
    copy_async(shard.master_parameters(), params, stream);
    shard.sync_parameters(stream);
    stream.synchronize();
  }
}

}  // namespace mgpu::parallel
