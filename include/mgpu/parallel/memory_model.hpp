// A model of the memory one training step of a GPT takes on each device, in every layout of one
// process that the library runs it in (one device, data parallel with or without ZeRO-1, tensor
// parallel, both), in the caching allocator's bytes: what a planner weighs layouts by before
// running any.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <mgpu/nn/gpt.hpp>

namespace mgpu::parallel {

/// Where a GPT runs: `data_parallel` replicas of `tensor_parallel` ranks each (DataParallel's ranks
/// with tensor_parallel 1, else TensorParallel with TensorParallelOptions::data_parallel), on
/// data_parallel x tensor_parallel devices.
struct GptLayout {
  int data_parallel = 1;
  int tensor_parallel = 1;
  /// DataParallelOptions::zero_stage (0 or 1); tensor parallelism keeps every rank's whole state.
  int zero_stage = 1;
};

/// One device's predicted peak, in allocator bytes (each tensor's block size, Allocator::block_size).
struct GptMemory {
  std::size_t parameters = 0;
  std::size_t gradients = 0;
  std::size_t optimizer = 0;  ///< AdamW's m and v (of the rank's owned elements with ZeRO-1)
  /// What forward keeps for backward at the peak (the start of the last block's backward): every
  /// block's saved tensors; with full recomputation every block's input and the rerun block's.
  std::size_t activations = 0;
  /// The rest at that moment: the embedding's and the final LayerNorm's outputs and backward's
  /// temporaries (fitted: see predict_gpt_memory).
  std::size_t workspace = 0;
  [[nodiscard]] std::size_t total() const noexcept { return parameters + gradients + optimizer + activations + workspace; }
};

/// The peak of one float32 training step (AdamW; config.recompute's activation recomputation) of
/// nn::gpt(config) on a batch of `rows` sequences of config.block_size tokens, per device in rank
/// order, the rows split as DataParallel and TensorParallel split them over replicas of one speed
/// (the first rows mod data_parallel replicas one more). Per transformer block and token of a
/// device (C = n_embd, H = n_head, T = tensor_parallel), without recomputation the block keeps
/// 4C + 4 replicated values (LayerNorm outputs and statistics, the residual stream) and
/// (12C + H) / T split ones (qkv, the attention output and its log-sum-exp, the MLP's
/// pre-activation and GELU output) plus its output; selective recomputation drops the attention
/// output and log-sum-exp; full keeps only the input and reruns one block at a time. Backward's
/// temporaries at the peak are fitted to the allocator's measured peaks on host devices
/// (V_r = the rank's vocab rows): max(V_r + 8C / T - C, 2 V_r) values per token, with the
/// embedding's and final LayerNorm's outputs (and, with dropout on one rank per replica, the
/// embedding Dropout's output; dropout keeps no masks: they are regenerated from seeds). Measured
/// against train_gpt's step peaks: within 3% for T <= 4 (tests/examples/memory_model_check.sh
/// checks 10% on every layout). Throws Error(invalid_argument) for a
/// bad config (nn::gpt's checks), rows < data_parallel, a tensor_parallel that does not divide
/// n_head or exceeds the vocab, or a zero_stage other than 0 or 1.
[[nodiscard]] std::vector<GptMemory> predict_gpt_memory(nn::GptConfig const& config, std::int64_t rows,
                                                        GptLayout const& layout);

}  // namespace mgpu::parallel
