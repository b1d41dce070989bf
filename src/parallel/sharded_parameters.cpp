// ZeRO-3's side of the gradient sync (see gradient_sync.hpp): each rank's owned parameters, the
// units' buffers the layers read, their gathers before forward and backward reach them, their
// prefetch and release, and the whole model gathered back (checkpoints, evaluation).
#include "parallel/gradient_sync.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace mgpu::parallel::detail {

void RankSync::gather_parameters(std::size_t bucket, Tensor const& buffer, Stream& stream, bool transient) {
  // A unit's buffer, whose memory goes once forward or backward is done with the unit: the work
  // gets a view that does not hold it, its use recorded when it goes (release_parameters()).
  Tensor const into = transient ? mgpu::detail::BufferInternals::unowned(buffer) : buffer;
  std::int64_t const block = sync_.blocks_[bucket];
  std::int64_t const begin = sync_.buckets_[bucket].begin;
  int const n = sync_.comm_->size();
  traced(stream, "all-gather parameters bucket " + std::to_string(bucket), [&] {
    for (Piece const& p : pieces_[bucket]) {
      Tensor const mine = owned_params_.slice(p.at, p.at + (p.end - p.begin));
      if (block > 0 && p.begin == begin + rank_ * block) {  // the rank's block: every rank's gathered
        sync_.comm_->all_gather(rank_, mine, into.slice(0, n * block), stream);
      } else {  // the leftovers, which every rank holds
        copy_async(into.slice(p.begin - begin, p.end - begin), mine, stream);
      }
    }
  });
}

Tensor RankSync::parameter_buffer(std::size_t bucket) const {
  if (bucket + 1 == sync_.buckets_.size()) return params_last_;
  return unit_params_[bucket];
}

void RankSync::prefetch(std::size_t bucket) {
  // The last unit's buffer keeps its memory, but when gathered per pass (without overlap).
  bool const last = bucket + 1 == sync_.buckets_.size() && !sync_.whole_gradients_;
  Tensor const into = parameter_buffer(bucket);
  auto const acquire = [&](Tensor const& t) {
    mgpu::detail::BufferInternals::acquire_memory(t, static_cast<std::size_t>(t.numel()) * size_of(t.dtype()), allocator(), comm_stream_);
  };
  if (!sixteen()) {
    if (!last) acquire(into);
    gather_parameters(bucket, into, comm_stream_, !last);
    params_gathered_[bucket].record(comm_stream_);
    return;
  }
  // 16-bit compute: the float32 parameters are gathered into staging memory, which goes back once
  // they are rounded into the compute-type copy the layers read.
  Tensor const& computed = unit_compute_params_[bucket];
  acquire(into);
  if (!last) acquire(computed);
  gather_parameters(bucket, into, comm_stream_, true);
  Tensor const to = last ? computed : mgpu::detail::BufferInternals::unowned(computed);
  convert_async(to, mgpu::detail::BufferInternals::unowned(into), comm_stream_);
  mgpu::detail::BufferInternals::record_use(comm_stream_, into);
  mgpu::detail::BufferInternals::release_memory(into);
  params_gathered_[bucket].record(comm_stream_);
}

void RankSync::release_parameters(std::size_t bucket, Stream& compute) {
  Tensor const params = sixteen() ? unit_compute_params_[bucket] : parameter_buffer(bucket);
  mgpu::detail::BufferInternals::record_use(compute, params);  // what the layers enqueued reads it
  mgpu::detail::BufferInternals::record_use(comm_stream_, params);
  mgpu::detail::BufferInternals::release_memory(params);
}

void RankSync::before_layer(std::size_t layer, bool backward, Stream& compute) {
  if (!sync_.shard_parameters_) {
    if (sync_.unit_compute_grads_ && sixteen()) unit_compute_gradients_before(layer, backward, compute);
    return;
  }
  std::vector<Bucket> const& buckets = sync_.buckets_;
  std::size_t const count = buckets.size();
  if (sync_.whole_gradients_) {  // without overlap: begin_pass() started the pass
    if (whole_) return;
    if (backward) {
      while (backward_entered_ < count && layer <= buckets[backward_entered_].last_layer)
        enter_in_pass(backward_entered_++, true, compute);
    } else {
      while (forward_entered_ < count && layer >= buckets[count - 1 - forward_entered_].first_layer)
        enter_in_pass(count - 1 - forward_entered_++, false, compute);
    }
    return;
  }
  if (!backward && layer == 0) {  // a new forward: after everything before it on `compute`
    forward_entered_ = 0;
    backward_entered_ = 0;
    forward_start_.record(compute);
    forward_start_.wait(comm_stream_);
    prefetch(count - 1);
    if (count >= 2) prefetch(count - 2);
  }
  if (backward) {
    while (backward_entered_ < count && layer <= buckets[backward_entered_].last_layer) enter_backward(backward_entered_++, compute);
  } else {
    while (forward_entered_ < count && layer >= buckets[count - 1 - forward_entered_].first_layer)
      enter_forward(count - 1 - forward_entered_++, compute);
  }
}

void RankSync::begin_pass(bool backward, Stream& compute) {
  std::size_t const count = sync_.buckets_.size();
  if (!sync_.shard_parameters_ || !sync_.whole_gradients_ || whole_ || count == 0) return;
  forward_entered_ = 0;
  backward_entered_ = 0;
  end_pass(compute);  // nothing is held but after a pass that failed, whose gathers may not have run
  forward_start_.record(compute);  // the gathers come after what `compute` ran before the pass
  forward_start_.wait(comm_stream_);
  hold(backward ? 0 : count - 1);  // forward runs the units from the last (the first layers) down, backward up
}

void RankSync::end_pass(Stream& compute) {
  for (std::size_t b = 0; b < held_.size(); ++b) drop(b, compute);
}

void RankSync::hold(std::size_t bucket) {
  if (held_[bucket]) return;
  prefetch(bucket);
  held_[bucket] = true;
}

void RankSync::drop(std::size_t bucket, Stream& compute) {
  if (!held_[bucket]) return;
  release_parameters(bucket, compute);
  held_[bucket] = false;
}

void RankSync::enter_in_pass(std::size_t bucket, bool backward, Stream& compute) {
  std::size_t const count = sync_.buckets_.size();
  params_gathered_[bucket].wait(compute);
  if (backward) {  // bucket - 1 is done, bucket + 1 comes next
    if (bucket >= 1) drop(bucket - 1, compute);
    if (bucket + 1 < count) hold(bucket + 1);
  } else {  // bucket + 1 is done, bucket - 1 comes next
    if (bucket + 1 < count) drop(bucket + 1, compute);
    if (bucket >= 1) hold(bucket - 1);
  }
}

void RankSync::enter_forward(std::size_t bucket, Stream& compute) {
  std::size_t const count = sync_.buckets_.size();
  params_gathered_[bucket].wait(compute);
  if (bucket >= 1 && bucket + 2 < count) release_parameters(bucket + 1, compute);  // bucket + 1 is done (1 stays for backward)
  if (bucket >= 1 && bucket + 1 < count) prefetch(bucket - 1);      // (the last bucket's next came at layer 0)
}

void RankSync::enter_backward(std::size_t bucket, Stream& compute) {
  std::size_t const count = sync_.buckets_.size();
  if (bucket >= 1) release_parameters(bucket - 1, compute);     // bucket - 1 is done
  if (bucket >= 1 && bucket + 2 < count) prefetch(bucket + 1);  // buckets 0, 1 and the last stayed
  if (bucket >= 2 && bucket + 1 < count) params_gathered_[bucket].wait(compute);
  if (bucket + 1 < count) {  // the layers write the unit's gradients into staging memory of its own
    Tensor const& grads = unit_grads_[bucket];
    mgpu::detail::BufferInternals::acquire_memory(grads, static_cast<std::size_t>(grads.numel()) * sizeof(float), allocator(), compute);
    if (sixteen()) {  // and their compute-type gradients, unscaled into it, into another
      Tensor const& computed = unit_compute_grads_[bucket];
      mgpu::detail::BufferInternals::acquire_memory(computed, static_cast<std::size_t>(computed.numel()) * size_of(computed.dtype()),
                                                    allocator(), compute);
    }
  }
}

void RankSync::shard_parameters(optim::Optimizer& optimizer, Allocator& allocator, Stream& stream) {
  if (!sync_.shard_parameters_ || !whole_) return;
  shard_optimizer_state(optimizer, allocator, stream);
  std::vector<Bucket> const& buckets = sync_.buckets_;
  Tensor const whole = model_.master_parameters();
  owned_params_ = Tensor::empty({owned_grads_.numel()}, DType::float32, allocator);
  for (std::size_t b = 0; b < buckets.size(); ++b)
    for (Piece const& p : pieces_[b]) copy_async(owned_params_.slice(p.at, p.at + (p.end - p.begin)), whole.slice(p.begin, p.end), stream);
  // A buffer per unit, bound to its layers once, whose memory comes and goes (prefetch(),
  // release_parameters()); the last unit's stays.
  // With 16-bit compute the layers read a compute-type copy of each (unit_compute_params_), whose
  // memory comes and goes likewise, and the float32 buffers are the gathers' staging memory only.
  DType const compute = model_.compute_type();
  unit_params_.assign(buckets.size() - 1, Tensor{});
  if (sixteen()) unit_compute_params_.assign(buckets.size(), Tensor{});
  for (std::size_t b = 0; b + 1 < buckets.size(); ++b) {
    unit_params_[b] = Tensor::empty({buckets[b].size()}, DType::float32, allocator, stream);
    mgpu::detail::BufferInternals::release_memory(unit_params_[b]);
    Tensor read = unit_params_[b];
    if (sixteen()) {
      read = unit_compute_params_[b] = Tensor::empty({buckets[b].size()}, compute, allocator, stream);
      mgpu::detail::BufferInternals::release_memory(read);
    }
    model_.bind_parameters(buckets[b].begin, buckets[b].end, read);
  }
  params_last_ = Tensor::empty({buckets.back().size()}, DType::float32, allocator);
  if (sixteen() || sync_.whole_gradients_)  // staging only, or gathered per pass as the other units
    mgpu::detail::BufferInternals::release_memory(params_last_);
  if (sixteen()) {
    unit_compute_params_.back() = Tensor::empty({buckets.back().size()}, compute, allocator);
    if (sync_.whole_gradients_) mgpu::detail::BufferInternals::release_memory(unit_compute_params_.back());
  }
  model_.bind_parameters(buckets.back().begin, buckets.back().end, sixteen() ? unit_compute_params_.back() : params_last_);
  held_.assign(buckets.size(), false);
  whole_ = false;
}

void RankSync::gather_whole(Allocator& allocator, Stream& stream) {
  if (!sync_.shard_parameters_ || whole_) return;
  Tensor const whole = Tensor::empty({model_.parameter_count()}, DType::float32, allocator);
  for (std::size_t b = 0; b < sync_.buckets_.size(); ++b)
    gather_parameters(b, whole.slice(sync_.buckets_[b].begin, sync_.buckets_[b].end), stream);
  if (sixteen()) {  // the layers read a compute-type copy of the masters
    Tensor const computed = Tensor::empty(whole.shape(), model_.compute_type(), allocator);
    convert_async(computed, whole, stream);
    model_.bind_parameters(0, model_.parameter_count(), computed);
  }
  model_.bind_master_parameters(whole);
  owned_params_ = Tensor{};
  unit_params_.clear();
  unit_compute_params_.clear();
  params_last_ = Tensor{};
  held_.clear();
  whole_ = true;
}

}  // namespace mgpu::parallel::detail
