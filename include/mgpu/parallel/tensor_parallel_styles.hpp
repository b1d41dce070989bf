// Tensor parallelism as layer styles: parallelize() turns a whole nn::Sequential into one rank's
// shard, each layer split by the style the plan names for it or the default its type registered
// (column- and row-parallel Linears, the vocab-parallel embedding and LM head, the tensor-parallel
// transformer block, replicated layers), with sequence-parallel regions between them. The splits
// and their collectives are described in docs/parallel-layouts.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <typeindex>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>

namespace mgpu::parallel {

/// A layer of a tensor-parallel shard that holds part of a whole model's layer's parameters.
class ShardedLayer {
 public:
  virtual ~ShardedLayer() = default;
  /// The [begin, end) offsets of the split parameters within this layer's (the rest is replicated).
  [[nodiscard]] virtual std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges() const = 0;
  /// Copies between the whole layer's parameters (`whole`, in its layout) and this rank's
  /// shard, either way. Throws Error(invalid_argument) for other sizes.
  virtual void copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const = 0;
  /// The offsets of replicated parameters whose gradients each rank computes from its own tokens.
  [[nodiscard]] virtual std::vector<std::pair<std::int64_t, std::int64_t>> partial_ranges() const { return {}; }
};

/// nn::Linear(in, out) split by output columns over `comm`'s ranks: rank r holds W's columns and
/// b's entries [r out / T, (r + 1) out / T) and returns those columns of the output [..., out / T],
/// or with `gather_output` the whole output (every rank's columns gathered). Its input is
/// replicated and its input gradient summed over the ranks; with `sequence_parallel` it takes the
/// rank's tokens [B, T / ranks, in], gathers them, and reduce-scatters the input gradient back.
/// Initialized as the whole Linear's shard.
class ColumnParallelLinear final : public nn::Layer, public ShardedLayer {
 public:
  /// Throws Error(invalid_argument) without a communicator, unless its size divides `out`, for a
  /// rank outside it, or for `gather_output` with `sequence_parallel` (the output would be the
  /// whole sequence's: a row-parallel layer or a token gather ends a sequence-parallel region).
  ColumnParallelLinear(std::int64_t in, std::int64_t out, std::shared_ptr<comm::Communicator> comm, int rank,
                       nn::Init init = nn::Init::kaiming, bool sequence_parallel = false, bool gather_output = false);
  std::string name() const override;
  std::int64_t parameter_count() const override { return linear_.parameter_count(); }
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override { return linear_.matrix_ranges(); }
  /// All of it.
  std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges() const override { return {{0, parameter_count()}}; }
  /// The whole is nn::Linear(in, out)'s layout: W [in, out] then b [out].
  void copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& x, nn::Context& ctx) override;
  Tensor backward(Tensor const& dy, nn::Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return linear_.saved_micro_batches(); }
  void set_input_grad(bool needed) override;
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<ColumnParallelLinear>(in_, out_, comm_, rank_, init_, sequence_parallel_, gather_output_);
  }

 private:
  std::int64_t in_, out_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_, ranks_;
  nn::Init init_;
  bool sequence_parallel_, gather_output_;
  bool input_grad_ = true;
  nn::Linear linear_;  // in -> out / T
  Tensor params_;      // the bound parameters
};

/// nn::Linear(in, out) split by input rows over `comm`'s ranks: rank r holds W's rows
/// [r in / T, (r + 1) in / T) and the whole b, takes those columns of the input, [..., in / T],
/// and returns the whole output summed over the ranks (all-reduce), or with `sequence_parallel`
/// (input [B, T, in / T]) the rank's tokens of it [B, T / ranks, out] (reduce-scatter), whose
/// gradient it gathers again. Initialized as the whole Linear's shard.
class RowParallelLinear final : public nn::Layer, public ShardedLayer {
 public:
  /// Throws Error(invalid_argument) as ColumnParallelLinear does, for `in`.
  RowParallelLinear(std::int64_t in, std::int64_t out, std::shared_ptr<comm::Communicator> comm, int rank,
                    nn::Init init = nn::Init::kaiming, bool sequence_parallel = false);
  std::string name() const override;
  std::int64_t parameter_count() const override { return (in_ / ranks_) * out_ + out_; }
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override {
    return {{0, (in_ / ranks_) * out_}};
  }
  /// W's rows (b is replicated).
  std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges() const override {
    return {{0, (in_ / ranks_) * out_}};
  }
  /// The whole is nn::Linear(in, out)'s layout: W [in, out] then b [out].
  void copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& x, nn::Context& ctx) override;
  Tensor backward(Tensor const& dy, nn::Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<RowParallelLinear>(in_, out_, comm_, rank_, init_, sequence_parallel_);
  }

 private:
  std::int64_t in_, out_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_, ranks_;
  nn::Init init_;
  bool sequence_parallel_;
  Tensor params_, w_, b_, dw_, db_;
  std::map<std::int64_t, Tensor> saved_;  // the inputs
};

/// The tensor-parallel group a shard is made for.
struct ShardGroup {
  std::shared_ptr<comm::Communicator> comm;
  int rank = 0;
  /// Split activations by tokens between the tensor-parallel regions (the ranks divide T).
  bool sequence_parallel = false;
};

/// How one layer of the whole model splits: the layers that take its place in rank's shard, in
/// order (its shard, after any layers without parameters or randomness that it needs first).
/// materialize() initializes the shard as the whole layer's shard. Throws Error(invalid_argument)
/// saying why the layer cannot split so (parallelize() adds which layer).
using Style = std::function<std::vector<std::unique_ptr<nn::Layer>>(nn::Layer const& whole, ShardGroup const& group)>;

/// nn::Linear -> ColumnParallelLinear, its output the rank's columns or, with `gather_output`, the
/// whole (for a layer that takes every column: a loss, or a replicated layer after it).
[[nodiscard]] Style column_parallel(bool gather_output = false);
/// nn::Linear -> RowParallelLinear.
[[nodiscard]] Style row_parallel();
/// nn::Embedding -> VocabParallelEmbedding (with sequence parallelism it returns the rank's tokens:
/// a sequence-parallel region starts).
[[nodiscard]] Style vocab_parallel_embedding();
/// nn::TiedLMHead -> VocabParallelLMHead, the rank's logits columns (for VocabParallelCrossEntropy);
/// with sequence parallelism a gather of the tokens first (the region ends).
[[nodiscard]] Style vocab_parallel_lm_head();
/// nn::TransformerBlock -> TensorParallelBlock.
[[nodiscard]] Style transformer_block();
/// The layer itself on every rank (a copy). With sequence parallelism (on the rank's tokens) only
/// for per-token layers: a Dropout, a LayerNorm (gradient summed by partial_ranges()) or a layer
/// without parameters.
[[nodiscard]] Style replicate();

/// Makes `style` the default of layers of dynamic type `type` (replacing any), for plans that do
/// not name them. nn's are registered: Embedding, TransformerBlock, TiedLMHead, LayerNorm,
/// Dropout, ReLU and GELU; nn::Linear has none (a plan says column or row). Thread-safe.
void register_style(std::type_index type, Style style);
/// The style registered for `layer`'s dynamic type; empty when none.
[[nodiscard]] Style default_style(nn::Layer const& layer);

/// Which style splits which layer.
struct TensorParallelPlan {
  /// Styles by index in the whole model; a layer not named takes default_style().
  std::map<std::size_t, Style> styles{};
  bool sequence_parallel = false;
};

/// Rank `rank`'s shard of `whole` (an architecture, as nn::Sequential::clone() copies it) over
/// `comm`'s ranks: every layer replaced by what its style returns. The shards' materialize()
/// with one seed together hold `whole` materialized from it. Throws Error(invalid_argument)
/// without a communicator, for a rank outside it, for a stage of a model (first_layer() > 0), for
/// a plan naming a layer `whole` lacks, or naming the layer (index and name) that has no style or
/// that its style cannot split, and why. With `origins`, sets it to the index in `whole` of each
/// of the shard's layers' whole layer (non-decreasing: the shard of `whole`'s layers [b, e) is the
/// shard's layers whose origin is in [b, e)).
[[nodiscard]] nn::Sequential parallelize(nn::Sequential const& whole, TensorParallelPlan const& plan,
                                         std::shared_ptr<comm::Communicator> comm, int rank,
                                         std::vector<std::size_t>* origins = nullptr);

}  // namespace mgpu::parallel
