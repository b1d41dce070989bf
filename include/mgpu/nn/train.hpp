// One training step against any nn::Loss (classification_step: softmax cross-entropy), evaluation,
// and what a training loop needs around the model: mixed-precision input conversion, and the one
// update every executor applies (apply_update: unscaling, dynamic loss scaling with overflow
// skipping, clipping by global norm, the optimizer step and the refresh of compute-type weights).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>

namespace mgpu::trace {
class Timeline;
}

namespace mgpu::nn {

/// Applies the optimizer to master parameters [begin, end) on `stream`, where their reduced
/// gradients are ready: what classification_step gives a GradientSync for the step.
using RangeUpdate = std::function<void(std::int64_t begin, std::int64_t end, Stream& stream)>;

/// Elements [begin, end) of a model's flat buffers that one data-parallel rank updates in a
/// sharded update. `counted`: this rank counts them in the global gradient norm and the overflow
/// check (every element is counted by exactly one rank; elements that every rank updates are
/// counted by rank 0).
struct OwnedRange {
  std::int64_t begin = 0, end = 0;
  bool counted = true;
};

/// What happens to gradients between backward and the optimizer: the seam through which
/// data-parallel training reduces them in buckets of its own while backward goes on. The step
/// calls begin() before backward, ready() for each layer's range of float32 master gradients (last
/// layer first) once the work writing them is enqueued on `compute`, and finish() after backward.
/// With a non-empty `update` the sync calls it once for each range of reduced gradients, on the
/// stream where they are ready (the step then updates nothing itself); with an empty one the step
/// updates after finish(). finish() must leave `compute` ordered after all of the sync's work. All
/// calls come from the thread running the step.
///
/// A sync may shard that later update (ZeRO stage 1 with clipping or loss scaling): it then reduces
/// only this rank's part of the gradients, which owned() returns after finish() (the same number
/// of ranges, in the same order, on every rank). apply_update then counts, clips and updates just
/// those elements, sums its per-range norms and overflow counts over the ranks with
/// sum_over_ranks(), and after an applied update calls gather_updated(), which brings every rank's
/// updated parameters (and their compute-type copies) to every rank. An empty owned(): every rank
/// holds every reduced gradient and updates them all.
///
/// A sync may also shard the gradients (ZeRO stage 2): it then keeps the reduced gradients of the
/// owned ranges in a buffer of its own, owned_gradients() (packed in the order of the ranges'
/// starts, as optim::Optimizer::shard_state packs the state), which the update reads instead of
/// the model's master gradients; the layers write into buffers the sync binds as backward goes
/// on. Such a sync reduces every micro-batch, accumulating them in owned_gradients() itself: the
/// step calls it with accumulate_only too (and needs no accumulator).
///
/// A sync may shard the parameters as well (ZeRO-3): it then keeps the parameters of the owned
/// ranges only, owned_parameters() (packed as owned_gradients()), which the update writes
/// (optim::Optimizer::update_owned) instead of the model's master parameters, and it binds the
/// layers to buffers it gathers every rank's parameters into: the step calls before_layer() before
/// each layer's forward and backward (Sequential::BeforeLayer) on `compute`, and gather_updated()
/// then has nothing to gather. An empty shard's step calls it for every layer too, in the same order.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual void begin(Stream& compute, RangeUpdate update) = 0;
  virtual void ready(ParameterRange const& range, Stream& compute) = 0;
  virtual void finish(Stream& compute) = 0;
  [[nodiscard]] virtual std::vector<OwnedRange> owned() const { return {}; }
  /// Sums the float32 `values` element-wise over the ranks, in place, ordered on `compute`: every
  /// rank gets bitwise the same sums.
  virtual void sum_over_ranks(Tensor const& /*values*/, Stream& /*compute*/) {}
  virtual void gather_updated(Stream& /*compute*/) {}
  /// With sharded gradients, the reduced gradients of owned(), packed; else undefined.
  [[nodiscard]] virtual Tensor owned_gradients() const { return {}; }
  /// With sharded parameters, the float32 parameters of owned(), packed; else undefined.
  [[nodiscard]] virtual Tensor owned_parameters() const { return {}; }
  virtual void before_layer(std::size_t /*layer*/, bool /*backward*/, Stream& /*compute*/) {}
};

struct StepOptions {
  /// Multiplies the optimizer's learning rate (schedules, warm-up): finite and >= 0.
  float lr_scale = 1.0f;
  /// Clip gradients to this global norm, finite and > 0; 0 turns clipping off.
  float clip_norm = 0.0f;
  /// Dynamic loss scaling (float16 training); nullptr for none.
  optim::LossScaler* scaler = nullptr;
  /// The counted units (Loss: rows, or tokens not ignored) of the global batch that x is a shard
  /// of (0: x is the whole batch, and the loss counts its units). The loss divides its summed
  /// per-unit loss by it, so the shards' losses and gradients add up to the global batch's mean
  /// and its gradient, for any shard sizes (empty shards included).
  std::int64_t global_units = 0;
  /// Deprecated: global_units for a loss that counts rows (used when global_units is 0).
  std::int64_t global_rows = 0;
  /// Multiplies the loss gradient (e.g. 1/k for k accumulated micro-batches).
  float grad_scale = 1.0f;
  /// Gradient accumulation: a float32 buffer of the model's parameter count. With
  /// `accumulate_only` the step adds its gradients into it and does not update; otherwise the
  /// buffer is added into the step's gradients before they are reduced and applied, and zeroed.
  /// None with a sync that shards the gradients (it accumulates them itself).
  Tensor const* accumulator = nullptr;
  bool accumulate_only = false;
  /// Between backward and update (data parallelism); nullptr on one device.
  GradientSync* sync = nullptr;
  /// Records forward, backward and update spans for `rank` when set and enabled.
  trace::Timeline* timeline = nullptr;
  int rank = 0;
};

struct StepResult {
  /// The batch's mean loss, a one-element float32 tensor on the model's device (read it with
  /// ops::item; reading synchronizes, so a loop reads it only when it reports). For a shard, its
  /// share of the global batch's mean: its summed loss over the global units (0 for an empty
  /// shard), so the shards' losses add up to the global mean.
  Tensor loss;
  /// False when the loss scaler found NaN or Inf gradients and the update was skipped, or when
  /// the step only accumulated.
  bool applied = true;
};

/// What check_batch checks a step's batch against besides the model and the loss.
struct BatchCheck {
  /// The step's learning-rate multiplier: finite and >= 0.
  float lr_scale = 1.0f;
  /// The model's compute type: x of values may be float32 or this.
  DType compute = DType::float32;
  /// A part of a batch (a data-parallel shard, a process's rows), which may have no rows; a whole
  /// batch has at least one.
  bool part = false;
  /// Read the values of ids and targets in host memory (false: their shapes and dtypes only, for
  /// a part whose values the executor checked in the whole batch and may still be copying).
  bool values = true;
};

/// The check every executor makes of a step's inputs on the host, before any device work or
/// collective, so that a bad batch is refused as itself and changes nothing: x of shape [rows, ...]
/// (rows >= 1 unless check.part); token ids (int32, each in [0, V)) for a model whose first layer
/// takes ids (Layer::input_vocab() = V), else float32 or the compute type; a shape the model
/// takes; targets that fit its output (Loss::check) with valid values (Loss::check_values); a
/// finite lr_scale >= 0. `parts`: the model's parts in order (one Sequential, or a pipeline's
/// chunks). Values in host memory are read at the call (no stream work may still be writing
/// them); values in device memory are left to the ops, which fail their stream. Returns the
/// model's output shape. Throws Error(invalid_argument) prefixed by `what`, naming the first bad
/// value and its row and position in the batch.
Shape check_batch(std::span<Sequential const* const> parts, Loss const& loss, Tensor const& x, Tensor const& targets,
                  BatchCheck const& check, std::string const& what);
Shape check_batch(Sequential const& model, Loss const& loss, Tensor const& x, Tensor const& targets, BatchCheck const& check,
                  std::string const& what);

/// Forward, `loss` against `targets`, backward, and the update (apply_update). `x` is float32 or
/// the model's compute type, or int32 token ids (a model starting with an Embedding), on ctx's
/// device; the model must be in training mode. x may have 0 rows (an empty data-parallel shard):
/// its gradients are zero. Without a loss scaler and clipping, each layer is updated as soon as
/// its (reduced) gradients are ready. The same function runs one device and every replica of
/// parallel::DataParallel. Throws Error(invalid_argument) before any work, changing nothing, for a
/// batch that check_batch refuses (an empty one unless it is a shard of a global batch:
/// global_units, global_rows or a sync set, whose values the executor checks), and for bad
/// options. A whole batch in host memory is checked once ctx's stream has finished the work
/// before the step (which may be writing it). A step that throws changes nothing on the host (RNG,
/// the optimizer's step count, the loss scaler) unless an update was enqueued; on a whole batch, a
/// step whose work fails on the stream after train_step returned (the error shows at the next
/// synchronize, or as the next call's error) is put back by the next call
/// (Sequential::step_record()), so the run goes on as if it had not been called.
StepResult train_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& targets, Loss const& loss,
                      Context& ctx, StepOptions const& options = {});

/// train_step with softmax cross-entropy against `labels` (float32 class ids).
StepResult classification_step(Sequential& model, optim::Optimizer& optimizer, Tensor const& x, Tensor const& labels, Context& ctx,
                               StepOptions const& options = {});

/// A model, or a part of one (a pipeline chunk), that an update changes, with its optimizer, on
/// the device of `stream`.
struct UpdatePart {
  Sequential* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  Allocator* allocator = nullptr;
  Stream* stream = nullptr;
  /// Elements [begin, end) of its flat buffers that another part holds too (the copy of a tied
  /// embedding on the last pipeline stage, whose gradient equals the first stage's): left out of
  /// the global norm, so they count once.
  std::int64_t shared_begin = 0, shared_end = 0;
  /// A data-parallel replica whose sync shards the update (GradientSync::owned() not empty): only
  /// its owned ranges are checked, clipped and updated, with the norm and the overflow count
  /// summed over the ranks; nullptr (or an unsharded sync) for a part that updates everything.
  GradientSync* sharded = nullptr;
};

struct UpdateOptions {
  /// Multiplies each optimizer's learning rate: finite and >= 0.
  float lr_scale = 1.0f;
  /// Clip to this global norm over all parts, finite and > 0; 0 turns clipping off.
  float clip_norm = 0.0f;
  /// Dynamic loss scaling; nullptr for none.
  optim::LossScaler* scaler = nullptr;
  /// First write the float32 master gradients from the compute-type ones times 1 / the scaler's
  /// scale; false when the step has done so layer by layer during backward.
  bool unscale = true;
};

/// The update every executor applies, to a model held in one or several parts: (1) unscale (see
/// UpdateOptions), (2) with a scaler, count NaN and Inf over every part's master gradients and
/// record the outcome in the scaler, skipping the update on overflow, (3) with clip_norm, scale
/// every part's master gradients by clip_norm / the global L2 norm over all parts when the norm is
/// larger, (4) each part's optimizer step, (5) refresh each part's compute-type parameters. Enqueues
/// on each part's stream; reading the counts and the norm synchronizes them. Returns whether the
/// optimizers stepped. Called from one thread, with no other work using the parts' streams. Throws
/// Error(invalid_argument) for bad options, and when clipping meets NaN or Inf gradients without a
/// scaler.
bool apply_update(std::span<UpdatePart const> parts, UpdateOptions const& options);

/// Rows of `x` whose predicted class equals the label, counted in evaluation mode over batches of
/// `batch` rows (the model is put back in training mode after). Synchronizes ctx's stream.
std::int64_t count_correct(Sequential& model, Tensor const& x, Tensor const& labels, Context& ctx, std::int64_t batch = 1024);

}  // namespace mgpu::nn
