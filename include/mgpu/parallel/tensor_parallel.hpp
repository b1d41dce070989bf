// Tensor parallelism (Megatron-style) for any Sequential whose layers have styles (nn::gpt's do),
// with optional sequence parallelism. The splits, collectives and their costs are described in
// docs/parallel-layouts.md.
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
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/transformer.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/mesh.hpp>
#include <mgpu/parallel/tensor_parallel_styles.hpp>
#include <mgpu/trace/timeline.hpp>

namespace mgpu::parallel {

/// The token ids [first, second) rank `rank` of `ranks` holds of a vocab of `vocab`: [rank V / T,
/// (rank + 1) V / T). Throws Error(invalid_argument) unless 1 <= ranks <= vocab and 0 <= rank < ranks.
[[nodiscard]] std::pair<std::int64_t, std::int64_t> vocab_shard(std::int64_t vocab, int ranks, int rank);

/// Rank `rank`'s shard of nn::Embedding(vocab, block_size, features): wte's rows vocab_shard(...)
/// then the whole wpe; forward gives every rank nn::Embedding's output (with `sequence_parallel`
/// its tokens [B, T / ranks, C]).
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

/// The LM head tied to the Sequential's VocabParallelEmbedding: the rank's logits columns
/// [B, T, V_r] = h wte_rᵀ, and dh summed over the ranks (unless `reduce_input_gradient` is false).
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

  /// Holds its own copy of the rank's wte rows instead of the embedding's; call before materialize.
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

/// nn::TokenCrossEntropy over the vocab-parallel logits of rank `rank`, without gathering them.
/// Every rank of the communicator calls compute(), each on its own thread with its own instance.
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

/// Makes rank `rank`'s loss over its tensor-parallel shard's output, over `comm`'s ranks.
using MakeLoss = std::function<std::unique_ptr<nn::Loss>(std::shared_ptr<comm::Communicator> comm, int rank)>;

/// The loss of `whole`'s tensor-parallel shards when none is given: VocabParallelCrossEntropy over
/// the vocab of its last layer, an nn::TiedLMHead. Throws Error(invalid_argument), its message
/// starting with `who`, for another last layer.
[[nodiscard]] MakeLoss vocab_parallel_loss(nn::Sequential const& whole, std::string const& who);

/// Rank `rank`'s shard of a pre-LN nn::TransformerBlock over `comm`'s ranks: heads / T heads, qkv
/// and mlp_fc by columns, the projections by rows, in nn::TransformerBlock's parameter order;
/// initialized as the whole block's shard. With `sequence_parallel` it takes and returns the
/// rank's tokens. Every rank must run forward and backward in the same order.
class TensorParallelBlock final : public nn::Layer, public ShardedLayer {
 public:
  /// Throws Error(invalid_argument) unless heads divide features and the communicator's size
  /// divides heads, and rank is one of its ranks.
  TensorParallelBlock(std::int64_t features, std::int64_t heads, std::shared_ptr<comm::Communicator> comm, int rank,
                      float proj_init_std = 0.02f, float dropout = 0.0f, nn::Recompute recompute = nn::Recompute::none,
                      bool sequence_parallel = false);
  std::string name() const override;
  /// A repeated block of the model: a part of its own in Sequential::structure_parts() (ZeRO-3's units).
  bool block() const override { return true; }
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

/// The ranges of a shard's flat buffers as counted in a global gradient norm: split parts counted
/// when `split`, the replicated rest when `replicated`.
[[nodiscard]] std::vector<nn::ElementRange> norm_ranges(nn::Sequential const& shard, bool split, bool replicated);

/// The ranges of a shard's flat buffers whose gradients are summed over the ranks before the
/// update (sequence parallelism's LayerNorms); none without.
[[nodiscard]] std::vector<nn::ParameterRange> partial_ranges(nn::Sequential const& shard, bool sequence_parallel);

struct TensorParallelOptions {
  std::uint64_t seed = 1;  ///< together the shards hold the whole model materialized from it
  /// The whole-model constructor's styles by layer index (a layer not named takes default_style()).
  std::map<std::size_t, Style> styles{};
  /// Makes rank `rank`'s loss over its shard's output, one per rank (empty: VocabParallelCrossEntropy
  /// over the vocab of the model's last layer, an nn::TiedLMHead).
  MakeLoss loss{};
  /// AdamW (decay_ranges must be empty: each rank decays its shard's 2-D weights).
  optim::AdamWOptions adamw{};
  /// Another optimizer per rank, made from the rank's shard (replaces the AdamW when set).
  std::function<std::unique_ptr<optim::Optimizer>(nn::Sequential const& shard)> optimizer{};
  float clip_norm = 0.0f;                          ///< the global norm to clip to, > 0 (0: off)
  int data_parallel = 1;                           ///< A replicas of T consecutive ranks; A must divide the group size
  /// ZeRO over the replicas, by DataParallel's gradient sync (per tensor-parallel index): 0
  /// replicated update, 1 sharded update and optimizer state, 2 sharded gradients too, 3 sharded
  /// parameters too, gathered a unit (a block, the embeddings, the final LayerNorm with the head)
  /// at a time (in 16 bits too, float32 masters). Each rank's optimizer then holds about 1/A of its
  /// shard's state.
  int zero_stage = 0;
  /// The replicas' gradient buckets: the cap of one, and of the first (last layers') one.
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  bool sequence_parallel = false;                  ///< split by tokens between regions; T divides the sequence
  DType compute = DType::float32;                  ///< float32, bfloat16 or float16, with float32 masters
  std::optional<optim::LossScaler> loss_scaler{};  ///< dynamic loss scaling, alike on every rank
  comm::Options comm{};
  /// The mesh whose communicators the shards and replicas use (its group the one passed, laid
  /// out dp x tp as data_parallel says; both factories empty); null: the executor makes its own.
  std::shared_ptr<Mesh> mesh{};
  /// Makes the communicator (empty: comm::make_communicator; across processes
  /// dist::communicator_factory(world), or a mesh).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> make_communicator{};
  /// Across processes with data_parallel > 1: dist::subset_communicator_factory(world).
  std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, std::vector<int> const&, comm::Options)>
      make_subset_communicator{};
  std::shared_ptr<trace::Timeline> timeline{};   ///< every rank's actions while enabled
  std::shared_ptr<metrics::Registry> metrics{};  ///< each rank's compute and wait times per step
};

/// Trains a whole model with every rank of `group` holding one tensor-parallel shard of it
/// (parallelize() with options.styles), in A = options.data_parallel replicas of T = group size / A
/// ranks each, in one process or across processes (dist::communicator_factory); the replicas stay
/// bitwise identical.
class TensorParallel {
 public:
  /// `whole`: the model's architecture (its layers are copied). Throws Error(invalid_argument) for
  /// bad options, e.g. a data_parallel that does not divide the device count, or one above 1
  /// across processes without make_subset_communicator; for a layer parallelize() cannot split;
  /// without options.loss for a model whose last layer is not an nn::TiedLMHead.
  TensorParallel(DeviceGroup& group, nn::Sequential const& whole, TensorParallelOptions options = {});
  ~TensorParallel();
  TensorParallel(TensorParallel const&) = delete;
  TensorParallel& operator=(TensorParallel const&) = delete;

  struct StepResult {
    double loss = 0;  ///< the batch's mean per-token cross-entropy
    bool applied = true;
  };
  /// One training step on int32 ids and targets [B, T] (ignore index -100), in any memory. Throws
  /// Error(invalid_argument) before any work, changing nothing, for a batch nn::check_batch refuses,
  /// fewer rows than replicas, or (sequence parallelism) a T that the ranks do not divide. A step
  /// that fails before the update changes nothing; after, the executor is unusable (later steps
  /// throw Error(invalid_argument)).
  StepResult step(Tensor const& ids, Tensor const& targets, float lr_scale = 1.0f);

  /// The whole model's float32 parameters in its flat layout, from replica 0's shards.
  /// Synchronizes; across processes collective.
  [[nodiscard]] std::vector<float> gather_parameters();
  /// Sets every replica's shards (this process's) from the whole model's float32 parameters.
  /// Synchronizes. Throws Error(invalid_argument) for another size.
  void scatter_parameters(std::span<float const> whole);
  /// Saves the model as one device holds it, in io::save_training's format (across processes
  /// collective, a folder). Throws Error(invalid_argument) on an unusable executor, Error(io) naming
  /// the file it cannot write.
  void save(std::filesystem::path const& path, io::TrainingState const& state = {});
  /// Loads a save of the whole model into every shard and optimizer, verifying everything first: an
  /// error leaves the executor unchanged everywhere and names the mismatch or damaged file.
  /// Returns the saved TrainingState.
  io::TrainingState load(std::filesystem::path const& path);
  /// The group's rank r's shard (across processes, world rank r's). With zero_stage 3 every shard
  /// is gathered whole first (across processes collective), until the next step.
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
