// Linear, ReLU, GELU and Sequential.
#include <mgpu/nn/layers.hpp>

#include <cmath>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::nn {

Linear::Linear(std::int64_t in, std::int64_t out, Init init) : in_(in), out_(out), init_(init) {
  if (in < 1 || out < 1)
    throw Error(Errc::invalid_argument, "Linear(" + std::to_string(in) + ", " + std::to_string(out) + ") (expected sizes >= 1)");
}

std::string Linear::name() const { return "Linear(" + std::to_string(in_) + ", " + std::to_string(out_) + ")"; }

void Linear::bind(Tensor const& params, Tensor const& grads) {
  w_ = params.slice(0, in_ * out_).reshape({in_, out_});
  b_ = params.slice(in_ * out_, in_ * out_ + out_);
  dw_ = grads.slice(0, in_ * out_).reshape({in_, out_});
  db_ = grads.slice(in_ * out_, in_ * out_ + out_);
}

void Linear::initialize(std::mt19937_64& rng) {
  double const bound = init_ == Init::kaiming ? std::sqrt(6.0 / static_cast<double>(in_))
                                               : std::sqrt(6.0 / static_cast<double>(in_ + out_));
  std::uniform_real_distribution<double> u(-bound, bound);
  for (float& w : w_.host_span<float>()) w = static_cast<float>(u(rng));
  for (float& b : b_.host_span<float>()) b = 0.0f;
}

Tensor Linear::forward(Tensor const& x, Context& ctx) {
  if (x.rank() != 2 || x.dim(1) != in_)
    throw Error(Errc::invalid_argument, name() + ": input of shape " + to_string(x.shape()) + " (expected [batch, " + std::to_string(in_) + "])");
  x_ = x;
  Tensor y = Tensor::empty({x.dim(0), out_}, DType::float32, ctx.allocator);
  ops::gemm(x, false, w_, false, y, 1.0f, 0.0f, ctx.stream);
  ops::add_bias(y, b_, ctx.stream);
  return y;
}

Tensor Linear::backward(Tensor const& dy, Context& ctx) {
  ops::gemm(x_, true, dy, false, dw_, 1.0f, 0.0f, ctx.stream);  // dW = x^T dy
  ops::bias_grad(dy, db_, ctx.stream);
  Tensor dx = Tensor::empty(x_.shape(), DType::float32, ctx.allocator);
  ops::gemm(dy, false, w_, true, dx, 1.0f, 0.0f, ctx.stream);  // dx = dy W^T
  return dx;
}

Tensor Activation::forward(Tensor const& x, Context& ctx) {
  x_ = x;
  Tensor y = Tensor::empty(x.shape(), DType::float32, ctx.allocator);
  forward_(x, y, ctx.stream);
  return y;
}

Tensor Activation::backward(Tensor const& dy, Context& ctx) {
  Tensor dx = Tensor::empty(dy.shape(), DType::float32, ctx.allocator);
  backward_(x_, dy, dx, ctx.stream);
  return dx;
}

ReLU::ReLU() : Activation(&ops::relu, &ops::relu_backward) {}
GELU::GELU() : Activation(&ops::gelu, &ops::gelu_backward) {}

Sequential Sequential::mlp(std::vector<std::int64_t> const& widths, std::string const& activation) {
  if (widths.size() < 2)
    throw Error(Errc::invalid_argument, "an MLP of " + std::to_string(widths.size()) + " widths (expected at least input and output)");
  if (activation != "relu" && activation != "gelu")
    throw Error(Errc::invalid_argument, "activation '" + activation + "' (expected relu or gelu)");
  Sequential model;
  for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
    bool const last = i + 2 == widths.size();
    model.add(std::make_unique<Linear>(widths[i], widths[i + 1], last || activation != "relu" ? Init::xavier : Init::kaiming));
    if (!last) {
      if (activation == "relu") {
        model.add(std::make_unique<ReLU>());
      } else {
        model.add(std::make_unique<GELU>());
      }
    }
  }
  return model;
}

void Sequential::add(std::unique_ptr<Layer> layer) { layers_.push_back(std::move(layer)); }

std::int64_t Sequential::parameter_count() const {
  std::int64_t total = 0;
  for (auto const& l : layers_) total += l->parameter_count();
  return total;
}

void Sequential::materialize(Allocator& allocator, std::uint64_t seed) {
  std::int64_t const total = parameter_count();
  params_ = Tensor::empty({total}, DType::float32, allocator);
  grads_ = Tensor::empty({total}, DType::float32, allocator);
  std::fill(grads_.host_span<float>().begin(), grads_.host_span<float>().end(), 0.0f);
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    std::int64_t const count = layers_[i]->parameter_count();
    layers_[i]->bind(params_.slice(offset, offset + count), grads_.slice(offset, offset + count));
    std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + i);  // a stream per layer: layers do not shift each other
    layers_[i]->initialize(rng);
    offset += count;
  }
}

Tensor Sequential::forward(Tensor const& x, Context& ctx) {
  if (!params_.defined() && parameter_count() > 0)
    throw Error(Errc::invalid_argument, "forward before materialize (expected model.materialize(allocator, seed) first)");
  Tensor h = x;
  for (auto& l : layers_) h = l->forward(h, ctx);
  return h;
}

Tensor Sequential::backward(Tensor const& dy, Context& ctx) {
  Tensor g = dy;
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) g = (*it)->backward(g, ctx);
  return g;
}

Sequential Sequential::clone() const {
  Sequential copy;
  for (auto const& l : layers_) copy.add(l->clone());
  return copy;
}

}  // namespace mgpu::nn
