// DataParallel's gradient sync: bucket planning, each rank's bucketed reduce overlapped with
// backward through a communication stream, the sharded update's blocks, and the bfloat16 comm hook.
#include "parallel/gradient_sync.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/trace/timeline.hpp>

#include "core/backend.hpp"

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

}  // namespace mgpu::parallel

namespace mgpu::parallel::detail {
namespace {
std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void check_zero_stage(DataParallelOptions const& options, std::string const& who, int max_stage, bool whole_gradients) {
  static char const* const stages[] = {"0, replicated update", "1, sharded update and optimizer state", "2, sharded gradients too",
                                       "3, sharded parameters too"};
  if (options.zero_stage < 0 || options.zero_stage > max_stage) {
    std::string expected;
    for (int s = 0; s <= max_stage; ++s) expected += (s == 0 ? "" : s == max_stage ? ", or " : ", ") + std::string(stages[s]);
    throw Error(Errc::invalid_argument, who + ": zero_stage " + std::to_string(options.zero_stage) + " (expected " + expected + ")");
  }
  if (options.zero_stage >= 2) {
    std::string const stage = who + ": zero_stage " + std::to_string(options.zero_stage);
    if (options.comm_hook)
      throw Error(Errc::invalid_argument, stage + " with the comm hook " + options.comm_hook->name() +
                                              " (expected none: a hook reduces whole buckets, which sharded gradients do not keep)");
    if (!options.overlap && !whole_gradients)
      throw Error(Errc::invalid_argument,
                  stage + " without overlap (expected overlap on: each bucket is reduced as soon as "
                          "backward has written it, so the next buckets can reuse its staging buffer)");
  }
}

std::vector<Bucket> plan_buckets(nn::Sequential const& model, std::size_t first_cap_bytes, std::size_t cap_bytes) {
  return plan_buckets(model.parameter_ranges(), first_cap_bytes, cap_bytes);
}

std::vector<Bucket> plan_buckets(std::vector<nn::ParameterRange> const& ranges, std::size_t first_cap_bytes, std::size_t cap_bytes) {
  auto const bytes = [](std::int64_t begin, std::int64_t end) { return static_cast<std::size_t>(end - begin) * sizeof(float); };
  std::vector<Bucket> buckets;
  for (auto r = ranges.rbegin(); r != ranges.rend(); ++r) {
    if (!buckets.empty() && bytes(r->begin, buckets.back().end) <= (buckets.size() == 1 ? first_cap_bytes : cap_bytes)) {
      buckets.back().first_layer = r->layer;  // the layer joins the open bucket
      buckets.back().begin = r->begin;
    } else {
      buckets.push_back({r->layer, r->layer, r->begin, r->end});
    }
  }
  return buckets;
}

std::vector<Bucket> plan_units(nn::Sequential const& model) { return plan_units(model.structure_parts(), model.parameter_ranges()); }

std::vector<Bucket> plan_units(std::vector<std::pair<std::size_t, std::size_t>> const& parts,
                               std::vector<nn::ParameterRange> const& ranges) {
  std::vector<Bucket> units;
  for (auto const& [first, end] : parts) {
    Bucket unit{};
    bool any = false;
    for (nn::ParameterRange const& r : ranges) {
      if (r.layer < first || r.layer >= end) continue;
      if (!any) unit.first_layer = r.layer, unit.begin = r.begin;
      unit.last_layer = r.layer, unit.end = r.end;
      any = true;
    }
    if (any) units.push_back(unit);
  }
  std::reverse(units.begin(), units.end());
  return units;
}

std::vector<Bucket> plan_buckets(nn::Sequential const& model, DataParallelOptions const& options) {
  return plan_buckets(model.structure_parts(), model.parameter_ranges(), options);
}

std::vector<Bucket> plan_buckets(std::vector<std::pair<std::size_t, std::size_t>> const& parts,
                                 std::vector<nn::ParameterRange> const& ranges, DataParallelOptions const& options) {
  if (options.zero_stage >= 2 && options.zero3_block_units) return plan_units(parts, ranges);
  return plan_buckets(ranges, options.first_bucket_cap_bytes, options.bucket_cap_bytes);
}

RankSync::RankSync(detail::GradientSync& sync, int rank, nn::Sequential& model, Stream comm_stream)
    : sync_(sync),
      rank_(rank),
      model_(model),
      comm_stream_(std::move(comm_stream)),
      bucket_events_(sync.buckets_.size()),
      params_gathered_(sync.buckets_.size()) {}

void RankSync::begin(Stream& compute, nn::RangeUpdate update) {
  update_ = std::move(update);
  next_ = 0;
  if (sync_.shard_gradients_ && !last_held_) {  // the last bucket's staging, which its reduce gives back
    mgpu::detail::BufferInternals::acquire_memory(staging_last_, static_cast<std::size_t>(staging_last_.numel()) * sizeof(float),
                                                  allocator(), compute);
    last_held_ = true;
  }
}

void RankSync::release_owned_gradients() {
  if (!owned_held_) return;
  mgpu::detail::BufferInternals::record_use(sync_.group_.stream(sync_.local(rank_)), owned_grads_);
  mgpu::detail::BufferInternals::record_use(comm_stream_, owned_grads_);
  mgpu::detail::BufferInternals::release_memory(owned_grads_);
  owned_held_ = false;
}

void RankSync::ready(nn::ParameterRange const& range, Stream& compute) {
  std::vector<Bucket> const& buckets = sync_.buckets_;
  if (next_ < buckets.size() && range.layer == buckets[next_].first_layer) {
    if (sync_.overlap_) launch(next_, compute);
    ++next_;
    // Sharded gradients: the next bucket's layers write into the staging buffer that bucket
    // next_ - 2 used, once its reduce has read it (the last bucket has its own).
    if (sync_.shard_gradients_ && !sync_.shard_parameters_ && next_ >= 2 && next_ + 1 < buckets.size())
      staging_free_[next_ % 2].wait(compute);
  }
}

void RankSync::finish(Stream& compute) {
  if (!sync_.overlap_) {
    for (std::size_t b = 0; b < sync_.buckets_.size(); ++b) launch(b, compute);
  }
  if (sync_.whole_gradients_) pack_owned_in_place();
  update_ = nullptr;  // the step's update is valid during the step only
  backward_end_.record(compute);
  bool const host = compute.device().kind == DeviceKind::host;
  if (host) compute.enqueue([marks = wait_marks_] { (*marks)[0] = now_ns(); });
  done_.record(comm_stream_);
  auto const wait = [&] { done_.wait(compute); };
  if (sync_.timeline_ && sync_.timeline_->enabled()) {
    sync_.timeline_->stream_span(compute, "wait for reduces", "communication", sync_.trace_ranks_[static_cast<std::size_t>(rank_)],
                                 trace::Lane::compute, wait);
  } else {
    wait();
  }
  if (host) compute.enqueue([marks = wait_marks_] { (*marks)[1] = now_ns(); });
}

double RankSync::wait_ms() const noexcept { return static_cast<double>((*wait_marks_)[1] - (*wait_marks_)[0]) * 1e-6; }

void RankSync::launch(std::size_t bucket, Stream& compute) {
  comm::Communicator& comm = *sync_.comm_;
  // Plain variables, not a structured binding: Clang before 16 cannot capture those.
  std::int64_t const begin = sync_.buckets_[bucket].begin;
  std::int64_t const end = sync_.buckets_[bucket].end;
  bucket_events_[bucket].record(compute);
  bucket_events_[bucket].wait(comm_stream_);
  // A staging buffer with sharded gradients. With sharded parameters a unit's staging memory goes
  // back as soon as its reduce is enqueued: the work gets a view that does not hold it (a
  // communicator's work may read a tensor's memory when it runs), its use recorded below.
  bool const last = bucket + 1 == sync_.buckets_.size();
  bool const transient = sync_.shard_gradients_ && !sync_.whole_gradients_ && (sync_.shard_parameters_ || last);
  if (transient && !last && sixteen()) {  // the layers' compute-type gradients are unscaled into the staging memory: done with
    Tensor const& computed = unit_compute_grads_[bucket];
    mgpu::detail::BufferInternals::record_use(compute, computed);
    mgpu::detail::BufferInternals::release_memory(computed);
  }
  Tensor const staged = model_.master_gradients(begin, end);
  Tensor const grads = transient ? mgpu::detail::BufferInternals::unowned(staged) : staged;
  std::shared_ptr<trace::Timeline> const& timeline = sync_.timeline_;
  bool const traced = timeline && timeline->enabled();
  int const who = sync_.trace_ranks_[static_cast<std::size_t>(rank_)];
  auto const span = [&](std::string name, auto&& enqueue) {
    if (traced) {
      timeline->stream_span(comm_stream_, std::move(name) + " bucket " + std::to_string(bucket), "communication", who,
                            trace::Lane::communication, enqueue);
    } else {
      enqueue();
    }
  };
  auto const mark_reduced = [this] { comm_stream_.enqueue([this] { reduced_.store(true, std::memory_order_relaxed); }); };
  CommHook* const hook = sync_.hook_.get();
  bool const gather_to_sum = sync_.deterministic_ && comm.backend() != comm::Backend::host;
  // With the sharded update and a plain sum, the bucket is reduce-scattered.
  std::int64_t const block = sync_.blocks_[bucket];
  bool const scatter = block > 0 && hook == nullptr && !gather_to_sum;
  if (!scatter) {
    span("all-reduce", [&] {
      if (hook != nullptr) {
        hook->reduce(comm, rank_, static_cast<int>(bucket), grads, sync_.group_.allocator(sync_.local(rank_)), comm_stream_);
      } else if (gather_to_sum && comm.size() > 1) {
        std::int64_t const n = grads.numel();
        if (!gathered_.defined() || gathered_.numel() < n * comm.size())
          gathered_ = Tensor::empty({n * comm.size()}, DType::float32, sync_.group_.allocator(sync_.local(rank_)));
        comm.all_gather(rank_, grads, gathered_.slice(0, n * comm.size()), comm_stream_);
        copy_async(grads, gathered_.slice(0, n), comm_stream_);
        for (int r = 1; r < comm.size(); ++r) ops::add_scaled(grads, gathered_.slice(r * n, (r + 1) * n), 1.0f, comm_stream_);
      } else {
        comm.all_reduce(rank_, grads, grads, comm::ReduceOp::sum, comm_stream_);
      }
    });
    mark_reduced();
  }
  // Sharded update: this rank's block of the bucket is reduced and updated, then every rank's
  // updated block is gathered. The few elements past the blocks (fewer than the ranks) are reduced
  // and updated everywhere.
  int const n = comm.size();
  std::int64_t const mine = rank_ * block;
  std::int64_t const body = block * n;
  if (scatter) {
    span("reduce-scatter", [&] {
      comm.reduce_scatter(rank_, grads.slice(0, body), grads.slice(mine, mine + block), comm::ReduceOp::sum, comm_stream_);
      if (body < grads.numel()) comm.all_reduce(rank_, grads.slice(body, grads.numel()), grads.slice(body, grads.numel()), comm::ReduceOp::sum, comm_stream_);
    });
    mark_reduced();
  }
  if (sync_.shard_gradients_ && !sync_.whole_gradients_) {  // the owned pieces leave the staging buffer, which the bucket after next reuses
    if (!owned_held_) {  // the step's first reduce: the owned gradients' memory comes (see release_owned_gradients())
      mgpu::detail::BufferInternals::acquire_memory(owned_grads_, static_cast<std::size_t>(owned_grads_.numel()) * sizeof(float),
                                                    allocator(), comm_stream_);
      owned_held_ = true;
    }
    for (Piece const& p : pieces_[bucket]) {
      Tensor const from = grads.slice(p.begin - begin, p.end - begin);
      Tensor const to = owned_grads_.slice(p.at, p.at + (p.end - p.begin));
      if (accumulate_) {
        ops::add_scaled(to, from, 1.0f, comm_stream_);
      } else {
        copy_async(to, from, comm_stream_);
      }
    }
    if (transient) {  // the unit's (or the last bucket's) staging memory goes back once the reduce has read it
      mgpu::detail::BufferInternals::record_use(comm_stream_, staged);
      mgpu::detail::BufferInternals::release_memory(staged);
      if (last) last_held_ = false;
    } else {
      staging_free_[bucket % 2].record(comm_stream_);
    }
  }
  if (!update_) return;  // the step updates after finish(): apply_update, over owned()
  if (block == 0) {
    update_(begin, end, comm_stream_);
    return;
  }
  update_(begin + mine, begin + mine + block, comm_stream_);
  if (body < grads.numel()) update_(begin + body, end, comm_stream_);
  if (!sync_.shard_parameters_) gather_bucket(bucket, comm_stream_);  // else the next forward gathers
}

void RankSync::gather_bucket(std::size_t bucket, Stream& stream) {
  int const n = sync_.comm_->size();
  std::int64_t const block = sync_.blocks_[bucket];
  std::int64_t const begin = sync_.buckets_[bucket].begin;
  Tensor const params = model_.master_parameters().slice(begin, begin + n * block);
  traced(stream, "all-gather bucket " + std::to_string(bucket), [&] {
    sync_.comm_->all_gather(rank_, params.slice(rank_ * block, (rank_ + 1) * block), params, stream);
    model_.sync_parameters(stream, begin, begin + n * block);
  });
}

void RankSync::traced(Stream& stream, std::string const& name, std::function<void()> const& enqueue) {
  std::shared_ptr<trace::Timeline> const& timeline = sync_.timeline_;
  if (timeline && timeline->enabled()) {
    timeline->stream_span(stream, name, "communication", sync_.trace_ranks_[static_cast<std::size_t>(rank_)],
                          trace::Lane::communication, enqueue);
  } else {
    enqueue();
  }
}

Allocator& RankSync::allocator() const { return sync_.group_.allocator(sync_.local(rank_)); }

std::vector<nn::ElementRange> RankSync::owned() const {
  std::vector<nn::ElementRange> out;
  // Without blocks every rank updates everything; with sharded gradients it still lists them, as
  // where the owned gradients are.
  if (!sync_.shard_gradients_ &&
      std::all_of(sync_.blocks_.begin(), sync_.blocks_.end(), [](std::int64_t block) { return block == 0; }))
    return out;
  int const n = sync_.comm_->size();
  for (std::size_t b = 0; b < sync_.buckets_.size(); ++b) {
    Bucket const& bucket = sync_.buckets_[b];
    std::int64_t const block = sync_.blocks_[b];
    if (block == 0) {  // all-reduced: every rank updates it, rank 0 counts it
      out.push_back({bucket.begin, bucket.end, rank_ == 0});
      continue;
    }
    out.push_back({bucket.begin + rank_ * block, bucket.begin + (rank_ + 1) * block, true});
    out.push_back({bucket.begin + n * block, bucket.end, rank_ == 0});  // the leftovers, maybe none
  }
  return out;
}

void RankSync::pack_owned_in_place() {
  // Every bucket is reduced in place: the owned pieces move, by increasing start, to their packed
  // places at the front of the whole buffer. A piece's place starts at or before the piece (the
  // pieces before it in the packing are no longer), so a move never overwrites a piece still to
  // move; one that overlaps its own place moves in steps of the distance, which do not overlap.
  std::vector<Piece> pieces;
  for (std::vector<Piece> const& bucket : pieces_) pieces.insert(pieces.end(), bucket.begin(), bucket.end());
  std::sort(pieces.begin(), pieces.end(), [](Piece const& a, Piece const& b) { return a.begin < b.begin; });
  Tensor const& whole = model_.master_gradients();
  for (Piece const& p : pieces) {
    std::int64_t const step = p.begin - p.at;
    if (step <= 0) continue;  // already in place
    for (std::int64_t from = p.begin; from < p.end; from += step) {
      std::int64_t const to = from - step;
      std::int64_t const count = std::min(step, p.end - from);
      copy_async(whole.slice(to, to + count), whole.slice(from, from + count), comm_stream_);
    }
  }
}

void RankSync::shard_gradients(Allocator& allocator, Stream& stream) {
  std::vector<Bucket> const& buckets = sync_.buckets_;
  Bucket const& last = buckets.back();
  for (nn::ParameterRange const& r : sync_.whole_gradients_ ? std::vector<nn::ParameterRange>{} : model_.parameter_ranges()) {
    auto const* embedding = dynamic_cast<nn::Embedding const*>(&model_.layer(r.layer));
    if (embedding != nullptr && embedding->tied() && r.begin < last.begin)
      throw Error(Errc::invalid_argument,
                  "DataParallel: zero_stage " + std::to_string(sync_.stage_) + " with the tied token embedding (layer " + std::to_string(r.layer) +
                      ") outside the last gradient bucket (expected it among the first layers, in the bucket reduced last, "
                      "whose staging buffer its LM head writes at the start of backward)");
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> sorted;
  for (nn::ElementRange const& r : owned())
    if (r.begin < r.end) sorted.emplace_back(r.begin, r.end);
  std::sort(sorted.begin(), sorted.end());
  std::int64_t total = 0;
  for (auto const& [b, e] : sorted) total += e - b;
  auto const packed_at = [&](std::int64_t begin) {
    std::int64_t at = 0;
    for (auto const& [b, e] : sorted)
      if (b < begin) at += e - b;
    return at;
  };
  int const n = sync_.comm_->size();
  pieces_.assign(buckets.size(), {});
  std::int64_t staging = 0;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    Bucket const& bucket = buckets[b];
    std::int64_t const block = sync_.blocks_[b];
    std::int64_t const body = block * n;
    if (block > 0) pieces_[b].push_back({bucket.begin + rank_ * block, bucket.begin + (rank_ + 1) * block, 0});
    if (body < bucket.size()) pieces_[b].push_back({bucket.begin + body, bucket.end, 0});
    for (Piece& p : pieces_[b]) p.at = packed_at(p.begin);
    if (b + 1 < buckets.size()) staging = std::max(staging, bucket.size());
  }
  if (sync_.whole_gradients_) {  // the layers write the model's whole buffer, whose front finish() packs them in
    owned_grads_ = model_.master_gradients().slice(0, total);
    owned_held_ = false;  // a view of the model's buffer, whose memory is not the sync's to release
    return;
  }
  owned_grads_ = ops::zeros({total}, allocator, stream);
  staging_last_ = Tensor::empty({last.size()}, DType::float32, allocator);
  model_.bind_gradients(last.begin, last.end, staging_last_);
  if (sync_.shard_parameters_) {  // a staging buffer per unit, whose memory comes and goes (enter_backward(), launch())
    unit_grads_.assign(buckets.size() - 1, Tensor{});
    for (std::size_t b = 0; b + 1 < buckets.size(); ++b) {
      unit_grads_[b] = Tensor::empty({buckets[b].size()}, DType::float32, allocator, stream);
      model_.bind_gradients(buckets[b].begin, buckets[b].end, unit_grads_[b]);
      mgpu::detail::BufferInternals::release_memory(unit_grads_[b]);
    }
    if (!sixteen()) return;
    // 16-bit compute: the layers write compute-type gradients, per unit as well (the last unit's stay).
    unit_compute_grads_.assign(buckets.size(), Tensor{});
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      unit_compute_grads_[b] = Tensor::empty({buckets[b].size()}, model_.compute_type(), allocator, stream);
      model_.bind_gradients(buckets[b].begin, buckets[b].end, unit_compute_grads_[b]);
      if (b + 1 < buckets.size()) mgpu::detail::BufferInternals::release_memory(unit_compute_grads_[b]);
    }
    fill_async(unit_compute_grads_.back(), 0.0f, stream);
    return;
  }
  for (std::size_t slot = 0; slot < staging_.size() && slot + 1 < buckets.size(); ++slot)
    staging_[slot] = Tensor::empty({staging}, DType::float32, allocator);
  for (std::size_t b = 0; b + 1 < buckets.size(); ++b)
    model_.bind_gradients(buckets[b].begin, buckets[b].end, staging_[b % 2].slice(0, buckets[b].size()));
}

void RankSync::shard_optimizer_state(optim::Optimizer& optimizer, Allocator& allocator, Stream& stream) const {
  if (!whole_) return;  // sharded with the parameters
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (nn::ElementRange const& r : owned()) ranges.emplace_back(r.begin, r.end);
  if (ranges.empty()) return;
  std::sort(ranges.begin(), ranges.end());  // buckets run last layers first
  optimizer.set_state_ranges(model_.master_parameters(), std::move(ranges), allocator, stream);
}

void RankSync::sum_over_ranks(Tensor const& values, Stream& compute) {
  sync_.comm_->all_reduce(rank_, values, values, comm::ReduceOp::sum, compute);
}

nn::UpdatePart RankSync::update_part(nn::UpdatePart part) {
  part.ranges = owned();
  part.gradients = owned_grads_;
  part.parameters = owned_params_;
  if (part.ranges.empty()) return part;
  part.combine = [this](Tensor const& values, Stream& compute) { sum_over_ranks(values, compute); };
  part.after = [this](Stream& compute) { gather_updated(compute); };
  return part;
}

void RankSync::gather_updated(Stream& compute) {
  if (sync_.shard_parameters_) return;  // the next forward gathers the owned parameters
  for (std::size_t b = 0; b < sync_.buckets_.size(); ++b)
    if (sync_.blocks_[b] > 0) gather_bucket(b, compute);
}

namespace {
std::vector<int> iota(int n) {
  std::vector<int> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = i;
  return out;
}
}  // namespace

GradientSync::GradientSync(DeviceGroup& group, std::vector<Bucket> buckets, DataParallelOptions const& options,
                           std::vector<int> trace_ranks)
    : GradientSync(group, comm::detail::make_renewable(group, options.make_communicator, options.comm), iota(group.size()),
                   std::move(buckets), options, std::move(trace_ranks)) {
  // Across processes the group's indices are named after the world's ranks.
  int const first = comm_->first_rank();
  for (std::size_t l = 0; l < trace_ranks.size(); ++l) trace_ranks_[static_cast<std::size_t>(first) + l] += first;
}

GradientSync::GradientSync(DeviceGroup& group, std::shared_ptr<comm::detail::Renewable> comm, std::vector<int> locals,
                           std::vector<Bucket> buckets, DataParallelOptions const& options, std::vector<int> trace_ranks)
    : group_(group),
      buckets_(std::move(buckets)),
      blocks_(buckets_.size(), 0),
      overlap_(options.overlap),
      deterministic_(options.deterministic),
      hook_(options.comm_hook),
      timeline_(options.timeline),
      comm_(std::move(comm)),
      locals_(std::move(locals)) {
  int const n = comm_->size();
  int const first = comm_->first_rank();
  if (n != static_cast<int>(locals_.size())) {  // across processes
    if (deterministic_ && comm_->backend() != comm::Backend::host)
      throw Error(Errc::invalid_argument, "DataParallel: deterministic mode across processes on the " +
                                              std::string(comm::to_string(comm_->backend())) +
                                              " backend (expected the host backend)");
  }
  // Indexed by communicator rank, as the ranks' syncs are: this process's entries name its used ranks.
  trace_ranks_.resize(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) trace_ranks_[static_cast<std::size_t>(r)] = r;
  for (std::size_t l = 0; l < trace_ranks.size(); ++l)
    trace_ranks_[static_cast<std::size_t>(first) + l] = trace_ranks[l];
  if (options.zero_stage >= 1 && n > 1) {
    for (std::size_t b = 0; b < buckets_.size(); ++b) blocks_[b] = buckets_[b].size() / n;
  }
  stage_ = options.zero_stage;
  shard_gradients_ = options.zero_stage >= 2 && n > 1;
  shard_parameters_ = options.zero_stage >= 3 && n > 1;
  whole_gradients_ = shard_gradients_ && !overlap_;
  if (hook_) {
    std::vector<std::int64_t> sizes;
    for (Bucket const& b : buckets_) sizes.push_back(b.size());
    hook_->attach(n, sizes);
  }
}

void GradientSync::add_rank(nn::Sequential& model) {
  int const index = static_cast<int>(ranks_.size());
  int const local = locals_.at(ranks_.size());
  ranks_.push_back(std::make_unique<RankSync>(*this, comm_->first_rank() + index, model, group_.make_stream(local)));
  if (shard_gradients_) ranks_.back()->shard_gradients(group_.allocator(local), group_.stream(local));
}

void GradientSync::renew_communicator() { comm_->renew(); }

void GradientSync::run(std::function<void(std::size_t i, Stream& stream)> const& fn) {
  group_.run([&](int local, Device, Stream& stream) {
    auto const at = std::find(locals_.begin(), locals_.end(), local);
    if (at != locals_.end()) fn(static_cast<std::size_t>(at - locals_.begin()), stream);
  });
}

void GradientSync::start_step(bool accumulate) {
  for (auto const& r : ranks_) {
    r->reduced_.store(false, std::memory_order_relaxed);
    r->accumulate_ = accumulate;
    if (!accumulate) r->release_owned_gradients();  // the last update has read them
  }
}

void GradientSync::synchronize() {
  // Every stream, also past a failed one: synchronize() clears a stream's failure, which would
  // otherwise mark all its later work failed.
  std::exception_ptr first;
  for (auto const& r : ranks_) {
    try {
      r->comm_stream_.synchronize();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void GradientSync::gather_optimizer_state(std::vector<optim::Optimizer*> const& optimizers) {
  gather_whole();  // whole state, whole parameters (set_state_ranges below reads the model's buffer)
  if (std::all_of(optimizers.begin(), optimizers.end(), [](optim::Optimizer const* o) { return o->state_ranges().empty(); }))
    return;
  int const n = comm_->size();
  run([&](std::size_t i, Stream& stream) {
    int const rank = comm_->first_rank() + static_cast<int>(i);
    optim::Optimizer& optimizer = *optimizers[i];
    optimizer.set_state_ranges(ranks_[i]->model_.master_parameters(), {}, group_.allocator(locals_[i]), stream);
    for (auto const& named : optimizer.state()) {
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        std::int64_t const block = blocks_[b];
        if (block == 0) continue;
        Tensor const part = named.second.slice(buckets_[b].begin, buckets_[b].begin + block * n);
        comm_->all_gather(rank, part.slice(rank * block, (rank + 1) * block), part, stream);
      }
    }
  });
  group_.synchronize();
}

void GradientSync::gather_whole() {
  if (!shard_parameters_) return;
  run([&](std::size_t i, Stream& stream) { ranks_[i]->gather_whole(group_.allocator(locals_[i]), stream); });
  group_.synchronize();
}

void GradientSync::shard_parameters(std::vector<optim::Optimizer*> const& optimizers) {
  if (!shard_parameters_) return;
  run([&](std::size_t i, Stream& stream) {
    ranks_[i]->shard_parameters(*optimizers[i], group_.allocator(locals_[i]), stream);
  });
  group_.synchronize();
}

bool GradientSync::copy_hook_state(Tensor const& rows) {
  std::int64_t const count = rows.numel() / static_cast<std::int64_t>(ranks_.size());
  bool any = false;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      Tensor const values = hook_->state(comm_->first_rank() + r, static_cast<int>(b));  // the hook's ranks: the world's
      if (!values.defined()) continue;
      any = true;
      copy_async(rows.slice(r * count + buckets_[b].begin, r * count + buckets_[b].end), values,
                 group_.stream(locals_[static_cast<std::size_t>(r)]));
    }
  }
  return any;
}

void GradientSync::set_hook_state(int rank, Tensor const& values) {
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    hook_->set_state(comm_->first_rank() + rank, static_cast<int>(b), values.slice(buckets_[b].begin, buckets_[b].end),
                    group_.allocator(locals_.at(static_cast<std::size_t>(rank))),
                     this->rank(rank).comm_stream_);
  }
}

}  // namespace mgpu::parallel::detail
