// Embedding, CausalSelfAttention, TransformerBlock and TiedLMHead.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::nn {
namespace {

std::string missing_forward(std::string const& layer, char const* call, std::int64_t micro_batch) {
  return layer + "." + call + " for micro-batch " + std::to_string(micro_batch) +
         " (expected a forward of that micro-batch whose backward has not run)";
}

// A [B, T, features] activation (the layout between transformer layers).
void check_activation(std::string const& layer, Shape const& shape, std::int64_t features) {
  if (shape.size() != 3 || shape[2] != features)
    throw Error(Errc::invalid_argument, layer + ": input of shape " + to_string(shape) + " (expected [B, T, " +
                                            std::to_string(features) + "])");
}

// Normal(0, std) weights of a bound float32 host view.
void normal_fill(Tensor const& t, float std, std::mt19937_64& rng) {
  std::normal_distribution<float> n(0.0f, std);
  for (float& v : t.host_span<float>()) v = n(rng);
}

void zero_fill(Tensor const& t) {
  for (float& v : t.host_span<float>()) v = 0.0f;
}

// Inference helpers (nothing saved for backward): act(x W + b) of a Linear and LayerNorm, on rows
// x [N, features].
Tensor linear_inference(Linear const& layer, Tensor const& x, ops::ActivationKind act, Context& ctx) {
  Tensor y = Tensor::empty({x.dim(0), layer.weight().dim(1)}, x.dtype(), ctx.allocator);
  Tensor const pre = act == ops::ActivationKind::gelu ? Tensor::empty(y.shape(), y.dtype(), ctx.allocator) : Tensor{};
  ops::linear(x, layer.weight(), layer.bias(), y, act, pre, ctx.stream);
  return y;
}

Tensor layer_norm_inference(LayerNorm const& layer, Tensor const& x, Context& ctx) {
  Tensor y = Tensor::empty(x.shape(), x.dtype(), ctx.allocator);
  Tensor const stats = Tensor::empty({2, x.dim(0)}, DType::float32, ctx.allocator);
  ops::layer_norm(x, layer.gamma(), layer.beta(), y, stats, layer.eps(), ctx.stream);
  return y;
}

}  // namespace

std::string_view to_string(Recompute recompute) noexcept {
  switch (recompute) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
  }
  return "?";
}

Embedding::Embedding(std::int64_t vocab, std::int64_t block_size, std::int64_t features, float init_std)
    : vocab_(vocab), block_size_(block_size), features_(features), init_std_(init_std) {
  if (vocab < 1 || block_size < 1 || features < 1 || !(init_std >= 0))
    throw Error(Errc::invalid_argument, "Embedding(vocab " + std::to_string(vocab) + ", block " +
                                            std::to_string(block_size) + ", features " + std::to_string(features) +
                                            ") (expected sizes >= 1 and init_std >= 0)");
}

std::string Embedding::name() const {
  return "Embedding(" + std::to_string(vocab_) + ", " + std::to_string(block_size_) + ", " + std::to_string(features_) +
         ")";
}

void Embedding::bind(Tensor const& params, Tensor const& grads) {
  std::int64_t const split = vocab_ * features_;
  std::int64_t const end = parameter_count();
  wte_ = params.slice(0, split).reshape({vocab_, features_});
  wpe_ = params.slice(split, end).reshape({block_size_, features_});
  dwte_ = grads.slice(0, split).reshape({vocab_, features_});
  dwpe_ = grads.slice(split, end).reshape({block_size_, features_});
}

void Embedding::initialize(std::mt19937_64& rng) {
  normal_fill(wte_, init_std_, rng);
  normal_fill(wpe_, init_std_, rng);
}

Tensor Embedding::forward(Tensor const& ids, Context& ctx) {
  Shape const shape = output_shape(ids.shape());
  if (ids.dtype() != DType::int32)
    throw Error(Errc::invalid_argument,
                name() + ": ids are " + std::string(to_string(ids.dtype())) + " (expected int32 token ids)");
  Tensor y = Tensor::empty(shape, wte_.dtype(), ctx.allocator, ctx.stream);
  ops::embedding(ids, wte_, wpe_, y, ctx.stream);
  if (ctx.keep_for_backward) saved_[ctx.micro_batch] = {ids, Tensor{}};
  return y;
}

Tensor Embedding::backward(Tensor const& dy, Context& ctx) {
  backward_input(dy, ctx);
  backward_weight(ctx);
  return {};
}

Tensor Embedding::backward_input(Tensor const& dy, Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end())
    throw Error(Errc::invalid_argument, missing_forward(name(), "backward_input", ctx.micro_batch));
  it->second.second = dy;
  return {};
}

void Embedding::backward_weight(Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end() || !it->second.second.defined())
    throw Error(Errc::invalid_argument, name() + ".backward_weight for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected backward_input of that micro-batch first)");
  auto const [ids, dy] = std::move(it->second);
  saved_.erase(it);
  ops::embedding_backward(ids, dy, dwte_, dwpe_, tied_ || ctx.accumulate_gradients, ctx.accumulate_gradients,
                          ctx.stream);
}

Shape Embedding::output_shape(Shape const& input) const {
  if (input.size() != 2)
    throw Error(Errc::invalid_argument, name() + ": ids of shape " + to_string(input) + " (expected [B, T])");
  if (input[1] > block_size_)
    throw Error(Errc::invalid_argument, name() + ": sequences of " + std::to_string(input[1]) +
                                            " tokens (expected at most the block size " + std::to_string(block_size_) +
                                            ")");
  return {input[0], input[1], features_};
}

CausalSelfAttention::CausalSelfAttention(std::int64_t features, std::int64_t heads, float dropout, float proj_init_std,
                                         bool recompute_core)
    : features_(features),
      heads_(heads),
      dropout_(dropout),
      proj_init_std_(proj_init_std),
      recompute_core_(recompute_core),
      qkv_(features, 3 * features),
      proj_(features, features) {
  if (heads < 1 || features % heads != 0)
    throw Error(Errc::invalid_argument, "CausalSelfAttention(" + std::to_string(features) + " features, " +
                                            std::to_string(heads) +
                                            " heads) (expected heads >= 1 dividing the features)");
  if (!(dropout >= 0.0f && dropout < 1.0f))
    throw Error(Errc::invalid_argument,
                "CausalSelfAttention: dropout " + std::to_string(dropout) + " (expected 0 <= p < 1)");
}

std::string CausalSelfAttention::name() const {
  return "CausalSelfAttention(" + std::to_string(features_) + ", heads " + std::to_string(heads_) + ")";
}

std::vector<std::pair<std::int64_t, std::int64_t>> CausalSelfAttention::matrix_ranges() const {
  std::int64_t const split = qkv_.parameter_count();
  return {qkv_.matrix_ranges()[0], {split + proj_.matrix_ranges()[0].first, split + proj_.matrix_ranges()[0].second}};
}

void CausalSelfAttention::bind(Tensor const& params, Tensor const& grads) {
  std::int64_t const split = qkv_.parameter_count();
  std::int64_t const end = parameter_count();
  qkv_.bind(params.slice(0, split), grads.slice(0, split));
  proj_.bind(params.slice(split, end), grads.slice(split, end));
}

void CausalSelfAttention::initialize(std::mt19937_64& rng) {
  normal_fill(qkv_.weight(), 0.02f, rng);
  zero_fill(qkv_.bias());
  normal_fill(proj_.weight(), proj_init_std_, rng);
  zero_fill(proj_.bias());
  seed_ = rng();
}

Tensor CausalSelfAttention::forward(Tensor const& x, Context& ctx) {
  check_activation(name(), x.shape(), features_);
  std::int64_t const batch = x.dim(0), t = x.dim(1);
  Tensor const qkv = qkv_.forward(x, ctx);  // [B, T, 3C]
  Tensor y = Tensor::empty(x.shape(), x.dtype(), ctx.allocator, ctx.stream);
  Tensor lse = Tensor::empty({batch, heads_, t}, DType::float32, ctx.allocator, ctx.stream);
  ops::AttentionDropout dropout;
  if (training_ && dropout_ > 0.0f) {
    // As Dropout: never seed 0, one seed per call, rows at their index in the whole batch.
    dropout = {dropout_, mgpu::detail::mix64(seed_ + calls_++) | 1u, ctx.row_offset};
  }
  ops::causal_attention(qkv, y, lse, heads_, ctx.stream, dropout);
  Tensor out = proj_.forward(y, ctx);
  if (!ctx.keep_for_backward) return out;
  if (recompute_core_) {
    proj_.release_input(ctx);  // y, recomputed by backward_input
    saved_[ctx.micro_batch] = Saved{qkv, Tensor{}, Tensor{}, dropout};
  } else {
    saved_[ctx.micro_batch] = Saved{qkv, y, lse, dropout};
  }
  return out;
}

void CausalSelfAttention::release(std::int64_t micro_batch) {
  saved_.erase(micro_batch);
  qkv_.release(micro_batch);
  proj_.release(micro_batch);
}

Tensor CausalSelfAttention::backward(Tensor const& dy, Context& ctx) {
  Tensor dx = backward_input(dy, ctx);
  backward_weight(ctx);
  return dx;
}

Tensor CausalSelfAttention::backward_input(Tensor const& dy, Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end())
    throw Error(Errc::invalid_argument, missing_forward(name(), "backward_input", ctx.micro_batch));
  Saved s = std::move(it->second);
  saved_.erase(it);
  if (recompute_core_) {  // the same kernel on the same qkv and dropout: the same y and lse, bit for bit
    std::int64_t const batch = s.qkv.dim(0), t = s.qkv.dim(1);
    s.y = Tensor::empty({batch, t, features_}, s.qkv.dtype(), ctx.allocator, ctx.stream);
    s.lse = Tensor::empty({batch, heads_, t}, DType::float32, ctx.allocator, ctx.stream);
    ops::causal_attention(s.qkv, s.y, s.lse, heads_, ctx.stream, s.dropout);
    proj_.restore_input(s.y, ctx);
  }
  Tensor const dy_heads = proj_.backward_input(dy, ctx);
  Tensor dqkv = Tensor::empty(s.qkv.shape(), s.qkv.dtype(), ctx.allocator, ctx.stream);
  ops::causal_attention_backward(s.qkv, s.y, s.lse, dy_heads, dqkv, heads_, ctx.stream, s.dropout);
  return qkv_.backward_input(dqkv, ctx);
}

void CausalSelfAttention::backward_weight(Context& ctx) {
  proj_.backward_weight(ctx);
  qkv_.backward_weight(ctx);
}

Tensor CausalSelfAttention::forward_cached(Tensor const& x, KvCache& cache, Context& ctx) const {
  check_activation(name(), x.shape(), features_);
  Tensor const& w = qkv_.weight();
  if (w.dtype() != DType::float32 || x.dtype() != DType::float32 || w.device().kind != DeviceKind::host ||
      x.device().kind != DeviceKind::host)
    throw Error(Errc::invalid_argument, name() + ".forward_cached with a " + std::string(to_string(w.dtype())) +
                                            " model on " + w.device().to_string() + " and a " +
                                            std::string(to_string(x.dtype())) + " input on " + x.device().to_string() +
                                            " (expected float32 on a host device: cached inference runs host loops)");
  std::int64_t const batch = x.dim(0), t = x.dim(1), c = features_, d = c / heads_;
  bool const fits = cache.k.defined() && cache.k.rank() == 3 && cache.k.dim(0) == batch && cache.k.dim(2) == c &&
                    cache.v.defined() && cache.v.shape() == cache.k.shape() && cache.k.dtype() == DType::float32 &&
                    cache.v.dtype() == DType::float32 && cache.k.device().kind == DeviceKind::host &&
                    cache.v.device().kind == DeviceKind::host && cache.length >= 0 &&
                    cache.length + t <= cache.k.dim(1);
  if (!fits)
    throw Error(Errc::invalid_argument,
                name() + ".forward_cached: a cache of " + (cache.k.defined() ? to_string(cache.k.shape()) : "nothing") +
                    " holding " + std::to_string(cache.length) + " positions, for " + std::to_string(t) +
                    " new positions of " + std::to_string(batch) + " sequences (expected float32 host k and v of [" +
                    std::to_string(batch) + ", capacity, " + std::to_string(c) + "] with room for them)");
  Tensor const qkv = linear_inference(qkv_, x.reshape({batch * t, c}), ops::ActivationKind::identity, ctx);
  Tensor const y = Tensor::empty({batch * t, c}, DType::float32, ctx.allocator);
  ctx.stream.synchronize();
  auto const q = qkv.host_span<float>();
  auto const k = cache.k.host_span<float>();
  auto const v = cache.v.host_span<float>();
  auto const out = y.host_span<float>();
  std::int64_t const capacity = cache.k.dim(1), length = cache.length;
  auto const at = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < t; ++i) {
      float const* row = q.data() + at((b * t + i) * 3 * c);
      std::copy(row + c, row + 2 * c, k.data() + at((b * capacity + length + i) * c));
      std::copy(row + 2 * c, row + 3 * c, v.data() + at((b * capacity + length + i) * c));
    }
  float const scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> p(at(length + t));
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads_; ++h)
      for (std::int64_t i = 0; i < t; ++i) {
        std::int64_t const last = length + i;  // the query's position: keys 0..last
        float const* qh = q.data() + at((b * t + i) * 3 * c + h * d);
        float max = -INFINITY;
        for (std::int64_t j = 0; j <= last; ++j) {
          float const* kh = k.data() + at((b * capacity + j) * c + h * d);
          float s = 0.0f;
          for (std::int64_t e = 0; e < d; ++e) s += qh[e] * kh[e];
          p[at(j)] = s * scale;
          max = std::max(max, p[at(j)]);
        }
        float sum = 0.0f;
        for (std::int64_t j = 0; j <= last; ++j) sum += (p[at(j)] = std::exp(p[at(j)] - max));
        float* yh = out.data() + at((b * t + i) * c + h * d);
        std::fill(yh, yh + d, 0.0f);
        for (std::int64_t j = 0; j <= last; ++j) {
          float const* vh = v.data() + at((b * capacity + j) * c + h * d);
          float const weight = p[at(j)] / sum;
          for (std::int64_t e = 0; e < d; ++e) yh[e] += weight * vh[e];
        }
      }
  cache.length += t;
  return linear_inference(proj_, y, ops::ActivationKind::identity, ctx).reshape(x.shape());
}

Shape CausalSelfAttention::output_shape(Shape const& input) const {
  check_activation(name(), input, features_);
  return input;
}

TransformerBlock::TransformerBlock(std::int64_t features, std::int64_t heads, float dropout, float proj_init_std,
                                   Recompute recompute)
    : features_(features),
      heads_(heads),
      dropout_(dropout),
      proj_init_std_(proj_init_std),
      recompute_(recompute),
      ln1_(features),
      attn_(features, heads, dropout, proj_init_std, recompute == Recompute::selective),
      attn_drop_(dropout),
      ln2_(features),
      fc_(features, 4 * features),
      proj_(4 * features, features),
      mlp_drop_(dropout) {}

std::string TransformerBlock::name() const {
  return "TransformerBlock(" + std::to_string(features_) + ", heads " + std::to_string(heads_) + ")";
}

std::int64_t TransformerBlock::parameter_count() const {
  return ln1_.parameter_count() + attn_.parameter_count() + ln2_.parameter_count() + fc_.parameter_count() +
         proj_.parameter_count();
}

std::vector<std::pair<std::int64_t, std::int64_t>> TransformerBlock::matrix_ranges() const {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  std::int64_t offset = 0;
  for (Layer const* layer : std::initializer_list<Layer const*>{&ln1_, &attn_, &ln2_, &fc_, &proj_}) {
    for (auto const& [begin, end] : layer->matrix_ranges()) ranges.emplace_back(offset + begin, offset + end);
    offset += layer->parameter_count();
  }
  return ranges;
}

void TransformerBlock::bind(Tensor const& params, Tensor const& grads) {
  std::int64_t offset = 0;
  for (Layer* layer : std::initializer_list<Layer*>{&ln1_, &attn_, &ln2_, &fc_, &proj_}) {
    std::int64_t const end = offset + layer->parameter_count();
    layer->bind(params.slice(offset, end), grads.slice(offset, end));
    offset = end;
  }
}

void TransformerBlock::initialize(std::mt19937_64& rng) {
  ln1_.initialize(rng);
  attn_.initialize(rng);
  ln2_.initialize(rng);
  normal_fill(fc_.weight(), 0.02f, rng);
  zero_fill(fc_.bias());
  normal_fill(proj_.weight(), proj_init_std_, rng);
  zero_fill(proj_.bias());
  attn_drop_.initialize(rng);
  mlp_drop_.initialize(rng);
}

void TransformerBlock::set_training(bool training) {
  attn_.set_training(training);
  attn_drop_.set_training(training);
  mlp_drop_.set_training(training);
}

void CausalSelfAttention::set_rng_seeds(std::span<std::uint64_t const> seeds) {
  Layer::set_rng_seeds(seeds);  // checks the count
  seed_ = seeds[0];
}

std::vector<std::uint64_t> TransformerBlock::rng_seeds() const {
  DropoutSeeds const seeds = dropout_seeds();
  return {seeds.attention, seeds.attention_output, seeds.mlp_output};
}

void TransformerBlock::set_rng_seeds(std::span<std::uint64_t const> seeds) {
  Layer::set_rng_seeds(seeds);  // checks the count
  attn_.set_rng_seeds(seeds.subspan(0, 1));
  attn_drop_.set_seed(seeds[1]);
  mlp_drop_.set_seed(seeds[2]);
}

void TransformerBlock::set_rng_counter(std::uint64_t counter) {
  attn_.set_rng_counter(counter);
  attn_drop_.set_rng_counter(counter);
  mlp_drop_.set_rng_counter(counter);
}

Tensor TransformerBlock::forward(Tensor const& x, Context& ctx) {
  check_activation(name(), x.shape(), features_);
  if (recompute_ != Recompute::full) return forward_layers(x, ctx);
  std::uint64_t const counter = rng_counter();
  Tensor y = forward_layers(x, ctx);
  // Keep only the input (and where dropout stood); backward_input reruns forward_layers.
  for (LayerNorm* norm : {&ln1_, &ln2_}) norm->release(ctx.micro_batch);
  attn_.release(ctx.micro_batch);
  for (Dropout* drop : {&attn_drop_, &mlp_drop_}) drop->release(ctx.micro_batch);
  for (Linear* linear : {&fc_, &proj_}) linear->release(ctx.micro_batch);
  if (ctx.keep_for_backward) inputs_[ctx.micro_batch] = Input{x, counter, ctx.row_offset};
  return y;
}

Tensor TransformerBlock::forward_layers(Tensor const& x, Context& ctx) {
  // h = x + Dropout(attn(LN1(x))): the branch's output is a fresh tensor, so the residual is added
  // in place, in LN2's pass over h.
  Tensor const h = attn_drop_.forward(attn_.forward(ln1_.forward(x, ctx), ctx), ctx);
  Tensor const m = mlp_drop_.forward(
      proj_.forward(fc_.forward(ln2_.forward_add(h, x, ctx), ctx, ops::ActivationKind::gelu), ctx), ctx);
  ops::add_scaled(m, h, 1.0f, ctx.stream);
  return m;
}

Tensor TransformerBlock::forward_cached(Tensor const& x, KvCache& cache, Context& ctx) const {
  check_activation(name(), x.shape(), features_);
  Tensor const x2 = x.reshape({x.dim(0) * x.dim(1), features_});
  Tensor const h =
      attn_.forward_cached(layer_norm_inference(ln1_, x2, ctx).reshape(x.shape()), cache, ctx).reshape(x2.shape());
  ops::add_scaled(h, x2, 1.0f, ctx.stream);
  Tensor const m =
      linear_inference(proj_, linear_inference(fc_, layer_norm_inference(ln2_, h, ctx), ops::ActivationKind::gelu, ctx),
                       ops::ActivationKind::identity, ctx);
  ops::add_scaled(m, h, 1.0f, ctx.stream);
  return m.reshape(x.shape());
}

Tensor TransformerBlock::backward(Tensor const& dy, Context& ctx) {
  Tensor dx = backward_input(dy, ctx);
  backward_weight(ctx);
  return dx;
}

Tensor TransformerBlock::backward_input(Tensor const& dy, Context& ctx) {
  if (recompute_ == Recompute::full) {
    auto const it = inputs_.find(ctx.micro_batch);
    if (it == inputs_.end())
      throw Error(Errc::invalid_argument, missing_forward(name(), "backward_input", ctx.micro_batch));
    Input const in = std::move(it->second);
    inputs_.erase(it);
    // The forward again, as it ran: its dropout masks and row offset (other micro-batches' forwards
    // may have advanced the count since). Only what the sublayers save is kept.
    std::uint64_t const counter = rng_counter();
    set_rng_counter(in.rng_counter);
    Context rerun{ctx.allocator, ctx.stream, in.row_offset, ctx.micro_batch, ctx.accumulate_gradients};
    (void)forward_layers(in.x, rerun);
    set_rng_counter(counter);
  }
  // dh = dy + the MLP branch's input gradient; dx = dh + the attention branch's: each sum in the
  // pass of the branch's LayerNorm backward.
  Tensor const dh =
      ln2_.backward_add(fc_.backward_input(proj_.backward_input(mlp_drop_.backward(dy, ctx), ctx), ctx), dy, ctx);
  return ln1_.backward_add(attn_.backward_input(attn_drop_.backward(dh, ctx), ctx), dh, ctx);
}

void TransformerBlock::backward_weight(Context& ctx) {
  proj_.backward_weight(ctx);
  fc_.backward_weight(ctx);
  attn_.backward_weight(ctx);
}

TiedLMHead::TiedLMHead(std::int64_t vocab, std::int64_t features) : vocab_(vocab), features_(features) {
  if (vocab < 1 || features < 1)
    throw Error(Errc::invalid_argument,
                "TiedLMHead(" + std::to_string(vocab) + ", " + std::to_string(features) + ") (expected sizes >= 1)");
}

std::string TiedLMHead::name() const {
  return "TiedLMHead(" + std::to_string(vocab_) + ", " + std::to_string(features_) + ")";
}

std::vector<std::pair<std::int64_t, std::int64_t>> TiedLMHead::matrix_ranges() const {
  if (!holds_weight_) return {};
  return {{0, vocab_ * features_}};
}

void TiedLMHead::bind(Tensor const& params, Tensor const& grads) {
  if (!holds_weight_) return;
  wte_ = params.reshape({vocab_, features_});
  dwte_ = grads.reshape({vocab_, features_});
}

void TiedLMHead::initialize(std::mt19937_64& /*rng*/) {
  if (holds_weight_) zero_fill(wte_);
}

std::unique_ptr<Layer> TiedLMHead::clone() const {
  auto copy = std::make_unique<TiedLMHead>(vocab_, features_);
  copy->holds_weight_ = holds_weight_;
  return copy;
}

void TiedLMHead::link(Sequential& model) {
  if (holds_weight_) return;
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (auto* embedding = dynamic_cast<Embedding*>(&model.layer(i));
        embedding != nullptr && embedding->vocab() == vocab_ && embedding->features() == features_) {
      embedding->set_tied(true);
      wte_ = embedding->token_weight();
      dwte_ = embedding->token_gradient();
      return;
    }
  }
  throw Error(Errc::invalid_argument,
              name() + ": no Embedding(" + std::to_string(vocab_) + ", *, " + std::to_string(features_) +
                  ") in its Sequential (expected the token embedding it is tied to in the same model, or "
                  "hold_weight() for a stage without it)");
}

Tensor TiedLMHead::forward(Tensor const& h, Context& ctx) {
  Shape const shape = output_shape(h.shape());
  if (!wte_.defined())
    throw Error(Errc::invalid_argument, name() + ".forward before materialize (expected it linked to its Embedding)");
  Tensor const h2 = h.reshape({h.numel() / features_, features_});
  Tensor logits = Tensor::empty({h2.dim(0), vocab_}, h.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(h2, false, wte_, true, logits, 1.0f, 0.0f, ctx.stream);  // h wteᵀ
  if (ctx.keep_for_backward) saved_[ctx.micro_batch] = {h2, Tensor{}};
  return logits.reshape(shape);
}

Tensor TiedLMHead::backward(Tensor const& dy, Context& ctx) {
  Tensor dx = backward_input(dy, ctx);
  backward_weight(ctx);
  return dx;
}

Tensor TiedLMHead::backward_input(Tensor const& dy, Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end())
    throw Error(Errc::invalid_argument, missing_forward(name(), "backward_input", ctx.micro_batch));
  Tensor const& h2 = it->second.first;
  Tensor const dy2 = dy.reshape({h2.dim(0), vocab_});
  it->second.second = dy2;
  Shape shape = dy.shape();
  shape.back() = features_;
  Tensor dh = Tensor::empty(shape, dy.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(dy2, false, wte_, false, dh.reshape(h2.shape()), 1.0f, 0.0f, ctx.stream);  // dlogits wte
  return dh;
}

void TiedLMHead::backward_weight(Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end() || !it->second.second.defined())
    throw Error(Errc::invalid_argument, name() + ".backward_weight for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected backward_input of that micro-batch first)");
  auto const [h2, dy2] = std::move(it->second);
  saved_.erase(it);
  ops::gemm(dy2, true, h2, false, dwte_, 1.0f, ctx.accumulate_gradients ? 1.0f : 0.0f, ctx.stream);  // dlogitsᵀ h
}

Shape TiedLMHead::output_shape(Shape const& input) const {
  if (input.size() < 2 || input.back() != features_)
    throw Error(Errc::invalid_argument, name() + ": input of shape " + to_string(input) + " (expected [B, T, " +
                                            std::to_string(features_) + "])");
  Shape out = input;
  out.back() = vocab_;
  return out;
}

}  // namespace mgpu::nn
