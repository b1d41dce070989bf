// Model parallelism: a Sequential cut into chunks over the devices of a DeviceGroup, trained by
// running any valid pipeline Schedule (layer split, GPipe, 1F1B, interleaved, ZB-H1) with the
// communicator's send/recv, gradient accumulation over micro-batches and one optimizer per chunk.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/schedule.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::pipeline {

/// Layer split (plain model parallelism): one micro-batch through the devices in turn, forward
/// then backward; the baseline pipelines beat.
Schedule layer_split(int devices);

/// Where a model is cut: chunk c runs layers [cuts[c], cuts[c + 1]) on device device[c], with the
/// time and memory predicted for it.
struct Partition {
  std::vector<std::size_t> cuts;
  /// Per chunk: one micro-batch's forward + backward on its device (the costs' unit, seconds when
  /// profiled).
  std::vector<double> chunk_seconds;
  std::vector<int> device;
  /// Per chunk: the bytes it holds at its peak (parameters, gradients, optimizer state and the
  /// activations of the micro-batches in flight), and the free bytes it was fitted into (its
  /// device's, divided among the device's chunks). 0 and infinity when memory is not modelled.
  std::vector<double> chunk_bytes;
  std::vector<double> free_bytes;
};

/// The plan as lines of text, one per chunk: its device, layers, predicted time and memory against
/// free memory, e.g. "chunk 0 on device 0: layers [0, 6), 1.25 ms, 3.1 MiB of 16.0 GiB free".
std::string to_string(Partition const& plan);

/// Cuts `model` into `chunks` contiguous chunks between its units (a Linear and its fused
/// activation stay together), minimizing the slowest chunk's summed `layer_seconds` (one per
/// layer), on equal devices without memory limits. Throws Error(invalid_argument) when the model
/// has fewer units than chunks or the costs do not match its layers.
Partition partition(nn::Sequential const& model, int chunks, std::vector<double> const& layer_seconds);

/// A device as the partitioner sees it: its speed relative to the device the layer costs are for
/// (1: as fast; 0.5: each layer takes twice as long), and the bytes a pipeline may use on it.
struct StageDevice {
  double speed = 1.0;
  double free_bytes = std::numeric_limits<double>::infinity();
};

/// The `devices` pipeline devices of `group` as StageDevices, from sched::node_state(group): with
/// data-parallel replicas (group.size() a multiple of `devices`; rank r runs pipeline device
/// r % devices, as in the Executor), each pipeline device is its slowest rank with its least free
/// memory. Speed: relative to the group's fastest device (the device profile_layers() reports
/// costs for); free bytes: the rank's share of its device's memory minus what its allocator holds,
/// and at most the allocator's limit minus what it has allocated. Throws Error(invalid_argument)
/// when group.size() is not a multiple of `devices`.
std::vector<StageDevice> stage_devices(DeviceGroup const& group, int devices);

/// Per-layer costs for partitioning, one entry per layer (a unit's cost sits on its first layer).
struct LayerProfile {
  /// Forward + backward seconds of one micro-batch on a speed-1 device.
  std::vector<double> seconds;
  /// Bytes of the layer's float32 parameters.
  std::vector<double> parameter_bytes;
  /// Bytes one micro-batch's forward leaves allocated until its backward (saved tensors and output).
  std::vector<double> activation_bytes;
};

/// How profile_layers() measures one forward + backward of a unit: it calls `run`, which enqueues
/// them on rank 0's stream and waits for them, and returns the seconds they took on rank 0. The
/// default (an empty ProfileTimer) reads the steady clock around `run`; a test, or a cost model,
/// gives known costs instead of the machine's speed.
using ProfileTimer = std::function<double(std::function<void()> const& run)>;

/// Profiles each unit of `model` on `group`'s rank 0 for a micro-batch of `input` shape: the
/// median of `repeats` forward + backward times (measured by `timer`), scaled by rank 0's speed
/// relative to the group's fastest device (so a slow or speed-emulated rank 0 still reports the
/// fastest device's costs, which stage_devices() speeds divide), and the bytes its forward leaves
/// on rank 0's allocator. Runs on rank 0 only: the other devices are assumed to differ by their
/// speed alone.
LayerProfile profile_layers(nn::Sequential const& model, DeviceGroup& group, Shape const& input, int repeats = 3,
                            ProfileTimer const& timer = {});

struct PartitionOptions {
  /// float32 copies of the parameters the optimizer keeps: 1 for SGD with momentum, 0 without, 2
  /// for AdamW.
  int optimizer_states = 1;
};

/// Cuts `model` into schedule.chunks() contiguous chunks between units for running `schedule` on
/// `devices` (one per schedule device; chunk c runs on devices[c % devices.size()]), minimizing
/// the slowest chunk's time: its layers' profile.seconds summed, divided by its device's speed.
/// Each chunk must fit in memory: its parameters times (2 + optimizer_states) (parameters,
/// gradients, optimizer state) plus its activation_bytes times the micro-batches its device holds
/// in flight at the schedule's peak (simulate(schedule).peak_in_flight), within its device's
/// free_bytes (with v chunks per device, a v-th of them each: enough for the device's sum).
/// Exact: a dynamic program over unit boundaries finds a split whose slowest chunk is the smallest
/// among all contiguous splits that fit. Throws Error(invalid_argument) when the sizes do not match
/// (profile entries per layer, a device per schedule device, more chunks than units), and
/// Error(out_of_memory) when no split fits, naming the chunk and device of the split that comes
/// closest, the bytes it needs and the bytes free.
Partition partition(nn::Sequential const& model, Schedule const& schedule, LayerProfile const& profile,
                    std::vector<StageDevice> const& devices, PartitionOptions options = {});

/// Tensor-parallel pipeline stages (a data x tensor x pipeline grid, see Executor): every stage
/// split over `ranks` devices, each running one rank's shard of the stage's layers. Megatron's
/// layers (tensor_parallel_stages() fills this for a GPT) run their collectives inside
/// forward and backward over the communicator of the stage's ranks.
struct TensorParallelStages {
  /// The ranks per stage, B (1: no tensor parallelism).
  int ranks = 1;
  /// Rank `rank`'s shard of the whole model's layers [begin, end) (a chunk: Sequential::stage of
  /// the rank's shard), its layers' collectives over `comm` (the chunk's ranks). Called once per
  /// pipeline and chunk.
  std::function<nn::Sequential(std::shared_ptr<comm::Communicator> const& comm, int rank, std::size_t begin,
                               std::size_t end)>
      stage{};
  /// The loss of rank `rank`'s last stage, over the last stage's communicator `comm` (replaces
  /// ExecutorOptions::loss).
  std::function<std::shared_ptr<nn::Loss const>(std::shared_ptr<comm::Communicator> const& comm, int rank)> loss{};
  /// Sequence parallelism: the chunks' LayerNorms' gradients are each rank's tokens' part
  /// (parallel::partial_ranges), summed over the chunk's ranks before the update.
  bool sequence_parallel = false;
};

/// gpt(config)'s tensor-parallel stages over `ranks` ranks per stage: rank t's pipeline holds
/// parallel::tensor_parallel_gpt(config, comm, t, sequence_parallel) cut at the executor's cuts
/// (gpt(config)'s layers; with sequence parallelism the layer that gathers the tokens before the
/// LM head goes with the head), its last stage the parallel::VocabParallelCrossEntropy; the
/// executor is given gpt(config) as its model. Throws Error(invalid_argument) for ranks that do
/// not divide n_head.
[[nodiscard]] TensorParallelStages tensor_parallel_stages(nn::GptConfig const& config, int ranks,
                                                          bool sequence_parallel = false);

struct ExecutorOptions {
  /// Initialises the chunks as nn::Sequential::materialize(seed) initialises the whole model.
  std::uint64_t seed = 0;
  /// Data-parallel replicas of the pipeline (a data x pipeline grid): replica r runs on ranks
  /// [r * devices, (r + 1) * devices) on the r-th shard of each batch, and the same chunk across
  /// replicas all-reduces its gradients over a communicator of those ranks. The group has
  /// devices x data_parallel ranks (x tensor_parallel.ranks: then replica r's pipelines run on
  /// ranks [r * ranks * devices, (r + 1) * ranks * devices), see Executor).
  int data_parallel = 1;
  /// The communicator's deadline (zero: comm::default_timeout()).
  std::chrono::milliseconds timeout{0};
  /// The type the chunks compute in and send between devices: float32, or bfloat16/float16 with
  /// float32 master parameters that the optimizers update (as nn::Sequential::materialize).
  DType compute = DType::float32;
  /// Dynamic loss scaling (for float16): the loss gradient is multiplied by the scale, and a step
  /// in which any chunk's gradients (of any replica) hold NaN or Inf is skipped by every chunk.
  /// The executor has no checkpoint of its own: a run continued by a new executor passes a scaler
  /// given the old one's state (Executor::loss_scaler()->state(), LossScaler::set_state()).
  std::optional<optim::LossScaler> loss_scaler{};
  /// Clip the gradients to this global norm over every chunk (a tied embedding counted once),
  /// finite and > 0; 0 turns clipping off.
  float clip_norm = 0.0f;
  /// What the last stage computes from each micro-batch's output (nullptr: nn::SoftmaxCrossEntropy,
  /// float32 class ids). Its divisor is the counted units of the whole batch, counted on the host
  /// before any action runs, so the micro-batches' losses and gradients add up to the batch's mean.
  std::shared_ptr<nn::Loss const> loss{};
  /// Where every action is recorded (rank = device, compute lane; transfers on the communication
  /// lane); nullptr for none.
  std::shared_ptr<trace::Timeline> timeline{};
  /// Tensor-parallel stages (ranks > 1: a data x tensor x pipeline grid, see Executor).
  TensorParallelStages tensor_parallel{};
  /// Makes the communicator of the pipelines' transfers from the group and {automatic, timeout}
  /// (empty: comm::make_communicator over the group). Across processes,
  /// dist::communicator_factory(world): see "Across processes" at Executor.
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> make_communicator{};
  /// Across processes with tensor-parallel stages: makes the communicator over some world ranks
  /// (rank i is world rank ranks[i]) from the group and {automatic, timeout}, for each chunk's
  /// tensor-parallel ranks; dist::subset_communicator_factory(world).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, std::vector<int> const&, comm::Options)>
      make_subset_communicator{};
  /// Where each of this process's devices' times are reported at the end of every step
  /// (metrics::DeviceTimes, rank: its rank in the group): compute, its forward, backward and loss
  /// actions; wait, its transfers and gradient sums (between stages, replicas and tensor-parallel
  /// ranks, the sums inside tensor-parallel layers moved there from compute), measured by events
  /// on its stream around each. nullptr: not measured.
  std::shared_ptr<metrics::Registry> metrics{};
};

/// Makes one optimizer (each chunk gets its own, for its own parameters).
using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>()>;
/// Makes the optimizer of one chunk, given the chunk (its layers and flat buffers' layout, e.g.
/// AdamW's decay_ranges = chunk.matrix_ranges() for weight decay on its weight matrices only).
using ChunkOptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(nn::Sequential const& chunk)>;

/// Runs a schedule over a DeviceGroup: chunk c of the model on rank c % devices (of each replica,
/// see ExecutorOptions::data_parallel). A GPT's LM head tied to its token embedding may sit in
/// another chunk than the Embedding: that chunk holds a copy of wte (see nn::TiedLMHead), made
/// equal to the embedding's at construction, and the two chunks' wte gradients are summed between
/// their devices (after the data-parallel all-reduce) before every update. Each step splits
/// the batch into the schedule's micro-batches (sizes as shard_sizes), runs every device's actions
/// (consecutive transfers grouped, so crossing sends and receives cannot deadlock), accumulates
/// parameter gradients over micro-batches and, in step(), updates each chunk. Dropout draws as in
/// the unsplit model: every micro-batch's forward uses the step's draw and its global rows.
/// Before enqueuing a forward, each device's thread waits for its stream to finish the compute
/// action before it (not the transfers in between, which may still wait for a peer), so memory
/// follows the schedule (1F1B holds at most devices - d micro-batches' activations on device d,
/// GPipe all) while the stream starts the forward as soon as its input arrives. Without a timeline
/// (or with it disabled) a step builds no names and allocates no containers per action.
/// A batch is checked before any action (nn::check_batch). If an action fails, the communicator
/// aborts the other devices and the step throws the failure's Error (its rank, and the failing
/// device, chunk and action where the action itself threw). Nothing was changed: the chunks' RNG is
/// put back, the communicators are made anew (across processes, where a failure in one process
/// fails the step in every process, by every process) and the executor goes on. A failure in the
/// update after it began, or communicators that cannot be made again (a process gone), leave it
/// unusable: step() and save() throw Error(invalid_argument) saying so with the step's error,
/// until load().
/// The group must outlive the executor. Not thread-safe: call from one thread.
///
/// Tensor-parallel stages (options.tensor_parallel.ranks = B > 1): a data x tensor x pipeline grid
/// of A = data_parallel replicas, B ranks per stage and `devices` stages over A x B x devices
/// ranks. It runs B pipelines per replica in lock-step: pipeline a B + t, on ranks
/// [(a B + t) devices, (a B + t + 1) devices), holds rank t's shard of every chunk
/// (tensor_parallel.stage(comm, t, begin, end), comm being the chunk's B ranks of replica a) and
/// runs the schedule on the replica's rows, as every pipeline of the replica does: each of them
/// runs the same actions in the same order, so the collectives the shards run inside forward and
/// backward meet on the chunk's B ranks, and a transfer goes from rank t's stage to rank t's next
/// stage. With sequence parallelism each chunk's partial LayerNorm gradients are then summed over
/// its B ranks. The rank-t pipelines of the A replicas sum their gradients as replicas do; a tied
/// LM head (parallel::VocabParallelLMHead) in another chunk than its embedding holds a copy of its
/// rank's rows, summed with them as above. Clipping counts split parameters on every rank of
/// replica 0 and replicated ones on its rank 0 (parallel::norm_ranges). The executor's model is
/// the whole model (its layers and cut points), its `loss` is replaced by tensor_parallel.loss,
/// and chunk(c, replica) takes the pipeline a B + t as its replica. Any compute type; across processes
/// with options.make_subset_communicator for each chunk's B ranks (the grid is laid out as below;
/// a rank's replicas sum over the same tensor-parallel rank, clipping adds each chunk's counted
/// ranges over the world); gather_parameters and scatter_parameters move the whole model (the model's layout) to and from
/// the shards, save and load are refused (Error(invalid_argument)). For a GPT,
/// tensor_parallel_stages().
///
/// Across processes: every process makes the executor over its own DeviceGroup with the same
/// model, cuts, schedule and options, and options.make_communicator = dist::communicator_factory(
/// dist::make_world(group)). The grid then spans the world's devices: world rank g (the
/// communicator's ranks, process 0's devices first) runs pipeline device g % devices of replica
/// g / devices, so schedule.devices x data_parallel must be the world's device count and every
/// process runs the stages on its own devices; activations and gradients cross processes over the
/// communicator's send/recv. With replicas (e.g. 2 processes x 2 devices as 2 stages x 2
/// replicas: each process one replica), the same chunk's replicas sum their gradients, and a tied
/// LM head's two devices their wte, through send/recv too: the replicas' first rank adds the
/// others' in replica order, as the all-reduce within one process does. Every process passes the
/// whole batch (each rank takes its rows), and step() returns the batch's loss on every process
/// (the last stages' losses, all-gathered). gather_parameters() brings every chunk to every
/// process, scatter_parameters() and load() fill this process's chunks, chunk() gives this
/// process's chunks only. Clipping and loss scaling see every process's chunks: each chunk's
/// squared norm (or overflow count) is all-gathered and every process adds them in chunk order,
/// as apply_update does in one process. A run is bitwise the one-process run over as many
/// devices, however the devices are spread over processes (with tensor-parallel stages within
/// float32 rounding: the norm's and the shards' sums may combine in another order). save() writes a folder of a shard per
/// process (see save()).
class Executor {
 public:
  /// Cuts `model` at `cuts` (schedule.chunks() + 1 increasing layer indices, from 0 to
  /// model.size(), each a cut point of the model) and validates `schedule`, which must be for
  /// group.size() devices. Throws Error(invalid_argument) naming what is wrong, also for an empty
  /// `make_optimizer` or one that returns no optimizer.
  Executor(nn::Sequential const& model, DeviceGroup& group, std::vector<std::size_t> cuts, Schedule schedule,
           OptimizerFactory make_optimizer, ExecutorOptions options = {});
  /// As above, with an optimizer made for each chunk from the chunk.
  Executor(nn::Sequential const& model, DeviceGroup& group, std::vector<std::size_t> cuts, Schedule schedule,
           ChunkOptimizerFactory make_optimizer, ExecutorOptions options = {});
  ~Executor();
  Executor(Executor const&) = delete;
  Executor& operator=(Executor const&) = delete;

  /// Forward and backward of every micro-batch of x ([N, features] float32, or int32 token ids
  /// [N, T]) and labels (the loss's targets: by default [N] float32 class ids; int32 [N, T] for
  /// nn::TokenCrossEntropy), leaving the batch's mean-loss gradients in each chunk's gradient
  /// buffer (the tied embedding's summed); returns the batch's mean loss. x and labels may live on
  /// any device. Throws Error(invalid_argument), before any action runs (the executor stays
  /// usable), when N is smaller than the number of micro-batches, x does not fit the model, or the
  /// loss refuses the labels (nn::Loss::check).
  float compute_gradients(Tensor const& x, Tensor const& labels);
  /// compute_gradients(), then the update of every chunk through nn::apply_update (unscaling,
  /// the loss scaler's overflow check over all chunks, clipping by the global norm over all
  /// chunks, each chunk's optimizer step with its learning rate times lr_scale): when the loss
  /// scaler found NaN or Inf gradients in any chunk, no chunk updates (see last_step_applied()).
  /// Returns once every chunk is updated (it synchronizes the group's streams). Throws
  /// Error(invalid_argument) for an lr_scale that is not finite and >= 0.
  float step(Tensor const& x, Tensor const& labels, float lr_scale = 1.0f);
  /// Copies replica 0's float32 master parameters into `whole`, a materialized model of the
  /// executor's architecture on any device, as one device holds them (the chunks' parameters in
  /// layer order, a tied LM head's copy of wte left out), and refreshes its compute-type weights;
  /// e.g. to evaluate or sample the trained model. `stream` is whole's; returns once the copies are
  /// done. Throws Error(invalid_argument) for a model of another parameter count.
  void gather_parameters(nn::Sequential& whole, Stream& stream);
  /// Copies `whole`'s float32 master parameters into every replica's chunks (a tied head's copy
  /// from wte) and refreshes their compute-type weights; e.g. to start from trained weights.
  void scatter_parameters(nn::Sequential const& whole, Stream& stream);
  /// Saves the model as one device holds it, in io::save_training's format, from replica 0 (the
  /// replicas are equal): the chunks' float32 master parameters in layer order (a tied LM head's
  /// copy of wte left out: it equals wte), every chunk's optimizer state in the same order and the
  /// optimizers' step count, every layer's RNG state, `state`, and the loss scaler's state. The
  /// file loads into an executor of the same model on any schedule, cuts, devices or replicas, into
  /// a parallel::DataParallel, or into one model (io::load_training). Written atomically.
  /// Across processes (every process calls it with the same `path`), or into an existing folder, it
  /// writes a folder of io::ShardWriter shards, one per process: each process's holds the
  /// parameters and optimizer state of replica 0's chunks that its ranks run, process 0's the
  /// other records besides (every layer's RNG state gathered from the chunks' processes); once
  /// every shard is written process 0 commits the save (io::commit_shards), and every process
  /// returns once it is committed or throws the first failing process's error (Error(io) naming
  /// its world rank on the others). Throws Error(invalid_argument) when the chunks' optimizers
  /// hold different numbers of state buffers.
  void save(std::filesystem::path const& path, io::TrainingState const& state = {});
  /// Loads a file or folder of save(), DataParallel::save() or io::save_training() into every
  /// replica's chunks and optimizers (a tied head's copy of wte from wte), and the loss scaler's
  /// state when it has one; a folder on any process or device count. Everything is verified first
  /// (a file's checksums; a folder's records' headers, its whole records and the pieces this
  /// process reads; architecture, optimizer kind), across processes on every process: on an error
  /// the executor is unchanged on every process and the Error names the mismatch or the damaged
  /// file (on the other processes, Error(io) naming the process that failed).
  io::TrainingState load(std::filesystem::path const& path);
  /// load() of a folder already opened: each process reads the split records (the parameters and
  /// the optimizer's state) only in the parts its chunks hold (a tied LM head's copy of wte from
  /// wte's), so only the pieces that hold them (checkpoint.payload_bytes_read() counts them).
  io::TrainingState load(io::ShardedCheckpoint const& checkpoint);
  /// Whether the last step() updated the parameters.
  [[nodiscard]] bool last_step_applied() const noexcept;
  /// The loss scaler (nullptr without one).
  [[nodiscard]] optim::LossScaler const* loss_scaler() const noexcept;

  [[nodiscard]] Schedule const& schedule() const noexcept;
  [[nodiscard]] std::vector<std::size_t> const& cuts() const noexcept;
  /// Chunk c's layers, parameters and gradients in `replica` (on rank replica * devices +
  /// c % devices); read them after a step.
  [[nodiscard]] nn::Sequential& chunk(int c, int replica = 0);
  /// Wall seconds of the last step's schedule run (from the first action to the last device done).
  [[nodiscard]] double last_step_seconds() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu::pipeline
