// Layers with explicit forward and backward, and Sequential, whose parameters and gradients live in
// one flat buffer each (a view per layer), so optimizers and gradient buckets see contiguous memory.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::nn {

/// Where a layer's work runs and where it gets scratch memory.
struct Context {
  Allocator& allocator;
  Stream& stream;
};

/// Weight initialisation: Kaiming (He) uniform for ReLU networks, Xavier (Glorot) uniform otherwise.
enum class Init { kaiming, xavier };

/// A layer. forward() keeps what backward() needs; backward() writes the layer's parameter
/// gradients (into its view of the gradient buffer) and returns the gradient of its input.
class Layer {
 public:
  virtual ~Layer() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual std::int64_t parameter_count() const { return 0; }
  /// Gives the layer its views of the flat parameter and gradient buffers (parameter_count() each).
  virtual void bind(Tensor const& /*params*/, Tensor const& /*grads*/) {}
  /// Writes initial parameters (host memory) from `rng`.
  virtual void initialize(std::mt19937_64& /*rng*/) {}
  virtual Tensor forward(Tensor const& x, Context& ctx) = 0;
  virtual Tensor backward(Tensor const& dy, Context& ctx) = 0;
  /// A fresh layer of the same configuration (for replicas on other devices).
  [[nodiscard]] virtual std::unique_ptr<Layer> clone() const = 0;
};

/// y = x W + b, with W [in, out] and b [out].
class Linear final : public Layer {
 public:
  Linear(std::int64_t in, std::int64_t out, Init init = Init::kaiming);
  std::string name() const override;
  std::int64_t parameter_count() const override { return in_ * out_ + out_; }
  void bind(Tensor const& params, Tensor const& grads) override;
  void initialize(std::mt19937_64& rng) override;
  Tensor forward(Tensor const& x, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Linear>(in_, out_, init_); }
  [[nodiscard]] Tensor const& weight() const noexcept { return w_; }
  [[nodiscard]] Tensor const& bias() const noexcept { return b_; }

 private:
  std::int64_t in_;
  std::int64_t out_;
  Init init_;
  Tensor w_, b_, dw_, db_, x_;
};

/// An element-wise activation given by an op and its backward (see ReLU and GELU).
class Activation : public Layer {
 public:
  using Forward = void (*)(Tensor const& x, Tensor const& y, Stream& stream);
  using Backward = void (*)(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream);
  Tensor forward(Tensor const& x, Context& ctx) override;
  Tensor backward(Tensor const& dy, Context& ctx) override;

 protected:
  Activation(Forward forward, Backward backward) : forward_(forward), backward_(backward) {}

 private:
  Forward forward_;
  Backward backward_;
  Tensor x_;
};

class ReLU final : public Activation {
 public:
  ReLU();
  std::string name() const override { return "ReLU"; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<ReLU>(); }
};

/// GELU, tanh approximation.
class GELU final : public Activation {
 public:
  GELU();
  std::string name() const override { return "GELU"; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<GELU>(); }
};

/// Layers in order, with one flat parameter buffer and one flat gradient buffer.
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
  [[nodiscard]] std::int64_t parameter_count() const;

  /// Allocates the flat buffers in `allocator` (host memory) and initialises every layer from
  /// `seed`, so every replica built with the same seed holds identical weights.
  void materialize(Allocator& allocator, std::uint64_t seed);
  [[nodiscard]] Tensor const& parameters() const noexcept { return params_; }
  [[nodiscard]] Tensor const& gradients() const noexcept { return grads_; }

  Tensor forward(Tensor const& x, Context& ctx);
  Tensor backward(Tensor const& dy, Context& ctx);
  /// A copy of the architecture (not the weights) for another device.
  [[nodiscard]] Sequential clone() const;

 private:
  std::vector<std::unique_ptr<Layer>> layers_;
  Tensor params_;
  Tensor grads_;
};

}  // namespace mgpu::nn
