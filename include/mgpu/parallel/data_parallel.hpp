// Data parallelism: one replica of a model per device, the global batch sharded across them, the
// gradients all-reduced in buckets while backward goes on, and the same update on every replica.
// With one device it is exactly nn::train_step (the same code, one replica), with any nn::Loss.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/sched/scheduler.hpp>
#include <mgpu/sched/types.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::parallel {

/// How a bucket's float32 gradients are summed across ranks. The default is a sum all-reduce; a
/// hook may compress, e.g. Bf16Compression. Called on each rank's thread, in bucket order, with the
/// bucket's gradients on `stream` (the rank's communication stream); the hook enqueues its work
/// there and leaves the summed gradients in `grads`. Each rank touches only its own state.
class CommHook {
 public:
  virtual ~CommHook() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  /// Called once, before any reduce, with the group size and the bucket sizes in elements.
  virtual void attach(int ranks, std::vector<std::int64_t> const& bucket_elements) = 0;
  virtual void reduce(comm::Communicator& comm, int rank, int bucket, Tensor const& grads, Allocator& allocator, Stream& stream) = 0;
  /// What the hook carries from one step to the next for a rank's bucket, which checkpoints save:
  /// float32, one value per element of the bucket, added to the bucket's gradients by the next
  /// reduce. Undefined when there is none (the default, and before the first reduce): zeros.
  [[nodiscard]] virtual Tensor state(int /*rank*/, int /*bucket*/) const { return {}; }
  /// Replaces that state with `values` (float32, the bucket's elements), enqueued on `stream`;
  /// DataParallel::load() calls it for every rank and bucket after attach(). The default ignores
  /// it (a hook without state).
  virtual void set_state(int /*rank*/, int /*bucket*/, Tensor const& /*values*/, Allocator& /*allocator*/, Stream& /*stream*/) {}
};

/// bfloat16-compressed all-reduce with float32 error feedback: each rank adds its residual to the
/// bucket, sends it rounded to bfloat16 (half the bytes), and keeps what the rounding lost as the
/// next step's residual, so the error does not accumulate over steps. The residual changes only
/// once the bucket's all-reduce has succeeded, and checkpoints save it (state()).
class Bf16Compression final : public CommHook {
 public:
  std::string name() const override { return "bf16-compression"; }
  void attach(int ranks, std::vector<std::int64_t> const& bucket_elements) override;
  void reduce(comm::Communicator& comm, int rank, int bucket, Tensor const& grads, Allocator& allocator, Stream& stream) override;
  /// The residual a rank keeps for a bucket (undefined before its first reduce).
  [[nodiscard]] Tensor const& residual(int rank, int bucket) const;
  Tensor state(int rank, int bucket) const override { return residual(rank, bucket); }
  void set_state(int rank, int bucket, Tensor const& values, Allocator& allocator, Stream& stream) override;

 private:
  struct Slot {
    Tensor residual, wire;
  };
  std::vector<std::vector<Slot>> slots_;  // [rank][bucket]
  std::vector<std::int64_t> elements_;
};

/// A gradient bucket: the parameters of the model's layers first_layer to last_layer (the first
/// and last with parameters in it), elements [begin, end) of the flat buffers, reduced as one
/// collective. Buckets hold whole layers and run last layers first.
struct Bucket {
  std::size_t first_layer = 0;
  std::size_t last_layer = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
  /// Elements (float32 gradients) in the bucket.
  [[nodiscard]] std::int64_t size() const noexcept { return end - begin; }
  bool operator==(Bucket const&) const = default;
};

struct DataParallelOptions {
  /// Cap of one gradient bucket, and of the first (last layers') bucket, which is smaller so its
  /// reduce starts early. Buckets hold whole layers (a layer larger than the cap is a bucket alone).
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  /// Reduce each bucket as soon as its gradients are written, on a communication stream, and
  /// update it there while earlier layers are still in backward. Off: reduce after backward.
  bool overlap = true;
  /// ZeRO stage: 0, the replicated update (every bucket all-reduced, every rank updates every
  /// parameter and keeps the whole optimizer state), or 1, the sharded update (ZeRO-1): each bucket
  /// is reduce-scattered instead of all-reduced, each rank updates only its 1/N block of it and
  /// keeps the optimizer state (AdamW's m and v, SGD's momentum) of its blocks only, and the updated
  /// parameters are all-gathered, so the pass over parameters, gradients and optimizer state is
  /// split across ranks instead of repeated on every one, and each rank holds about 1/N of the
  /// optimizer state (the few elements past the blocks, and buckets smaller than the ranks, are
  /// all-reduced and updated, with their state, on every rank). Without a loss scaler and clipping
  /// each bucket is updated as soon as it is reduced, and the results are bitwise those of the
  /// replicated update. With either, the update waits for the end of backward: each rank checks and
  /// measures its own blocks, the overflow count and the squared norm are summed over the ranks, and
  /// each rank updates its blocks (the norm, summed block by block, may differ from the replicated
  /// update's in its last bits; the results are still bitwise repeatable). save() and optimizer()
  /// gather the whole state first (every rank then holds it until its next step). One rank: 0, 1
  /// and 2 are the same.
  ///
  /// 2, sharded gradients too (ZeRO-2): each rank keeps the reduced gradients of the elements it
  /// owns only, packed as its optimizer state, instead of a gradient per parameter. The layers
  /// write into bucket-sized staging buffers bound to them once (nn::Sequential::bind_gradients):
  /// the buckets share two buffers in turn (a bucket's layers start writing once the bucket two
  /// before has been reduced out of it) and the last bucket (the first layers, with a tied
  /// embedding, whose LM head writes its gradient at the start of backward) has its own. So each
  /// rank holds about 1/N of the gradients plus twice the largest bucket but the last and the last
  /// bucket: small buckets (bucket_cap_bytes) save the most. The reduce, clipping and update are
  /// stage 1's, bitwise. With accumulation every micro-batch is reduce-scattered and added to the
  /// owned gradients (the same sums as stage 1's in another order). float32 compute, overlap on,
  /// no comm hook, and checkpoints at the end of an accumulation cycle only; across processes too
  /// (Error(invalid_argument) otherwise, naming what).
  ///
  /// 3, sharded parameters too (ZeRO-3, FSDP-style): each rank keeps only the parameters of the
  /// elements it owns (packed as its owned gradients), which its update writes, and the gathered
  /// unit is the bucket: by default (zero3_block_units) one per part of the model's structure, as
  /// FSDP2 wraps each transformer block (nn::Sequential::structure_parts(): each block, e.g. each
  /// of nn::gpt's TransformerBlocks, a unit of its own, the tied embedding a unit, the final
  /// LayerNorm with the LM head a unit), whatever the bucket caps. The layers read their parameters
  /// from unit-sized buffers bound to them once (nn::Sequential::bind_parameters), whose memory
  /// comes when every rank's owned elements are all-gathered into them on the communication stream
  /// just before forward (and again backward) reaches the unit, the next unit prefetched while the
  /// current one computes, and goes back to the allocator as soon as forward or backward is done
  /// with the unit (the two units forward reaches last stay for backward; the last unit, the
  /// first layers with a tied embedding, which the LM head reads at the end of forward and the
  /// start of backward, stays throughout). The units' gradients are written into staging buffers
  /// of their own whose memory comes when backward enters the unit and goes once the unit is
  /// reduce-scattered. So each rank holds 1/N of the parameters, gradients and optimizer state
  /// plus the last unit's parameters and gradients, at most two other units' parameters and,
  /// during backward, about two units' gradients. Reduces, clipping and updates are stage 2's, so
  /// the results are stage 2's bit for bit on the same buckets. replica(), optimizer(),
  /// count_correct(), verify_replicas(), save() and load() first gather the whole model on every
  /// rank (which holds it until reshard() or its next step shards it again), so checkpoints are
  /// those of the other stages and load on any stage and device count. Stage 2's limits apply. A
  /// GPT of 8 blocks on 4 devices peaks at 0.59 of stage 1's bytes per device, on 2 at 0.82.
  int zero_stage = 1;
  /// zero_stage 3's units (its buckets): true, one per part of the model's structure (see
  /// zero_stage); false, the buckets of bucket_cap_bytes and first_bucket_cap_bytes.
  bool zero3_block_units = true;
  /// Bitwise repeatable results whatever the bucket layout and thread timing: host devices reduce
  /// in rank order already; other backends gather the bucket and sum it in rank order.
  bool deterministic = false;
  /// Gradient accumulation: step() accumulates k micro-batches locally (no reduce, no update) and
  /// reduces and applies their mean gradient on every k-th call.
  int accumulation_steps = 1;
  /// How buckets are reduced (nullptr: a float32 sum all-reduce).
  std::shared_ptr<CommHook> comm_hook{};
  /// Shard weights per used rank (empty: the scheduler's, from device speeds and queued work).
  std::vector<double> weights{};
  /// Re-weight shards online from each rank's measured compute time per row (an exponentially
  /// weighted mean with weight `rebalance_ewma`), so a slower device stops holding the others back.
  /// The times are those the step reports to `metrics`, read back from it.
  bool rebalance = false;
  double rebalance_ewma = 0.5;
  /// The compute time (milliseconds) rebalancing counts for a rank's step, given the rank, its rows
  /// and the measured time (empty: the measured time). For a cost model of your own, or a test that
  /// must not depend on how fast the machine happens to be.
  std::function<double(int rank, std::int64_t rows, double measured_ms)> rebalance_time{};
  /// Whether a batch may leave a used rank without rows (its gradients are then zero).
  bool allow_empty_shards = true;
  /// Which ranks to use: with a request (memory per replica in memory_bytes, devices wanted in
  /// `devices`, 0 < devices <= group size), the scheduler picks them over node_state(group);
  /// without one, every rank.
  std::optional<sched::Request> request{};
  /// The scheduler that places the request (default profile when empty).
  std::shared_ptr<sched::Scheduler const> scheduler{};
  /// Replicas are materialized from this seed on rank 0 and broadcast; `compute` is their type.
  std::uint64_t seed = 1;
  DType compute = DType::float32;
  /// Dynamic loss scaling (float16): each replica keeps a copy, updated identically.
  std::optional<optim::LossScaler> loss_scaler{};
  /// Clip the reduced gradients to this global norm, finite and > 0 (0: off).
  float clip_norm = 0.0f;
  /// What step() minimizes (nullptr: nn::SoftmaxCrossEntropy, float32 class ids). Its divisor is
  /// the counted units of the global batch, counted on the host before the ranks start, so the
  /// loss and gradients are the global batch's mean whatever the shard sizes.
  std::shared_ptr<nn::Loss const> loss{};
  comm::Options comm{};
  /// Makes the communicator from the used ranks' group and `comm` (empty: comm::make_communicator).
  /// Across processes, dist::communicator_factory(world): see "Across processes" at DataParallel.
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> make_communicator{};
  /// Where every rank's actions are recorded when enabled (nullptr: no timeline).
  std::shared_ptr<trace::Timeline> timeline{};
  /// Where each used rank's compute and wait times are reported at the end of every step
  /// (metrics::DeviceTimes, rank: its rank in the given group), for a trainer's metrics and for
  /// `rebalance`, which reads them from here (nullptr: a registry of the executor's own).
  std::shared_ptr<metrics::Registry> metrics{};
};

/// What one step did (across processes: `loss` is the world's, the per-rank lists this process's).
struct DataParallelResult {
  /// The global batch's mean loss (the sum of the shards' shares of it, in rank order).
  float loss = 0;
  /// True when the optimizer was applied (false while accumulating, or when the loss scaler
  /// skipped an overflowing step).
  bool applied = true;
  /// Rows each used rank got.
  std::vector<std::int64_t> rows;
  /// Per used rank: milliseconds of forward and backward, and of waiting for reduces after
  /// backward (host devices; 0 elsewhere).
  std::vector<double> compute_ms;
  std::vector<double> wait_ms;
};

/// Data-parallel training of a Sequential over a DeviceGroup. Construction materializes a replica
/// per used rank (weights from rank 0 by broadcast), plans the buckets and makes the communicator.
/// Methods are called from one thread at a time; the group must outlive the executor and must not
/// be used by others during step().
///
/// After a failed step: a bad batch (nn::check_batch: x, token ids or host labels that do not fit,
/// an empty batch, a bad lr_scale) is refused before any rank starts, changing nothing; across
/// processes every process then refuses the step, the others naming the world rank of the process
/// that refused its rows. A failure inside a step (a rank's error, a timeout) aborts the
/// communicator; step() then waits for every stream, makes a new communicator, zeroes the
/// accumulated gradients (the micro-batches of the current accumulation cycle are dropped and the
/// next step starts a cycle) and, when no reduce of the step had completed anywhere (so no replica
/// was updated), puts back what the step changed (RNG, optimizer step count, loss scaler): the
/// executor goes on as if the step had not been called. When a reduce had completed (the update
/// may have begun on some ranks), and for any failure of an applying step with one device and no
/// comm hook (whose update runs unobserved inside backward), the executor cannot be used: step()
/// and save() throw Error(invalid_argument) saying so with the step's error, until load().
///
/// Across processes (mgpu::dist), as PyTorch's DistributedDataParallel: every process makes its
/// own DataParallel over its own DeviceGroup, with make_communicator = dist::communicator_factory(
/// dist::make_world(group)), and calls step() with its own part of the global batch (e.g. rows
/// split among the processes by their device counts), which it shards over its own devices. The
/// buckets, overlap and sharded update run over the world's ranks; the loss and gradients are the
/// mean over the whole global batch, however unevenly its rows are split (each step first
/// exchanges every rank's row and unit counts), and step()'s loss is the world's. Replicas start
/// from world rank 0's weights and RNG state. Shard weights, ranks(), replica() and
/// verify_replicas() concern this process's devices; rows move between processes as the caller
/// splits the global batch, with rebalancing by process_rows(), which follows every process's
/// measured speed. A process may pass no rows of a step's global batch (its ranks' gradients
/// are then zero), but it must call step(), and with the sharded update optimizer() too (it
/// gathers the state from every rank). save() and load() are collective: every process calls them
/// with the same folder (see save()). ZeRO-1 to 3 and comm hooks (their ranks: the world's) work
/// across processes, and so do checkpoints mid accumulation cycle or with a comm hook's state. Not
/// across processes (Error(invalid_argument) at construction): a request (the scheduler picks ranks
/// within one process). A step that fails in one process fails in every process (the others at
/// the latest at their deadline, naming it); each then makes the communicator anew and goes on as
/// within one process. Where a process is gone that times out and the executor cannot be used: the
/// job ends.
class DataParallel {
 public:
  /// `model` gives the architecture (and, when materialized, the starting weights); `optimizer`
  /// is copied once per replica.
  template <class Opt>
    requires std::derived_from<Opt, optim::Optimizer>
  DataParallel(nn::Sequential model, DeviceGroup& group, Opt const& optimizer, DataParallelOptions options = {})
      : DataParallel(std::move(model), group, [optimizer] { return std::unique_ptr<optim::Optimizer>(new Opt(optimizer)); },
                     std::move(options)) {}
  DataParallel(nn::Sequential model, DeviceGroup& group, std::function<std::unique_ptr<optim::Optimizer>()> const& make_optimizer,
               DataParallelOptions options);
  DataParallel(DataParallel const&) = delete;
  DataParallel& operator=(DataParallel const&) = delete;
  ~DataParallel();

  /// One training step on the global batch: x [N, ...] (float32 or the compute type, or int32 token
  /// ids [N, T]) and labels, the targets of the options' loss (by default [N] float32 class ids;
  /// int32 [N, T] for nn::TokenCrossEntropy), in any device's or host memory. Shards x and labels
  /// by rows with the current weights, runs forward and backward on every used rank at once,
  /// all-reduces the gradients in buckets and updates every replica. Throws mgpu::Error naming the
  /// rank that failed (see the class comment for what a failure leaves), and
  /// Error(invalid_argument) before any work for x that does not fit the model or is none of
  /// those types, targets that the loss refuses (nn::Loss::check), or an lr_scale that is not
  /// finite and >= 0.
  DataParallelResult step(Tensor const& x, Tensor const& labels, float lr_scale = 1.0f);

  /// Rows of the test set whose predicted class is the label, evaluated on rank 0's replica.
  /// Throws Error(invalid_argument) for a label that is not a class id.
  std::int64_t count_correct(Tensor const& x, Tensor const& labels, std::int64_t batch = 1024);

  /// Saves, atomically and checksummed, what makes a resumed run equal the uninterrupted one:
  /// replica 0 (model, optimizer with its step count, RNG state), `state`, and the executor's own
  /// state: the accumulation cycle's length and position, each rank's accumulated gradients when
  /// saved mid-cycle, the loss scaler (scale, finite steps towards growth, skipped steps), and the
  /// comm hook's state (Bf16Compression's residuals) per rank.
  /// Across processes `path` is a folder (an io::ShardWriter save, see io/sharded_checkpoint.hpp),
  /// and every process calls save() with the same one: each writes its shard, with the sharded
  /// update the optimizer state of the elements its ranks own (without, process 0 writes it whole),
  /// and its ranks' rows of the per-rank records (accumulated gradients, the hook's state),
  /// process 0 also the whole records (its `state`), and once every shard is written process 0
  /// commits the save (one more than the folder's committed one); every process returns once it is
  /// committed, or throws the first process's failure. The previous save stays whole until then.
  /// In one process `path` is such a folder when it is an existing folder (a save of one shard).
  /// Throws Error(invalid_argument) for a save mid accumulation cycle at zero_stage 2 or 3 (the
  /// sharded gradients' cycle is not saved yet).
  void save(std::filesystem::path const& path, io::TrainingState const& state);
  /// Loads a checkpoint written by save() (on any number of devices) into every replica, leaving the
  /// executor exactly as a new one that loaded it: gradients accumulated before are dropped, the
  /// loss scaler and comm hook state are the file's (or, where the file has none, as configured /
  /// zero; an executor without a scaler or with another kind of hook ignores those records). On
  /// the device count that saved it (the world's, across processes) the run continues bitwise as it
  /// would have; on another, world rank 0 takes the sum of the saved ranks' accumulated gradients
  /// and hook residuals.
  /// A file from save_training or from before these records loads as saved at a cycle's start.
  /// A folder that save() wrote across processes loads in one process or across any number of
  /// processes (each reads the whole folder's records, and each rank the optimizer state of the
  /// elements it owns with the sharded update, from whichever shards hold them).
  /// Throws, leaving the executor as it was, Error(invalid_argument) naming the mismatch for
  /// another architecture, or for a checkpoint saved mid-cycle with another accumulation_steps.
  /// Makes an executor that a failed step left unusable usable again.
  io::TrainingState load(std::filesystem::path const& path);

  /// Throws Error(invalid_argument) naming the first rank and layer whose architecture or master
  /// parameters differ from rank 0's (a replica that diverged).
  void verify_replicas();

  /// The used ranks (indices into the group given), their current shard weights, the bucket
  /// layout (last layers first).
  [[nodiscard]] std::vector<int> const& ranks() const noexcept;
  [[nodiscard]] std::vector<double> const& weights() const noexcept;
  /// Every process's rows of a global batch of `rows`, in process order, for a caller that splits
  /// each global batch among the processes (see "Across processes" above). With `rebalance`, once
  /// every rank of the world has had rows: by the processes' measured speeds (the sum over each
  /// process's ranks of rows per millisecond, an exponentially weighted mean of each rank's step
  /// times, which every step exchanges), so rows move from slower processes to faster ones. Before
  /// that, and without rebalancing: by `weights`, one per process (e.g. the sums of their devices'
  /// speeds). Every process gets the same split; in one process {rows}. Throws
  /// Error(invalid_argument) for rows < 0, or across processes for weights of another count than
  /// the processes, or not finite and >= 0 with a positive sum.
  [[nodiscard]] std::vector<std::int64_t> process_rows(std::int64_t rows, std::vector<double> const& weights) const;
  [[nodiscard]] std::vector<Bucket> const& buckets() const noexcept;
  /// A replica (index into ranks()) and its optimizer (with zero_stage 1 to 3, whose whole state
  /// is gathered from every rank's blocks first). At zero_stage 2 and 3 a replica's gradients()
  /// are undefined: its layers write into the staging buffers. At zero_stage 3 both gather the
  /// whole model on every rank first, which the next step shards again: a reference kept across
  /// steps reads bucket buffers, not the whole model, until replica() is called again.
  [[nodiscard]] nn::Sequential& replica(int index);
  [[nodiscard]] optim::Optimizer& optimizer(int index);
  /// With the sharded update: every rank keeps the optimizer state of its owned elements only
  /// again, and at zero_stage 3 its owned parameters only, freeing what replica(), optimizer(),
  /// count_correct(), verify_replicas(), save() and load() gathered whole (the next step() does
  /// it first otherwise, so its peak memory would count them); nothing when already so. No
  /// collective. References from replica() read the gathered units' buffers from then on. Throws
  /// Error(invalid_argument), as step() does, on an executor that a failed step left unusable.
  void reshard();
  /// The loss scaler of replica 0 (nullptr without loss scaling).
  [[nodiscard]] optim::LossScaler const* loss_scaler() const;
  /// The group the replicas run on (the one given, or the used ranks' own group).
  [[nodiscard]] DeviceGroup& group() noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu::parallel
