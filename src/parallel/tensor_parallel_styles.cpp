// Tensor parallelism as layer styles: the column- and row-parallel Linears, the styles that make
// each layer's shard, their registry, and parallelize() over a whole Sequential.
#include <mgpu/parallel/tensor_parallel_styles.hpp>

#include <algorithm>
#include <typeinfo>
#include <mutex>
#include <string>
#include <unordered_map>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "parallel/tensor_parallel_regions.hpp"

namespace mgpu::parallel {
namespace {

// The communicator's size, refusing a missing communicator, a size not dividing `split` or a rank
// outside it; `what` names the layer.
int checked_ranks(std::string const& what, std::int64_t split, char const* split_name,
                  comm::Communicator const* comm, int rank) {
  if (comm == nullptr)
    throw Error(Errc::invalid_argument, what + " without a communicator (expected the tensor-parallel group's)");
  int const ranks = comm->size();
  if (split < 1 || split % ranks != 0)
    throw Error(Errc::invalid_argument, what + " over " + std::to_string(ranks) + " ranks (expected the ranks dividing " +
                                            split_name + ", " + std::to_string(split) + ")");
  if (rank < 0 || rank >= ranks)
    throw Error(Errc::invalid_argument, what + " for rank " + std::to_string(rank) + " (expected a rank in [0, " +
                                            std::to_string(ranks) + "))");
  return ranks;
}

std::string linear_text(char const* kind, std::int64_t in, std::int64_t out) {
  return std::string(kind) + "(Linear(" + std::to_string(in) + ", " + std::to_string(out) + ")";
}

void check_copy_sizes(std::string const& what, std::span<float> whole, std::span<float> shard, std::int64_t in,
                      std::int64_t out, std::int64_t shard_count) {
  auto const whole_count = in * out + out;
  if (whole.size() != static_cast<std::size_t>(whole_count) || shard.size() != static_cast<std::size_t>(shard_count))
    throw Error(Errc::invalid_argument, what + ".copy_shard: " + std::to_string(whole.size()) + " and " +
                                            std::to_string(shard.size()) + " elements (expected " +
                                            std::to_string(whole_count) + " and " + std::to_string(shard_count) + ")");
}

// The whole nn::Linear(in, out, init) initialized from `rng` on the host, and `shard` (a layer's
// bound float32 host parameters) set to its part by `copy`.
void initialize_shard(std::int64_t in, std::int64_t out, nn::Init init, std::mt19937_64& rng, ShardedLayer const& copy,
                      Tensor const& shard) {
  auto const host = Allocator::create({DeviceKind::host, 0});
  nn::Linear whole(in, out, init);
  Tensor const params = Tensor::empty({whole.parameter_count()}, DType::float32, *host);
  Tensor const grads = Tensor::empty({whole.parameter_count()}, DType::float32, *host);
  whole.bind(params, grads);
  whole.initialize(rng);
  copy.copy_shard(params.host_span<float>(), shard.host_span<float>(), true);
}

void check_last(std::string const& what, Shape const& shape, std::int64_t features, bool sequence_parallel) {
  if (sequence_parallel) {
    detail::check_activation(what, shape, features);
  } else if (shape.empty() || shape.back() != features) {
    throw Error(Errc::invalid_argument, what + ": input of shape " + to_string(shape) + " (expected [..., " +
                                            std::to_string(features) + "])");
  }
}

}  // namespace

ColumnParallelLinear::ColumnParallelLinear(std::int64_t in, std::int64_t out, std::shared_ptr<comm::Communicator> comm,
                                           int rank, nn::Init init, bool sequence_parallel, bool gather_output)
    : in_(in),
      out_(out),
      comm_(std::move(comm)),
      rank_(rank),
      ranks_(checked_ranks(linear_text("ColumnParallel", in, out) + ")", out, "the output features", comm_.get(),
                           rank)),
      init_(init),
      sequence_parallel_(sequence_parallel),
      gather_output_(gather_output),
      linear_(in, out / ranks_, init) {
  if (gather_output && sequence_parallel)
    throw Error(Errc::invalid_argument,
                linear_text("ColumnParallel", in, out) +
                    ") with a gathered output and sequence parallelism (expected one of them: a sequence-parallel "
                    "region ends at a row-parallel layer or a token gather)");
}

std::string ColumnParallelLinear::name() const {
  return linear_text("ColumnParallel", in_, out_) + (gather_output_ ? ", gathered" : "") + ", rank " +
         std::to_string(rank_) + " of " + std::to_string(ranks_) + ")";
}

void ColumnParallelLinear::copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const {
  check_copy_sizes(name(), whole, shard, in_, out_, parameter_count());
  std::int64_t const part = out_ / ranks_;
  // W's rows, then b as one more row: this rank's columns of each.
  for (std::int64_t r = 0; r <= in_; ++r)
    for (std::int64_t j = 0; j < part; ++j) {
      float& w = whole[static_cast<std::size_t>(r * out_ + rank_ * part + j)];
      float& s = shard[static_cast<std::size_t>(r * part + j)];
      if (to_shard) {
        s = w;
      } else {
        w = s;
      }
    }
}

void ColumnParallelLinear::bind(Tensor const& params, Tensor const& grads) {
  params_ = params;
  linear_.bind(params, grads);
}

void ColumnParallelLinear::initialize(std::mt19937_64& rng) { initialize_shard(in_, out_, init_, rng, *this, params_); }

void ColumnParallelLinear::set_input_grad(bool needed) {
  input_grad_ = needed;
  linear_.set_input_grad(needed);
}

Tensor ColumnParallelLinear::forward(Tensor const& x, nn::Context& ctx) {
  check_last(name(), x.shape(), in_, sequence_parallel_);
  // f: the replicated input as it is (its gradient summed in backward), or the ranks' tokens gathered.
  Tensor const y = linear_.forward(sequence_parallel_ ? detail::gather_tokens(x, *comm_, rank_, ctx) : x, ctx);
  if (!gather_output_) return y;
  // Every rank's columns, rank after rank, then each rank's block into its columns of the whole.
  std::int64_t const part = out_ / ranks_, rows = y.numel() / part;
  Tensor const parts = Tensor::empty({ranks_ * rows * part}, y.dtype(), ctx.allocator, ctx.stream);
  comm_->all_gather(rank_, y, parts, ctx.stream);
  Shape shape = y.shape();
  shape.back() = out_;
  Tensor whole = Tensor::empty(shape, y.dtype(), ctx.allocator, ctx.stream);
  for (int r = 0; r < ranks_; ++r)
    ops::copy_columns(parts.slice(r * rows * part, (r + 1) * rows * part).reshape({rows, part}), 0, whole, r * part,
                      part, ctx.stream);
  return whole;
}

Tensor ColumnParallelLinear::backward(Tensor const& dy, nn::Context& ctx) {
  Tensor local = dy;
  if (gather_output_) {  // the gradient of this rank's columns
    std::int64_t const part = out_ / ranks_;
    Shape shape = dy.shape();
    shape.back() = part;
    local = Tensor::empty(shape, dy.dtype(), ctx.allocator, ctx.stream);
    ops::copy_columns(dy, rank_ * part, local, 0, part, ctx.stream);
  }
  Tensor dx = linear_.backward(local, ctx);  // this rank's part of the input gradient
  if (!input_grad_) return dx;
  if (sequence_parallel_) return detail::scatter_tokens(dx, *comm_, rank_, ctx);
  comm_->all_reduce(rank_, dx, dx, ReduceOp::sum, ctx.stream);
  return dx;
}

Shape ColumnParallelLinear::output_shape(Shape const& input) const {
  check_last(name(), input, in_, sequence_parallel_);
  Shape out = input;
  if (sequence_parallel_) out[1] *= ranks_;
  out.back() = gather_output_ ? out_ : out_ / ranks_;
  return out;
}

RowParallelLinear::RowParallelLinear(std::int64_t in, std::int64_t out, std::shared_ptr<comm::Communicator> comm,
                                     int rank, nn::Init init, bool sequence_parallel)
    : in_(in),
      out_(out),
      comm_(std::move(comm)),
      rank_(rank),
      ranks_(checked_ranks(linear_text("RowParallel", in, out) + ")", in, "the input features", comm_.get(), rank)),
      init_(init),
      sequence_parallel_(sequence_parallel) {
  if (out < 1)
    throw Error(Errc::invalid_argument, linear_text("RowParallel", in, out) + ") (expected output features >= 1)");
}

std::string RowParallelLinear::name() const {
  return linear_text("RowParallel", in_, out_) + ", rank " + std::to_string(rank_) + " of " + std::to_string(ranks_) +
         ")";
}

void RowParallelLinear::copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const {
  check_copy_sizes(name(), whole, shard, in_, out_, parameter_count());
  std::int64_t const part = in_ / ranks_;
  auto const move = [&](std::int64_t w, std::int64_t s) {
    if (to_shard) {
      shard[static_cast<std::size_t>(s)] = whole[static_cast<std::size_t>(w)];
    } else {
      whole[static_cast<std::size_t>(w)] = shard[static_cast<std::size_t>(s)];
    }
  };
  for (std::int64_t i = 0; i < part * out_; ++i) move(rank_ * part * out_ + i, i);  // W's rows
  for (std::int64_t i = 0; i < out_; ++i) move(in_ * out_ + i, part * out_ + i);    // b
}

void RowParallelLinear::bind(Tensor const& params, Tensor const& grads) {
  std::int64_t const part = in_ / ranks_;
  params_ = params;
  w_ = params.slice(0, part * out_).reshape({part, out_});
  dw_ = grads.slice(0, part * out_).reshape({part, out_});
  b_ = params.slice(part * out_, part * out_ + out_);
  db_ = grads.slice(part * out_, part * out_ + out_);
}

void RowParallelLinear::initialize(std::mt19937_64& rng) { initialize_shard(in_, out_, init_, rng, *this, params_); }

Tensor RowParallelLinear::forward(Tensor const& x, nn::Context& ctx) {
  check_last(name(), x.shape(), in_ / ranks_, sequence_parallel_);
  // g: summed over the ranks (all-reduce), or reduce-scattered to the rank's tokens.
  Tensor y = detail::row_parallel_forward(x, w_, b_, *comm_, rank_, sequence_parallel_, ctx);
  if (ctx.keep_for_backward) saved_[ctx.micro_batch] = x;
  return y;
}

Tensor RowParallelLinear::backward(Tensor const& dy, nn::Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end())
    throw Error(Errc::invalid_argument, name() + ".backward for micro-batch " + std::to_string(ctx.micro_batch) +
                                            " (expected a forward of that micro-batch whose backward has not run)");
  Tensor const x = std::move(it->second);
  saved_.erase(it);
  // Every row's output gradient, the same on every rank (sequence parallelism: gathered).
  Tensor const every = sequence_parallel_ ? detail::gather_tokens(dy, *comm_, rank_, ctx) : dy;
  return detail::row_parallel_backward(x, every, w_, dw_, db_, ctx);
}

Shape RowParallelLinear::output_shape(Shape const& input) const {
  check_last(name(), input, in_ / ranks_, sequence_parallel_);
  Shape out = input;
  if (sequence_parallel_) {
    if (out[1] % ranks_ != 0)
      throw Error(Errc::invalid_argument, name() + ": input of shape " + to_string(input) + " (expected the " +
                                              std::to_string(ranks_) + " ranks dividing T)");
    out[1] /= ranks_;
  }
  out.back() = out_;
  return out;
}

namespace {

std::vector<std::unique_ptr<nn::Layer>> one(std::unique_ptr<nn::Layer> layer) {
  std::vector<std::unique_ptr<nn::Layer>> layers;
  layers.push_back(std::move(layer));
  return layers;
}

// `whole` as a T, or Error naming the style and what it takes.
template <typename T>
T const& expect(nn::Layer const& whole, char const* style, char const* expected) {
  auto const* layer = dynamic_cast<T const*>(&whole);
  if (layer == nullptr)
    throw Error(Errc::invalid_argument,
                std::string(style) + " for a " + whole.name() + " (expected " + expected + ")");
  return *layer;
}

int group_size(ShardGroup const& group) { return group.comm != nullptr ? group.comm->size() : 0; }

}  // namespace

Style column_parallel(bool gather_output) {
  return [gather_output](nn::Layer const& whole, ShardGroup const& group) {
    auto const& linear = expect<nn::Linear>(whole, "column_parallel", "an nn::Linear");
    return one(std::make_unique<ColumnParallelLinear>(linear.in_features(), linear.out_features(), group.comm,
                                                      group.rank, linear.init(), group.sequence_parallel,
                                                      gather_output));
  };
}

Style row_parallel() {
  return [](nn::Layer const& whole, ShardGroup const& group) {
    auto const& linear = expect<nn::Linear>(whole, "row_parallel", "an nn::Linear");
    return one(std::make_unique<RowParallelLinear>(linear.in_features(), linear.out_features(), group.comm,
                                                   group.rank, linear.init(), group.sequence_parallel));
  };
}

Style vocab_parallel_embedding() {
  return [](nn::Layer const& whole, ShardGroup const& group) {
    auto const& embedding = expect<nn::Embedding>(whole, "vocab_parallel_embedding", "an nn::Embedding");
    return one(std::make_unique<VocabParallelEmbedding>(embedding.vocab(), embedding.block_size(),
                                                        embedding.features(), group.comm, group.rank,
                                                        embedding.init_std(), group.sequence_parallel));
  };
}

Style vocab_parallel_lm_head() {
  return [](nn::Layer const& whole, ShardGroup const& group) {
    auto const& head = expect<nn::TiedLMHead>(whole, "vocab_parallel_lm_head", "an nn::TiedLMHead");
    std::vector<std::unique_ptr<nn::Layer>> layers;
    if (group.sequence_parallel) {
      if (group.comm == nullptr)
        throw Error(Errc::invalid_argument, "vocab_parallel_lm_head without a communicator (expected the "
                                            "tensor-parallel group's)");
      layers.push_back(std::make_unique<detail::TokenGather>(head.features(), group.comm, group.rank));
    }
    // With sequence parallelism TokenGather's backward sums the heads' partial input gradients.
    auto shard = std::make_unique<VocabParallelLMHead>(head.vocab(), head.features(), group.comm, group.rank,
                                                       !group.sequence_parallel);
    if (head.holds_weight()) shard->hold_weight();
    layers.push_back(std::move(shard));
    return layers;
  };
}

Style transformer_block() {
  return [](nn::Layer const& whole, ShardGroup const& group) {
    auto const& block = expect<nn::TransformerBlock>(whole, "transformer_block", "an nn::TransformerBlock");
    return one(std::make_unique<TensorParallelBlock>(block.features(), block.heads(), group.comm, group.rank,
                                                     block.proj_init_std(), block.dropout(), block.recompute(),
                                                     group.sequence_parallel));
  };
}

Style replicate() {
  return [](nn::Layer const& whole, ShardGroup const& group) -> std::vector<std::unique_ptr<nn::Layer>> {
    if (!group.sequence_parallel) return one(whole.clone());
    if (auto const* dropout = dynamic_cast<nn::Dropout const*>(&whole))
      return one(std::make_unique<detail::TokenDropout>(dropout->p(), group_size(group), group.rank));
    if (whole.parameter_count() > 0 && dynamic_cast<nn::LayerNorm const*>(&whole) == nullptr)
      throw Error(Errc::invalid_argument,
                  "replicate with sequence parallelism for a " + whole.name() +
                      " (expected a layer without parameters, a LayerNorm or a Dropout: the gradients of another "
                      "layer's parameters from the rank's tokens would not be summed over the ranks)");
    return one(whole.clone());
  };
}

namespace {

// The default styles by layer type, nn's registered first.
struct Registry {
  std::mutex mutex;
  std::unordered_map<std::type_index, Style> styles;
  Registry() {
    styles[typeid(nn::Embedding)] = vocab_parallel_embedding();
    styles[typeid(nn::TransformerBlock)] = transformer_block();
    styles[typeid(nn::TiedLMHead)] = vocab_parallel_lm_head();
    for (std::type_index const type : {std::type_index(typeid(nn::LayerNorm)), std::type_index(typeid(nn::Dropout)),
                                       std::type_index(typeid(nn::ReLU)), std::type_index(typeid(nn::GELU))})
      styles[type] = replicate();
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_style(std::type_index type, Style style) {
  if (!style) throw Error(Errc::invalid_argument, "register_style with an empty style (expected a function)");
  Registry& r = registry();
  std::lock_guard const lock(r.mutex);
  r.styles[type] = std::move(style);
}

Style default_style(nn::Layer const& layer) {
  Registry& r = registry();
  std::lock_guard const lock(r.mutex);
  auto const it = r.styles.find(typeid(layer));
  return it == r.styles.end() ? Style{} : it->second;
}

nn::Sequential parallelize(nn::Sequential const& whole, TensorParallelPlan const& plan,
                           std::shared_ptr<comm::Communicator> comm, int rank, std::vector<std::size_t>* origins) {
  if (comm == nullptr)
    throw Error(Errc::invalid_argument, "parallelize without a communicator (expected the tensor-parallel group's)");
  if (rank < 0 || rank >= comm->size())
    throw Error(Errc::invalid_argument, "parallelize for rank " + std::to_string(rank) + " (expected a rank in [0, " +
                                            std::to_string(comm->size()) + "))");
  if (whole.first_layer() != 0)
    throw Error(Errc::invalid_argument, "parallelize of a stage starting at layer " +
                                            std::to_string(whole.first_layer()) +
                                            " (expected a whole model: parallelize it, then cut the shard into stages)");
  for (auto const& [index, style] : plan.styles) {
    if (index >= whole.size())
      throw Error(Errc::invalid_argument, "parallelize: the plan names layer " + std::to_string(index) + " of a " +
                                              std::to_string(whole.size()) + "-layer model (expected indices below " +
                                              std::to_string(whole.size()) + ")");
    if (!style)
      throw Error(Errc::invalid_argument, "parallelize: the plan's style for layer " + std::to_string(index) +
                                              " is empty (expected a function)");
  }
  ShardGroup const group{std::move(comm), rank, plan.sequence_parallel};
  nn::Sequential shard;
  if (origins != nullptr) origins->clear();
  for (std::size_t i = 0; i < whole.size(); ++i) {
    nn::Layer const& layer = whole.layer(i);
    std::string const what = "parallelize: layer " + std::to_string(i) + " (" + layer.name() + ")";
    auto const named = plan.styles.find(i);
    Style const style = named != plan.styles.end() ? named->second : default_style(layer);
    if (!style)
      throw Error(Errc::invalid_argument,
                  what + " has no tensor-parallel style (expected one in the plan, e.g. column_parallel() or "
                         "row_parallel() for an nn::Linear, or one registered for its type with register_style)");
    std::vector<std::unique_ptr<nn::Layer>> parts;
    try {
      parts = style(layer, group);
    } catch (Error const& e) {
      throw Error(e.category(), what + ": " + std::string(e.message()));
    }
    if (parts.empty() || std::find(parts.begin(), parts.end(), nullptr) != parts.end())
      throw Error(Errc::invalid_argument, what + ": its style returned " +
                                              (parts.empty() ? std::string("no layer") : std::string("a null layer")) +
                                              " (expected the shard's layers)");
    // materialize() seeds each layer by its index: layers added before a shard shift the later
    // layers', which must then draw nothing.
    if (parts.size() > 1)
      for (std::size_t later = i + 1; later < whole.size(); ++later) {
        nn::Layer const& next = whole.layer(later);
        if (next.parameter_count() > 0 || !next.rng_seeds().empty())
          throw Error(Errc::invalid_argument,
                      what + ": its style adds " + std::to_string(parts.size() - 1) + " layer(s) before layer " +
                          std::to_string(later) + " (" + next.name() +
                          "), whose initialization would then differ from the whole model's (expected layers with "
                          "parameters or randomness only before the added ones)");
      }
    for (auto& part : parts) shard.add(std::move(part));
    if (origins != nullptr) origins->insert(origins->end(), parts.size(), i);
  }
  return shard;
}

}  // namespace mgpu::parallel
