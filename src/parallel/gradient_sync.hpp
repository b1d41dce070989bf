// DataParallel's gradient sync: buckets of whole layers planned from the model's parameter ranges,
// and per rank the nn::GradientSync that classification_step notifies as backward writes each
// layer's gradients. It reduces a bucket on the rank's communication stream as soon as backward has
// written the bucket's last layer and, when the step hands it the update, updates the bucket there
// (with the sharded update: reduce-scatter, update of the rank's block, all-gather). When the step
// updates after backward (clipping, loss scaling), the sharded update still reduce-scatters; the
// step's apply_update then updates the rank's blocks and calls back for the all-gather. With
// sharded gradients (zero_stage 2) the layers write into the sync's staging buffers and each
// reduced bucket's owned pieces go to the rank's packed owned gradients, which the update reads.
// With sharded parameters (zero_stage 3) each rank keeps its owned parameters only, packed the same
// way, which the update writes, and gathers every rank's into the buckets' parameter buffers that
// the layers read, bucket by bucket just before forward and backward reach them; a bucket's
// parameters and gradients have memory only from their gather (or backward's start) to their last
// use (or reduce). Its buckets are then ZeRO-3's units, one per part of the model (plan_units).
// Sharded gradients without overlap (a pipeline's replicas, whose micro-batches' backward passes
// accumulate into a chunk before finish() reduces it) keep the model's whole gradient buffer for
// the backward passes instead of staging buffers: finish() reduce-scatters every bucket in place
// and packs the owned pieces at the buffer's front, which owned_gradients() views (with 16-bit
// compute: the whole float32 buffer, which the caller unscales the accumulated 16-bit gradients
// into before finish()). A rank never holds more gradients than ZeRO-1 does (the whole buffer, for
// the step and between steps).
// Sharded parameters without overlap (a pipeline's replicas, whose chunks run several forward and
// backward passes a step in the schedule's order) keep the whole gradient buffer likewise, and
// gather each unit per pass (begin_pass(), end_pass(); of a split backward the input half only),
// the last one (the first layers) too: nothing gathered stays from one pass to the next; with
// 16-bit compute each unit rounded into its compute-type buffer as data parallelism's are.
// The sharded parameters' methods are in sharded_parameters.cpp.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "comm/renewable.hpp"

namespace mgpu::parallel::detail {

/// Buckets of whole layers, last layer first: the first up to `first_cap_bytes` of float32
/// gradients, the others up to `cap_bytes` (a layer larger than the cap is a bucket alone).
/// `ranges`: a model's parameter ranges (nn::Sequential::parameter_ranges()).
std::vector<Bucket> plan_buckets(std::vector<nn::ParameterRange> const& ranges, std::size_t first_cap_bytes, std::size_t cap_bytes);
std::vector<Bucket> plan_buckets(nn::Sequential const& model, std::size_t first_cap_bytes, std::size_t cap_bytes);
/// One bucket per part of the model's structure (`parts`, nn::Sequential::structure_parts()), last
/// part first.
std::vector<Bucket> plan_units(std::vector<std::pair<std::size_t, std::size_t>> const& parts,
                               std::vector<nn::ParameterRange> const& ranges);
std::vector<Bucket> plan_units(nn::Sequential const& model);
/// The buckets DataParallel reduces (and with zero_stage 3 gathers) with these options: at stages 2
/// and 3 the units (plan_units) by default (zero3_block_units), else plan_buckets' of the caps. `parts` and
/// `ranges` as a model's (which a memory model may lay out without one).
std::vector<Bucket> plan_buckets(std::vector<std::pair<std::size_t, std::size_t>> const& parts,
                                 std::vector<nn::ParameterRange> const& ranges, DataParallelOptions const& options);
std::vector<Bucket> plan_buckets(nn::Sequential const& model, DataParallelOptions const& options);

/// Throws Error(invalid_argument), prefixed by `who`, for a zero_stage outside 0 to `max_stage` or
/// one that the options cannot take: stages 2 and 3 need overlap and no comm hook.
/// `whole_gradients`: the caller reduces after accumulating backward passes (no overlap), which
/// stages 2 and 3 take in every precision (see the top of this file).
void check_zero_stage(DataParallelOptions const& options, std::string const& who, int max_stage = 3,
                      bool whole_gradients = false);

class GradientSync;

/// One rank's side of the sync, given to classification_step: counts the layers backward reports
/// and launches a bucket on the rank's communication stream once its first (lowest) layer is
/// written, or, without overlap, every bucket from finish(). Used from the rank's thread only. Its
/// `rank` is the communicator's: across processes the world rank (first_rank() + the group rank).
class RankSync final : public nn::GradientSync {
 public:
  RankSync(detail::GradientSync& sync, int rank, nn::Sequential& model, Stream comm_stream);
  void begin(Stream& compute, nn::RangeUpdate update) override;
  void ready(nn::ParameterRange const& range, Stream& compute) override;
  void finish(Stream& compute) override;
  /// With the sharded update, when the step updates after finish() (clipping, loss scaling): this
  /// rank's block of every bucket (reduce-scattered), and the leftovers past the blocks and the
  /// buckets too small to split (all-reduced; updated everywhere, counted by rank 0).
  [[nodiscard]] std::vector<nn::ElementRange> owned() const;
  /// Sums float32 `values` over the ranks in place on `compute`, bitwise the same on every rank.
  void sum_over_ranks(Tensor const& values, Stream& compute);
  /// All-gathers every bucket's updated blocks on `compute` and refreshes their compute-type copies.
  void gather_updated(Stream& compute);
  /// With sharded gradients (zero_stage 2): the reduced gradients of owned(), packed by start.
  [[nodiscard]] Tensor owned_gradients() const { return owned_grads_; }
  /// With sharded parameters (zero_stage 3, while not whole): the parameters of owned(), packed
  /// as owned_gradients().
  [[nodiscard]] Tensor owned_parameters() const { return owned_params_; }
  /// With the sharded update: `part` narrowed to owned(), owned_gradients() and owned_parameters(),
  /// its values summed over the ranks and the updated blocks gathered after; else `part`.
  [[nodiscard]] nn::UpdatePart update_part(nn::UpdatePart part) override;
  /// With sharded parameters: gathers the parameters of the bucket that forward (or backward) is
  /// about to enter, ordered before `compute`'s next work, and prefetches the next one (see the
  /// members below).
  void before_layer(std::size_t layer, bool backward, Stream& compute) override;
  /// With sharded parameters without overlap: a forward (or backward) pass of the model starts on
  /// `compute`, after everything enqueued there before; before_layer() then gathers each unit as
  /// the pass reaches it (prefetching the next) and lets the one before go, and end_pass() lets
  /// what the pass still holds go: a rank holds its owned parameters and at most two units'. Nothing
  /// otherwise.
  void begin_pass(bool backward, Stream& compute);
  void end_pass(Stream& compute);
  /// With sharded parameters, while the model holds them whole (after construction, gather_whole()
  /// or a load): lays out `optimizer`'s state for the owned elements (shard_optimizer_state), keeps
  /// the owned parameters only and binds the layers to the buckets' parameter buffers, freeing the
  /// model's flat buffer; on `stream`. Nothing otherwise.
  void shard_parameters(optim::Optimizer& optimizer, Allocator& allocator, Stream& stream);
  /// With sharded parameters: every rank's parameters gathered into a whole flat buffer on
  /// `stream`, which the model's layers are bound to (Sequential::bind_parameters), until the next
  /// shard_parameters(). A collective: every rank calls it. Nothing when already whole.
  void gather_whole(Allocator& allocator, Stream& stream);
  /// With the sharded update, lays out `optimizer`'s state for this rank's owned elements only
  /// (optim::Optimizer::set_state_ranges), on `stream`; nothing when the state is already so, or while
  /// the parameters are sharded (shard_parameters() sharded the state with them).
  void shard_optimizer_state(optim::Optimizer& optimizer, Allocator& allocator, Stream& stream) const;

  /// The stream the buckets are reduced (and updated) on.
  [[nodiscard]] Stream& comm_stream() noexcept { return comm_stream_; }
  /// Recorded on the compute stream by finish() when backward's work ends, before the wait for the
  /// reduces.
  [[nodiscard]] Event const& backward_end() const noexcept { return backward_end_; }
  /// Milliseconds the compute stream waited for the reduces in the last finish() (host devices).
  [[nodiscard]] double wait_ms() const noexcept;
  /// Whether a collective of this rank completed since GradientSync::start_step().
  [[nodiscard]] bool reduced() const noexcept { return reduced_.load(std::memory_order_relaxed); }

 private:
  friend class detail::GradientSync;
  void launch(std::size_t bucket, Stream& compute);
  // Sharded gradients without overlap, after every launch(): the owned pieces to owned_grads_, the
  // whole buffer's front (see the top of this file), on the communication stream.
  void pack_owned_in_place();
  // The sharded update's all-gather of every rank's updated block of `bucket` on `stream`, with
  // the compute-type copies refreshed (an "all-gather bucket" span on the timeline).
  void gather_bucket(std::size_t bucket, Stream& stream);
  // Sharded gradients: the owned gradients' buffer and the staging buffers, bound to the model.
  void shard_gradients(Allocator& allocator, Stream& stream);
  // Sharded gradients: the owned gradients' memory goes back once the work enqueued so far on the
  // rank's streams has run (a step's first reduce takes it again); nothing when not held.
  void release_owned_gradients();
  // `enqueue`'s work on `stream`, as a span named `name` on the timeline when there is one.
  void traced(Stream& stream, std::string const& name, std::function<void()> const& enqueue);
  // Sharded parameters: every rank's owned parameters of `bucket` gathered into `into` (the
  // bucket's elements) on `stream`.
  // `transient`: into is a unit's buffer, whose memory goes before that work may have run.
  void gather_parameters(std::size_t bucket, Tensor const& into, Stream& stream, bool transient = false);
  // Sharded parameters: forward or backward enters `bucket` (see before_layer()).
  void enter_forward(std::size_t bucket, Stream& compute);
  void enter_backward(std::size_t bucket, Stream& compute);
  // Sharded parameters without overlap: a pass enters `bucket` (see begin_pass()); a unit gathered
  // for the pass (hold()), its memory going once the pass is done with it (drop()).
  void enter_in_pass(std::size_t bucket, bool backward, Stream& compute);
  void hold(std::size_t bucket);
  void drop(std::size_t bucket, Stream& compute);
  // Sharded parameters: the buffer the layers of `bucket` read, and its gather on the communication
  // stream once the bucket that used the buffer before is done with it (params_gathered_[bucket] marks it).
  [[nodiscard]] Tensor parameter_buffer(std::size_t bucket) const;
  void prefetch(std::size_t bucket);
  // Sharded parameters: the memory of `bucket`'s parameter buffer goes back once the work enqueued
  // so far on `compute` and the communication stream has run.
  void release_parameters(std::size_t bucket, Stream& compute);
  // With GradientSync::unit_compute_gradients(), from before_layer(): the first call binds the
  // layers' compute-type gradients to a buffer per unit; backward entering a unit takes its memory
  // and gives back the previous unit's, whose gradients backward has unscaled.
  void unit_compute_gradients_before(std::size_t layer, bool backward, Stream& compute);
  [[nodiscard]] Allocator& allocator() const;
  // Whether the model computes in 16 bits (its layers then read and write compute-type copies).
  [[nodiscard]] bool sixteen() const noexcept { return model_.compute_type() != DType::float32; }

  detail::GradientSync& sync_;
  int rank_;
  nn::Sequential& model_;
  nn::RangeUpdate update_;
  std::size_t next_ = 0;  // the next bucket to complete in this backward
  // Set on the communication stream once a collective of the step has completed there (declared
  // before comm_stream_, whose destruction runs what is left of its work).
  std::atomic<bool> reduced_{false};
  Stream comm_stream_;
  std::vector<Event> bucket_events_;
  Event done_, backward_end_;
  Tensor gathered_;  // deterministic reduce on non-host backends
  // Sharded gradients (zero_stage 2). The layers of bucket b write into staging_[b % 2], except
  // those of the last bucket (the first layers), which keep staging_last_ to themselves: a tied LM
  // head writes the embedding's gradients at the start of backward. Bucket b's layers start writing
  // once bucket b - 2's reduce has read the shared buffer (staging_free_). Each reduced bucket's
  // owned pieces go to owned_grads_ (packed as the optimizer's sharded state), copied, or added
  // while an accumulation cycle goes on (accumulate_). With sharded parameters (zero_stage 3)
  // each bucket but the last has a staging buffer of its own instead, unit_grads_[b], whose memory
  // comes when backward enters the bucket and goes back once its reduce has read it.
  struct Piece {
    std::int64_t begin = 0, end = 0;  // elements of the flat buffers
    std::int64_t at = 0;              // where they start in owned_grads_
  };
  std::vector<std::vector<Piece>> pieces_;  // per bucket
  Tensor owned_grads_;
  std::array<Tensor, 2> staging_;
  Tensor staging_last_;
  std::array<Event, 2> staging_free_;
  std::vector<Tensor> unit_grads_;
  bool accumulate_ = false;
  // Whether owned_grads_ and staging_last_ have memory: the owned gradients from a step's first
  // reduce to the next step that does not accumulate (GradientSync::start_step()), the last
  // bucket's staging from backward's start (begin()) to its reduce.
  bool owned_held_ = true, last_held_ = true;
  // Sharded parameters (zero_stage 3). owned_params_: the owned pieces' parameters (packed as
  // owned_grads_). The layers of bucket b read theirs from unit_params_[b], a buffer whose memory
  // comes when the bucket is gathered and goes back once forward or backward is done with it
  // (mgpu::detail::BufferInternals::acquire_memory and release_memory: the layers stay bound to
  // it), and those of the last bucket (the first layers, with a tied embedding, whose LM head reads
  // it at the end of forward and the start of backward) from params_last_, which stays. Forward
  // gathers the last bucket and the one before it at layer 0 and, as it enters bucket b, lets
  // bucket b + 1's memory go and prefetches bucket b - 1; buckets 1 and 0, the last ones forward
  // runs, stay for backward, which, as it enters bucket b, lets bucket b - 1's memory go and
  // prefetches bucket b + 1. So a rank holds its owned parameters, the last bucket's and at most
  // two other buckets'. whole_: the model holds every parameter in its flat buffer instead
  // (gather_whole()). With 16-bit compute the layers read and write compute-type buffers per bucket
  // (unit_compute_params_, unit_compute_grads_; the last bucket's stay), whose memory comes and goes
  // with the float32 ones': unit_params_ and params_last_ then only stage the gathers, and a
  // bucket's compute-type gradients go back once unscaled into unit_grads_[b] (launch()).
  Tensor owned_params_;
  std::vector<Tensor> unit_params_;
  Tensor params_last_;
  std::vector<Tensor> unit_compute_params_, unit_compute_grads_;
  std::vector<Event> params_gathered_;
  // unit_compute_gradients_before(): the units (last first), their compute-type gradient buffers,
  // which have memory, and how many backward has entered in this pass.
  std::vector<Bucket> grad_units_;
  std::vector<Tensor> grad_unit_buffers_;
  std::vector<bool> grad_unit_held_;
  std::size_t grad_units_entered_ = 0;
  Event forward_start_;
  std::size_t forward_entered_ = 0, backward_entered_ = 0;  // buckets entered in this pass
  bool whole_ = true;
  // Without overlap: the units gathered for the pass that runs (params_last_ among them).
  std::vector<bool> held_;
  // Host timestamps written by marker tasks on the compute stream around the wait for the reduces.
  std::shared_ptr<std::array<std::int64_t, 2>> wait_marks_ = std::make_shared<std::array<std::int64_t, 2>>();
};

/// The buckets and what every rank's sync shares: the communicator, the comm hook, the sharded
/// update's blocks. Made before the replicas, which add_rank() then joins one by one. Methods are
/// called from the executor's thread while no step runs.
class GradientSync {
 public:
  /// `buckets` as plan_buckets makes them; `group` holds the used ranks, whose indices in the group
  /// the executor was given are `trace_ranks` (their names on the timeline). Makes the communicator
  /// (options.make_communicator's, else comm::make_communicator's) and attaches the comm hook;
  /// refuses, across processes, a comm hook and deterministic mode on a backend other than host.
  GradientSync(DeviceGroup& group, std::vector<Bucket> buckets, DataParallelOptions const& options, std::vector<int> trace_ranks);
  /// Over some of `group`'s ranks (e.g. one dimension of a device mesh): `comm`, a communicator
  /// over them, whose rank comm->first_rank() + i is `group`'s rank locals[i] (this process's ranks
  /// of it, in order), named trace_ranks[i] on the timeline. options.make_communicator is not used.
  GradientSync(DeviceGroup& group, std::shared_ptr<comm::detail::Renewable> comm, std::vector<int> locals,
               std::vector<Bucket> buckets, DataParallelOptions const& options, std::vector<int> trace_ranks);
  GradientSync(GradientSync const&) = delete;
  GradientSync& operator=(GradientSync const&) = delete;

  /// Adds the next rank's sync, reducing `model`'s gradients on a new communication stream.
  void add_rank(nn::Sequential& model);
  /// The sync of the `rank`-th rank added (the group's rank locals[rank]).
  [[nodiscard]] RankSync& rank(int rank) { return *ranks_.at(static_cast<std::size_t>(rank)); }
  [[nodiscard]] std::vector<Bucket> const& buckets() const noexcept { return buckets_; }
  [[nodiscard]] comm::Communicator& communicator() noexcept { return *comm_; }
  /// A new communicator in place of one that a failure aborted.
  void renew_communicator();

  /// Before a step: no rank has reduced yet (RankSync::reduced()). With sharded gradients,
  /// `accumulate` adds the step's reduced gradients to those kept (a micro-batch after the first of
  /// an accumulation cycle) instead of replacing them.
  /// Without `accumulate`, the memory of every rank's owned gradients goes back (the next reduce
  /// takes it again), so it is not held while forward and the start of backward peak.
  void start_step(bool accumulate = false);
  /// Waits for every communication stream; throws the first error.
  void synchronize();

  /// Makes every optimizer's state (optimizers[i]'s, of the i-th rank added) whole again where the sharded update left
  /// each rank holding the state of its own elements only: each lays its state out over every
  /// parameter and the blocks are all-gathered to every rank. With sharded parameters the
  /// parameters are gathered whole first (gather_whole()).
  void gather_optimizer_state(std::vector<optim::Optimizer*> const& optimizers);
  /// With sharded parameters: every rank's model whole (RankSync::gather_whole()), until its next
  /// step shards it again; nothing otherwise.
  void gather_whole();
  /// With sharded parameters: every rank keeps its owned parameters only
  /// (RankSync::shard_parameters() with optimizers[rank]); nothing otherwise.
  void shard_parameters(std::vector<optim::Optimizer*> const& optimizers);
  /// With 16-bit compute below zero_stage 3: the layers write their compute-type gradients into a
  /// buffer per unit of the model (plan_units) instead of a whole flat buffer, whose memory each
  /// rank holds from backward entering the unit to entering the next (RankSync::before_layer();
  /// the last unit's, the first layers', stays: a tied LM head writes it at backward's start). For
  /// callers whose backward unscales each layer's gradients into the float32 ones as it writes them
  /// (nn::train_step) and reports every layer to before_layer(). Call before add_rank().
  void unit_compute_gradients() noexcept { unit_compute_grads_ = true; }

  /// With a comm hook: enqueues on each rank's default stream the copy of the hook's state for
  /// every bucket into that rank's row of `rows` (float32 [ranks x parameters], flat), leaving the
  /// elements of buckets without state as they are. Returns whether any bucket had state.
  bool copy_hook_state(Tensor const& rows);
  /// With a comm hook: sets the hook's state of every bucket of `rank` from `values` (float32, one
  /// per parameter), enqueued on the rank's communication stream.
  void set_hook_state(int rank, Tensor const& values);

 private:
  friend class RankSync;
  DeviceGroup& group_;
  std::vector<Bucket> buckets_;
  // The sharded update's blocks: per bucket, the elements each rank owns, rank r owning
  // [r * block, (r + 1) * block) of the bucket; 0 where buckets are all-reduced.
  std::vector<std::int64_t> blocks_;
  bool shard_gradients_ = false;   // zero_stage 2 or 3 over more than one rank
  bool shard_parameters_ = false;  // zero_stage 3 over more than one rank
  bool whole_gradients_ = false;   // sharded gradients without overlap: the model's whole buffer (stage 3 too)
  bool unit_compute_grads_ = false;  // unit_compute_gradients()
  int stage_ = 0;                  // the zero_stage asked for
  bool overlap_;
  bool deterministic_;
  std::shared_ptr<CommHook> hook_;
  std::shared_ptr<trace::Timeline> timeline_;
  std::vector<int> trace_ranks_;  // per communicator rank
  std::shared_ptr<comm::detail::Renewable> comm_;  // before ranks_, whose streams run collectives on it
  std::vector<int> locals_;  // the group's rank of each of this process's communicator ranks
  // The group's rank of communicator rank `rank` (one of this process's).
  [[nodiscard]] int local(int rank) const { return locals_.at(static_cast<std::size_t>(rank - comm_->first_rank())); }
  // Runs fn(i, rank's stream) on the group's ranks of this sync, i the index of the rank added.
  void run(std::function<void(std::size_t i, Stream& stream)> const& fn);
  std::vector<std::unique_ptr<RankSync>> ranks_;
};

}  // namespace mgpu::parallel::detail
