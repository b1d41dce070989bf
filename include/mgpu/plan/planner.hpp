// The layout planner: how to train a GPT on a set of devices. It enumerates the layouts the
// executors run (data-, tensor- and pipeline-parallel degrees, the ZeRO stage, activation
// recomputation, micro-batches), drops those the memory model (parallel::predict_gpt_memory) says
// do not fit, and ranks the rest by a model of the step time built from the layers' measured costs
// and the group's measured collectives. The scheduler decides where jobs and shards go; the
// planner decides the shape of one job on the devices it was given, above the executors whose
// layouts it weighs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>

namespace mgpu::plan {

/// A measured cost as a line in the tokens of a call: seconds = fixed + per_token * tokens (least
/// squares over the measured sizes; the fixed part is the per-call overhead that small
/// micro-batches pay).
struct CostLine {
  double fixed = 0;
  double per_token = 0;
  [[nodiscard]] double at(double tokens) const noexcept { return fixed + per_token * tokens; }
};

/// What a parallel step over `ranks` devices costs, measured with the ranks running alone (their
/// collectives, their update and their sharing of compute when they share it included): tensor
/// parallelism over `ranks` ranks, or data parallelism (ZeRO-1) over `ranks` replicas.
struct GroupCost {
  int ranks = 2;
  /// One block's forward + backward (recomputation none) and update, in the tokens of a rank (a
  /// replica's rows, or the tensor-parallel ranks' shared rows).
  CostLine block;
  /// The rest of a step: the embedding, head and cross-entropy, and the update of what is not a
  /// block.
  CostLine rest;
};

/// What a GPT's parts cost on one device of a group, and what the group's collectives cost: the
/// step-time model's inputs (measure_gpt_costs measures them; a test gives its own).
struct GptCosts {
  /// One transformer block's forward + backward, by nn::Recompute (none, selective, full).
  CostLine block[3];
  /// The token and position embeddings and the embedding dropout, forward + backward.
  CostLine embedding;
  /// The final LayerNorm, the tied LM head and the cross-entropy, forward + backward.
  CostLine head;
  /// By tensor-parallel degree (a layout with a degree not listed is not weighed).
  std::vector<GroupCost> tensor_parallel;
  /// By data-parallel degree, for data parallelism alone (without one listed, its step is composed
  /// from the one-device parts and the collectives below).
  std::vector<GroupCost> data_parallel;
  /// AdamW's update of one parameter (with clipping's norm).
  double update_seconds_per_element = 0;
  /// An all-reduce over the group: seconds = collective_seconds + bytes * 2 (n - 1) / n /
  /// collective_bytes_per_second for n ranks (a ring's bus bandwidth).
  double collective_seconds = 0;
  double collective_bytes_per_second = 1e12;
  /// Devices that compute at once: host devices share the machine's cores (their count); 0: every
  /// device computes on its own.
  int concurrency = 0;
};

/// Measures `config`'s costs on `group` for micro-batches of each of `rows` sequences of
/// config.block_size tokens (medians of `repeats` runs after one more, each fitted to a CostLine):
/// on rank 0, each part's forward + backward, timed layer by layer and scaled to the time of a
/// whole pass without the per-layer waits, for each recomputation mode, and AdamW's update over
/// the model; tensor parallelism over the first t devices for every degree t that divides
/// n_head and the group's size, and data parallelism over the first d devices for every d that
/// divides it (the fastest of at least 5 steps of TensorParallel, or of DataParallel at ZeRO-1,
/// on models of one and two blocks: their difference is a block, the rest the step's rest); and all-reduces over the whole group (one
/// value for the latency, 1 Mi values for the bandwidth). Throws Error(invalid_argument) for a bad
/// config (nn::gpt's checks), no rows or a row count < 1, repeats < 1.
[[nodiscard]] GptCosts measure_gpt_costs(nn::GptConfig const& config, DeviceGroup& group, std::vector<std::int64_t> const& rows,
                                         int repeats = 3);

/// One way to run a GPT step: data_parallel x tensor_parallel x stages devices.
struct Layout {
  int data_parallel = 1;
  int tensor_parallel = 1;
  /// Pipeline stages (1F1B; with data_parallel replicas of the pipeline).
  int stages = 1;
  /// DataParallelOptions::zero_stage (data parallelism alone; 0 otherwise).
  int zero_stage = 0;
  /// TensorParallelOptions::sequence_parallel (with tensor parallelism; its step costs are taken
  /// as tensor parallelism's: the same bytes gathered and scattered in place of the all-reduces).
  bool sequence_parallel = false;
  nn::Recompute recompute = nn::Recompute::none;
  /// The pipeline's micro-batches (1 without one).
  int micro_batches = 1;
  /// The pipeline's cuts of nn::gpt(config)'s layers (pipeline::Partition::cuts), empty without one.
  std::vector<std::size_t> cuts{};
};

/// "dp 2 x tp 1 x pp 2, 4 micro-batches, recompute none"; "dp 1 x tp 2 x pp 1, sequence parallel,
/// recompute full"; "dp 2 x tp 1 x pp 1, ZeRO 1, recompute selective".
[[nodiscard]] std::string to_string(Layout const& layout);

/// A layout with its predictions.
struct Candidate {
  Layout layout;
  /// The largest device's predicted peak (parallel::predict_gpt_memory), bytes.
  std::size_t peak_bytes = 0;
  /// The predicted step time, seconds (predict_step_seconds).
  double step_seconds = 0;
};

/// The predicted seconds of one training step of `rows` sequences in `layout` over
/// data_parallel x tensor_parallel x stages devices of speed 1, from `costs`: each device's
/// compute (a replica's largest share of rows; a pipeline's first micro-batch through every stage
/// and the rest at its slowest stage; tensor-parallel ranks, and data-parallel replicas without
/// other parallelism, their measured block and rest, a recomputing block's extra work split over
/// the ranks), its AdamW update (of its owned elements with ZeRO; within the measured
/// data-parallel step, but for ZeRO-0's larger one), at least the work of every device over `costs.concurrency` when they share compute; plus
/// the replicas' gradient all-reduce (reduce-scatter and all-gather with ZeRO; within the measured
/// data-parallel step) and ZeRO-3's parameter all-gathers in forward and backward, and a pipeline's
/// sends. Throws Error(invalid_argument) for a layout predict_gpt_memory refuses or a
/// tensor-parallel degree without costs.
[[nodiscard]] double predict_step_seconds(nn::GptConfig const& config, std::int64_t rows, Layout const& layout,
                                          GptCosts const& costs);

struct PlanOptions {
  /// Bytes each device may use: a layout fits when every device's predicted peak is at most this.
  std::size_t memory_bytes = std::numeric_limits<std::size_t>::max();
  /// Layouts to weigh: tensor parallelism (degrees dividing n_head; with and without sequence
  /// parallelism where the degree divides the block size), pipelines (1F1B, micro-batches stages x
  /// 1, 2, 4 up to a replica's rows, cut by predicted time) and the ZeRO stages 0-3.
  bool tensor_parallel = true;
  bool pipeline = true;
  bool zero = true;
};

/// The layouts over exactly `devices` devices of speed 1 (data x tensor x pipeline degrees whose
/// product is `devices`, tensor-parallel degrees with costs; every recomputation mode), ranked by predicted step time, fastest first
/// (ties: the smaller peak); `candidates` holds those that fit, `considered` counts all.
struct Plan {
  std::vector<Candidate> candidates;
  std::size_t considered = 0;
};

/// Plans `config` for a global batch of `rows` sequences on `devices` devices. Throws
/// Error(invalid_argument) for devices < 1, rows < 1, a bad config or no layout over the devices
/// (e.g. 3 devices, 2 rows and 4 heads), and Error(out_of_memory) naming the smallest predicted
/// peak when no layout fits options.memory_bytes.
[[nodiscard]] Plan plan_gpt(nn::GptConfig const& config, std::int64_t rows, int devices, GptCosts const& costs,
                            PlanOptions const& options);

}  // namespace mgpu::plan
