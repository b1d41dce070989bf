// A model of the memory one training step of a GPT takes on each device, in the layouts of one
// process that the library runs it in (one device, data parallel with ZeRO 0-3, tensor parallel
// with or without sequence parallelism, both, and GPipe or 1F1B pipelines and their replicas), in the caching allocator's bytes: what a planner
// weighs layouts by before running any.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <mgpu/nn/gpt.hpp>

namespace mgpu::parallel {

/// Where a GPT runs: `data_parallel` replicas of `tensor_parallel` ranks each (DataParallel's ranks
/// with tensor_parallel 1, else TensorParallel with TensorParallelOptions::data_parallel), on
/// data_parallel x tensor_parallel devices; or a pipeline (pipeline::Executor) of data_parallel
/// replicas of tensor_parallel pipelines each (ExecutorOptions::tensor_parallel).
struct GptLayout {
  int data_parallel = 1;
  int tensor_parallel = 1;
  /// DataParallelOptions::zero_stage (0 to 3); tensor parallelism keeps every rank's whole state.
  int zero_stage = 1;
  /// DataParallelOptions' bucket caps: with ZeRO 1 and 2 a rank owns 1/N of each bucket (and its
  /// last size mod N elements); with ZeRO-2 it keeps the owned gradients and the staging buffers
  /// (two of the largest bucket but the last, and the last), with ZeRO-3 the owned parameters and
  /// the units gathered at the peak (two of the largest but the last, and the last) too, and of
  /// the staging only the unit's whose backward runs and the last's.
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  /// DataParallelOptions::zero3_block_units: with ZeRO-3 the buckets are one per transformer block,
  /// the embedding and the final LayerNorm (the caps do not apply).
  bool zero3_block_units = true;
  /// A pipeline: the executor's cuts of nn::gpt(config)'s layers (pipeline::Partition::cuts: stage
  /// s holds layers [cuts[s], cuts[s + 1]) on device s), empty for none.
  std::vector<std::size_t> cuts{};
  /// The pipeline's micro-batches (the rows split as the executor splits them: the first rows mod
  /// micro_batches one row more).
  int micro_batches = 1;
  /// GPipe keeps every micro-batch in flight; 1F1B at most stages - s of them at stage s.
  bool gpipe = false;
  /// TensorParallelOptions::sequence_parallel: what a block keeps outside its split regions (the
  /// LayerNorms' outputs and statistics, the residual stream, its output) holds 1/tensor_parallel
  /// of the tokens.
  bool sequence_parallel = false;
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
/// (V_r = the rank's vocab rows): V_r + max(8C / T - C, V_r) values per token, with the
/// embedding's and final LayerNorm's outputs (and, with dropout on one rank per replica, the
/// embedding Dropout's output; dropout keeps no masks: they are regenerated from seeds). Measured
/// against train_gpt's step peaks: within 3% for T <= 4 (tests/examples/memory_model_check.sh
/// checks 10% on every layout). A pipeline stage holds its layers' parameters (the head in a stage
/// without the embedding its own copy of wte), the micro-batches in flight (each stage's input
/// too; the last stage's logits-sized tensor per micro-batch) and a block's backward temporaries
/// (7C values per token); with data_parallel replicas each replica's stages hold its rows (the
/// gradients are all-reduced in place); with tensor-parallel stages each rank's stage holds its
/// shards (and the last stage's head a copy of its rank's wte rows), activations split as
/// above, and backward's temporaries of 7C / T values per token, V_r + max(8C / T - C, V_r) on the
/// head's stage (fitted as above: within 2.5% of train_gpt's peaks for TP 2 x PP 2 and 3, GPipe and
/// 1F1B, replicas, sequence parallelism). Devices in the executor's order: replica a's rank r's
/// stage s is device (a * tensor_parallel + r) * stages + s. Throws Error(invalid_argument) for a
/// bad config (nn::gpt's checks), rows < data_parallel or micro_batches, a tensor_parallel that
/// does not divide n_head or exceeds the vocab, a zero_stage other than 0 to 3 (2 and 3: data
/// parallelism only), cuts that do not
/// run from 0 to the model's layer count in increasing steps, a replica with fewer rows than
/// micro_batches, or sequence_parallel without a tensor_parallel >= 2 that divides
/// config.block_size.
[[nodiscard]] std::vector<GptMemory> predict_gpt_memory(nn::GptConfig const& config, std::int64_t rows,
                                                        GptLayout const& layout);

}  // namespace mgpu::parallel
