// The pipeline executor's state, shared by its run (pipeline.cpp) and its checkpoints
// (checkpoint.cpp).
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/comm/mesh.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "comm/renewable.hpp"
#include "parallel/gradient_sync.hpp"

namespace mgpu::pipeline {

// The whole model, materialized in float32 host memory, and an optimizer of the chunks' kind for
// it: what a pipeline's checkpoint is written from and read into.
struct WholeModel {
  std::shared_ptr<Allocator> allocator = Allocator::create(Device{DeviceKind::host, 0});
  Stream stream{Device{DeviceKind::host, 0}};
  nn::Sequential model;
  std::unique_ptr<optim::Optimizer> optimizer;

  WholeModel(nn::Sequential const& architecture, ChunkOptimizerFactory const& make, std::uint64_t seed);
};

struct Executor::Impl {
  DeviceGroup* group = nullptr;
  Schedule schedule;
  std::vector<std::size_t> cuts;
  ExecutorOptions options;
  // Pipelines: data-parallel replicas x tensor-parallel ranks, each running rank t's shard of
  // replica a (tp = 1 without tensor parallelism).
  int replicas = 1;
  int tp = 1;
  // The grid's ranks as a mesh, dp x tp x pp (pp, the schedule's devices, fastest): pipeline p (of
  // `replicas`) is the p-th group along pp, and the helpers below are the only rank arithmetic.
  comm::DeviceMesh mesh{{{"pp", 1}}};
  [[nodiscard]] int rank_at(int pipeline, int device) const { return mesh.at("pp", pipeline, device); }
  [[nodiscard]] int pipeline_of(int rank) const { return mesh.group_index(rank, "pp"); }
  [[nodiscard]] int device_in_pipeline(int rank) const { return mesh.coordinate(rank, "pp"); }
  [[nodiscard]] int data_index(int pipeline) const { return mesh.coordinate(rank_at(pipeline, 0), "dp"); }
  [[nodiscard]] int tp_index(int pipeline) const { return mesh.coordinate(rank_at(pipeline, 0), "tp"); }
  // The world's ranks (comm's) of this process: [first, first + group->size()); across processes
  // the grid's other ranks belong to other processes, and their chunks stay unmaterialized here.
  int first = 0;
  bool across = false;  // the grid spans processes
  [[nodiscard]] bool is_local(int rank) const noexcept { return rank >= first && rank < first + group->size(); }
  std::unique_ptr<comm::Communicator> comm;                     // every rank: the pipelines' transfers
  // Per group along dp (mesh.groups("dp"): a tensor-parallel rank and device) and chunk ([group *
  // chunks + c], null for the chunks the group's device does not run and the groups of other
  // processes' ranks only): the data-parallel gradient sync over the group's replicas' chunk
  // (this process's of them), without overlap (finish() after the last micro-batch's backward
  // reduces every bucket), with options.zero_stage.
  std::vector<std::unique_ptr<parallel::detail::GradientSync>> replica_syncs;
  [[nodiscard]] parallel::detail::RankSync* replica_sync(int rank, int c) {
    if (replica_syncs.empty()) return nullptr;
    auto const& sync = replica_syncs[static_cast<std::size_t>(mesh.group_index(rank, "dp") * schedule.chunks() + c)];
    if (!sync) return nullptr;
    int added = 0;  // the sync's ranks: this process's of the group, in order
    for (int const other : mesh.group(rank, "dp")) {
      if (other == rank) break;
      if (is_local(other)) ++added;
    }
    return &sync->rank(added);
  }
  // With zero_stage 1: per pipeline and chunk ([pipeline * chunks + c]), the update's view of the
  // chunk's sync (ShardedUpdate); null for another process's.
  std::vector<std::unique_ptr<nn::GradientSync>> sharded_updates;
  // The optimizers of group g (along dp) for chunk c, in the group's order.
  [[nodiscard]] std::vector<optim::Optimizer*> replica_optimizers(std::size_t g, int c) const;
  // Every sync's optimizer state whole (before a checkpoint is written or read); the next step
  // shards it again.
  void gather_optimizer_state();
  // With zero_stage 3: every sync's chunks hold their whole parameters (gather_whole(): to read or
  // write them), until the next step keeps each replica's owned ones only (shard_parameters(),
  // which shards their optimizers' state with them). Collectives; nothing with other stages.
  void gather_whole();
  void shard_parameters();
  // Tensor parallelism: per replica a and chunk c (tp_comm(pipeline, c)), over the chunk's tp ranks.
  std::vector<std::shared_ptr<comm::Communicator>> tp_comms;
  [[nodiscard]] comm::Communicator& tp_comm(int pipeline, int c) const {
    return *tp_comms[static_cast<std::size_t>(data_index(pipeline) * schedule.chunks() + c)];
  }
  // Tensor parallelism: per pipeline and chunk, the ranges counted in the global gradient norm.
  std::vector<std::unique_ptr<nn::GradientSync>> norms;
  std::vector<std::shared_ptr<nn::Loss const>> losses;  // per pipeline: its last chunk's loss
  // Sequence parallelism: per pipeline and chunk, the ranges of gradients summed over the chunk's
  // tp ranks after backward (parallel::partial_ranges); empty without.
  std::vector<std::vector<nn::ParameterRange>> partials;
  std::vector<std::vector<nn::Sequential>> chunks;               // [replica][chunk]
  std::vector<std::vector<std::unique_ptr<optim::Optimizer>>> optimizers;
  nn::Sequential architecture;  // the whole model's layers, unmaterialized (checkpoints build it)
  // The whole model's dropout seeds from the last load() (empty: options.seed's, as materialized).
  std::vector<std::uint64_t> loaded_seeds;
  ChunkOptimizerFactory make_optimizer;
  double last_seconds = 0;
  bool last_applied = true;
  // A tied LM head in another chunk than its Embedding: wte is `elements` long at
  // embedding_offset of chunk embedding_chunk, and its copy at head_offset of chunk head_chunk.
  struct Tie {
    int embedding_chunk = 0, head_chunk = 0;
    std::int64_t embedding_offset = 0, head_offset = 0, elements = 0;
  };
  std::optional<Tie> tie;
  // Per pipeline, the tied elements: `elements` but for tensor-parallel ranks holding a row more or
  // less of the vocab (the chunks and offsets are every pipeline's).
  std::vector<std::int64_t> tie_elements;
  // The tie among one pipeline's chunks: a tied LM head holding a copy of wte (nn::TiedLMHead, or
  // a tensor-parallel rank's parallel::VocabParallelLMHead) and the embedding of its rows.
  static std::optional<Tie> find_tie(std::vector<nn::Sequential> const& pipeline_chunks);
  // Tensor parallelism: chunk c of pipeline r, rank r % tp's shard of its layers over the chunk's
  // communicator; a VocabParallelLMHead without its embedding in the chunk holds a copy of its rows.
  nn::Sequential tensor_parallel_chunk(int r, std::size_t c) const;
  // A float32 buffer laid out as chunk c of pipeline p's parameters: its master parameters, or one
  // of its optimizer's state buffers.
  using ChunkBuffer = std::function<Tensor(int pipeline, int c)>;
  // Tensor-parallel stages: copies a buffer of the whole model (host, gpt(config)'s layout: its
  // parameters or an optimizer's state) into every pipeline's local chunks' `buffer` (to_shards),
  // or gathers it from replica 0's (the split parts from every rank, the replicated ones from rank
  // 0; across processes collective); a tied head's copy of its rank's rows is made from wte's rows.
  void tensor_parallel_whole(std::span<float> whole, bool to_shards, ChunkBuffer const& buffer);
  // Every local chunk's compute copy of its master parameters, after they changed.
  void sync_local_chunks();
  // Tensor-parallel stages' save to and load from a file (tensor_parallel_checkpoint.cpp): through
  // the whole model and its optimizer on the host, as TensorParallel does (its errors, as every
  // check, come before any chunk changes).
  void save_tensor_parallel(std::filesystem::path const& path, io::TrainingState const& training);
  io::TrainingState load_tensor_parallel(std::filesystem::path const& path);
  // What replica 0's chunks hold besides their buffers, gathered from every process: the number of
  // state buffers of their optimizers (as many in every chunk, else Error(invalid_argument) naming
  // `what`) and the whole model's per-layer RNG state.
  struct ReplicaRecords {
    std::int32_t buffers = 0;
    std::vector<std::uint64_t> rng;
    std::vector<std::uint64_t> seeds;  // the whole model's rng_seeds(), from the chunks
  };
  // The index in the whole model (architecture) of each layer of chunk c of pipeline p (a local
  // one): the tensor-parallel stages' origins, else cuts[c] + its index.
  [[nodiscard]] std::vector<std::size_t> chunk_origins(int p, int c) const;
  // Sets chunk c of pipeline p's layers' RNG state and dropout seeds from the whole model's (`seeds`
  // empty: the chunk keeps its own), each layer its origin's.
  void set_chunk_rng(int p, int c, std::vector<std::uint64_t> const& rng, std::vector<std::uint64_t> const& seeds);
  // Folders (box_checkpoint.cpp): every process writes the boxes of the whole model's named tensors
  // that replica 0's chunks on its ranks hold (a replicated tensor by tensor-parallel rank 0, a tied
  // head's copy of wte by none), process 0 the layouts and the other records; load reads each local
  // chunk's boxes (a tied head's copy from wte's rows) from a folder of any layout.
  void save_boxes(std::filesystem::path const& folder, io::TrainingState const& training);
  io::TrainingState load_boxes(io::ShardedCheckpoint const& checkpoint);
  ReplicaRecords replica_records(std::string const& what);
  // Where each chunk's parameters sit in the whole model: the chunk's first `count` elements are
  // the whole model's [offset, offset + count); a tied head's copy of wte follows them.
  struct Span {
    std::int64_t offset = 0, count = 0;
  };
  [[nodiscard]] std::vector<Span> whole_spans() const;
  // Chunk c's share of a buffer laid out as the whole model's parameters (the parameters, or an
  // optimizer's state) between the whole buffer and the chunk's own, on `stream`: to_whole leaves
  // a tied head's copy of wte out, from_whole fills it from wte.
  void to_whole(int c, Tensor const& chunk_buffer, Tensor const& whole, Stream& stream) const;
  void from_whole(int c, Tensor const& whole, Tensor const& chunk_buffer, Stream& stream) const;
  // What from_whole copies: `count` elements from the whole buffer's `whole_begin` to the chunk's
  // `chunk_begin`, for chunk c's span, then a tied head's copy of wte.
  struct Part {
    std::int64_t whole_begin = 0, chunk_begin = 0, count = 0;
  };
  [[nodiscard]] std::vector<Part> chunk_parts(int c) const;
  // load() of a one-device file's records; `source` names it.
  io::TrainingState load_records(io::Checkpoint const& records, std::string const& source);
  // The end of every load(), once the chunks hold what was read: the seeds, the loss scaler, and
  // the executor usable again.
  io::TrainingState finish_load(io::TrainingRecords const& training, std::optional<optim::LossScaler::State> const& scaler);
  // Per replica, over its two tie devices (none when they are one; null for another process's).
  std::vector<std::shared_ptr<comm::Communicator>> tie_comms;
  // Every communicator above but another process's chunks' (which nothing calls), in the order
  // they were made, made anew by recover().
  std::vector<comm::detail::Renewable*> renewable;
  // A renewable communicator over `ranks`: the group's in one process (the mesh's subset factory,
  // else the group's own subsets), the world's across processes (options.make_subset_communicator:
  // a mesh's, or dist::subset_communicator_factory; Error(invalid_argument) without one).
  std::unique_ptr<comm::detail::Renewable> renewable_over(std::vector<int> const& ranks, comm::Options options);
  // Why the executor cannot be used (empty: it can), said by every call until load().
  std::string broken;
  void check_usable(char const* call) const;
  // After a step failed inside: waits for every stream, puts back the chunks' RNG state, drops the
  // step's tensors and makes the communicators anew (across processes with the other processes);
  // when `updated`, or when that fails, the executor cannot be used (broken) until load().
  // Rethrows `failure`.
  [[noreturn]] void recover(std::exception_ptr failure, bool updated);
  // Sums wte and its copy (the master parameters, or the master gradients) on the tie's devices of `rank`'s replica, leaving both equal; does nothing on
  // other ranks.
  void sum_tied(int rank, Stream& stream, bool parameters);
  // The update's total of the parts' values (nn::PartTotal; `parts`, this process's, in
  // step()'s order), added as apply_update adds them in one process: across processes, and with
  // ZeRO in one process too. Every rank's values all-gathered (with ZeRO each chunk's summed first),
  // then added in chunk order, each chunk's pipelines in order, in double on every process.
  double world_total(std::span<nn::UpdatePart const> parts, std::span<Tensor const> sums);

  // What a timed region of a device's step did (see DeviceState): compute actions; transfers and
  // sums over other communicators; sums over a chunk's tensor-parallel ranks (also timed there).
  enum class Region : char { compute, wait, tensor_parallel_sum };

  // One replica's batch for a step.
  struct Step {
    Tensor const* x;
    Tensor const* labels;
    std::int64_t units;  // the loss's divisor: the counted units of the whole batch
    std::vector<std::int64_t> sizes, offsets;  // global rows of each micro-batch
    std::vector<std::vector<Shape>> input_shapes;  // [chunk][micro-batch], and [chunks()] the logits
    std::vector<Tensor> losses;                    // per micro-batch, on the last chunk's device
    float loss_scale;                              // multiplies the loss gradient
  };
  // Tensors moving between one device's actions, slot chunk * micro_batches + micro-batch; each is
  // touched by that device's thread only and kept across steps, so a step allocates no containers.
  struct DeviceState {
    std::vector<Tensor> act_in, act_out, grad_in, grad_out;
    std::vector<std::vector<std::uint64_t>> rng_start, rng_after;  // per chunk
    std::vector<bool> ran_forward;                                 // per chunk, this step
    Event compute_done;  // recorded after a compute action that a forward follows
    // With options.metrics: an event before and after each of the step's timed regions (reused
    // across steps), what each region did, and how many ran.
    std::vector<Event> marks;
    std::vector<Region> kinds;
    std::size_t regions = 0;
  };
  std::vector<DeviceState> devices;  // per rank
  void run_device(int rank, Stream& stream, Step& step);
  // Enqueues `work` on `stream` between two of `st`'s marks when options.metrics is set.
  template <class Work>
  void timed(DeviceState& st, Stream& stream, Region kind, Work&& work) {
    if (!options.metrics) {
      std::forward<Work>(work)();
      return;
    }
    std::size_t const first = 2 * st.regions;
    if (st.marks.size() < first + 2) st.marks.resize(first + 2), st.kinds.resize(st.regions + 1);
    st.marks[first].record(stream);
    std::forward<Work>(work)();
    st.marks[first + 1].record(stream);
    st.kinds[st.regions++] = kind;
  }
  // With options.metrics and tensor-parallel stages: times the chunks' tensor-parallel
  // communicators' calls (the layers' sums inside compute actions, and the partial sums) from here
  // to the end of the step.
  void time_tensor_parallel();
  // After a step's streams finished: reports each local device's times to options.metrics (when
  // set): its regions' sums, the tensor-parallel calls inside compute actions moved from compute
  // to wait.
  void report_times();
  // Chunk c of the replica that `rank` belongs to.
  nn::Sequential& chunk_of(int rank, int c) {
    return chunks[static_cast<std::size_t>(pipeline_of(rank))][static_cast<std::size_t>(c)];
  }
};

}  // namespace mgpu::pipeline
