// The memory one training step of a GPT takes on each device in each layout, in the caching
// allocator's bytes, for a planner (the model is described in docs/parallel-layouts.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <mgpu/core/dtype.hpp>
#include <mgpu/nn/gpt.hpp>

namespace mgpu::parallel {

/// One compute pass of a pipeline device, in the order the device runs them (a schedule's
/// forward, backward, backward_input and backward_weight actions, pipeline::memory_passes).
struct GptPass {
  enum class Kind { forward, backward, backward_input, backward_weight };
  Kind kind = Kind::forward;
  int micro_batch = 0;
  int chunk = 0;  ///< the model chunk: layers [cuts[chunk], cuts[chunk + 1]), on device chunk % devices
};

/// Where a GPT runs: `data_parallel` replicas of `tensor_parallel` ranks each, optionally as a
/// pipeline cut at `cuts`.
struct GptLayout {
  int data_parallel = 1;
  int tensor_parallel = 1;
  int zero_stage = 1;  ///< the executor's zero_stage (0 to 3)
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;  ///< DataParallelOptions' bucket caps
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  bool zero3_block_units = true;    ///< DataParallelOptions::zero3_block_units
  std::vector<std::size_t> cuts{};  ///< pipeline::Partition::cuts of nn::gpt(config); empty: none
  int micro_batches = 1;            ///< the pipeline's micro-batches
  bool gpipe = false;               ///< GPipe (every micro-batch in flight), else 1F1B; without `passes`
  /// Any schedule (interleaved, zero-bubble): per pipeline device, its compute passes in order; the
  /// chunks are cuts.size() - 1, chunk c on device c % passes.size(). Empty: one chunk per device,
  /// GPipe or 1F1B as `gpipe` says.
  std::vector<std::vector<GptPass>> passes{};
  bool sequence_parallel = false;   ///< TensorParallelOptions::sequence_parallel
  /// The compute type: float32, or bfloat16 / float16 with float32 masters (each rank's parameters
  /// and gradients then also have compute-type copies; activations and backward's temporaries are
  /// in the compute type, LayerNorm statistics and the attention's log-sum-exp in float32).
  DType compute = DType::float32;
};

/// One device's predicted peak, in allocator bytes (each tensor's block size, Allocator::block_size).
struct GptMemory {
  std::size_t parameters = 0;
  std::size_t gradients = 0;
  std::size_t optimizer = 0;  ///< AdamW's m and v (of the rank's owned elements with ZeRO-1)
  std::size_t activations = 0;  ///< what forward keeps for backward at the peak
  std::size_t workspace = 0;    ///< the rest at that moment (outputs, backward's temporaries)
  [[nodiscard]] std::size_t total() const noexcept { return parameters + gradients + optimizer + activations + workspace; }
};

/// The peak of one AdamW training step (computing in layout.compute) of nn::gpt(config) on `rows` sequences of
/// config.block_size tokens, per device in the executor's rank order. Throws
/// Error(invalid_argument) for a bad config, rows < data_parallel or micro_batches, a
/// tensor_parallel that does not divide n_head or exceeds the vocab, a zero_stage other than 0 to
/// 3 (or 3 with cuts and replicas), bad cuts, passes that do not run each chunk's forward and backward of each
/// micro-batch once on its device, a replica with fewer rows than micro_batches, or
/// sequence_parallel without a tensor_parallel >= 2 that divides config.block_size.
[[nodiscard]] std::vector<GptMemory> predict_gpt_memory(nn::GptConfig const& config, std::int64_t rows,
                                                        GptLayout const& layout);

}  // namespace mgpu::parallel
