// The layout planner: the data x tensor x pipeline layouts of a GPT on a device count that fit the
// memory model, ranked by a step-time model from measured costs. Guide: docs/parallel-layouts.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>

namespace mgpu::plan {

/// A measured cost, seconds = fixed + per_token * tokens (least squares over the measured sizes).
struct CostLine {
  double fixed = 0;
  double per_token = 0;
  [[nodiscard]] double at(double tokens) const noexcept { return fixed + per_token * tokens; }
};

/// A measured step of tensor parallelism, or data parallelism (ZeRO-1), over `ranks` devices.
struct GroupCost {
  int ranks = 2;
  /// One block's forward + backward (recompute none) and update, in a rank's tokens.
  CostLine block;
  /// The rest of a step: embedding, head, cross-entropy and their update.
  CostLine rest;
};

/// The step-time model's inputs: a GPT's parts on one device, and the group's collectives.
struct GptCosts {
  /// One transformer block's forward + backward, by nn::Recompute (none, selective, full).
  CostLine block[3];
  /// The token and position embeddings and the embedding dropout, forward + backward.
  CostLine embedding;
  /// The final LayerNorm, the tied LM head and the cross-entropy, forward + backward.
  CostLine head;
  /// By tensor-parallel degree (a layout with a degree not listed is not weighed).
  std::vector<GroupCost> tensor_parallel;
  /// By data-parallel degree (unlisted: composed from the parts and the collectives).
  std::vector<GroupCost> data_parallel;
  /// AdamW's update of one parameter (with clipping's norm).
  double update_seconds_per_element = 0;
  /// An all-reduce of n ranks: collective_seconds + bytes * 2 (n - 1) / n / collective_bytes_per_second.
  double collective_seconds = 0;
  double collective_bytes_per_second = 1e12;
  /// Devices that compute at once (host devices: the cores); 0: every device on its own.
  int concurrency = 0;
};

/// Measures `config`'s costs on `group` at each of `rows` rows (medians of `repeats` runs): the parts
/// on rank 0, tensor and data parallelism over the degrees that divide the group (and n_head), and
/// all-reduces. Throws Error(invalid_argument) for a bad config, no rows, a row count or repeats < 1.
[[nodiscard]] GptCosts measure_gpt_costs(nn::GptConfig const& config, DeviceGroup& group, std::vector<std::int64_t> const& rows,
                                         int repeats = 3);

/// One way to run a GPT step: data_parallel x tensor_parallel x stages devices.
struct Layout {
  int data_parallel = 1;
  int tensor_parallel = 1;
  /// Pipeline stages (1F1B; with data_parallel replicas of the pipeline).
  int stages = 1;
  /// The ZeRO stage over the data_parallel replicas (at most parallel::max_zero_stage; 0 with one).
  int zero_stage = 0;
  /// TensorParallelOptions::sequence_parallel (costed as tensor parallelism).
  bool sequence_parallel = false;
  nn::Recompute recompute = nn::Recompute::none;
  /// The pipeline's micro-batches (1 without one).
  int micro_batches = 1;
  /// The pipeline's cuts of nn::gpt(config)'s layers (pipeline::Partition::cuts), empty without one.
  std::vector<std::size_t> cuts{};
};

/// E.g. "dp 2 x tp 1 x pp 2, 4 micro-batches, recompute none".
[[nodiscard]] std::string to_string(Layout const& layout);

/// A layout with its predictions.
struct Candidate {
  Layout layout;
  /// The largest device's predicted peak (parallel::predict_gpt_memory), bytes.
  std::size_t peak_bytes = 0;
  /// The predicted step time, seconds (predict_step_seconds).
  double step_seconds = 0;
};

/// The predicted seconds of a step of `rows` sequences in `layout` on devices of speed 1, from
/// `costs` (the model: docs/parallel-layouts.md, "The planner"). Throws Error(invalid_argument) for
/// a layout predict_gpt_memory refuses or a tensor-parallel degree without costs.
[[nodiscard]] double predict_step_seconds(nn::GptConfig const& config, std::int64_t rows, Layout const& layout,
                                          GptCosts const& costs);

struct PlanOptions {
  /// Bytes each device may use: a layout fits when every device's predicted peak is at most this.
  std::size_t memory_bytes = std::numeric_limits<std::size_t>::max();
  /// Layouts to weigh: tensor parallelism (with and without sequence parallelism), 1F1B pipelines
  /// (stages x 1, 2, 4 micro-batches), the ZeRO stages parallel::max_zero_stage allows in float32.
  bool tensor_parallel = true;
  bool pipeline = true;
  bool zero = true;
};

/// The layouts that fit, fastest first (ties: the smaller peak), of `considered` over the devices.
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
