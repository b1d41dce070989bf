// Layers with explicit forward and backward, and Sequential, whose parameters and gradients live in
// one flat buffer each (a view per layer), so optimizers and gradient buckets see contiguous memory.
// Mixed precision: a Sequential materialized with a bfloat16 or float16 compute type keeps float32
// master parameters and gradients beside the compute-type buffers the layers use.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::optim {
class Optimizer;
}

namespace mgpu::nn {

/// Where a layer's work runs and where it gets scratch memory. `row_offset` is the index, in the
/// global batch, of the first row this call sees (a data-parallel shard or a micro-batch), so that
/// row-wise randomness such as Dropout's mask is the same however the batch is split.
/// `micro_batch` keys what forward saves for backward, so several micro-batches can be in flight
/// (each backward must use the key of its forward). With `accumulate_gradients`, backward adds
/// parameter gradients to the gradient buffer instead of overwriting it.
struct Context {
  Allocator& allocator;
  Stream& stream;
  std::int64_t row_offset = 0;
  std::int64_t micro_batch = 0;
  bool accumulate_gradients = false;
  /// False for a forward that no backward follows (evaluation): layers keep nothing for backward,
  /// so what they computed is freed as soon as nothing reads it.
  bool keep_for_backward = true;
};

class Sequential;

/// Weight initialisation: Kaiming (He) uniform for ReLU networks, Xavier (Glorot) uniform otherwise.
enum class Init { kaiming, xavier };

/// A layer. forward() saves what backward() needs under ctx.micro_batch (a later forward with the
/// same key replaces it; nothing with ctx.keep_for_backward false); backward() writes the layer's parameter gradients (into its view of the
/// gradient buffer, or adds to them with ctx.accumulate_gradients), returns the gradient of its
/// input and frees what that micro-batch's forward saved. backward_input() then backward_weight()
/// do the same in two parts (zero-bubble schedules run other work between them). A layer is used
/// by one thread at a time.
class Layer {
 public:
  virtual ~Layer() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual std::int64_t parameter_count() const { return 0; }
  /// The [begin, end) offsets, within this layer's parameters, of its weight matrices (its 2-D
  /// parameters: Linear weights, embedding tables), in order: what weight decay applies to by the
  /// usual convention (biases and normalization gains are not matrices). None by default.
  [[nodiscard]] virtual std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const { return {}; }
  /// Gives the layer its views of the flat parameter and gradient buffers (parameter_count() each).
  virtual void bind(Tensor const& /*params*/, Tensor const& /*grads*/) {}
  /// Called by Sequential::materialize once every layer of `model` is bound, for a layer that uses
  /// another layer's parameters (an LM head tied to the token embedding); throws Error when the
  /// layer it needs is missing.
  virtual void link(Sequential& /*model*/) {}
  /// Writes initial parameters from `rng` into the views last bound, which are float32 host memory
  /// when Sequential::materialize calls it.
  virtual void initialize(std::mt19937_64& /*rng*/) {}
  /// Training (the default) or evaluation mode; only layers such as Dropout behave differently.
  virtual void set_training(bool /*training*/) {}
  /// The layer's random-number position (Dropout: forward calls so far), saved in checkpoints.
  [[nodiscard]] virtual std::uint64_t rng_counter() const { return 0; }
  virtual void set_rng_counter(std::uint64_t /*counter*/) {}
  /// The seeds initialize() drew for the layer's randomness (Dropout's masks): with rng_counter()
  /// they decide every later mask, so checkpoints save them and set_rng_seeds() puts them back
  /// (into a layer initialised from any seed). None by default.
  [[nodiscard]] virtual std::vector<std::uint64_t> rng_seeds() const { return {}; }
  /// Throws Error(invalid_argument) for another number of seeds than rng_seeds() returns.
  virtual void set_rng_seeds(std::span<std::uint64_t const> seeds);
  /// The vocabulary of the token ids the layer takes as input (an embedding: int32 ids in
  /// [0, input_vocab())), or 0 for a layer that takes values.
  [[nodiscard]] virtual std::int64_t input_vocab() const { return 0; }
  virtual Tensor forward(Tensor const& x, Context& ctx) = 0;
  virtual Tensor backward(Tensor const& dy, Context& ctx) = 0;
  /// The input gradient; what backward_weight() needs stays saved. By default all of backward().
  virtual Tensor backward_input(Tensor const& dy, Context& ctx) { return backward(dy, ctx); }
  /// The parameter gradients left by backward_input(); frees the micro-batch's saved tensors.
  virtual void backward_weight(Context& /*ctx*/) {}
  /// The shape forward() returns for an input of `input` (throws Error(invalid_argument) for an
  /// input the layer cannot take).
  [[nodiscard]] virtual Shape output_shape(Shape const& input) const { return input; }
  /// The number of micro-batches whose forward saved tensors not yet freed by their backward.
  [[nodiscard]] virtual std::size_t saved_micro_batches() const { return 0; }
  /// Whether backward() must return the input gradient. Sequential turns it off for its first
  /// layer when nobody needs it (Linear then skips a GEMM and returns an undefined tensor).
  virtual void set_input_grad(bool /*needed*/) {}
  /// A fresh layer of the same configuration (for replicas on other devices).
  [[nodiscard]] virtual std::unique_ptr<Layer> clone() const = 0;
  /// Whether the layer is one of the model's repeated blocks (a transformer block): how the model
  /// divides by its structure, each block a part of its own and the layers between two blocks one
  /// part together (Sequential::structure_parts()). False by default.
  [[nodiscard]] virtual bool block() const { return false; }
};

/// y = x W + b, with W [in, out] and b [out]; x [batch, in], or [..., in] with the leading
/// dimensions taken as rows (a [B, T, in] activation gives [B, T, out]).
///
/// Sequential runs a Linear followed by a ReLU or GELU as one fused layer: forward(x, ctx, act)
/// computes act(x W + b) with ops::linear (bias and activation in the GEMM's epilogue), and the
/// next backward() starts with ops::activation_bias_grad (activation and bias gradients in one pass).
class Linear final : public Layer {
 public:
  Linear(std::int64_t in, std::int64_t out, Init init = Init::kaiming);
  std::string name() const override;
  std::int64_t parameter_count() const override { return in_ * out_ + out_; }
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override { return {{0, in_ * out_}}; }
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& x, Context& ctx) override { return forward(x, ctx, ops::ActivationKind::identity); }
  /// act(x W + b); the following backward() takes the gradient of this output.
  Tensor forward(Tensor const& x, Context& ctx, ops::ActivationKind act);
  Tensor backward(Tensor const& dy, Context& ctx) override;
  /// dz (through the activation), the bias gradient and dx = dz W^T; keeps x and dz for
  /// backward_weight(), which computes dW = x^T dz.
  Tensor backward_input(Tensor const& dy, Context& ctx) override;
  void backward_weight(Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  void set_input_grad(bool needed) override { input_grad_ = needed; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Linear>(in_, out_, init_); }
  /// Activation recomputation: frees what forward saved for `micro_batch` (its backward will not
  /// run; a later forward of the same micro-batch saves it again).
  void release(std::int64_t micro_batch) { saved_.erase(micro_batch); }
  /// Activation recomputation: forgets the input forward saved for ctx.micro_batch, and gives a
  /// recomputed one back, which must hold the same values, before backward_input.
  void release_input(Context const& ctx);
  void restore_input(Tensor const& x, Context const& ctx);
  [[nodiscard]] Tensor const& weight() const noexcept { return w_; }
  [[nodiscard]] Tensor const& bias() const noexcept { return b_; }

 private:
  std::int64_t in_;
  std::int64_t out_;
  Init init_;
  bool input_grad_ = true;
  struct Saved {
    Tensor x;
    Tensor z;  // what the activation's backward reads: y for relu, the pre-activation for gelu (else none)
    Tensor dz;  // the gradient of x W + b, between backward_input and backward_weight
    ops::ActivationKind act = ops::ActivationKind::identity;
  };
  Saved& saved(Context const& ctx, char const* call);
  Tensor w_, b_, dw_, db_;
  std::map<std::int64_t, Saved> saved_;
};

/// An element-wise activation (see ReLU and GELU).
class Activation : public Layer {
 public:
  [[nodiscard]] ops::ActivationKind kind() const noexcept { return kind_; }
  Tensor forward(Tensor const& x, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  std::size_t saved_micro_batches() const override { return x_.size(); }

 protected:
  explicit Activation(ops::ActivationKind kind) : kind_(kind) {}

 private:
  ops::ActivationKind kind_;
  std::map<std::int64_t, Tensor> x_;
};

class ReLU final : public Activation {
 public:
  ReLU() : Activation(ops::ActivationKind::relu) {}
  std::string name() const override { return "ReLU"; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<ReLU>(); }
};

/// GELU, tanh approximation.
class GELU final : public Activation {
 public:
  GELU() : Activation(ops::ActivationKind::gelu) {}
  std::string name() const override { return "GELU"; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<GELU>(); }
};

/// LayerNorm over the last dimension with learned gamma (initialised to 1) and beta (0); any rank
/// >= 2, leading dimensions taken as rows.
class LayerNorm final : public Layer {
 public:
  explicit LayerNorm(std::int64_t features, float eps = 1e-5f);
  std::string name() const override;
  std::int64_t parameter_count() const override { return 2 * features_; }
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& x, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<LayerNorm>(features_, eps_); }
  /// Frees what forward saved for `micro_batch` (activation recomputation: its backward will not run).
  void release(std::int64_t micro_batch) { saved_.erase(micro_batch); }
  /// forward of x + residual, the sum written into x (in place) in the same pass: the residual add
  /// before a LayerNorm; backward reads the sum.
  Tensor forward_add(Tensor const& x, Tensor const& residual, Context& ctx);
  /// backward, with `residual` (shaped as dy) added to the input gradient in the same pass: for a
  /// LayerNorm whose input also feeds a residual path with that gradient.
  Tensor backward_add(Tensor const& dy, Tensor const& residual, Context& ctx);
  [[nodiscard]] Tensor const& gamma() const noexcept { return gamma_; }
  [[nodiscard]] Tensor const& beta() const noexcept { return beta_; }
  [[nodiscard]] float eps() const noexcept { return eps_; }

 private:
  std::int64_t features_;
  float eps_;
  Tensor gamma_, beta_, dgamma_, dbeta_;
  std::map<std::int64_t, std::pair<Tensor, Tensor>> saved_;  // x and stats
};

/// Inverted dropout with probability p while training, the identity in evaluation mode. Its masks
/// come from a seed drawn at initialisation, a count of forward calls and each element's global
/// index (Context::row_offset), so replicas built with one seed drop, row for row, what one device
/// would drop from the whole batch, and a resumed run continues the same sequence.
class Dropout final : public Layer {
 public:
  explicit Dropout(float p);
  std::string name() const override;
  void initialize(std::mt19937_64& rng) override { seed_ = rng(); }
  void set_training(bool training) override { training_ = training; }
  std::uint64_t rng_counter() const override { return calls_; }
  void set_rng_counter(std::uint64_t counter) override { calls_ = counter; }
  std::vector<std::uint64_t> rng_seeds() const override { return {seed_}; }
  void set_rng_seeds(std::span<std::uint64_t const> seeds) override;
  Tensor forward(Tensor const& x, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  std::size_t saved_micro_batches() const override { return masks_.size(); }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Dropout>(p_); }
  /// Forgets the mask of `micro_batch` (activation recomputation: its backward will not run).
  void release(std::int64_t micro_batch) { masks_.erase(micro_batch); }
  /// The seed initialize() drew; set_seed gives the layer another's (a tensor-parallel shard of a
  /// block takes the whole block's, so it drops what the block would).
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  void set_seed(std::uint64_t seed) noexcept { seed_ = seed; }

 private:
  float p_;
  bool training_ = true;
  std::uint64_t seed_ = 0;
  std::uint64_t calls_ = 0;
  std::map<std::int64_t, std::pair<std::uint64_t, std::int64_t>> masks_;  // mask seed (0: identity), element offset
};

/// Where one layer's parameters lie in its Sequential's flat buffers: elements [begin, end) of
/// parameters(), gradients() and their float32 masters belong to layer `layer` (an index into that
/// Sequential; add first_layer() for its index in the whole model). Only layers with parameters
/// have one; a Sequential's ranges, in layer order, tile [0, parameter_count()).
struct ParameterRange {
  std::size_t layer = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
  [[nodiscard]] std::int64_t size() const noexcept { return end - begin; }
  bool operator==(ParameterRange const&) const = default;
};

/// Layers in order, with one flat parameter buffer and one flat gradient buffer. A Sequential may
/// be a stage of a larger model (see stage()): its layers keep their indices in the whole model,
/// which seed their initialisation. Used by one thread at a time.
class Sequential {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::unique_ptr<Layer>> layers) : layers_(std::move(layers)) {}
  Sequential(Sequential&&) noexcept = default;
  Sequential& operator=(Sequential&&) noexcept = default;

  /// An MLP: Linear layers of the given widths with `activation` ("relu" or "gelu") between them.
  static Sequential mlp(std::vector<std::int64_t> const& widths, std::string const& activation = "relu");

  void add(std::unique_ptr<Layer> layer);
  [[nodiscard]] std::size_t size() const noexcept { return layers_.size(); }
  [[nodiscard]] Layer& layer(std::size_t i) { return *layers_.at(i); }
  [[nodiscard]] Layer const& layer(std::size_t i) const { return *layers_.at(i); }
  [[nodiscard]] std::int64_t parameter_count() const;
  /// Each layer with parameters and its range in the flat buffers, in layer order (the one walk
  /// over parameter offsets: buckets, optimizer slices and checks use it).
  [[nodiscard]] std::vector<ParameterRange> parameter_ranges() const;
  /// Every layer's matrix_ranges() as ranges of the flat buffers, adjacent ones merged: AdamW's
  /// decay_ranges for weight decay on the weight matrices only. For a stage (see stage()), the
  /// stage's own buffers; a stage's ranges are the whole model's that fall into it, shifted.
  [[nodiscard]] std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const;

  /// Allocates the flat buffers on ctx's device and initialises every layer from `seed` and its index
  /// in the whole model (on the host, then copied), so every replica built with the same seed holds
  /// identical weights, and a stage holds the weights of the same layers in the whole model.
  /// `compute` is the type layers compute in: float32, or bfloat16/float16 with float32 masters.
  void materialize(Context& ctx, std::uint64_t seed, DType compute = DType::float32);
  [[nodiscard]] DType compute_type() const noexcept { return params_.dtype(); }
  /// Whether materialize() has run (the parameters may be bound elsewhere: bind_parameters()).
  [[nodiscard]] bool materialized() const noexcept { return params_.defined() || !bound_params_.empty(); }
  /// The compute-type buffers the layers read and write.
  [[nodiscard]] Tensor const& parameters() const noexcept { return params_; }
  [[nodiscard]] Tensor const& gradients() const noexcept { return grads_; }
  /// The float32 buffers optimizers update (the same tensors as above for float32 compute).
  [[nodiscard]] Tensor const& master_parameters() const noexcept { return master_params_; }
  [[nodiscard]] Tensor const& master_gradients() const noexcept { return master_grads_; }
  /// Sharded gradients (ZeRO-2, float32 compute): from now on the layers of the parameter ranges
  /// within [begin, end) (whole ranges, not cut) write their gradients into `grads` (float32,
  /// end - begin values) instead of the flat gradient buffers, which the first call frees
  /// (gradients() and master_gradients() are then undefined once every layer is rebound elsewhere;
  /// master_gradients(begin, end) finds where a range's gradients are). A later call rebinds, e.g.
  /// a staging buffer reused by one group of layers after another during backward: work enqueued
  /// before it keeps the views it had. Layers are linked again (a tied LM head follows its
  /// embedding). Throws Error(invalid_argument) for another compute type, a range that cuts a
  /// layer's parameters, or a buffer of another size or type.
  void bind_gradients(std::int64_t begin, std::int64_t end, Tensor const& grads);
  /// Sharded parameters (ZeRO-3, float32 compute): from now on the layers of the parameter ranges
  /// within [begin, end) (whole ranges) read their parameters from `params` (float32, end - begin
  /// values) instead of the flat buffers, which the first call frees (parameters() and
  /// master_parameters() are then undefined); binding all of [0, parameter_count()) makes `params`
  /// the flat parameter buffers again. A later call rebinds, e.g. a buffer that one group of layers
  /// after another gathers its parameters into. Layers are linked again (a tied LM head follows its
  /// embedding). Throws Error(invalid_argument) as bind_gradients() does.
  void bind_parameters(std::int64_t begin, std::int64_t end, Tensor const& params);
  /// The float32 gradients of [begin, end): a slice of master_gradients(), or, after
  /// bind_gradients(), of the buffer last bound to those elements (which must hold all of them).
  [[nodiscard]] Tensor master_gradients(std::int64_t begin, std::int64_t end) const;
  /// master gradients = gradients * factor (e.g. 1 / loss scale), converting from the compute
  /// type; over elements [begin, end) of the flat buffers, or all of them (end < 0).
  void unscale_gradients(float factor, Stream& stream, std::int64_t begin = 0, std::int64_t end = -1);
  /// parameters = master parameters rounded to the compute type (after an optimizer step), over
  /// [begin, end) or all; does nothing for float32 compute.
  void sync_parameters(Stream& stream, std::int64_t begin = 0, std::int64_t end = -1);

  /// Training or evaluation mode for every layer.
  void train(bool training);
  /// Every layer's rng_counter(), in order, and setting them back (checkpoints).
  [[nodiscard]] std::vector<std::uint64_t> rng_state() const;
  void set_rng_state(std::vector<std::uint64_t> const& state);
  /// Every layer's rng_seeds(), in layer order, one after the other, and setting them back (throws
  /// Error(invalid_argument), changing nothing, for another count than rng_seeds() returns).
  [[nodiscard]] std::vector<std::uint64_t> rng_seeds() const;
  void set_rng_seeds(std::span<std::uint64_t const> seeds);

  /// What nn::train_step keeps between its calls on a whole batch: the RNG state and the
  /// optimizer's step count before the last step, and whether that step's work has run (its stream
  /// marks it last), so that a step whose work failed after train_step returned is put back at
  /// the next call. Not copied by clone().
  struct StepRecord {
    std::vector<std::uint64_t> rng;
    std::int64_t steps = 0;
    optim::Optimizer const* optimizer = nullptr;
    std::shared_ptr<std::atomic<bool>> done;  // null: nothing to check
  };
  [[nodiscard]] StepRecord& step_record() noexcept { return step_record_; }

  /// Called by forward() before each layer's (or fused unit's) forward, layer 0 first, and by
  /// backward() before each one's backward, last first, with the layer's index and whether it is
  /// backward: where sharded parameters (ZeRO-3) are gathered before the layers read them.
  using BeforeLayer = std::function<void(std::size_t layer, bool backward)>;
  /// Forward through every layer; a Linear followed by a ReLU or GELU runs as one fused layer.
  Tensor forward(Tensor const& x, Context& ctx, BeforeLayer const& before = {});
  /// Called during backward for each layer with parameters, last layer first, once the work that
  /// writes its gradients is enqueued: [begin, end) is its range in the flat buffers (one of
  /// parameter_ranges()). Work the callback enqueues on ctx.stream runs after those gradients are
  /// written (e.g. an optimizer update of the layer, or a data-parallel bucket's all-reduce).
  using GradientsReady = std::function<void(std::int64_t begin, std::int64_t end)>;
  /// Backward through every layer; returns the input gradient when `input_grad` (else an
  /// undefined tensor, saving the first layer's input-gradient GEMM).
  Tensor backward(Tensor const& dy, Context& ctx, bool input_grad = true, GradientsReady const& ready = {},
                  BeforeLayer const& before = {});
  /// The input-gradient half of backward (every layer's backward_input, last first), and the
  /// weight-gradient half (every layer's backward_weight), which must follow for the same
  /// ctx.micro_batch before the gradients are read.
  Tensor backward_input(Tensor const& dy, Context& ctx, bool input_grad = true);
  void backward_weight(Context& ctx);
  /// Sets the gradient buffer (every buffer bind_gradients() gave) to zero (before accumulating
  /// micro-batches), or the compute-type gradients of elements [begin, end) only.
  void zero_gradients(Stream& stream);
  void zero_gradients(Stream& stream, std::int64_t begin, std::int64_t end);
  /// The shape forward() returns for an input of `input`.
  [[nodiscard]] Shape output_shape(Shape const& input) const;
  /// The model's parts by its structure, as [begin, end) spans of layer indices in order, each
  /// holding parameters: every block (Layer::block()) a part alone, the layers between two blocks
  /// (with parameters among them) one part together; without blocks, every layer with parameters
  /// a part alone. Layers without parameters join the part before them (the first ones the part
  /// after). What a sharded data-parallel executor gathers one at a time (ZeRO-3's units).
  [[nodiscard]] std::vector<std::pair<std::size_t, std::size_t>> structure_parts() const;
  /// The layer indices where the model may be cut into stages: 0, every unit boundary (a Linear
  /// and the activation fused into it are one unit) and size().
  [[nodiscard]] std::vector<std::size_t> cut_points() const;
  /// A new Sequential (architecture, not weights) of layers [begin, end), which materialize()
  /// initialises exactly as those layers of this model; a TiedLMHead whose Embedding is not in the
  /// span holds its own copy of wte (TiedLMHead::hold_weight()). Throws Error(invalid_argument) for
  /// an empty or out-of-range span, or a cut inside a fused Linear and activation.
  [[nodiscard]] Sequential stage(std::size_t begin, std::size_t end) const;
  /// The index of layer 0 in the whole model (0 unless made by stage()).
  [[nodiscard]] std::size_t first_layer() const noexcept { return first_layer_; }
  /// A copy of the architecture (not the weights) for another device.
  [[nodiscard]] Sequential clone() const;

 private:
  // The activation layer i + 1 fuses into the Linear layer i, if any.
  [[nodiscard]] Activation const* fused_activation(std::size_t i) const;
  // Gives each layer with parameters its views of `params` and `grads`.
  void bind_layers(Tensor const& params, Tensor const& grads);
  // bind_gradients() and bind_parameters(): refuses another compute type, a buffer that is not
  // end - begin float32 values, and a range that cuts a layer's parameters.
  void check_binding(std::string const& what, std::int64_t begin, std::int64_t end, Tensor const& buffer) const;
  // The float32 parameters of [begin, end): a slice of master_parameters(), or of the buffer
  // bind_parameters() bound to them last.
  [[nodiscard]] Tensor master_parameters(std::int64_t begin, std::int64_t end) const;
  void check_materialized(char const* call) const;

  std::vector<std::unique_ptr<Layer>> layers_;
  std::size_t first_layer_ = 0;
  Tensor params_, grads_, master_params_, master_grads_;
  // bind_gradients(): where each rebound range of elements [first, second.first) has its gradients.
  std::map<std::int64_t, std::pair<std::int64_t, Tensor>> bound_grads_;
  // bind_parameters(): the same for the parameters.
  std::map<std::int64_t, std::pair<std::int64_t, Tensor>> bound_params_;
  StepRecord step_record_;
};

}  // namespace mgpu::nn
