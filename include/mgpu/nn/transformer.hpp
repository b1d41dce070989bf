// The layers of a decoder-only transformer (GPT-2 style): token + position Embedding,
// CausalSelfAttention, the pre-LN TransformerBlock and an LM head tied to the token embedding.
//
// Activation layout: [B, T, C] tensors between layers (B sequences of T tokens, C features); token
// ids are int32 [B, T]. Linear and LayerNorm take any rank >= 2 and treat the leading dimensions as
// rows, so inside a layer a [B, T, C] tensor is the same storage viewed as [B T, C].
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>

#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/ops/transformer.hpp>

namespace mgpu::nn {

/// Activation recomputation: what a TransformerBlock keeps from forward for backward, trading
/// memory for recomputed forward work. Gradients equal the `none` run's bit for bit (the rerun
/// uses the same kernels in the same order, and dropout replays its masks).
///   none       everything backward reads: per block, without dropout, 15 B T C values besides its
///              input (8 of them the MLP's GELU input and output) and the LayerNorm and attention
///              row statistics.
///   selective  not the attention core's output y [B, T, C] nor its per-row log-sum-exp
///              [B, heads, T]: backward reruns ops::causal_attention on the kept qkv. The online
///              softmax never stores the [B, heads, T, T] probabilities that Megatron's selective
///              recomputation drops, so this is its counterpart here: the attention core's
///              intermediates, a cheap O(B T^2 C) rerun without any GEMM of the weights.
///   full       only the block's input: backward reruns the whole block's forward first, so the
///              stored activations of n blocks are their n inputs plus one block's at a time.
enum class Recompute { none, selective, full };
std::string_view to_string(Recompute recompute) noexcept;
using mgpu::to_string;  // the overloads for shapes and dtypes stay visible in nn

/// The keys and values a CausalSelfAttention has computed for the positions it has seen, for
/// inference that appends tokens one step at a time (see Decoder in mgpu/nn/lm.hpp): k and v
/// [B, capacity, C] float32 host tensors, of which positions [0, length) are filled.
struct KvCache {
  Tensor k, v;
  std::int64_t length = 0;
};

/// Token embedding wte [V, C] plus learned position embedding wpe [P, C] (P = block size): ids
/// int32 [B, T] with T <= P -> [B, T, C]. Parameters wte then wpe, initialised N(0, init_std).
/// Backward is a deterministic scatter-add (ops::embedding_backward); ids take no gradient, so
/// backward returns an undefined tensor. When a TiedLMHead reads wte, the head's backward writes
/// (or adds to) the wte gradient first and this layer adds its part to it.
class Embedding final : public Layer {
 public:
  Embedding(std::int64_t vocab, std::int64_t block_size, std::int64_t features, float init_std = 0.02f);
  std::string name() const override;
  std::int64_t parameter_count() const override { return (vocab_ + block_size_) * features_; }
  /// wte and wpe (adjacent: one range).
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override { return {{0, parameter_count()}}; }
  /// "wte.weight" [vocab, features], "wpe.weight" [block_size, features].
  std::vector<TensorSpec> tensors() const override {
    return {{"wte.weight", {vocab_, features_}, 0}, {"wpe.weight", {block_size_, features_}, vocab_ * features_}};
  }
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& ids, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  /// Keeps dy for backward_weight (ids have no gradient).
  Tensor backward_input(Tensor const& dy, Context& ctx) override;
  void backward_weight(Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::int64_t input_vocab() const override { return vocab_; }
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<Embedding>(vocab_, block_size_, features_, init_std_);
  }

  [[nodiscard]] std::int64_t vocab() const noexcept { return vocab_; }
  [[nodiscard]] std::int64_t features() const noexcept { return features_; }
  [[nodiscard]] std::int64_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] float init_std() const noexcept { return init_std_; }
  /// The bound token-embedding weight [V, C] and its gradient view.
  [[nodiscard]] Tensor const& token_weight() const noexcept { return wte_; }
  /// The bound position-embedding weight [block_size, C].
  [[nodiscard]] Tensor const& position_weight() const noexcept { return wpe_; }
  [[nodiscard]] Tensor const& token_gradient() const noexcept { return dwte_; }
  /// Whether an LM head shares wte (its backward then always adds to the wte gradient).
  void set_tied(bool tied) noexcept { tied_ = tied; }
  [[nodiscard]] bool tied() const noexcept { return tied_; }

 private:
  std::int64_t vocab_, block_size_, features_;
  float init_std_;
  bool tied_ = false;
  Tensor wte_, wpe_, dwte_, dwpe_;
  std::map<std::int64_t, std::pair<Tensor, Tensor>> saved_;  // ids, and dy once backward_input has run
};

/// Causal multi-head self-attention: one fused qkv Linear (C -> 3C; q, k, v side by side, heads
/// contiguous inside each), softmax(q kᵀ / sqrt(C / heads)) v over keys at or before each query
/// (ops::causal_attention: online softmax, O(B T C) memory), optional dropout on the attention
/// probabilities, and an output Linear (C -> C). Input and output [B, T, C]. Parameters: the qkv
/// Linear's then the projection's (W [in, out], then b); weights initialised N(0, 0.02) and
/// N(0, proj_init_std), biases 0. With `recompute_core` forward keeps qkv but not the attention's
/// output and log-sum-exp; backward recomputes them (Recompute::selective).
class CausalSelfAttention final : public Layer {
 public:
  CausalSelfAttention(std::int64_t features, std::int64_t heads, float dropout = 0.0f, float proj_init_std = 0.02f,
                      bool recompute_core = false);
  std::string name() const override;
  std::int64_t parameter_count() const override { return qkv_.parameter_count() + proj_.parameter_count(); }
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override;
  /// "qkv.weight" [C, 3C], "qkv.bias", "proj.weight" [C, C], "proj.bias".
  std::vector<TensorSpec> tensors() const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  void set_training(bool training) override { training_ = training; }
  std::uint64_t rng_counter() const override { return calls_; }
  void set_rng_counter(std::uint64_t counter) override { calls_ = counter; }
  std::vector<std::uint64_t> rng_seeds() const override { return {seed_}; }
  void set_rng_seeds(std::span<std::uint64_t const> seeds) override;
  Tensor forward(Tensor const& x, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  Tensor backward_input(Tensor const& dy, Context& ctx) override;
  void backward_weight(Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return qkv_.saved_micro_batches(); }
  void set_input_grad(bool needed) override { qkv_.set_input_grad(needed); }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<CausalSelfAttention>(features_, heads_, dropout_, proj_init_std_, recompute_core_);
  }
  /// Frees what forward saved for `micro_batch` (activation recomputation: its backward will not run).
  void release(std::int64_t micro_batch);
  /// The seed of the probabilities' dropout that initialize() drew (call k masks with
  /// mix64(seed + k) | 1).
  [[nodiscard]] std::uint64_t dropout_seed() const noexcept { return seed_; }
  /// Inference on a float32 host model (no dropout, nothing saved for backward): x [B, t, C] holds
  /// positions [cache.length, cache.length + t) of B sequences; their keys and values are appended
  /// to `cache` and each query attends to every cached position at or before its own, so a step
  /// of one token costs O(length) attention. Returns [B, t, C]. Synchronizes ctx's stream. Throws
  /// Error(invalid_argument) for a cache of another batch or width, one without room for t more
  /// positions, or a model that is not float32 on a host device.
  Tensor forward_cached(Tensor const& x, KvCache& cache, Context& ctx) const;

 private:
  struct Saved {
    Tensor qkv, y, lse;
    ops::AttentionDropout dropout;
  };
  std::int64_t features_, heads_;
  float dropout_, proj_init_std_;
  bool recompute_core_;
  bool training_ = true;
  std::uint64_t seed_ = 0;
  std::uint64_t calls_ = 0;
  Linear qkv_, proj_;
  std::map<std::int64_t, Saved> saved_;
};

/// A pre-LN transformer block: h = x + Dropout(attn(LN1(x))), y = h + Dropout(MLP(LN2(h))) with
/// MLP = Linear C -> 4C, GELU (tanh, fused into the Linear), Linear 4C -> C. Input and output
/// [B, T, C]. Parameters in order: ln_1 (gamma, beta), attention (qkv, proj), ln_2, mlp_fc, mlp_proj.
/// GPT-2 init: weights N(0, 0.02) except the residual projections (attention and MLP output)
/// N(0, proj_init_std), biases 0, LayerNorm 1 and 0. The three dropouts share `dropout` and advance
/// together, so rng_counter() is one count. `recompute`: what forward keeps for backward (see
/// Recompute); with full, backward_input reruns forward from the kept input, at the dropout
/// count and row offset of the original forward, before the usual backward.
class TransformerBlock final : public Layer {
 public:
  TransformerBlock(std::int64_t features, std::int64_t heads, float dropout = 0.0f, float proj_init_std = 0.02f,
                   Recompute recompute = Recompute::none);
  std::string name() const override;
  std::int64_t parameter_count() const override;
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override;
  /// "ln_1.weight", "ln_1.bias", the attention's prefixed "attn_" ("attn_qkv.weight", ...),
  /// "ln_2.*", "mlp_fc.*", "mlp_proj.*" (GPT-2's names).
  std::vector<TensorSpec> tensors() const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  void set_training(bool training) override;
  std::uint64_t rng_counter() const override { return attn_.rng_counter(); }
  void set_rng_counter(std::uint64_t counter) override;
  /// The attention's seed, then the two Dropouts' (dropout_seeds()).
  std::vector<std::uint64_t> rng_seeds() const override;
  void set_rng_seeds(std::span<std::uint64_t const> seeds) override;
  Tensor forward(Tensor const& x, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  Tensor backward_input(Tensor const& dy, Context& ctx) override;
  void backward_weight(Context& ctx) override;
  Shape output_shape(Shape const& input) const override { return attn_.output_shape(input); }
  std::size_t saved_micro_batches() const override { return inputs_.size() + fc_.saved_micro_batches(); }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<TransformerBlock>(features_, heads_, dropout_, proj_init_std_, recompute_);
  }
  /// A repeated block of a model: a part of its own in Sequential::structure_parts().
  bool block() const override { return true; }
  [[nodiscard]] Recompute recompute() const noexcept { return recompute_; }
  [[nodiscard]] std::int64_t features() const noexcept { return features_; }
  [[nodiscard]] std::int64_t heads() const noexcept { return heads_; }
  [[nodiscard]] float dropout() const noexcept { return dropout_; }
  [[nodiscard]] float proj_init_std() const noexcept { return proj_init_std_; }
  /// The seeds of the attention probabilities' dropout and of the two residual branches' Dropouts,
  /// drawn by initialize().
  struct DropoutSeeds {
    std::uint64_t attention = 0, attention_output = 0, mlp_output = 0;
  };
  [[nodiscard]] DropoutSeeds dropout_seeds() const noexcept {
    return {attn_.dropout_seed(), attn_drop_.seed(), mlp_drop_.seed()};
  }
  /// The block at inference with its attention's key/value cache (see
  /// CausalSelfAttention::forward_cached): x [B, t, C] -> [B, t, C], dropout off.
  Tensor forward_cached(Tensor const& x, KvCache& cache, Context& ctx) const;

 private:
  // The forward of every sublayer, each saving what its backward reads.
  Tensor forward_layers(Tensor const& x, Context& ctx);
  // Recompute::full: what forward keeps to rerun itself.
  struct Input {
    Tensor x;
    std::uint64_t rng_counter = 0;
    std::int64_t row_offset = 0;
  };
  std::int64_t features_, heads_;
  float dropout_, proj_init_std_;
  Recompute recompute_;
  std::map<std::int64_t, Input> inputs_;
  LayerNorm ln1_;
  CausalSelfAttention attn_;
  Dropout attn_drop_;
  LayerNorm ln2_;
  Linear fc_, proj_;
  Dropout mlp_drop_;
};

/// The LM head tied to the token embedding: logits [B, T, V] = h [B, T, C] wteᵀ, with wte the
/// weight of the Embedding of the same Sequential (found by link()). It holds no parameters: its
/// backward writes (or, with ctx.accumulate_gradients, adds) dwte = dlogitsᵀ h into the
/// embedding's gradient view, and the embedding's backward, which runs after it, adds its own part,
/// so the one parameter gets the sum of both uses.
///
/// A pipeline stage holding the head without its Embedding (Sequential::stage() calls
/// hold_weight() for it) holds a copy of wte as its own parameters instead, as Megatron's last
/// stage does: pipeline::Executor makes the copy equal to the first stage's wte at the start and
/// sums the two stages' wte gradients before every update, so both apply the same update and stay
/// equal.
class TiedLMHead final : public Layer {
 public:
  TiedLMHead(std::int64_t vocab, std::int64_t features);
  std::string name() const override;
  /// V C with its own copy of wte, else 0.
  std::int64_t parameter_count() const override { return holds_weight_ ? vocab_ * features_ : 0; }
  /// Its copy of wte, when it holds one (decayed as wte is, so the two stay equal).
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override;
  /// Its copy "wte.weight" [vocab, features] when it holds one, else none.
  std::vector<TensorSpec> tensors() const override;
  void bind(Tensor const& params, Tensor const& grads) override;
  /// The copy of wte starts at zero (the pipeline executor adds the first stage's wte to it).
  void initialize(std::mt19937_64& rng) override;
  void link(Sequential& model) override;
  Tensor forward(Tensor const& h, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  Tensor backward_input(Tensor const& dy, Context& ctx) override;
  void backward_weight(Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<Layer> clone() const override;

  /// Makes the head hold its own copy of wte ([V, C] parameters) instead of reading its
  /// Embedding's; call before materialize.
  void hold_weight() noexcept { holds_weight_ = true; }
  [[nodiscard]] bool holds_weight() const noexcept { return holds_weight_; }
  [[nodiscard]] std::int64_t vocab() const noexcept { return vocab_; }
  [[nodiscard]] std::int64_t features() const noexcept { return features_; }

 private:
  std::int64_t vocab_, features_;
  bool holds_weight_ = false;
  Tensor wte_, dwte_;
  std::map<std::int64_t, std::pair<Tensor, Tensor>> saved_;  // h as [N, C], and dlogits as [N, V]
};

}  // namespace mgpu::nn
