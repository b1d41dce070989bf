// Tensor parallelism (Megatron-style) for the GPT: every transformer block split across T ranks,
// each holding 1/T of the block's weight matrices. The MLP's first Linear is split by columns and
// its second by rows; attention is split by heads (the fused qkv Linear by columns, grouped per
// head, the output projection by rows). LayerNorms and the biases of the row-parallel Linears are
// replicated. A block's forward all-reduces the row-parallel outputs (the "g" operator) and its
// backward all-reduces the input gradients of the column-parallel Linears (the "f" operator): four
// all-reduces per block and step. The token embedding and the LM head tied to it are split by
// vocab rows (VocabParallelEmbedding, VocabParallelLMHead), each rank producing only its columns of
// the logits, and the cross-entropy (VocabParallelCrossEntropy) reduces per-row statistics across
// the ranks instead of gathering the logits. The position embedding and the final LayerNorm are
// replicated.
//
// Sequence parallelism (Korthikanti et al. 2022), an option: between the tensor-parallel regions
// each rank holds only 1/T of the tokens, so the LayerNorms, the dropouts and the residual adds
// run on 1/T of the activations. A rank's tokens are its B T / T_ranks consecutive rows of the
// flattened [B T, C] activation, shaped [B, T / T_ranks, C] (the sequence length must divide by
// the ranks). A column-parallel Linear's input is all-gathered from the ranks' tokens (its
// backward gathers it again, so only the rank's tokens are kept, and reduce-scatters the input
// gradient) and a row-parallel Linear's output reduce-scattered instead of all-reduced (its
// backward all-gathers the output gradient): the all-reduces' traffic plus the two gathers again.
// The replicated LayerNorms' gradients are then each rank's tokens' part, summed over the ranks
// before the update.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/transformer.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::parallel {

/// A layer of a tensor-parallel shard that holds part of a gpt(config) layer's parameters.
class ShardedLayer {
 public:
  virtual ~ShardedLayer() = default;
  /// The [begin, end) offsets, within this layer's parameters, of the split ones (each rank holds
  /// other values there); everything else is replicated (the same on every rank).
  [[nodiscard]] virtual std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges() const = 0;
  /// Copies between the whole layer's parameters (gpt(config)'s layout, `whole`) and this rank's
  /// shard (`shard`, the layer's parameter_count() elements), float32 host spans: to the shard
  /// (`to_shard`), or from it into its places in `whole`. Throws Error(invalid_argument) for other
  /// sizes.
  virtual void copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const = 0;
  /// The [begin, end) offsets of replicated parameters whose gradients each rank computes from its
  /// own tokens only (sequence parallelism: the LayerNorms): they are summed over the ranks before
  /// the update. None by default.
  [[nodiscard]] virtual std::vector<std::pair<std::int64_t, std::int64_t>> partial_ranges() const { return {}; }
};

/// The token ids [first, second) that rank `rank` of `ranks` holds of a vocab of `vocab` in the
/// vocab-parallel embedding: [rank V / T, (rank + 1) V / T) (rounded down), so the ranks' rows
/// differ by at most one and cover the vocab. Throws Error(invalid_argument) unless 1 <= ranks <=
/// vocab and rank is in [0, ranks).
[[nodiscard]] std::pair<std::int64_t, std::int64_t> vocab_shard(std::int64_t vocab, int ranks, int rank);

/// Rank `rank`'s shard of nn::Embedding(vocab, block_size, features) over the communicator's
/// ranks: wte's rows vocab_shard(vocab, T, rank) [V_r, C], then the whole wpe [P, C] (replicated).
/// forward looks the rank's ids up (0 for the others), rank 0 adds the positions, and an
/// all-reduce sums the ranks' parts: every rank gets nn::Embedding's output. backward writes (or
/// adds, when tied to a VocabParallelLMHead, which writes first) the gradient of the rank's wte
/// rows and the whole wpe gradient (the output gradient being the same on every rank).
/// initialize() draws the whole embedding as nn::Embedding does and keeps the rank's rows.
/// With `sequence_parallel` a reduce-scatter replaces the all-reduce: each rank gets its tokens
/// [B, T / ranks, C] of the output (T must divide by the ranks), and backward all-gathers their
/// gradients first.
class VocabParallelEmbedding final : public nn::Layer, public ShardedLayer {
 public:
  /// Throws Error(invalid_argument) for sizes < 1, a vocab smaller than the group or a bad rank.
  VocabParallelEmbedding(std::int64_t vocab, std::int64_t block_size, std::int64_t features,
                         std::shared_ptr<comm::Communicator> comm, int rank, float init_std = 0.02f,
                         bool sequence_parallel = false);
  std::string name() const override;
  std::int64_t parameter_count() const override { return (end_ - begin_ + block_size_) * features_; }
  /// wte's rows and wpe (adjacent: one range), as nn::Embedding.
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override { return {{0, parameter_count()}}; }
  /// wte's rows.
  std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges() const override {
    return {{0, (end_ - begin_) * features_}};
  }
  void copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& ids, nn::Context& ctx) override;
  Tensor backward(Tensor const& dy, nn::Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  /// The whole vocab: every rank takes every id.
  std::int64_t input_vocab() const override { return vocab_; }
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<VocabParallelEmbedding>(vocab_, block_size_, features_, comm_, rank_, init_std_,
                                                    sequence_parallel_);
  }

  [[nodiscard]] std::int64_t vocab() const noexcept { return vocab_; }
  [[nodiscard]] std::int64_t features() const noexcept { return features_; }
  /// The first token id of the rank's rows, and one past the last.
  [[nodiscard]] std::int64_t vocab_begin() const noexcept { return begin_; }
  [[nodiscard]] std::int64_t vocab_end() const noexcept { return end_; }
  /// The bound rows of wte [V_r, C] and their gradient view.
  [[nodiscard]] Tensor const& token_weight() const noexcept { return wte_; }
  [[nodiscard]] Tensor const& token_gradient() const noexcept { return dwte_; }
  /// Whether a VocabParallelLMHead shares the rows (its backward then adds to their gradient).
  void set_tied(bool tied) noexcept { tied_ = tied; }

 private:
  std::int64_t vocab_, block_size_, features_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_;
  std::int64_t begin_, end_;
  float init_std_;
  bool sequence_parallel_;
  bool tied_ = false;
  Tensor params_;  // the bound parameters
  Tensor wte_, wpe_, dwte_, dwpe_;
  std::map<std::int64_t, Tensor> saved_;  // ids
};

/// The LM head tied to the VocabParallelEmbedding of the same Sequential (found by link()): the
/// rank's logits columns [B, T, V_r] = h wte_rᵀ for the replicated h [B, T, C]. It holds no
/// parameters; backward writes (or adds) dwte_r = dlogits_rᵀ h into the embedding's gradient view
/// and returns dh = the sum over the ranks of dlogits_r wte_r (an all-reduce). With
/// `reduce_input_gradient` false it returns the rank's part dlogits_r wte_r (sequence parallelism:
/// the gather before it reduce-scatters it). A pipeline stage without the embedding calls
/// hold_weight(): the head then holds its own copy of the rank's wte rows, as nn::TiedLMHead does
/// (pipeline::Executor keeps the copy equal to the first stage's rows).
class VocabParallelLMHead final : public nn::Layer {
 public:
  VocabParallelLMHead(std::int64_t vocab, std::int64_t features, std::shared_ptr<comm::Communicator> comm, int rank,
                      bool reduce_input_gradient = true);
  std::string name() const override;
  /// The copy of the rank's wte rows [V_r, C] when it holds one, else none.
  std::int64_t parameter_count() const override { return holds_weight_ ? (end_ - begin_) * features_ : 0; }
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  /// The copy starts at zero (the pipeline executor adds the embedding's rows to it).
  void initialize(std::mt19937_64& rng) override;
  void link(nn::Sequential& model) override;
  Tensor forward(Tensor const& h, nn::Context& ctx) override;
  Tensor backward(Tensor const& dy, nn::Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<Layer> clone() const override;

  /// Holds its own copy of the rank's wte rows instead of linking to the embedding's; call before
  /// materialize.
  void hold_weight() noexcept { holds_weight_ = true; }
  [[nodiscard]] bool holds_weight() const noexcept { return holds_weight_; }
  [[nodiscard]] std::int64_t features() const noexcept { return features_; }
  /// The first token id of the rank's columns, and one past the last.
  [[nodiscard]] std::int64_t vocab_begin() const noexcept { return begin_; }
  [[nodiscard]] std::int64_t vocab_end() const noexcept { return end_; }

 private:
  std::int64_t vocab_, features_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_;
  bool reduce_input_gradient_;
  bool holds_weight_ = false;
  std::int64_t begin_, end_;
  Tensor wte_, dwte_;
  std::map<std::int64_t, Tensor> saved_;  // h as [N, C]
};

/// nn::TokenCrossEntropy over the vocab-parallel logits [B, T, V_r] of rank `rank` (its columns
/// vocab_shard(vocab, T, rank)) without gathering them: each row's max is all-reduced (max), then
/// its sum of exp(logit - max) and its target's logit (sum), and every rank gets the whole loss and
/// softmax - onehot on its columns (ops::vocab_shard_cross_entropy). Targets are whole-vocab ids.
/// compute() enqueues the all-reduces on its stream: every rank of the communicator calls it, each
/// on its own thread, with its own instance.
class VocabParallelCrossEntropy final : public nn::Loss {
 public:
  /// Throws Error(invalid_argument) as vocab_shard does.
  VocabParallelCrossEntropy(std::int64_t vocab, std::shared_ptr<comm::Communicator> comm, int rank,
                            std::int32_t ignore_index = -100);
  std::string name() const override { return "vocab_parallel_cross_entropy"; }
  void check(Shape const& output, Tensor const& targets, std::string const& what) const override;
  void check_values(Shape const& output, Tensor const& targets, std::string const& what) const override;
  std::int64_t count(Tensor const& targets, Stream& stream) const override;
  void compute(Tensor const& output, Tensor const& targets, Tensor const& doutput, Tensor const& loss,
               std::int64_t divisor, float grad_scale, Allocator& allocator, Stream& stream) const override;

 private:
  std::int64_t vocab_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_;
  std::int64_t begin_, end_;
  nn::TokenCrossEntropy whole_;  // its checks against the whole vocab, and its count
};

/// Rank `rank`'s shard of a pre-LN nn::TransformerBlock over the `comm`'s ranks: heads / T heads, qkv [C, 3C/T] (that
/// rank's heads' q, k and v columns), the attention projection's rows [C/T, C], mlp_fc [C, 4C/T] and mlp_proj's rows
/// [4C/T, C]. Parameters in nn::TransformerBlock's order, each split matrix (and a column-parallel bias) as its shard:
/// ln_1, qkv W and b, proj W, proj b (whole), ln_2, fc W and b, proj W, proj b (whole). initialize() draws the whole
/// block's weights as nn::TransformerBlock does from the same rng and keeps this rank's shard, so shards materialized
/// with a seed hold the 1-device model's weights, and its dropout seeds: the residual branches' Dropouts (replicated
/// regions) drop the same elements on every rank, and the attention probabilities' dropout drops, on each rank's heads,
/// what the whole block drops on those heads (ops::AttentionDropout::head_offset), so with the same
/// seed the shards train as the 1-device model does, dropout included. `recompute` as
/// nn::TransformerBlock's (nn::Recompute): selective drops the attention core's output and
/// log-sum-exp and backward reruns the core on the kept qkv; full keeps only the input and backward
/// reruns the forward (its all-reduces included, on every rank alike) at the original dropout
/// count and row offset. Both give the `none` gradients bit for bit.
/// With `sequence_parallel` the block takes and returns the rank's tokens [B, T / ranks, C] (see
/// the top of this file): LayerNorms, dropouts and residual adds on them, an all-gather before each
/// column-parallel Linear and a reduce-scatter after each row-parallel one; the dropouts drop what
/// they drop on those tokens without sequence parallelism. The column-parallel Linears' inputs are
/// kept as the rank's tokens and all-gathered again in backward (two all-gathers more per block
/// and step, for 1/T of that memory). Its LayerNorms are partial_ranges().
/// forward and backward enqueue collectives on ctx.stream: every rank must run the same calls in
/// the same order (each on its own thread). TensorParallel trains it in float32 (16-bit compute is
/// not tested yet).
class TensorParallelBlock final : public nn::Layer, public ShardedLayer {
 public:
  /// Throws Error(invalid_argument) unless heads divide features and the communicator's size
  /// divides heads, and rank is one of its ranks.
  TensorParallelBlock(std::int64_t features, std::int64_t heads, std::shared_ptr<comm::Communicator> comm, int rank,
                      float proj_init_std = 0.02f, float dropout = 0.0f, nn::Recompute recompute = nn::Recompute::none,
                      bool sequence_parallel = false);
  std::string name() const override;
  std::int64_t parameter_count() const override;
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override;
  /// qkv W and b with the attention projection's rows; mlp_fc W and b with mlp_proj's rows.
  std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges() const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  void set_training(bool training) override;
  /// One count for the three dropouts, as nn::TransformerBlock's.
  std::uint64_t rng_counter() const override { return calls_; }
  void set_rng_counter(std::uint64_t counter) override;
  /// The whole block's (nn::TransformerBlock::rng_seeds()), which every rank holds.
  std::vector<std::uint64_t> rng_seeds() const override { return {attention_seed_, attn_drop_.seed(), mlp_drop_.seed()}; }
  void set_rng_seeds(std::span<std::uint64_t const> seeds) override;
  Tensor forward(Tensor const& x, nn::Context& ctx) override;
  Tensor backward(Tensor const& dy, nn::Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  /// Its own and its sublayers' (LayerNorms, Linears, Dropouts).
  std::size_t saved_micro_batches() const override {
    return saved_.size() + inputs_.size() + ln1_.saved_micro_batches() + ln2_.saved_micro_batches() + qkv_.saved_micro_batches() +
           fc_.saved_micro_batches() + attn_drop_.saved_micro_batches() + mlp_drop_.saved_micro_batches();
  }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<TensorParallelBlock>(features_, heads_, comm_, rank_, proj_init_std_, dropout_, recompute_,
                                                 sequence_parallel_);
  }

  /// The whole block is nn::TransformerBlock's layout.
  void copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const override;
  /// ln_1 and ln_2 with sequence parallelism, else none.
  std::vector<std::pair<std::int64_t, std::int64_t>> partial_ranges() const override;

 private:
  // The forward of every part, each saving what its backward reads.
  Tensor forward_layers(Tensor const& x, nn::Context& ctx);
  struct Saved {
    Tensor qkv, y, lse;  // attention's (y: the attention projection's input; none with selective)
    Tensor mlp_in;       // mlp_proj's input
    ops::AttentionDropout dropout;
    // Sequence parallelism: the rank's tokens of the column-parallel Linears' inputs (LN1's and
    // LN2's outputs), gathered again in backward instead of kept gathered.
    Tensor ln1, ln2;
  };
  // Recompute::full: what forward keeps to rerun itself.
  struct Input {
    Tensor x;
    std::uint64_t rng_counter = 0;
    std::int64_t row_offset = 0;
  };
  std::int64_t features_, heads_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_, ranks_;
  float proj_init_std_, dropout_;
  nn::Recompute recompute_;
  bool sequence_parallel_;
  bool training_ = true;
  std::uint64_t attention_seed_ = 0, calls_ = 0;
  nn::Dropout attn_drop_, mlp_drop_;  // the residual branches' (replicated)
  nn::LayerNorm ln1_, ln2_;
  nn::Linear qkv_, fc_;                         // column-parallel
  Tensor params_;                               // the bound parameters
  Tensor attn_w_, attn_b_, dattn_w_, dattn_b_;  // row-parallel: W [C/T, C], b [C]
  Tensor mlp_w_, mlp_b_, dmlp_w_, dmlp_b_;      // W [4C/T, C], b [C]
  std::map<std::int64_t, Saved> saved_;
  std::map<std::int64_t, Input> inputs_;
};

/// The shard of gpt(config) a tensor-parallel rank holds: VocabParallelEmbedding, Dropout,
/// n_layer TensorParallelBlocks, LayerNorm and the VocabParallelLMHead; its output is the rank's
/// logits columns, for VocabParallelCrossEntropy. With `sequence_parallel` the embedding, the
/// blocks and the LayerNorm work on the rank's tokens, the Dropout drops what it drops on them
/// without, and a layer between the LayerNorm and the head all-gathers the tokens (its backward
/// reduce-scatters the head's input gradient). Throws Error(invalid_argument) for a bad config,
/// a group size that does not divide n_head, or a vocab smaller than the group.
[[nodiscard]] nn::Sequential tensor_parallel_gpt(nn::GptConfig const& config, std::shared_ptr<comm::Communicator> comm,
                                                 int rank, bool sequence_parallel = false);

/// The ranges of a tensor-parallel shard's flat buffers (`shard`: a rank's tensor_parallel_gpt,
/// or a pipeline stage of one) as counted in a global gradient norm over the ranks: one range per
/// split part of a ShardedLayer (ShardedLayer::split_ranges), counted when `split`, and one per
/// rest of a layer's parameters, counted when `replicated` (the replicated parameters are the same
/// on every rank: only one rank counts them).
[[nodiscard]] std::vector<nn::OwnedRange> norm_ranges(nn::Sequential const& shard, bool split, bool replicated);

/// The ranges of a tensor-parallel shard's flat buffers (`shard`, or a pipeline stage of one) whose
/// gradients each rank computes from its own tokens only, with the layer of each: with sequence
/// parallelism the LayerNorms (the ShardedLayers' partial_ranges() and the plain LayerNorms), to be
/// summed over the ranks before the update; none without.
[[nodiscard]] std::vector<nn::ParameterRange> partial_ranges(nn::Sequential const& shard, bool sequence_parallel);

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
  /// Data-parallel replicas A of the tensor-parallel model: the group's A x T ranks form A
  /// tensor-parallel groups of T consecutive ranks (replica a: ranks a T to a T + T - 1, so each
  /// group sits on neighbouring devices). A must divide the group size.
  int data_parallel = 1;
  /// Sequence parallelism (see the top of this file): the LayerNorm, dropout and residual
  /// activations split by tokens over the T ranks instead of replicated. The batches' sequence
  /// length must then divide by T.
  bool sequence_parallel = false;
  /// The type the shards compute in: float32, bfloat16 or float16 (float32 master weights and
  /// optimizer state either way, as in nn::Sequential::materialize).
  DType compute = DType::float32;
  /// Dynamic loss scaling (for float16): each rank steps a copy, all deciding alike (the overflow
  /// check counts every rank's gradients); a skipped step updates nothing.
  std::optional<optim::LossScaler> loss_scaler{};
  /// The communicators' options (backend, deadline).
  comm::Options comm{};
  /// Across processes (see "Across processes" at TensorParallel): makes the communicator over
  /// every rank of the world from the group and `comm`, dist::communicator_factory(world) (empty:
  /// one process, comm::make_communicator over the group).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> make_communicator{};
  /// Across processes with data_parallel > 1: makes the communicator over some world ranks (rank i
  /// is world rank ranks[i]), dist::subset_communicator_factory(world).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, std::vector<int> const&, comm::Options)>
      make_subset_communicator{};
  /// Where every rank's forward, backward per layer, collectives and update are recorded while it
  /// is enabled (nullptr: no timeline); rank = the grid's (world) rank.
  std::shared_ptr<trace::Timeline> timeline{};
  /// Where each of this process's ranks' times are reported at the end of every step
  /// (metrics::DeviceTimes, rank: its rank in the group), measured by events on its stream: wait,
  /// the time in the executor's collectives (the layers' and the gradients' sums); compute, the
  /// rest of its step (forward, backward, the update). nullptr: not measured.
  std::shared_ptr<metrics::Registry> metrics{};
};

/// Trains gpt(config) with every rank of `group` holding one tensor-parallel shard, in A =
/// options.data_parallel replicas of T = group size / A ranks each: each step splits the batch's
/// rows across the replicas (the first B mod A replicas take one row more), runs a replica's rows on
/// each of its ranks (its activations replicated between blocks, or with sequence_parallel split
/// by tokens), the vocab-parallel
/// cross-entropy divided by the whole batch's token count, backward, and nn::apply_update on every
/// rank, through a GradientSync that, with A > 1, sums each layer's gradients over the A ranks of
/// the same tensor-parallel index (a communicator per index) as backward writes them, so the
/// replicas hold the whole batch's gradients and stay bitwise identical. Its owned ranges are the
/// rank's whole buffer (replicated ranges counted by the replica's rank 0 only, split ones by every
/// rank) and its sum over ranks is an all-reduce over the replica. float32.
///
/// Across processes (mgpu::dist): every process makes its own TensorParallel over its own
/// DeviceGroup with the same config and options, make_communicator = dist::communicator_factory(
/// world) and, with A > 1, make_subset_communicator = dist::subset_communicator_factory(world).
/// The A x T grid then spans the world's ranks (world rank g: replica g / T, tensor-parallel index
/// g mod T), e.g. tensor parallelism inside each process and data parallelism across them, or a
/// tensor-parallel group across processes. Each process passes the whole batch to step(), whose
/// ranks take their replicas' rows; step()'s loss is the world's (every rank's share gathered over
/// the world), the shards start from the same seed everywhere, clipping spans each replica's ranks
/// as in one process, and gather_parameters() gathers the world's shards on every process.
/// shard() and scatter_parameters() concern this process's ranks. The same losses and weights as
/// one process over as many devices (its reductions in the same order).
class TensorParallel {
 public:
  /// Throws Error(invalid_argument) for a bad config or options (see tensor_parallel_gpt and
  /// TensorParallelOptions), e.g. a data_parallel that does not divide the device count, or one
  /// above 1 across processes without make_subset_communicator.
  TensorParallel(DeviceGroup& group, nn::GptConfig const& config, TensorParallelOptions options = {});
  ~TensorParallel();
  TensorParallel(TensorParallel const&) = delete;
  TensorParallel& operator=(TensorParallel const&) = delete;

  struct StepResult {
    double loss = 0;  ///< the batch's mean per-token cross-entropy
    bool applied = true;
  };
  /// One training step on int32 ids and targets [B, T] (ignore index -100), in any memory: each
  /// rank copies its replica's rows to its device. Throws Error(invalid_argument) before any work,
  /// changing nothing, for a batch nn::check_batch refuses (ids or targets out of range, an empty
  /// batch, a bad lr_scale), fewer rows than replicas, or (sequence parallelism) a T that does not
  /// divide by the tensor-parallel ranks. The updates wait for a barrier over every rank after
  /// backward: a step that fails before it throws the failure's Error and changes nothing
  /// (communicators made anew, across processes by every process; RNG and step counts put back); a
  /// failure past it, or communicators that cannot be made again (a process gone), leave the
  /// executor unusable (later steps throw Error(invalid_argument) saying so).
  StepResult step(Tensor const& ids, Tensor const& targets, float lr_scale = 1.0f);

  /// The whole model's float32 parameters in gpt(config)'s flat layout, gathered from replica 0's
  /// shards (the replicated ones from rank 0). Synchronizes the ranks' streams. Across processes
  /// collective: every process calls it and gets the whole model.
  [[nodiscard]] std::vector<float> gather_parameters();
  /// Sets every replica's shards (across processes, this process's) from the whole model's float32
  /// parameters in gpt(config)'s flat layout (e.g. weights loaded from a file). Synchronizes the
  /// ranks' streams. Throws Error(invalid_argument) for another size.
  void scatter_parameters(std::span<float const> whole);
  /// Saves the model as one device holds it, in io::save_training's format: the whole model's
  /// parameters and optimizer state put together from replica 0's shards, the optimizers' step
  /// count, every layer's RNG state, the loss scaler's state and `state`; so it loads into any layout (one model, a
  /// DataParallel, a pipeline, a TensorParallel of any A x T). One process: a file written
  /// atomically, or into an existing folder a one-shard folder save (io::ShardWriter). Across
  /// processes (collective, every process with the same path): a folder whose process-0 shard holds
  /// every record, committed once every process has written; every process returns once it is, or
  /// throws the first failing process's error. Throws Error(invalid_argument) on an unusable
  /// executor, Error(io) naming the file it cannot write.
  void save(std::filesystem::path const& path, io::TrainingState const& state = {});
  /// Loads a file or folder of save(), DataParallel::save(), pipeline::Executor::save() or
  /// io::save_training() of gpt(config) into every shard and optimizer (across processes,
  /// collective: this process's ranks). Everything is verified before any shard changes (checksums,
  /// architecture, optimizer kind), on every process: an error leaves the executor unchanged
  /// everywhere and names the mismatch or the damaged file. Returns the saved TrainingState.
  io::TrainingState load(std::filesystem::path const& path);
  /// The group's rank r's shard (its flat buffers hold only its split matrices' part): replica
  /// g / T's shard of tensor-parallel index g mod T, g = r (across processes, r's world rank).
  [[nodiscard]] nn::Sequential& shard(int rank);
  /// The grid's ranks, A x T (across processes, the world's).
  [[nodiscard]] int size() const noexcept;
  /// Rank 0's loss scaler (every rank's decides alike); null without one.
  [[nodiscard]] optim::LossScaler const* loss_scaler() const noexcept;
  /// A, the data-parallel replicas.
  [[nodiscard]] int data_parallel() const noexcept;
  /// T, the ranks of each replica's tensor-parallel group.
  [[nodiscard]] int tensor_parallel() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu::parallel
