// Tensor parallelism (Megatron-style) for the GPT: every transformer block split across T ranks,
// each holding 1/T of the block's weight matrices. The MLP's first Linear is split by columns and
// its second by rows; attention is split by heads (the fused qkv Linear by columns, grouped per
// head, the output projection by rows). LayerNorms and the biases of the row-parallel Linears are
// replicated. A block's forward all-reduces the row-parallel outputs (the "g" operator) and its
// backward all-reduces the input gradients of the column-parallel Linears (the "f" operator): four
// all-reduces per block and step. In this first slice the embedding, the final LayerNorm and the
// tied LM head are replicated on every rank (no vocab-parallel embedding or cross-entropy yet).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/optim/optim.hpp>

namespace mgpu::parallel {

/// Rank `rank`'s shard of a pre-LN TransformerBlock (nn::TransformerBlock without dropout) over
/// the `comm`'s ranks: heads / T heads, qkv [C, 3C/T] (that rank's heads' q, k and v columns),
/// the attention projection's rows [C/T, C], mlp_fc [C, 4C/T] and mlp_proj's rows [4C/T, C].
/// Parameters in nn::TransformerBlock's order, each split matrix (and a column-parallel bias) as
/// its shard: ln_1, qkv W and b, proj W, proj b (whole), ln_2, fc W and b, proj W, proj b (whole).
/// initialize() draws the whole block's weights as nn::TransformerBlock does from the same rng and
/// keeps this rank's shard, so shards materialized with a seed hold the 1-device model's weights.
/// forward and backward enqueue all-reduces on ctx.stream: every rank must run the same calls in
/// the same order (each on its own thread). TensorParallel trains it in float32 (16-bit compute is
/// not tested yet).
class TensorParallelBlock final : public nn::Layer {
 public:
  /// Throws Error(invalid_argument) unless heads divide features and the communicator's size
  /// divides heads, and rank is one of its ranks.
  TensorParallelBlock(std::int64_t features, std::int64_t heads, std::shared_ptr<comm::Communicator> comm, int rank,
                      float proj_init_std = 0.02f);
  std::string name() const override;
  std::int64_t parameter_count() const override;
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override;
  /// The [begin, end) offsets, within this layer's parameters, of the split ones (each rank holds
  /// other values there); everything else is replicated (the same on every rank).
  [[nodiscard]] std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges() const;
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& x, nn::Context& ctx) override;
  Tensor backward(Tensor const& dy, nn::Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<TensorParallelBlock>(features_, heads_, comm_, rank_, proj_init_std_);
  }

  /// Copies between the whole block's parameters (nn::TransformerBlock's layout, `whole`) and this
  /// rank's shard (`shard`, parameter_count() elements), float32 host spans: to the shard
  /// (`to_shard`), or from it into its places in `whole`.
  void copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const;

 private:
  struct Saved {
    Tensor qkv, y, lse;  // attention's (y: the attention projection's input)
    Tensor mlp_in;       // mlp_proj's input
  };
  std::int64_t features_, heads_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_, ranks_;
  float proj_init_std_;
  nn::LayerNorm ln1_, ln2_;
  nn::Linear qkv_, fc_;                         // column-parallel
  Tensor params_;                               // the bound parameters
  Tensor attn_w_, attn_b_, dattn_w_, dattn_b_;  // row-parallel: W [C/T, C], b [C]
  Tensor mlp_w_, mlp_b_, dmlp_w_, dmlp_b_;      // W [4C/T, C], b [C]
  std::map<std::int64_t, Saved> saved_;
};

/// The shard of gpt(config) a tensor-parallel rank holds: Embedding, Dropout(0), n_layer
/// TensorParallelBlocks, LayerNorm and the tied LM head (embedding and head replicated).
/// Throws Error(invalid_argument) for a bad config, dropout other than 0 or recompute other than
/// none (not supported with tensor parallelism yet), or a group size that does not divide n_head.
[[nodiscard]] nn::Sequential tensor_parallel_gpt(nn::GptConfig const& config, std::shared_ptr<comm::Communicator> comm,
                                                 int rank);

struct TensorParallelOptions {
  /// The shards are materialized from this seed: together they hold gpt(config)'s weights
  /// materialized from it.
  std::uint64_t seed = 1;
  /// AdamW; decay_ranges must be empty: each rank decays its shard's 2-D weights (embeddings and
  /// Linear weights, as nn::gpt_decay_ranges does for the whole model).
  optim::AdamWOptions adamw{};
  /// Another optimizer per rank, made from the rank's shard (replaces the AdamW when set).
  std::function<std::unique_ptr<optim::Optimizer>(nn::Sequential const& shard)> optimizer{};
  /// Clip to this global norm, finite and > 0 (0: off). The norm counts each replicated parameter
  /// once and each split one on every rank.
  float clip_norm = 0.0f;
};

/// Trains gpt(config) with every rank of `group` holding one tensor-parallel shard (T = group
/// size): each step runs the whole batch on every rank (its activations replicated between blocks),
/// the per-token cross-entropy, backward, and nn::apply_update on every rank, through a
/// GradientSync whose owned ranges are the rank's whole buffer (replicated ranges counted by rank
/// 0 only, split ones by every rank) and whose sum over ranks is an all-reduce. float32.
class TensorParallel {
 public:
  /// Throws Error(invalid_argument) for a bad config or options (see tensor_parallel_gpt and
  /// TensorParallelOptions).
  TensorParallel(DeviceGroup& group, nn::GptConfig const& config, TensorParallelOptions options = {});
  ~TensorParallel();
  TensorParallel(TensorParallel const&) = delete;
  TensorParallel& operator=(TensorParallel const&) = delete;

  struct StepResult {
    double loss = 0;  ///< the batch's mean per-token cross-entropy
    bool applied = true;
  };
  /// One training step on int32 ids and targets [B, T] (ignore index -100), in any memory: each
  /// rank copies them to its device. Throws Error(invalid_argument) before any work for targets
  /// that do not fit.
  StepResult step(Tensor const& ids, Tensor const& targets, float lr_scale = 1.0f);

  /// The whole model's float32 parameters in gpt(config)'s flat layout, gathered from the shards
  /// (the replicated ones from rank 0). Synchronizes the ranks' streams.
  [[nodiscard]] std::vector<float> gather_parameters();
  /// Sets every shard from the whole model's float32 parameters in gpt(config)'s flat layout (e.g.
  /// weights loaded from a file). Synchronizes the ranks' streams. Throws Error(invalid_argument)
  /// for another size.
  void scatter_parameters(std::span<float const> whole);
  /// Rank r's shard (its flat buffers hold only its split matrices' part).
  [[nodiscard]] nn::Sequential& shard(int rank);
  [[nodiscard]] int size() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu::parallel
