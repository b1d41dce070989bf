// The TensorParallel executor: the grid's communicators, its gradient sync and commit point, a
// step and its recovery.
#include <mgpu/parallel/tensor_parallel.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <string>
#include <string_view>

#include <mgpu/comm/mesh.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>

#include "comm/renewable.hpp"
#include "parallel/gradient_sync.hpp"
#include "parallel/tensor_parallel_impl.hpp"

namespace mgpu::parallel {

std::vector<float> detail::host_copy(Tensor const& t, Stream& stream) {
  auto const host = Allocator::create({DeviceKind::host, 0});
  Tensor const copy = Tensor::empty(t.shape(), DType::float32, *host);
  copy_async(copy, t, stream);
  stream.synchronize();
  auto const span = copy.host_span<float>();
  return {span.begin(), span.end()};
}

namespace detail {

// Within a replica nothing is left to reduce between backward and the update (the blocks'
// all-reduces leave every gradient complete on its rank). Across replicas (`data`, when set: the
// data-parallel gradient sync of this rank's tensor-parallel index, whose replicas are alike
// Sequentials) the sync reduces each bucket of gradients as backward writes it and, with ZeRO,
// shards the update, the optimizer state and (stage 2) the gradients; every replica's loss is
// divided by the whole batch's count. This side keeps what tensor parallelism adds: with sequence
// parallelism the LayerNorms' gradients (the blocks' partial_ranges() and the final LayerNorm) are
// each rank's tokens' part, which ready() first sums over the replica's ranks; the commit point;
// and the global norm, in which split ranges count on every rank and replicated ones on the
// replica's rank 0 only (with a sharded update, within the data-parallel rank's owned ranges,
// summed over every rank of the grid; else over the replica's ranks, the replicas holding the same
// gradients). The updates wait for the commit point: the data-parallel sync is given none.
class TensorParallelSync final : public nn::GradientSync {
 public:
  TensorParallelSync(nn::Sequential const& shard, comm::Communicator& comm, int rank, comm::Communicator& all, int all_rank,
                     bool sequence_parallel, trace::Timeline* timeline, Allocator& allocator)
      : shard_(shard),
        comm_(comm),
        rank_(rank),
        all_(all),
        all_rank_(all_rank),
        norm_(norm_ranges(shard, true, rank == 0)),
        timeline_(timeline),
        allocator_(allocator) {
    for (nn::ParameterRange const& partial : partial_ranges(shard, sequence_parallel))
      partial_[partial.layer].emplace_back(partial.begin, partial.end);
  }
  /// Joins the data-parallel sync of this rank (null for one replica), once the shard is materialized.
  void set_data(RankSync* data) noexcept { data_ = data; }
  [[nodiscard]] RankSync* data() const noexcept { return data_; }
  /// Before a step: nothing updated yet (begin() comes only once forward has been enqueued).
  void start_step() noexcept { updated_.store(false, std::memory_order_relaxed); }
  void begin(Stream& compute, nn::RangeUpdate update) override {
    update_ = std::move(update);
    pending_.clear();
    if (data_ != nullptr) data_->begin(compute, {});
  }
  /// Whether the step's updates may have begun on this rank (every rank had finished its backward).
  [[nodiscard]] bool updated() const noexcept { return updated_.load(std::memory_order_acquire); }
  void ready(nn::ParameterRange const& range, Stream& compute) override {
    if (auto const it = partial_.find(range.layer); it != partial_.end()) {
      traced(compute, "all_reduce(" + shard_.layer(range.layer).name() + " token parts)", [&] {
        for (auto const& [begin, end] : it->second) {
          Tensor const grads = shard_.master_gradients(begin, end);
          comm_.all_reduce(rank_, grads, grads, ReduceOp::sum, compute);
        }
      });
    }
    if (data_ != nullptr) data_->ready(range, compute);
    if (update_) pending_.emplace_back(range.begin, range.end);
  }
  // The commit point: a barrier over every rank, so the updates (here, or apply_update's after it)
  // run on every rank or, when any rank failed before it, on none (a failed stream skips them).
  void finish(Stream& compute) override {
    if (data_ != nullptr) data_->finish(compute);  // the reduces done
    traced(compute, "barrier (commit point)", [&] { all_.barrier(all_rank_, compute); });
    // On a host stream the mark runs only if the barrier did; a CUDA stream runs later kernels
    // after a failed callback, so there the updates count as begun once enqueued.
    if (compute.device().kind == DeviceKind::host) {
      compute.enqueue([this] { updated_.store(true, std::memory_order_release); });
    } else {
      updated_.store(true, std::memory_order_release);
    }
    std::vector<nn::ElementRange> const sharded = data_ != nullptr ? data_->owned() : std::vector<nn::ElementRange>{};
    if (update_ && !sharded.empty()) {  // the data-parallel rank's owned ranges, then every rank's gathered
      for (nn::ElementRange const& r : sharded)
        if (r.begin < r.end) update_(r.begin, r.end, compute);
      data_->gather_updated(compute);
    } else if (update_) {
      for (auto const& [begin, end] : pending_) update_(begin, end, compute);
    }
    pending_.clear();
    update_ = nullptr;
  }
  // The update's ranges: the norm's, each split where the data-parallel rank's owned ones are.
  std::vector<nn::ElementRange> ranges() const {
    std::vector<nn::ElementRange> const sharded = data_ != nullptr ? data_->owned() : std::vector<nn::ElementRange>{};
    if (sharded.empty()) return norm_;
    // Each owned range split where the norm's are (norm_ is sorted and covers the buffer).
    std::vector<nn::ElementRange> out;
    for (nn::ElementRange const& r : sharded) {
      for (nn::ElementRange const& n : norm_) {
        std::int64_t const begin = std::max(r.begin, n.begin), end = std::min(r.end, n.end);
        if (begin < end) out.push_back({begin, end, r.counted && n.counted});
      }
    }
    return out;
  }
  // Runs `enqueue`, recorded on the timeline's communication lane while it records (the
  // collectives run on the compute stream).
  template <class Enqueue>
  void traced(Stream& compute, std::string name, Enqueue&& enqueue) {
    if (timeline_ != nullptr && timeline_->enabled()) {
      timeline_->stream_span(compute, std::move(name), "communication", all_rank_, trace::communication,
                             std::forward<Enqueue>(enqueue));
    } else {
      std::forward<Enqueue>(enqueue)();
    }
  }
  void sum_over_ranks(Tensor const& values, Stream& compute) {
    if (data_ != nullptr && !data_->owned().empty()) {
      // The ranks of other tensor-parallel indices own other counts of ranges: each sums its own
      // first; every rank's sum is gathered and added up in rank order into the first value (the
      // step adds the values up), the same bits in one process as across processes.
      Tensor const mine = Tensor::empty({1}, DType::float32, allocator_);
      Tensor const every = Tensor::empty({all_.size()}, DType::float32, allocator_);
      ops::sum(values, mine, compute);
      all_.all_gather(all_rank_, mine, every, compute);
      fill_async(values, 0.0f, compute);
      ops::sum(every, values.slice(0, 1), compute);
    } else {
      comm_.all_reduce(rank_, values, values, ReduceOp::sum, compute);
    }
  }
  // The update of ranges(), reading the data-parallel rank's packed gradients and writing its
  // packed parameters where it keeps them, its values summed over the ranks (sum_over_ranks()) and
  // the updated blocks gathered after.
  nn::UpdatePart update_part(nn::UpdatePart part) override {
    part.ranges = ranges();
    part.combine = [this](Tensor const& values, Stream& compute) { sum_over_ranks(values, compute); };
    if (data_ == nullptr) return part;
    part.gradients = data_->owned_gradients();
    part.parameters = data_->owned_parameters();
    part.after = [data = data_](Stream& compute) { data->gather_updated(compute); };
    return part;
  }
  void before_layer(std::size_t layer, bool backward, Stream& compute) override {
    if (data_ != nullptr) data_->before_layer(layer, backward, compute);
  }

 private:
  nn::Sequential const& shard_;
  comm::Communicator& comm_;
  int rank_;
  comm::Communicator& all_;  // over every rank of the grid
  int all_rank_;
  std::vector<nn::ElementRange> norm_;
  trace::Timeline* timeline_;  // null: not traced
  Allocator& allocator_;       // the rank's
  RankSync* data_ = nullptr;  // the data-parallel sync; null for one replica
  std::map<std::size_t, std::vector<std::pair<std::int64_t, std::int64_t>>> partial_;  // by layer
  nn::RangeUpdate update_;
  std::vector<std::pair<std::int64_t, std::int64_t>> pending_;  // ranges whose update waits for finish()
  std::atomic<bool> updated_{false};
};

}  // namespace detail

namespace {

// The data-parallel gradient sync's options for TensorParallel's replicas.
DataParallelOptions data_parallel_options(TensorParallelOptions const& options) {
  DataParallelOptions out;
  out.zero_stage = options.zero_stage;
  out.bucket_cap_bytes = options.bucket_cap_bytes;
  out.first_bucket_cap_bytes = options.first_bucket_cap_bytes;
  out.compute = options.compute;
  out.timeline = options.timeline;
  return out;
}

}  // namespace


void TensorParallel::Impl::recover(std::exception_ptr failure, Before const& before) {
  std::string const cause = describe(failure);
  try {
    group->drain();
    for (auto const& sync : syncs) {  // the data-parallel reduces' streams too
      if (sync->data() == nullptr) continue;
      try {
        sync->data()->comm_stream().synchronize();
      } catch (Error const&) {  // the failure, already known
      }
    }
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
        shards[r].set_rng_state(before.rng[r]);
        optimizers[r]->set_steps(before.steps[r]);
        if (scalers[r]) scalers[r]->set_state(*before.scalers[r]);
      }
    }
  } catch (Error const& e) {  // an executor that cannot be put back is as unusable as a partly updated one
    broken = "the executor cannot be used after a step failed and it could not be put back (" + std::string(e.what()) +
             "); the step failed with " + cause;
  }
  std::rethrow_exception(failure);
}

TensorParallel::TensorParallel(DeviceGroup& group, nn::Sequential const& whole, TensorParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  if (!options.loss) options.loss = vocab_parallel_loss(whole, "TensorParallel");
  if (!options.adamw.decay_ranges.empty())
    throw Error(Errc::invalid_argument, "TensorParallel: AdamW with " +
                                            std::to_string(options.adamw.decay_ranges.size()) +
                                            " decay ranges (expected none: each rank decays its shard's 2-D weights)");
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument, "TensorParallel: clip_norm " + std::to_string(options.clip_norm) +
                                            " (expected 0 for no clipping, or a finite norm > 0)");
  if (options.compute != DType::float32 && options.compute != DType::bfloat16 && options.compute != DType::float16)
    throw Error(Errc::invalid_argument, "TensorParallel: compute " + std::string(to_string(options.compute)) +
                                            " (expected float32, bfloat16 or float16)");
  DataParallelOptions const data_options = data_parallel_options(options);
  detail::check_zero_stage(data_options, "TensorParallel");
  int const replicas = options.data_parallel;
  std::shared_ptr<Mesh> const mesh = options.mesh;
  if (mesh) {  // the mesh's communicators in place of the executor's own
    if (options.make_communicator || options.make_subset_communicator)
      throw Error(Errc::invalid_argument, "TensorParallel: a mesh with make_communicator or make_subset_communicator "
                                          "(expected the mesh alone: it makes the communicators)");
    int const ranks = mesh->layout().size();
    if (replicas >= 1 && ranks % replicas == 0)
      mesh->check(group, comm::DeviceMesh({{"dp", replicas}, {"tp", ranks / replicas}}), "TensorParallel");
    if (mesh->across()) {
      options.make_communicator = Mesh::factory(mesh);
      options.make_subset_communicator = Mesh::subset_factory(mesh);
    }
  }
  // In one process: the mesh's communicators over some ranks, or the executor's own.
  SubsetCommunicatorFactory const make_local =
      mesh ? Mesh::subset_factory(mesh)
           : SubsetCommunicatorFactory([](DeviceGroup& g, std::vector<int> const& ranks, comm::Options o) {
               return comm::make_communicator(g, ranks, o);
             });
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
  im.whole = whole.clone();
  im.options = std::move(options);
  im.make_shard = [model = std::make_shared<nn::Sequential const>(whole.clone()),
                   plan = TensorParallelPlan{.styles = im.options.styles,
                                             .sequence_parallel = im.options.sequence_parallel}](
                      std::shared_ptr<comm::Communicator> comm, int rank) {
    return parallelize(*model, plan, std::move(comm), rank);
  };
  im.replicas = replicas;
  im.ranks = size / replicas;
  im.mesh = comm::DeviceMesh({{"dp", replicas}, {"tp", im.ranks}});
  // A communicator over the grid ranks `ranks` (across processes, made only where this process
  // drives one of them).
  auto const subset = [&](std::vector<int> const& ranks) -> std::unique_ptr<comm::detail::Renewable> {
    if (!across) {
      auto made = std::make_unique<comm::detail::Renewable>(
          [g = &group, ranks, options = im.options.comm, make_local] { return make_local(*g, ranks, options); });
      im.renewable.push_back(made.get());
      return made;
    }
    if (!comm::drives_any(ranks, im.first, group.size())) return nullptr;
    auto made = std::make_unique<comm::detail::Renewable>(
        [&group, make = im.options.make_subset_communicator, ranks, options = im.options.comm] { return make(group, ranks, options); });
    im.renewable.push_back(made.get());
    return made;
  };
  if (replicas == 1) {
    if (across) {
      im.comms.push_back(im.world);
    } else {
      CommunicatorFactory const make_whole = mesh ? Mesh::factory(mesh) : CommunicatorFactory([](DeviceGroup& g, comm::Options o) {
        return comm::make_communicator(g, o);
      });
      auto made = std::make_shared<comm::detail::Renewable>(
          [g = &group, options = im.options.comm, make_whole] { return make_whole(*g, options); });
      im.renewable.push_back(made.get());
      im.comms.push_back(std::move(made));
    }
  } else {
    for (std::vector<int> const& ranks : im.mesh.groups("tp")) im.comms.push_back(subset(ranks));
    for (std::vector<int> const& ranks : im.mesh.groups("dp")) im.data.push_back(subset(ranks));
  }
  if (across) {
    im.all = im.world;
  } else if (replicas == 1) {
    im.all = im.comms[0];
  } else {
    im.all = subset(im.mesh.group(0, std::vector<std::string_view>{"dp", "tp"}));
  }
  im.shards.reserve(static_cast<std::size_t>(group.size()));  // the syncs keep references
  for (int r = 0; r < group.size(); ++r) {
    int const a = im.mesh.coordinate(im.first + r, "dp"), t = im.mesh.coordinate(im.first + r, "tp");
    std::shared_ptr<comm::Communicator> const& comm = im.comms[static_cast<std::size_t>(a)];
    im.shards.push_back(im.make_shard(comm, t));
    if (im.options.optimizer) {
      im.optimizers.push_back(im.options.optimizer(im.shards.back()));
    } else {
      optim::AdamWOptions adamw = im.options.adamw;
      adamw.decay_ranges = im.shards.back().matrix_ranges();
      im.optimizers.push_back(std::make_unique<optim::AdamW>(adamw));
    }
    im.syncs.push_back(std::make_unique<detail::TensorParallelSync>(im.shards.back(), *comm, t, *im.all, im.first + r,
                                                                    im.options.sequence_parallel, im.options.timeline.get(),
                                                                    group.allocator(r)));
    im.losses.push_back(im.options.loss(comm, t));
    if (!im.losses.back())
      throw Error(Errc::invalid_argument, "TensorParallel: options.loss returned no loss for rank " + std::to_string(t) +
                                              " (expected a new loss from every call)");
    im.scalers.push_back(im.options.loss_scaler);
  }
  group.run([&](int rank, Device /*device*/, Stream& stream) {
    nn::Context ctx{group.allocator(rank), stream};
    im.shards[static_cast<std::size_t>(rank)].materialize(ctx, im.options.seed, im.options.compute);
  });
  // Each tensor-parallel index's replicas, alike Sequentials, share a data-parallel gradient sync
  // over its "dp" communicator (made where this process drives one of its ranks).
  std::vector<std::vector<int>> const replica_groups = im.mesh.groups("dp");
  for (std::size_t t = 0; t < im.data.size(); ++t) {
    if (!im.data[t]) {
      im.data_syncs.push_back(nullptr);
      continue;
    }
    std::vector<int> locals, names;
    for (int const g : replica_groups[t]) {
      if (g < im.first || g >= im.first + group.size()) continue;
      locals.push_back(g - im.first);
      names.push_back(g);
    }
    nn::Sequential& first = im.shards[static_cast<std::size_t>(locals.front())];
    auto& sync = *im.data_syncs.emplace_back(std::make_unique<detail::GradientSync>(
        group, im.data[t], locals, detail::plan_buckets(first, data_options), data_options, names));
    sync.unit_compute_gradients();  // nn::train_step unscales each layer's 16-bit gradients as backward writes them
    for (std::size_t i = 0; i < locals.size(); ++i) {
      auto const local = static_cast<std::size_t>(locals[i]);
      sync.add_rank(im.shards[local]);
      im.syncs[local]->set_data(&sync.rank(static_cast<int>(i)));
    }
  }
  group.synchronize();
  im.shard_parameters();  // zero_stage 3: each rank keeps its owned parameters only
}

TensorParallel::~TensorParallel() = default;

std::vector<optim::Optimizer*> TensorParallel::Impl::replica_optimizers(std::size_t t) const {
  std::vector<optim::Optimizer*> out;
  for (std::size_t r = 0; r < syncs.size(); ++r)
    if (mesh.coordinate(first + static_cast<int>(r), "tp") == static_cast<int>(t)) out.push_back(optimizers[r].get());
  return out;
}

void TensorParallel::Impl::gather_optimizer_state() {
  for (std::size_t t = 0; t < data_syncs.size(); ++t)
    if (data_syncs[t]) data_syncs[t]->gather_optimizer_state(replica_optimizers(t));
}

void TensorParallel::Impl::gather_whole() {
  for (auto const& sync : data_syncs)
    if (sync) sync->gather_whole();
}

void TensorParallel::Impl::shard_parameters() {
  for (std::size_t t = 0; t < data_syncs.size(); ++t)
    if (data_syncs[t]) data_syncs[t]->shard_parameters(replica_optimizers(t));
}

int TensorParallel::size() const noexcept { return impl_->replicas * impl_->ranks; }
optim::LossScaler const* TensorParallel::loss_scaler() const noexcept {
  return impl_->scalers.empty() || !impl_->scalers[0] ? nullptr : &*impl_->scalers[0];
}
int TensorParallel::data_parallel() const noexcept { return impl_->replicas; }
int TensorParallel::tensor_parallel() const noexcept { return impl_->ranks; }

nn::Sequential& TensorParallel::shard(int rank) {
  nn::Sequential& shard = impl_->shards.at(static_cast<std::size_t>(rank));
  impl_->gather_whole();
  return shard;
}

void TensorParallel::Impl::report_times() {
  std::vector<metrics::DeviceTimes> times;
  for (int rank = 0; rank < group->size(); ++rank) {
    auto const r = static_cast<std::size_t>(rank);
    double wait = 0;
    for (comm::detail::Renewable const* comm : renewable) wait += comm->seconds(group->stream(rank));
    // The replicas' reduces run on the data-parallel sync's stream: the rank's stream waits for them
    // (measured on host devices).
    if (detail::RankSync const* data = syncs[r]->data(); data != nullptr && group->device(rank).kind == DeviceKind::host)
      wait += data->wait_ms() / 1e3;
    double const total = std::max(0.0, Event::elapsed_ms(step_start[r], step_end[r]) / 1e3);
    wait = std::min(wait, total);  // both from the same stream's events; rounding aside
    times.push_back({.rank = rank, .device = group->device(rank), .compute_seconds = total - wait, .wait_seconds = wait});
  }
  options.metrics->report_times(times);
}

TensorParallel::StepResult TensorParallel::step(Tensor const& ids, Tensor const& targets, float lr_scale) {
  Impl& im = *impl_;
  if (!im.broken.empty()) throw Error(Errc::invalid_argument, "TensorParallel::step: " + im.broken);
  nn::Loss const& loss = *im.losses[0];
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
  Impl::Before before;  // what a failed step puts back
  for (std::size_t r = 0; r < im.shards.size(); ++r) {
    before.rng.push_back(im.shards[r].rng_state());
    before.steps.push_back(im.optimizers[r]->steps());
    before.scalers.push_back(im.scalers[r] ? std::optional(im.scalers[r]->state()) : std::nullopt);
    im.syncs[r]->start_step();
  }
  for (auto const& sync : im.data_syncs)
    if (sync) sync->start_step();
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
      auto const a = static_cast<std::size_t>(im.mesh.coordinate(g, "dp"));
      auto const local = [&](Tensor const& t) {
        Tensor const rows_of = im.replicas == 1 ? t : t.slice(offsets[a], offsets[a + 1]);
        if (rows_of.device() == device) return rows_of;
        Tensor copy = Tensor::empty(rows_of.shape(), rows_of.dtype(), allocator);
        copy_async(copy, rows_of, stream);
        return copy;
      };
      auto const r = static_cast<std::size_t>(rank);
      nn::Context ctx{allocator, stream, offsets[a]};
      // ZeRO: the optimizer's state for the rank's owned elements only (nothing once it is).
      if (detail::RankSync* data = im.syncs[r]->data()) {
        data->shard_optimizer_state(*im.optimizers[r], allocator, stream);
        data->shard_parameters(*im.optimizers[r], allocator, stream);  // zero_stage 3, when gathered whole
      }
      nn::StepResult const step =
          nn::train_step(im.shards[r], *im.optimizers[r], local(ids), local(targets), *im.losses[r], ctx,
                         {.lr_scale = lr_scale,
                          .clip_norm = im.options.clip_norm,
                          .scaler = im.scalers[r] ? &*im.scalers[r] : nullptr,
                          .global_units = units,
                          .sync = im.syncs[r].get(),
                          .timeline = im.options.timeline.get(),
                          .rank = g});
      if (im.world) {  // across processes: every rank's share, from every process
        Tensor const all = Tensor::empty({size()}, DType::float32, allocator);
        im.world->all_gather(g, step.loss.reshape({1}), all, stream);
        if (rank == 0) {
          std::vector<float> const values = detail::host_copy(all, stream);
          std::copy(values.begin(), values.end(), shares.begin());
        }
      } else if (im.mesh.coordinate(g, "tp") == 0) {
        shares[static_cast<std::size_t>(g)] = ops::item(step.loss, stream);
      }
      if (rank == 0) result.applied = step.applied;  // the same on every rank
      if (timed) im.step_end[static_cast<std::size_t>(rank)].record(stream);
    });
  } catch (...) {
    im.recover(std::current_exception(), before);
  }
  if (timed) im.report_times();
  for (int a = 0; a < im.replicas; ++a) result.loss += shares[static_cast<std::size_t>(im.mesh.at("tp", a, 0))];
  return result;
}

}  // namespace mgpu::parallel
