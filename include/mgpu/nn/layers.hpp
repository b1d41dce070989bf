// Layers with explicit forward and backward, and Sequential, whose parameters and gradients live in
// one flat buffer each (float32 masters beside 16-bit compute buffers). Notes: docs/architecture.md.
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

/// Where a layer's work runs and its scratch memory. `row_offset`: the global index of the call's
/// first row (row-wise randomness does not depend on the split); `micro_batch` keys what forward
/// saves for backward; `accumulate_gradients`: backward adds to the gradient buffer.
struct Context {
  Allocator& allocator;
  Stream& stream;
  std::int64_t row_offset = 0;
  std::int64_t micro_batch = 0;
  bool accumulate_gradients = false;
  /// False for a forward that no backward follows (evaluation): nothing is kept for backward.
  bool keep_for_backward = true;
};

class Sequential;

/// One named tensor of a layer's (or a Sequential's) parameters: `shape` as the flat buffer holds
/// it (a Linear weight [in, out]), from element `offset` of those parameters on, row-major.
struct TensorSpec {
  std::string name;
  Shape shape;
  std::int64_t offset = 0;
  [[nodiscard]] std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (std::int64_t const d : shape) n *= d;
    return n;
  }
  bool operator==(TensorSpec const&) const = default;
};

/// Weight initialisation: Kaiming (He) uniform for ReLU networks, Xavier (Glorot) uniform otherwise.
enum class Init { kaiming, xavier };

/// A layer, used by one thread at a time. forward() saves what backward() needs under
/// ctx.micro_batch; backward() writes (or adds) the parameter gradients, returns the input's and
/// frees the saved tensors. backward_input() then backward_weight() do the same in two parts.
class Layer {
 public:
  virtual ~Layer() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual std::int64_t parameter_count() const { return 0; }
  /// The [begin, end) offsets of its weight matrices within its parameters (none by default).
  [[nodiscard]] virtual std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const { return {}; }
  /// Its parameters as named tensors laid end to end (checkpoints address them by name); by default
  /// one 1-D tensor "parameters" of parameter_count() elements, none when it has no parameters.
  [[nodiscard]] virtual std::vector<TensorSpec> tensors() const;
  /// Gives the layer its views of the flat parameter and gradient buffers (parameter_count() each).
  virtual void bind(Tensor const& /*params*/, Tensor const& /*grads*/) {}
  /// Links a layer that uses another's parameters (a tied LM head) once every layer of `model` is
  /// bound; throws Error when that layer is missing.
  virtual void link(Sequential& /*model*/) {}
  /// Writes initial parameters from `rng` into the views last bound, which are float32 host memory
  /// when Sequential::materialize calls it.
  virtual void initialize(std::mt19937_64& /*rng*/) {}
  /// Training (the default) or evaluation mode; only layers such as Dropout behave differently.
  virtual void set_training(bool /*training*/) {}
  /// The layer's random-number position (Dropout: forward calls so far), saved in checkpoints.
  [[nodiscard]] virtual std::uint64_t rng_counter() const { return 0; }
  virtual void set_rng_counter(std::uint64_t /*counter*/) {}
  /// The seeds initialize() drew for the layer's randomness (none by default), saved in
  /// checkpoints.
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
  /// The parameter gradients left by backward_input(), from saved tensors only: it reads no
  /// parameters (ZeRO-3 gathers none for it). Frees the micro-batch's saved tensors.
  virtual void backward_weight(Context& /*ctx*/) {}
  /// The shape forward() returns for an input of `input` (throws Error(invalid_argument) for an
  /// input the layer cannot take).
  [[nodiscard]] virtual Shape output_shape(Shape const& input) const { return input; }
  /// The number of micro-batches whose forward saved tensors not yet freed by their backward.
  [[nodiscard]] virtual std::size_t saved_micro_batches() const { return 0; }
  /// Whether backward() must return the input gradient (else it may return an undefined tensor).
  virtual void set_input_grad(bool /*needed*/) {}
  /// A fresh layer of the same configuration (for replicas on other devices).
  [[nodiscard]] virtual std::unique_ptr<Layer> clone() const = 0;
  /// Whether the layer is one of the model's repeated blocks (see Sequential::structure_parts()).
  [[nodiscard]] virtual bool block() const { return false; }
};

/// y = x W + b, with W [in, out] and b [out]; x [..., in], leading dimensions taken as rows.
/// Sequential fuses a following ReLU or GELU into it.
class Linear final : public Layer {
 public:
  Linear(std::int64_t in, std::int64_t out, Init init = Init::kaiming);
  std::string name() const override;
  std::int64_t parameter_count() const override { return in_ * out_ + out_; }
  std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const override { return {{0, in_ * out_}}; }
  /// "weight" [in, out], "bias" [out].
  std::vector<TensorSpec> tensors() const override { return {{"weight", {in_, out_}, 0}, {"bias", {out_}, in_ * out_}}; }
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& x, Context& ctx) override { return forward(x, ctx, ops::ActivationKind::identity); }
  /// act(x W + b); the following backward() takes the gradient of this output.
  Tensor forward(Tensor const& x, Context& ctx, ops::ActivationKind act);
  Tensor backward(Tensor const& dy, Context& ctx) override;
  /// dz (through the activation), the bias gradient and dx = dz W^T; backward_weight(): dW = x^T dz.
  Tensor backward_input(Tensor const& dy, Context& ctx) override;
  void backward_weight(Context& ctx) override;
  Shape output_shape(Shape const& input) const override;
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  void set_input_grad(bool needed) override { input_grad_ = needed; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Linear>(in_, out_, init_); }
  /// Activation recomputation: frees what forward saved for `micro_batch`.
  void release(std::int64_t micro_batch) { saved_.erase(micro_batch); }
  /// Activation recomputation: replaces the input saved for ctx.micro_batch by a recomputed one.
  void release_input(Context const& ctx);
  void restore_input(Tensor const& x, Context const& ctx);
  [[nodiscard]] Tensor const& weight() const noexcept { return w_; }
  [[nodiscard]] Tensor const& bias() const noexcept { return b_; }
  [[nodiscard]] std::int64_t in_features() const noexcept { return in_; }
  [[nodiscard]] std::int64_t out_features() const noexcept { return out_; }
  [[nodiscard]] Init init() const noexcept { return init_; }

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
  /// "weight" (gamma) and "bias" (beta), [features] each.
  std::vector<TensorSpec> tensors() const override { return {{"weight", {features_}, 0}, {"bias", {features_}, features_}}; }
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

/// Inverted dropout with probability p while training, the identity in evaluation mode; its masks
/// do not depend on how the batch is split, and a resumed run continues them.
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
  /// The seed initialize() drew, and giving the layer another's.
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  void set_seed(std::uint64_t seed) noexcept { seed_ = seed; }
  /// The probability of dropping an element.
  [[nodiscard]] float p() const noexcept { return p_; }

 private:
  float p_;
  bool training_ = true;
  std::uint64_t seed_ = 0;
  std::uint64_t calls_ = 0;
  std::map<std::int64_t, std::pair<std::uint64_t, std::int64_t>> masks_;  // mask seed (0: identity), element offset
};

/// Elements [begin, end) of a Sequential's flat buffers that belong to its layer `layer`; a
/// Sequential's ranges, in layer order, tile [0, parameter_count()).
struct ParameterRange {
  std::size_t layer = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
  [[nodiscard]] std::int64_t size() const noexcept { return end - begin; }
  bool operator==(ParameterRange const&) const = default;
};

/// Layers in order, with one flat parameter buffer and one flat gradient buffer; a Sequential may
/// be a stage of a larger model (see stage()). Used by one thread at a time.
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
  /// Each layer with parameters and its range in the flat buffers, in layer order.
  [[nodiscard]] std::vector<ParameterRange> parameter_ranges() const;
  /// Every layer's tensors() with offsets in the flat buffers, in order, each named by its layer:
  /// "h.<k>." before the tensors of the k-th block() layer (a transformer block: "h.3.attn_qkv.weight"),
  /// "<layer index>." before any other layer's ("0.wte.weight"). Throws Error(invalid_argument)
  /// when a layer's tensors do not lie end to end over its parameters.
  [[nodiscard]] std::vector<TensorSpec> tensors() const;
  /// Every layer's matrix_ranges() in the flat buffers, adjacent ones merged (AdamW's decay_ranges).
  [[nodiscard]] std::vector<std::pair<std::int64_t, std::int64_t>> matrix_ranges() const;

  /// Allocates the flat buffers on ctx's device and initialises every layer from `seed` and its
  /// index in the whole model. `compute`: float32, or bfloat16/float16 with float32 masters.
  void materialize(Context& ctx, std::uint64_t seed, DType compute = DType::float32);
  [[nodiscard]] DType compute_type() const noexcept { return compute_; }
  /// Whether materialize() has run (the parameters may be bound elsewhere: bind_parameters()).
  [[nodiscard]] bool materialized() const noexcept { return params_.defined() || !bound_params_.empty(); }
  /// The compute-type buffers the layers read and write.
  [[nodiscard]] Tensor const& parameters() const noexcept { return params_; }
  [[nodiscard]] Tensor const& gradients() const noexcept { return grads_; }
  /// The float32 buffers optimizers update (the same tensors as above for float32 compute).
  [[nodiscard]] Tensor const& master_parameters() const noexcept { return master_params_; }
  [[nodiscard]] Tensor const& master_gradients() const noexcept { return master_grads_; }
  /// Sharded gradients (ZeRO-2): the gradients of the whole parameter ranges in [begin, end) are in
  /// `grads` (end - begin values) from now on. A float32 buffer holds their master gradients (with
  /// float32 compute the layers write it; with 16-bit compute unscale_gradients() writes it from the
  /// layers' compute-type gradients), a compute-type one (16-bit compute) the gradients the layers
  /// write. The first call of a kind frees the flat buffer it replaces. Throws Error(invalid_argument)
  /// for a range that cuts a layer's parameters, or a buffer of another size or type.
  void bind_gradients(std::int64_t begin, std::int64_t end, Tensor const& grads);
  /// Sharded parameters (ZeRO-3): the layers of the whole parameter ranges in [begin, end) read their
  /// parameters from `params` (end - begin values of the compute type) from now on; the first call
  /// frees the flat buffers, the master parameters too (the caller keeps those: bound over every
  /// element, `params` is the flat buffer again, with float32 compute the masters too, with 16-bit
  /// compute none until bind_master_parameters()).
  /// Throws Error(invalid_argument) as bind_gradients() does.
  void bind_parameters(std::int64_t begin, std::int64_t end, Tensor const& params);
  /// The whole float32 master parameters from now on (a 16-bit model's, after its layers were bound
  /// whole again by bind_parameters()). Throws Error(invalid_argument) for another size or type.
  void bind_master_parameters(Tensor const& masters);
  /// The float32 gradients of [begin, end), wherever bind_gradients() last put them.
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
  /// Every layer's rng_seeds(), in order, and setting them back (throws Error(invalid_argument),
  /// changing nothing, for another count).
  [[nodiscard]] std::vector<std::uint64_t> rng_seeds() const;
  void set_rng_seeds(std::span<std::uint64_t const> seeds);

  /// What nn::train_step keeps between calls to put back a step whose work failed later (not
  /// copied by clone()).
  struct StepRecord {
    std::vector<std::uint64_t> rng;
    std::int64_t steps = 0;
    optim::Optimizer const* optimizer = nullptr;
    std::shared_ptr<std::atomic<bool>> done;  // null: nothing to check
  };
  [[nodiscard]] StepRecord& step_record() noexcept { return step_record_; }

  /// Called before each layer's (or fused unit's) forward, layer 0 first, and backward, last first.
  using BeforeLayer = std::function<void(std::size_t layer, bool backward)>;
  /// Forward through every layer; a Linear followed by a ReLU or GELU runs as one fused layer.
  Tensor forward(Tensor const& x, Context& ctx, BeforeLayer const& before = {});
  /// Called during backward for each layer's parameter range, last first, once the work writing
  /// its gradients is enqueued; work it enqueues on ctx.stream runs after those are written.
  using GradientsReady = std::function<void(std::int64_t begin, std::int64_t end)>;
  /// Backward through every layer; returns the input gradient when `input_grad` (else an
  /// undefined tensor, saving the first layer's input-gradient GEMM).
  Tensor backward(Tensor const& dy, Context& ctx, bool input_grad = true, GradientsReady const& ready = {},
                  BeforeLayer const& before = {});
  /// The input-gradient half of backward (calling `before` as backward() does), and the
  /// weight-gradient half, which must follow for the same ctx.micro_batch before the gradients are
  /// read and reads no parameters (Layer::backward_weight()).
  Tensor backward_input(Tensor const& dy, Context& ctx, bool input_grad = true, BeforeLayer const& before = {});
  void backward_weight(Context& ctx);
  /// Sets the gradients the layers write (the flat buffer and those bind_gradients() gave) to zero
  /// (before accumulating micro-batches), or those of elements [begin, end) only.
  void zero_gradients(Stream& stream);
  void zero_gradients(Stream& stream, std::int64_t begin, std::int64_t end);
  /// The shape forward() returns for an input of `input`.
  [[nodiscard]] Shape output_shape(Shape const& input) const;
  /// The model's parts by its structure ([begin, end) layer spans with parameters, each block
  /// alone): ZeRO-3's units.
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
  // bind_gradients() and bind_parameters(): refuses a buffer that is not end - begin values of the
  // compute type (or, `masters`, float32) and a range that cuts a layer's parameters.
  void check_binding(std::string const& what, std::int64_t begin, std::int64_t end, Tensor const& buffer, bool masters) const;
  // The compute-type parameters and gradients the layers of [begin, end) use: slices of the flat
  // buffers, or of the buffers bound to them last.
  [[nodiscard]] Tensor layer_parameters(std::int64_t begin, std::int64_t end) const;
  [[nodiscard]] Tensor layer_gradients(std::int64_t begin, std::int64_t end) const;
  // Gives the layers of the whole parameter ranges in [begin, end) their current buffers.
  void rebind_layers(std::int64_t begin, std::int64_t end);
  void check_materialized(char const* call) const;

  std::vector<std::unique_ptr<Layer>> layers_;
  std::size_t first_layer_ = 0;
  DType compute_ = DType::float32;
  Tensor params_, grads_, master_params_, master_grads_;
  // bind_gradients(): where each rebound range of elements [first, second.first) has its (master) gradients.
  std::map<std::int64_t, std::pair<std::int64_t, Tensor>> bound_grads_;
  // bind_parameters(): the same for the parameters, and (16-bit compute) for the layers' gradients.
  std::map<std::int64_t, std::pair<std::int64_t, Tensor>> bound_params_, bound_compute_grads_;
  StepRecord step_record_;
};

}  // namespace mgpu::nn
