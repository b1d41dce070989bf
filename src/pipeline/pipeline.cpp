// The pipeline executor: construction over a group (chunks, communicators), a step and its
// update, recovery from a failed step, and layer split. The chunks themselves: stages.cpp.
#include <mgpu/pipeline/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "comm/host_communicator.hpp"
#include "comm/renewable.hpp"
#include "pipeline/executor_impl.hpp"

namespace mgpu::pipeline {

Schedule layer_split(int devices) {
  Schedule s = gpipe(devices, 1);
  s.name = "layer-split";
  return s;
}

namespace {

// The ranges of a tensor-parallel chunk counted in the global gradient norm (nn::apply_update
// updates the part's ranges, here the whole buffer, and counts the counted ones).
class NormRanges final : public nn::GradientSync {
 public:
  explicit NormRanges(std::vector<nn::ElementRange> ranges) : ranges_(std::move(ranges)) {}
  void begin(Stream& /*compute*/, nn::RangeUpdate /*update*/) override {}
  void ready(nn::ParameterRange const& /*range*/, Stream& /*compute*/) override {}
  void finish(Stream& /*compute*/) override {}
  nn::UpdatePart update_part(nn::UpdatePart part) override {
    part.ranges = ranges_;
    return part;
  }

 private:
  std::vector<nn::ElementRange> ranges_;
};

// With zero_stage 1 to 3, the update's view of a chunk's data-parallel sync: the replica's owned
// blocks (RankSync::owned()), with 2 and 3 their packed gradients (RankSync::owned_gradients()) and
// with 3 their parameters (RankSync::owned_parameters()), each element counted in the norm where the sync counts it and `counting`
// does (the chunk's ranges as the replica would count them owning all: a tied head's copy of wte
// nowhere, the replicated parameters of tensor-parallel stages on rank 0 only; elements outside
// them count), and the norm's sums left to the step, which adds every replica's part in one process.
class ShardedUpdate final : public nn::GradientSync {
 public:
  ShardedUpdate(parallel::detail::RankSync& sync, std::vector<nn::ElementRange> counting)
      : sync_(sync), counting_(std::move(counting)) {}
  void begin(Stream& /*compute*/, nn::RangeUpdate /*update*/) override {}
  void ready(nn::ParameterRange const& /*range*/, Stream& /*compute*/) override {}
  void finish(Stream& /*compute*/) override {}
  nn::UpdatePart update_part(nn::UpdatePart part) override {
    part.ranges = owned();
    part.gradients = sync_.owned_gradients();
    part.parameters = sync_.owned_parameters();
    if (!part.ranges.empty()) part.after = [&sync = sync_](Stream& compute) { sync.gather_updated(compute); };
    return part;
  }

 private:
  std::vector<nn::ElementRange> owned() const {
    std::vector<nn::ElementRange> out;
    for (nn::ElementRange const& r : sync_.owned()) {
      std::vector<std::int64_t> cuts{r.begin, r.end};
      for (nn::ElementRange const& c : counting_)
        for (std::int64_t const at : {c.begin, c.end})
          if (at > r.begin && at < r.end) cuts.push_back(at);
      std::sort(cuts.begin(), cuts.end());
      cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
      for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
        bool counted = r.counted;
        for (nn::ElementRange const& c : counting_)
          if (c.begin <= cuts[i] && cuts[i] < c.end) counted = counted && c.counted;
        out.push_back({cuts[i], cuts[i + 1], counted});
      }
    }
    return out;
  }
  parallel::detail::RankSync& sync_;
  std::vector<nn::ElementRange> counting_;
};

// Refuses what tensor-parallel stages do not support (yet).
void check_tensor_parallel(ExecutorOptions const& options, bool across) {
  TensorParallelStages const& tp = options.tensor_parallel;
  if (tp.ranks < 1)
    throw Error(Errc::invalid_argument, "tensor_parallel.ranks " + std::to_string(tp.ranks) + " (expected >= 1)");
  if (tp.ranks == 1) return;
  std::string const what = "tensor-parallel stages (tensor_parallel.ranks " + std::to_string(tp.ranks) + ")";
  if (!tp.stage || !tp.loss)
    throw Error(Errc::invalid_argument, what + " without a stage or loss factory (expected both)");
  if (across && !options.make_subset_communicator)
    throw Error(Errc::invalid_argument, what + " over several processes without make_subset_communicator (expected "
                                               "dist::subset_communicator_factory(world) for the chunks' tensor-parallel ranks)");
}

}  // namespace

Executor::Executor(nn::Sequential const& model, DeviceGroup& group, std::vector<std::size_t> cuts, Schedule schedule,
                   OptimizerFactory make_optimizer, ExecutorOptions options)
    : Executor(model, group, std::move(cuts), std::move(schedule),
               make_optimizer ? ChunkOptimizerFactory([make = std::move(make_optimizer)](nn::Sequential const&) { return make(); })
                              : ChunkOptimizerFactory{},
               std::move(options)) {}

Executor::Executor(nn::Sequential const& model, DeviceGroup& group, std::vector<std::size_t> cuts, Schedule schedule,
                   ChunkOptimizerFactory make_optimizer, ExecutorOptions options)
    : impl_(std::make_unique<Impl>()) {
  validate(schedule);
  // The pipelines' communicator first: across processes its size is the world's device count.
  comm::Options const comm_options{comm::Backend::automatic, options.timeout};
  if (options.mesh) {  // the mesh's communicators in place of the executor's own
    if (options.make_communicator || options.make_subset_communicator)
      throw Error(Errc::invalid_argument, "pipeline: a mesh with make_communicator or make_subset_communicator "
                                          "(expected the mesh alone: it makes the communicators)");
    options.make_communicator = parallel::Mesh::factory(options.mesh);
    if (options.mesh->across()) options.make_subset_communicator = parallel::Mesh::subset_factory(options.mesh);
  }
  std::unique_ptr<comm::Communicator> transfers = options.make_communicator
                                                      ? options.make_communicator(group, comm_options)
                                                      : comm::make_communicator(group, comm_options);
  if (!transfers)
    throw Error(Errc::invalid_argument,
                "the pipeline's make_communicator returned no communicator (expected one over the group's devices)");
  bool const across = transfers->size() != group.size();
  int const tp = options.tensor_parallel.ranks;
  check_tensor_parallel(options, across);
  {
    parallel::DataParallelOptions zero;
    zero.zero_stage = options.zero_stage;
    zero.compute = options.compute;
    zero.overlap = false;  // the replicas reduce once a chunk's micro-batches are done
    parallel::detail::check_zero_stage(zero, "pipeline", 3, true);
    if (across && options.data_parallel > 1 && !options.make_subset_communicator)
      throw Error(Errc::invalid_argument, "pipeline: data_parallel " + std::to_string(options.data_parallel) +
                                              " over several processes without make_subset_communicator (expected "
                                              "dist::subset_communicator_factory(world) for the replicas' gradient sync)");
  }
  if (options.data_parallel < 1 || schedule.devices * options.data_parallel * tp != transfers->size()) {
    // Across processes: this process, when the grid ends before its devices, would run no stage.
    int const grid = schedule.devices * std::max(options.data_parallel, 1);
    int const first = transfers->first_rank();
    std::string const idle = across && first >= grid
                                 ? "; this process, whose devices are world ranks [" + std::to_string(first) + ", " +
                                       std::to_string(first + group.size()) + "), would run no stage"
                                 : "";
    std::string const ranks = tp > 1 ? " x tensor-parallel ranks" : "";
    throw Error(Errc::invalid_argument, "a schedule for " + std::to_string(schedule.devices) + " devices times " +
                                            std::to_string(options.data_parallel) + " data-parallel replicas" +
                                            (tp > 1 ? " times " + std::to_string(tp) + " tensor-parallel ranks" : "") + " on " +
                                            (across ? "a world of " + std::to_string(transfers->size()) +
                                                          " devices over several processes (expected devices x "
                                                          "replicas" + ranks + " = the world's device count: every process's "
                                                          "devices run stages" +
                                                          idle + ")"
                                                    : "a group of " + std::to_string(group.size()) +
                                                          " (expected devices x replicas" + ranks + " = the group's size)"));
  }
  if (options.mesh)
    options.mesh->check(group, comm::DeviceMesh({{"dp", options.data_parallel}, {"tp", tp}, {"pp", schedule.devices}}), "pipeline");
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
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument, "a pipeline executor with clip_norm " + std::to_string(options.clip_norm) +
                                            " (expected 0 for no clipping, or a finite norm > 0)");
  Impl& m = *impl_;
  m.group = &group;
  // Every communicator can be made anew after a failed step (recover()), across processes by every
  // process in the order they were made.
  std::unique_ptr<comm::detail::Renewable> renewable =
      comm::detail::make_renewable(group, options.make_communicator, comm_options, std::move(transfers));
  m.renewable.push_back(renewable.get());
  m.comm = std::move(renewable);
  m.first = m.comm->first_rank();
  m.across = across;
  m.schedule = std::move(schedule);
  m.cuts = std::move(cuts);
  m.options = std::move(options);
  m.tp = tp;
  m.replicas = m.options.data_parallel * tp;
  m.mesh = comm::DeviceMesh({{"dp", m.options.data_parallel}, {"tp", tp}, {"pp", m.schedule.devices}});
  m.architecture = model.clone();
  m.make_optimizer = make_optimizer;
  m.chunks.resize(static_cast<std::size_t>(m.replicas));
  m.optimizers.resize(static_cast<std::size_t>(m.replicas));
  int const devices = m.schedule.devices;
  comm::Options const stage_options{comm::Backend::automatic, m.options.timeout};
  if (tp > 1) {  // the ranks of each replica's chunk
    for (int a = 0; a < m.options.data_parallel; ++a) {
      for (std::size_t c = 0; c < chunks; ++c) {
        std::vector<int> const ranks =
            m.mesh.group(m.mesh.rank(std::vector<int>{a, 0, m.schedule.device_of(static_cast<int>(c))}), "tp");
        if (!across) {
          m.tp_comms.push_back(m.renewable_over(ranks, stage_options));
        } else if (comm::drives_any(ranks, m.first, group.size())) {
          std::unique_ptr<comm::Communicator> first = m.options.make_subset_communicator(group, ranks, stage_options);
          if (!first)
            throw Error(Errc::invalid_argument, "the pipeline's make_subset_communicator returned no communicator "
                                                "(expected one over the chunk's tensor-parallel ranks)");
          auto made = std::make_shared<comm::detail::Renewable>(
              std::move(first), [&group, make = m.options.make_subset_communicator, ranks, stage_options]() {
                return make(group, ranks, stage_options);
              });
          m.renewable.push_back(made.get());
          m.tp_comms.push_back(std::move(made));
        } else {
          // Another process's chunk: its shards are laid out here (never run or materialized) over
          // a communicator of the same size that nothing calls.
          m.tp_comms.push_back(std::make_shared<comm::detail::HostCommunicator>(group, tp, m.comm->timeout()));
        }
      }
    }
  }
  for (int r = 0; r < m.replicas; ++r) {
    for (std::size_t c = 0; c < chunks; ++c) {
      m.chunks[static_cast<std::size_t>(r)].push_back(
          tp > 1 ? m.tensor_parallel_chunk(r, c) : model.stage(m.cuts[c], m.cuts[c + 1]));
      std::unique_ptr<optim::Optimizer> optimizer = make_optimizer(m.chunks[static_cast<std::size_t>(r)].back());
      if (!optimizer)
        throw Error(Errc::invalid_argument, "the pipeline's optimizer factory returned no optimizer for chunk " + std::to_string(c) +
                                                " of replica " + std::to_string(r) + " (expected a new optimizer from every call)");
      m.optimizers[static_cast<std::size_t>(r)].push_back(std::move(optimizer));
    }
  }
  m.tie = Impl::find_tie(m.chunks[0]);
  for (int r = 0; r < m.replicas && m.tie; ++r)  // tensor-parallel ranks' rows may differ by one
    m.tie_elements.push_back(r == 0 ? m.tie->elements : Impl::find_tie(m.chunks[static_cast<std::size_t>(r)]).value().elements);
  m.devices.resize(static_cast<std::size_t>(m.comm->size()));
  for (Impl::DeviceState& st : m.devices) {
    auto const slots = chunks * static_cast<std::size_t>(m.schedule.micro_batches);
    for (auto* v : {&st.act_in, &st.act_out, &st.grad_in, &st.grad_out}) v->resize(slots);
    st.rng_start.resize(chunks);
    st.rng_after.resize(chunks);
    st.ran_forward.assign(chunks, false);
  }
  group.run([&](int local, Device, Stream& stream) {
    nn::Context ctx{group.allocator(local), stream};
    int const rank = m.first + local;
    for (int c = m.device_in_pipeline(rank); c < m.schedule.chunks(); c += devices)
      m.chunk_of(rank, c).materialize(ctx, m.options.seed, m.options.compute);
  });
  // Each chunk's replicas: a data-parallel gradient sync over a subset communicator (across
  // processes where this process drives some of them).
  if (m.replicas > tp) {
    parallel::DataParallelOptions data;
    data.zero_stage = m.options.zero_stage;
    data.overlap = false;
    // ZeRO-2 reduces the whole gradients in place (no staging to keep small): ZeRO-1's buckets, so
    // each replica owns, clips and updates the very elements it owns at ZeRO-1.
    if (data.zero_stage == 2) data.zero3_block_units = false;
    data.compute = m.options.compute;
    data.timeline = m.options.timeline;
    for (std::vector<int> const& ranks : m.mesh.groups("dp")) {
      std::vector<int> locals, names;  // this process's ranks of the group
      for (int const rank : ranks) {
        if (!m.is_local(rank)) continue;
        locals.push_back(rank - m.first);
        names.push_back(rank);
      }
      for (int c = 0; c < m.schedule.chunks(); ++c) {
        if (locals.empty() || m.schedule.device_of(c) != m.device_in_pipeline(ranks.front())) {
          m.replica_syncs.push_back(nullptr);
          continue;
        }
        std::shared_ptr<comm::detail::Renewable> comm = m.renewable_over(ranks, stage_options);
        nn::Sequential& first = m.chunk_of(names.front(), c);
        auto& sync = *m.replica_syncs.emplace_back(std::make_unique<parallel::detail::GradientSync>(
            group, std::move(comm), locals, parallel::detail::plan_buckets(first, data), data, names));
        for (int const rank : names) sync.add_rank(m.chunk_of(rank, c));
      }
    }
  }
  if (!m.options.loss) m.options.loss = nn::default_loss();
  for (int r = 0; r < m.replicas; ++r) {
    if (tp == 1) {
      m.losses.push_back(m.options.loss);
      continue;
    }
    auto const& comm = m.tp_comms[static_cast<std::size_t>(m.data_index(r)) * chunks + chunks - 1];
    m.losses.push_back(m.options.tensor_parallel.loss(comm, m.tp_index(r)));
    if (!m.losses.back())
      throw Error(Errc::invalid_argument, "the tensor-parallel stages' loss factory returned no loss for rank " +
                                              std::to_string(m.tp_index(r)) + " (expected one from every call)");
    // The norm counts split parameters on replica 0's ranks, replicated ones on its rank 0 and a
    // tied head's copy of wte nowhere (the embedding's rows count).
    for (std::size_t c = 0; c < chunks; ++c) {
      nn::Sequential const& chunk = m.chunks[static_cast<std::size_t>(r)][c];
      if (m.options.tensor_parallel.sequence_parallel) m.partials.push_back(parallel::partial_ranges(chunk, true));
      std::vector<nn::ElementRange> ranges = parallel::norm_ranges(chunk, r < tp, r == 0);
      for (nn::ElementRange& range : ranges)
        if (m.tie && static_cast<int>(c) == m.tie->head_chunk && range.begin == m.tie->head_offset) range.counted = false;
      m.norms.push_back(std::make_unique<NormRanges>(std::move(ranges)));
    }
  }
  for (int r = 0; r < m.replicas && m.options.zero_stage > 0 && !m.replica_syncs.empty(); ++r) {
    for (int c = 0; c < m.schedule.chunks(); ++c) {
      if (!m.is_local(m.rank_at(r, m.schedule.device_of(c)))) {  // another process's
        m.sharded_updates.push_back(nullptr);
        continue;
      }
      std::vector<nn::ElementRange> counting;
      if (tp > 1) {  // split parameters on every rank, replicated ones on tensor-parallel rank 0
        counting = parallel::norm_ranges(m.chunks[static_cast<std::size_t>(r)][static_cast<std::size_t>(c)], true, m.tp_index(r) == 0);
      } else if (m.tie && c == m.tie->head_chunk) {
        counting.push_back({m.tie->head_offset, m.tie->head_offset + m.tie->elements, false});
      }
      for (nn::ElementRange& range : counting)  // a tied head's copy of wte counts in the embedding
        if (m.tie && c == m.tie->head_chunk && range.begin == m.tie->head_offset) range.counted = false;
      m.sharded_updates.push_back(std::make_unique<ShardedUpdate>(*m.replica_sync(m.rank_at(r, m.schedule.device_of(c)), c), std::move(counting)));
    }
  }
  if (m.tie) {
    int const embedding_device = m.schedule.device_of(m.tie->embedding_chunk);
    int const head_device = m.schedule.device_of(m.tie->head_chunk);
    if (embedding_device != head_device) {
      for (int r = 0; r < m.replicas; ++r) {
        std::vector<int> const ranks{m.rank_at(r, embedding_device), m.rank_at(r, head_device)};
        if (comm::drives_any(ranks, m.first, group.size())) {
          m.tie_comms.push_back(m.renewable_over(ranks, stage_options));
        } else {
          m.tie_comms.push_back(nullptr);  // another process's replica
        }
      }
    }
    // The copy starts at zero: the sum makes it the embedding's initial wte.
    group.run([&](int local, Device, Stream& stream) { m.sum_tied(m.first + local, stream, true); });
    group.synchronize();
  }
}

Executor::~Executor() = default;

std::unique_ptr<comm::detail::Renewable> Executor::Impl::renewable_over(std::vector<int> const& ranks, comm::Options options) {
  DeviceGroup* const g = group;
  parallel::SubsetCommunicatorFactory make = this->options.make_subset_communicator;  // a mesh's across processes
  if (across && !make) {
    std::string text;
    for (int const r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
    throw Error(Errc::invalid_argument, "pipeline: a communicator over world ranks {" + text +
                                            "} across processes without make_subset_communicator (expected "
                                            "dist::subset_communicator_factory(world), or a mesh)");
  }
  if (!across) {
    make = this->options.mesh ? parallel::Mesh::subset_factory(this->options.mesh)
                              : parallel::SubsetCommunicatorFactory([](DeviceGroup& devices, std::vector<int> const& members, comm::Options o) {
                                  return comm::make_communicator(devices, members, o);
                                });
  }
  auto made = std::make_unique<comm::detail::Renewable>([g, ranks, options, make] { return make(*g, ranks, options); });
  renewable.push_back(made.get());
  return made;
}

std::vector<optim::Optimizer*> Executor::Impl::replica_optimizers(std::size_t g, int c) const {
  std::vector<optim::Optimizer*> out;
  std::vector<std::vector<int>> const groups = mesh.groups("dp");
  for (int const rank : groups[g])
    if (is_local(rank)) out.push_back(optimizers[static_cast<std::size_t>(pipeline_of(rank))][static_cast<std::size_t>(c)].get());
  return out;
}

void Executor::Impl::gather_optimizer_state() {
  auto const chunks = static_cast<std::size_t>(schedule.chunks());
  for (std::size_t i = 0; i < replica_syncs.size(); ++i)
    if (replica_syncs[i]) replica_syncs[i]->gather_optimizer_state(replica_optimizers(i / chunks, static_cast<int>(i % chunks)));
}

void Executor::Impl::gather_whole() {
  for (auto const& sync : replica_syncs)
    if (sync) sync->gather_whole();
}

void Executor::Impl::shard_parameters() {
  auto const chunks = static_cast<std::size_t>(schedule.chunks());
  for (std::size_t i = 0; i < replica_syncs.size(); ++i)
    if (replica_syncs[i]) replica_syncs[i]->shard_parameters(replica_optimizers(i / chunks, static_cast<int>(i % chunks)));
}

void Executor::Impl::check_usable(char const* call) const {
  if (!broken.empty()) throw Error(Errc::invalid_argument, std::string("pipeline ") + call + ": " + broken);
}

void Executor::Impl::recover(std::exception_ptr failure, bool updated) {
  std::string const cause = describe(failure);
  try {
    group->drain();
    // The failure aborted them. Across processes a failure in one makes the others' steps fail too
    // (at the latest at their deadline), and every process makes them anew here, in the order they
    // were made; a process that is gone makes that time out.
    for (auto const& sync : replica_syncs) {  // the replicas' reduces ran on their syncs' streams
      try {
        if (sync) sync->synchronize();
      } catch (Error const&) {  // the failure, already known
      }
    }
    for (comm::detail::Renewable* comm : renewable) comm->renew();
    if (updated)
      broken = "the executor cannot be used after a step failed once its update had begun, leaving the chunks partly "
               "updated (expected load() of a checkpoint first); the step failed with " + cause;
    // The step's tensors between actions, and the chunks' RNG as the step found it (each device's
    // run_device recorded it first).
    for (int local = 0; local < group->size(); ++local) {
      int const rank = first + local;
      DeviceState& st = devices[static_cast<std::size_t>(rank)];
      for (auto* slots : {&st.act_in, &st.act_out, &st.grad_in, &st.grad_out}) std::fill(slots->begin(), slots->end(), Tensor{});
      st.compute_done = Event{};  // it may mark failed work, which the next step would wait on
      st.marks.clear(), st.kinds.clear();  // so may they
      for (int c = device_in_pipeline(rank); c < schedule.chunks(); c += schedule.devices)
        if (!st.rng_start[static_cast<std::size_t>(c)].empty()) chunk_of(rank, c).set_rng_state(st.rng_start[static_cast<std::size_t>(c)]);
    }
  } catch (Error const& e) {  // an executor that cannot be put back is as unusable as a partly updated one
    broken = "the executor cannot be used after a step failed and it could not be put back (" + std::string(e.what()) +
             "; expected load() of a checkpoint first); the step failed with " + cause;
  }
  std::rethrow_exception(failure);
}

float Executor::compute_gradients(Tensor const& x, Tensor const& labels) {
  Impl& m = *impl_;
  m.check_usable("step");
  int const mbs = m.schedule.micro_batches;
  // The batch (its ids and labels too) is checked before any action: a bad batch found inside one
  // would abort the communicator, and the step with it.
  std::vector<nn::Sequential const*> parts;
  for (nn::Sequential const& chunk : m.chunks[0]) parts.push_back(&chunk);
  nn::Loss const& loss_of_0 = *m.losses[0];
  nn::check_batch(parts, loss_of_0, x, labels, {1.0f, DType::float32, false}, "pipeline batch");
  // The loss's divisor; a batch without counted units has loss 0 and zero gradients.
  std::int64_t const units = std::max<std::int64_t>(1, loss_of_0.count(labels, m.group->stream(0)));
  int const replicas = m.replicas / m.tp;  // the data-parallel ones; a replica's pipelines see the same rows
  if (x.dim(0) < static_cast<std::int64_t>(mbs) * replicas)
    throw Error(Errc::invalid_argument, "a batch of " + std::to_string(x.dim(0)) + " rows cannot be split into " + std::to_string(replicas) +
                                            " replica(s) x " + std::to_string(mbs) +
                                            " micro-batches (expected at least one row per micro-batch)");
  // Replica r takes the r-th shard of the batch, cut into the schedule's micro-batches; each of its
  // pipelines (one per tensor-parallel rank) gets its own Step for its losses.
  std::vector<Impl::Step> steps;
  std::int64_t offset = 0;
  for (std::int64_t const shard : shard_sizes(x.dim(0), replicas)) {
    Impl::Step step{&x,
                    &labels,
                    units,
                    shard_sizes(shard, mbs),
                    {},
                    {},
                    std::vector<Tensor>(static_cast<std::size_t>(mbs)),
                    m.options.loss_scaler ? m.options.loss_scaler->scale() : 1.0f};
    for (std::int64_t n : step.sizes) {
      step.offsets.push_back(offset);
      offset += n;
    }
    step.input_shapes.resize(static_cast<std::size_t>(m.schedule.chunks()) + 1);
    for (std::int64_t n : step.sizes) {
      Shape shape = x.shape();
      shape[0] = n;
      for (std::size_t c = 0; c < m.chunks[0].size(); ++c) {
        step.input_shapes[c].push_back(shape);
        shape = m.chunks[0][c].output_shape(shape);
      }
      step.input_shapes.back().push_back(shape);
    }
    for (int t = 1; t < m.tp; ++t) steps.push_back(step);
    steps.push_back(std::move(step));
  }
  // Across processes the last stages' losses are all-gathered, every rank's micro-batch losses in
  // its slots (zeros on other stages), so every process adds them up as one process would.
  std::vector<Tensor> gathered(m.across ? static_cast<std::size_t>(m.group->size()) : 0);
  int const last_device = m.schedule.device_of(m.schedule.chunks() - 1);
  m.shard_parameters();  // zero_stage 3, where they were gathered whole (construction, a load, gather_parameters)
  m.time_tensor_parallel();
  auto const start = std::chrono::steady_clock::now();
  try {
    m.group->run([&](int local, Device, Stream& stream) {
      // A host device's actions run on its driver thread as it reaches them: a hop between devices
      // is then one wake-up (the receiver's), not a chain of handoffs between driver and stream threads.
      Stream::InlineScope const inline_work(stream);
      int const rank = m.first + local;
      Impl::Step& step = steps[static_cast<std::size_t>(m.pipeline_of(rank))];
      m.run_device(rank, stream, step);
      if (!m.across) return;
      Tensor& all = gathered[static_cast<std::size_t>(local)];
      all = Tensor::empty({static_cast<std::int64_t>(m.comm->size()) * mbs}, DType::float32, m.group->allocator(local));
      Tensor const mine = all.slice(static_cast<std::int64_t>(rank) * mbs, static_cast<std::int64_t>(rank + 1) * mbs);
      if (m.device_in_pipeline(rank) == last_device) {
        for (int k = 0; k < mbs; ++k) copy_async(mine.slice(k, k + 1), step.losses[static_cast<std::size_t>(k)], stream);
      } else {
        fill_async(mine, 0.0f, stream);
      }
      m.comm->all_gather(rank, mine, all, stream);
    });
  } catch (...) {  // nothing was updated: the executor goes on as if the step had not been called
    m.recover(std::current_exception(), false);
  }
  m.last_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  m.report_times();  // the streams are done: group->run() synchronized them
  double loss = 0;
  for (int r = 0; r < replicas; ++r) {  // the replica's first pipeline's last stage
    int const last_rank = m.mesh.rank(std::vector<int>{r, 0, last_device});
    Impl::Step const& step = steps[static_cast<std::size_t>(m.pipeline_of(last_rank))];
    for (std::size_t k = 0; k < step.losses.size(); ++k) {
      auto const i = static_cast<std::int64_t>(last_rank) * mbs + static_cast<std::int64_t>(k);
      loss += m.across ? ops::item(gathered[0].slice(i, i + 1), m.group->stream(0))
                       : ops::item(step.losses[k], m.group->stream(last_rank));
    }
  }
  return static_cast<float>(loss);
}

float Executor::step(Tensor const& x, Tensor const& labels, float lr_scale) {
  if (!(lr_scale >= 0 && std::isfinite(lr_scale)))
    throw Error(Errc::invalid_argument, "pipeline step: lr_scale " + std::to_string(lr_scale) + " (expected a finite lr_scale >= 0)");
  float const loss = compute_gradients(x, labels);
  Impl& m = *impl_;
  // Every chunk of every replica. The replicas' reduced gradients are equal, so replica 0's alone
  // count in the global norm, and the tied copy of wte counts once, in the embedding's chunk. With
  // tensor-parallel stages every pipeline is a replica here, counting its norm ranges.
  std::vector<nn::UpdatePart> parts;
  for (int r = 0; r < m.replicas; ++r) {
    for (int c = 0; c < m.schedule.chunks(); ++c) {
      int const rank = m.rank_at(r, m.schedule.device_of(c));
      if (!m.is_local(rank)) continue;  // another process updates it
      nn::Sequential& chunk = m.chunk_of(rank, c);
      nn::UpdatePart part{&chunk, m.optimizers[static_cast<std::size_t>(r)][static_cast<std::size_t>(c)].get(),
                          &m.group->allocator(rank - m.first), &m.group->stream(rank - m.first)};
      if (!m.sharded_updates.empty()) {  // zero_stage 1, 2: the replica's blocks
        part = m.sharded_updates[static_cast<std::size_t>(r * m.schedule.chunks() + c)]->update_part(part);
        m.replica_sync(rank, c)->shard_optimizer_state(*part.optimizer, *part.allocator, *part.stream);
      } else if (m.tp > 1) {
        part = m.norms[static_cast<std::size_t>(r * m.schedule.chunks() + c)]->update_part(part);
      } else if (r > 0) {
        part.shared_end = chunk.master_gradients().numel();
      } else if (m.tie && c == m.tie->head_chunk) {
        part.shared_begin = m.tie->head_offset;
        part.shared_end = m.tie->head_offset + m.tie->elements;
      }
      parts.push_back(part);
    }
  }
  optim::LossScaler* const scaler = m.options.loss_scaler ? &*m.options.loss_scaler : nullptr;
  std::optional<optim::LossScaler::State> const scaler_before = scaler != nullptr ? std::optional(scaler->state()) : std::nullopt;
  std::vector<std::int64_t> steps_before;
  for (nn::UpdatePart const& part : parts) steps_before.push_back(part.optimizer->steps());
  try {
    // Across processes, and with ZeRO in one process too (the same sums as across them), the
    // overflow count and the norm are the world's (world_total).
    nn::PartTotal total;
    if (m.across || !m.sharded_updates.empty())
      total = [&m, &parts](std::span<Tensor const> sums) { return m.world_total(parts, sums); };
    m.last_applied = nn::apply_update(parts, {lr_scale, m.options.clip_norm, scaler, false}, total);
    // step() returns with the chunks updated, as when each device's thread ran its update inline:
    // the update enqueued from this thread runs on the streams' workers.
    m.group->synchronize();
  } catch (...) {
    // Refused before any optimizer stepped (gradients holding NaN with clipping): nothing changed.
    bool updated = false;
    for (std::size_t i = 0; i < parts.size(); ++i) updated = updated || parts[i].optimizer->steps() != steps_before[i];
    if (!updated && scaler != nullptr) scaler->set_state(*scaler_before);
    m.recover(std::current_exception(), updated);
  }
  return loss;
}

bool Executor::last_step_applied() const noexcept { return impl_->last_applied; }
optim::LossScaler const* Executor::loss_scaler() const noexcept {
  return impl_->options.loss_scaler ? &*impl_->options.loss_scaler : nullptr;
}

Schedule const& Executor::schedule() const noexcept { return impl_->schedule; }
std::vector<std::size_t> const& Executor::cuts() const noexcept { return impl_->cuts; }
double Executor::last_step_seconds() const noexcept { return impl_->last_seconds; }

nn::Sequential& Executor::chunk(int c, int replica) {
  if (c < 0 || c >= impl_->schedule.chunks() || replica < 0 || replica >= impl_->replicas)
    throw Error(Errc::invalid_argument, "chunk " + std::to_string(c) + " of replica " + std::to_string(replica) + " (expected chunk in [0, " +
                                            std::to_string(impl_->schedule.chunks()) + ") and replica in [0, " +
                                            std::to_string(impl_->replicas) + "))");
  int const rank = impl_->rank_at(replica, impl_->schedule.device_of(c));
  if (!impl_->is_local(rank))
    throw Error(Errc::invalid_argument,
                "chunk " + std::to_string(c) + " of replica " + std::to_string(replica) + " runs on world rank " +
                    std::to_string(rank) + ", another process's (expected a chunk on this process's ranks [" +
                    std::to_string(impl_->first) + ", " + std::to_string(impl_->first + impl_->group->size()) + "))");
  return impl_->chunks[static_cast<std::size_t>(replica)][static_cast<std::size_t>(c)];
}

}  // namespace mgpu::pipeline
