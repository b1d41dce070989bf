// Linear, ReLU, GELU, LayerNorm, Dropout and Sequential (its flat buffers: sequential_buffers.cpp).
#include <mgpu/nn/layers.hpp>

#include <algorithm>
#include <cmath>
#include <iterator>

#include <mgpu/core/error.hpp>
#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>

#include "core/backend.hpp"

namespace mgpu::nn {
namespace {

// t viewed as rows of `width` elements: [B, T, width] as [B T, width] (the same storage).
Tensor as_rows(Tensor const& t, std::int64_t width) { return t.rank() == 2 ? t : t.reshape({t.numel() / width, width}); }

// `input` with its last dimension replaced by `width`.
Shape with_last(Shape input, std::int64_t width) {
  input.back() = width;
  return input;
}

}  // namespace

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

Tensor Linear::forward(Tensor const& x, Context& ctx, ops::ActivationKind act) {
  Shape const out_shape = output_shape(x.shape());
  if (x.dtype() != w_.dtype())
    throw Error(Errc::invalid_argument, name() + ": input is " + std::string(to_string(x.dtype())) + " (expected the model's compute type " +
                                            std::string(to_string(w_.dtype())) + ")");
  Tensor const x2 = as_rows(x, in_);
  Tensor y = Tensor::empty({x2.dim(0), out_}, x.dtype(), ctx.allocator, ctx.stream);
  Tensor pre =
      act == ops::ActivationKind::gelu ? Tensor::empty(y.shape(), y.dtype(), ctx.allocator, ctx.stream) : Tensor{};
  ops::linear(x2, w_, b_, y, act, pre, ctx.stream);
  // Without an activation, backward reads no output: none is kept.
  Tensor const z = pre.defined() ? pre : act == ops::ActivationKind::identity ? Tensor{} : y;
  if (ctx.keep_for_backward) saved_[ctx.micro_batch] = Saved{x, z, Tensor{}, act};
  return y.reshape(out_shape);
}

void Linear::release_input(Context const& ctx) { saved(ctx, "release_input").x = Tensor{}; }

void Linear::restore_input(Tensor const& x, Context const& ctx) {
  Saved& s = saved(ctx, "restore_input");
  if (x.shape().empty() || x.shape().back() != in_ || x.dtype() != w_.dtype())
    throw Error(Errc::invalid_argument, name() + ".restore_input of a " + std::string(to_string(x.dtype())) + " " +
                                            to_string(x.shape()) + " tensor (expected the " +
                                            std::string(to_string(w_.dtype())) + " input of forward, [..., " +
                                            std::to_string(in_) + "])");
  s.x = x;
}

Linear::Saved& Linear::saved(Context const& ctx, char const* call) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end())
    throw Error(Errc::invalid_argument, name() + "." + call + " for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected a forward of that micro-batch whose backward has not run)");
  return it->second;
}

Tensor Linear::backward(Tensor const& dy, Context& ctx) {
  Tensor dx = backward_input(dy, ctx);
  backward_weight(ctx);
  return dx;
}

Tensor Linear::backward_input(Tensor const& dy, Context& ctx) {
  Saved& s = saved(ctx, "backward_input");
  if (!s.x.defined())
    throw Error(Errc::invalid_argument, name() + ".backward_input for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " after release_input (expected restore_input first)");
  if (s.dz.defined())
    throw Error(Errc::invalid_argument, name() + ".backward_input twice for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected backward_weight in between)");
  Tensor const dy2 = as_rows(dy, out_);
  s.dz = dy2;  // the gradient of x W + b
  if (s.act == ops::ActivationKind::identity) {
    ops::bias_grad(dy2, db_, ctx.stream, ctx.accumulate_gradients);
  } else {
    s.dz = Tensor::empty(dy2.shape(), dy2.dtype(), ctx.allocator, ctx.stream);
    ops::activation_bias_grad(s.act, s.z, dy2, s.dz, db_, ctx.stream, ctx.accumulate_gradients);
  }
  s.z = Tensor{};
  if (!input_grad_) return {};
  Tensor dx = Tensor::empty(s.x.shape(), s.x.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(s.dz, false, w_, true, as_rows(dx, in_), 1.0f, 0.0f, ctx.stream);  // dx = dz W^T
  return dx;
}

void Linear::backward_weight(Context& ctx) {
  Saved const& s = saved(ctx, "backward_weight");
  if (!s.dz.defined())
    throw Error(Errc::invalid_argument, name() + ".backward_weight for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected backward_input first)");
  ops::gemm(as_rows(s.x, in_), true, s.dz, false, dw_, 1.0f, ctx.accumulate_gradients ? 1.0f : 0.0f, ctx.stream);  // dW (+)= x^T dz
  saved_.erase(ctx.micro_batch);
}

Shape Linear::output_shape(Shape const& input) const {
  if (input.size() < 2 || input.back() != in_)
    throw Error(Errc::invalid_argument, name() + ": input of shape " + to_string(input) + " (expected [batch, " + std::to_string(in_) +
                                            "])");
  return with_last(input, out_);
}

Tensor Activation::forward(Tensor const& x, Context& ctx) {
  if (ctx.keep_for_backward) x_[ctx.micro_batch] = x;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), ctx.allocator, ctx.stream);
  if (kind_ == ops::ActivationKind::relu) {
    ops::relu(x, y, ctx.stream);
  } else {
    ops::gelu(x, y, ctx.stream);
  }
  return y;
}

Tensor Activation::backward(Tensor const& dy, Context& ctx) {
  auto const it = x_.find(ctx.micro_batch);
  if (it == x_.end())
    throw Error(Errc::invalid_argument, name() + ".backward for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected a forward of that micro-batch whose backward has not run)");
  Tensor const x = std::move(it->second);
  x_.erase(it);
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype(), ctx.allocator, ctx.stream);
  if (kind_ == ops::ActivationKind::relu) {
    ops::relu_backward(x, dy, dx, ctx.stream);
  } else {
    ops::gelu_backward(x, dy, dx, ctx.stream);
  }
  return dx;
}

LayerNorm::LayerNorm(std::int64_t features, float eps) : features_(features), eps_(eps) {
  if (features < 1 || !(eps > 0))
    throw Error(Errc::invalid_argument, "LayerNorm(" + std::to_string(features) + ", eps " + std::to_string(eps) +
                                            ") (expected features >= 1 and eps > 0)");
}

std::string LayerNorm::name() const { return "LayerNorm(" + std::to_string(features_) + ")"; }

void LayerNorm::bind(Tensor const& params, Tensor const& grads) {
  gamma_ = params.slice(0, features_);
  beta_ = params.slice(features_, 2 * features_);
  dgamma_ = grads.slice(0, features_);
  dbeta_ = grads.slice(features_, 2 * features_);
}

void LayerNorm::initialize(std::mt19937_64&) {
  for (float& g : gamma_.host_span<float>()) g = 1.0f;
  for (float& b : beta_.host_span<float>()) b = 0.0f;
}

Tensor LayerNorm::forward(Tensor const& x, Context& ctx) { return forward_add(x, Tensor{}, ctx); }

Tensor LayerNorm::forward_add(Tensor const& x, Tensor const& residual, Context& ctx) {
  (void)output_shape(x.shape());
  Tensor const x2 = as_rows(x, features_);
  Tensor stats = Tensor::empty({2, x2.dim(0)}, DType::float32, ctx.allocator, ctx.stream);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), ctx.allocator, ctx.stream);
  ops::layer_norm(x2, gamma_, beta_, as_rows(y, features_), stats, eps_, ctx.stream,
                  residual.defined() ? as_rows(residual, features_) : Tensor{});
  if (ctx.keep_for_backward) saved_[ctx.micro_batch] = {x2, stats};
  return y;
}

Tensor LayerNorm::backward(Tensor const& dy, Context& ctx) { return backward_add(dy, Tensor{}, ctx); }

Tensor LayerNorm::backward_add(Tensor const& dy, Tensor const& residual, Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end())
    throw Error(Errc::invalid_argument, name() + ".backward for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected a forward of that micro-batch whose backward has not run)");
  auto const [x, stats] = std::move(it->second);
  saved_.erase(it);
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype(), ctx.allocator, ctx.stream);
  ops::layer_norm_backward(x, gamma_, stats, as_rows(dy, features_), as_rows(dx, features_), dgamma_, dbeta_,
                           ctx.stream, ctx.accumulate_gradients,
                           residual.defined() ? as_rows(residual, features_) : Tensor{});
  return dx;
}

Shape LayerNorm::output_shape(Shape const& input) const {
  if (input.size() < 2 || input.back() != features_)
    throw Error(Errc::invalid_argument, name() + ": input of shape " + to_string(input) + " (expected [batch, " +
                                            std::to_string(features_) + "])");
  return input;
}

Dropout::Dropout(float p) : p_(p) {
  if (!(p >= 0.0f && p < 1.0f)) throw Error(Errc::invalid_argument, "Dropout(" + std::to_string(p) + ") (expected 0 <= p < 1)");
}

std::string Dropout::name() const { return "Dropout(" + std::to_string(p_) + ")"; }

Tensor Dropout::forward(Tensor const& x, Context& ctx) {
  if (!training_ || p_ == 0.0f) {
    if (ctx.keep_for_backward) masks_[ctx.micro_batch] = {0, 0};
    return x;
  }
  std::uint64_t const mask_seed = mgpu::detail::mix64(seed_ + calls_++) | 1u;  // never 0: 0 marks "identity" for backward
  std::int64_t const offset = x.rank() > 0 && x.dim(0) > 0 ? ctx.row_offset * (x.numel() / x.dim(0)) : 0;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), ctx.allocator, ctx.stream);
  ops::dropout(x, y, p_, mask_seed, ctx.stream, offset);
  if (ctx.keep_for_backward) masks_[ctx.micro_batch] = {mask_seed, offset};
  return y;
}

Tensor Dropout::backward(Tensor const& dy, Context& ctx) {
  auto const it = masks_.find(ctx.micro_batch);
  if (it == masks_.end())
    throw Error(Errc::invalid_argument, name() + ".backward for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected a forward of that micro-batch whose backward has not run)");
  auto const [mask_seed, offset] = it->second;
  masks_.erase(it);
  if (mask_seed == 0) return dy;
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype(), ctx.allocator, ctx.stream);
  ops::dropout_backward(dy, dx, p_, mask_seed, ctx.stream, offset);
  return dx;
}

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

std::vector<ParameterRange> Sequential::parameter_ranges() const {
  std::vector<ParameterRange> ranges;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    std::int64_t const count = layers_[i]->parameter_count();
    if (count > 0) ranges.push_back({i, offset, offset + count});
    offset += count;
  }
  return ranges;
}

std::vector<std::pair<std::int64_t, std::int64_t>> Sequential::matrix_ranges() const {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (ParameterRange const& r : parameter_ranges())
    for (auto const& [begin, end] : layers_[r.layer]->matrix_ranges()) {
      if (!ranges.empty() && ranges.back().second == r.begin + begin)
        ranges.back().second = r.begin + end;
      else
        ranges.emplace_back(r.begin + begin, r.begin + end);
    }
  return ranges;
}

void Sequential::train(bool training) {
  for (auto& l : layers_) l->set_training(training);
}

std::vector<std::uint64_t> Sequential::rng_state() const {
  std::vector<std::uint64_t> state;
  for (auto const& l : layers_) state.push_back(l->rng_counter());
  return state;
}

std::vector<std::uint64_t> Sequential::rng_seeds() const {
  std::vector<std::uint64_t> seeds;
  for (auto const& l : layers_) {
    std::vector<std::uint64_t> const mine = l->rng_seeds();
    seeds.insert(seeds.end(), mine.begin(), mine.end());
  }
  return seeds;
}

void Sequential::set_rng_seeds(std::span<std::uint64_t const> seeds) {
  std::size_t const expected = rng_seeds().size();
  if (seeds.size() != expected)
    throw Error(Errc::invalid_argument, "RNG seeds of " + std::to_string(seeds.size()) + " values (expected " +
                                            std::to_string(expected) + ", the layers' rng_seeds())");
  std::size_t at = 0;
  for (auto const& l : layers_) {
    std::size_t const n = l->rng_seeds().size();
    l->set_rng_seeds(seeds.subspan(at, n));
    at += n;
  }
}

void Layer::set_rng_seeds(std::span<std::uint64_t const> seeds) {
  std::size_t const expected = rng_seeds().size();
  if (seeds.size() != expected)
    throw Error(Errc::invalid_argument, name() + ": " + std::to_string(seeds.size()) + " RNG seeds (expected " +
                                            std::to_string(expected) + ")");
}

void Dropout::set_rng_seeds(std::span<std::uint64_t const> seeds) {
  Layer::set_rng_seeds(seeds);  // checks the count
  seed_ = seeds[0];
}

void Sequential::set_rng_state(std::vector<std::uint64_t> const& state) {
  if (state.size() != layers_.size())
    throw Error(Errc::invalid_argument, "an RNG state of " + std::to_string(state.size()) + " layers (expected " +
                                            std::to_string(layers_.size()) + ")");
  for (std::size_t i = 0; i < layers_.size(); ++i) layers_[i]->set_rng_counter(state[i]);
}

void Sequential::check_materialized(char const* call) const {
  if (!materialized() && parameter_count() > 0)
    throw Error(Errc::invalid_argument, std::string(call) + " before materialize (expected model.materialize(ctx, seed) first)");
}

Tensor Sequential::forward(Tensor const& x, Context& ctx, BeforeLayer const& before) {
  check_materialized("forward");
  Tensor h = x;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    if (before) before(i, false);
    if (Activation const* act = fused_activation(i)) {
      h = static_cast<Linear&>(*layers_[i]).forward(h, ctx, act->kind());
      ++i;  // the activation ran inside the Linear
    } else {
      h = layers_[i]->forward(h, ctx);
    }
  }
  return h;
}

Tensor Sequential::backward(Tensor const& dy, Context& ctx, bool input_grad, GradientsReady const& ready, BeforeLayer const& before) {
  if (!layers_.empty()) layers_.front()->set_input_grad(input_grad);
  Tensor g = dy;
  std::vector<ParameterRange> const ranges = parameter_ranges();
  auto next = ranges.rbegin();  // the range of the next layer with parameters, going backwards
  for (std::size_t i = layers_.size(); i-- > 0;) {
    if (i > 0 && fused_activation(i - 1) != nullptr) --i;  // the Linear's backward covers the activation
    if (before) before(i, true);
    g = layers_[i]->backward(g, ctx);
    if (next != ranges.rend() && next->layer == i) {
      if (ready) ready(next->begin, next->end);
      ++next;
    }
  }
  return g;
}

Tensor Sequential::backward_input(Tensor const& dy, Context& ctx, bool input_grad, BeforeLayer const& before) {
  check_materialized("backward_input");
  if (!layers_.empty()) layers_.front()->set_input_grad(input_grad);
  Tensor g = dy;
  for (std::size_t i = layers_.size(); i-- > 0;) {
    if (i > 0 && fused_activation(i - 1) != nullptr) --i;
    if (before) before(i, true);
    g = layers_[i]->backward_input(g, ctx);
  }
  return g;
}

void Sequential::backward_weight(Context& ctx) {
  check_materialized("backward_weight");
  for (std::size_t i = layers_.size(); i-- > 0;) {
    if (i > 0 && fused_activation(i - 1) != nullptr) --i;
    layers_[i]->backward_weight(ctx);
  }
}

void Sequential::zero_gradients(Stream& stream) {
  check_materialized("zero_gradients");
  if (grads_.defined()) fill_async(grads_, 0.0f, stream);
  for (auto const& [first, bound] : compute_type() == DType::float32 ? bound_grads_ : bound_compute_grads_)
    fill_async(bound.second, 0.0f, stream);
}

void Sequential::zero_gradients(Stream& stream, std::int64_t begin, std::int64_t end) {
  check_materialized("zero_gradients");
  fill_async(layer_gradients(begin, end), 0.0f, stream);
}

Shape Sequential::output_shape(Shape const& input) const {
  Shape shape = input;
  for (auto const& l : layers_) shape = l->output_shape(shape);
  return shape;
}

std::vector<std::pair<std::size_t, std::size_t>> Sequential::structure_parts() const {
  bool const blocks = std::any_of(layers_.begin(), layers_.end(), [](auto const& l) { return l->block(); });
  std::vector<std::pair<std::size_t, std::size_t>> parts;
  bool has_parameters = false;  // the last part's
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    Layer const& layer = *layers_[i];
    // A part starts at a block, at the first layer after a block, and, without blocks, at a layer
    // with parameters; one without parameters so far takes the next layers in.
    bool const starts = parts.empty() || (has_parameters && (blocks ? layer.block() || layers_[i - 1]->block() : layer.parameter_count() > 0));
    if (starts) {
      parts.emplace_back(i, i + 1);
      has_parameters = false;
    } else {
      parts.back().second = i + 1;
    }
    has_parameters = has_parameters || layer.parameter_count() > 0;
  }
  if (!parts.empty() && !has_parameters) {  // trailing layers without parameters join the part before
    std::size_t const end = parts.back().second;
    parts.pop_back();
    if (!parts.empty()) parts.back().second = end;
  }
  return parts;
}

std::vector<std::size_t> Sequential::cut_points() const {
  std::vector<std::size_t> cuts{0};
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    if (fused_activation(i) != nullptr) ++i;
    cuts.push_back(i + 1);
  }
  return cuts;
}

Sequential Sequential::stage(std::size_t begin, std::size_t end) const {
  if (begin >= end || end > layers_.size())
    throw Error(Errc::invalid_argument, "stage of layers [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " +
                                            std::to_string(layers_.size()) + " (expected 0 <= begin < end <= " +
                                            std::to_string(layers_.size()) + ")");
  auto const cuts = cut_points();
  for (std::size_t const cut : {begin, end}) {
    if (std::find(cuts.begin(), cuts.end(), cut) == cuts.end())
      throw Error(Errc::invalid_argument, "a stage cut at layer " + std::to_string(cut) + ", between " + layers_[cut - 1]->name() +
                                              " and the " + layers_[cut]->name() + " fused into it (expected a cut between units)");
  }
  Sequential part;
  for (std::size_t i = begin; i < end; ++i) part.add(layers_[i]->clone());
  part.first_layer_ = first_layer_ + begin;
  // A tied LM head whose Embedding stays in another stage holds its own copy of wte.
  for (auto& layer : part.layers_) {
    auto* head = dynamic_cast<TiedLMHead*>(layer.get());
    if (head == nullptr) continue;
    bool const embedded = std::any_of(part.layers_.begin(), part.layers_.end(), [&](auto const& other) {
      auto const* embedding = dynamic_cast<Embedding const*>(other.get());
      return embedding != nullptr && embedding->vocab() == head->vocab() && embedding->features() == head->features();
    });
    if (!embedded) head->hold_weight();
  }
  return part;
}

Activation const* Sequential::fused_activation(std::size_t i) const {
  if (i + 1 >= layers_.size() || dynamic_cast<Linear const*>(layers_[i].get()) == nullptr) return nullptr;
  return dynamic_cast<Activation const*>(layers_[i + 1].get());
}

Sequential Sequential::clone() const {
  Sequential copy;
  for (auto const& l : layers_) copy.add(l->clone());
  copy.first_layer_ = first_layer_;
  return copy;
}

}  // namespace mgpu::nn
