// The tensor-parallel transformer block (TensorParallelBlock) and the ranges of a shard the
// executors reduce and count (partial_ranges, norm_ranges).
#include <mgpu/parallel/tensor_parallel.hpp>

#include <algorithm>
#include <cmath>
#include <string>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>

#include "parallel/tensor_parallel_regions.hpp"

namespace mgpu::parallel {
namespace {

std::string block_text(std::int64_t features, std::int64_t heads, int ranks) {
  return "TensorParallelBlock(" + std::to_string(features) + " features, " + std::to_string(heads) + " heads, " +
         std::to_string(ranks) + " ranks)";
}

int checked_ranks(std::int64_t features, std::int64_t heads, comm::Communicator const* comm, int rank) {
  if (comm == nullptr)
    throw Error(Errc::invalid_argument,
                "TensorParallelBlock without a communicator (expected the tensor-parallel group's)");
  int const ranks = comm->size();
  if (heads < 1 || features % heads != 0 || heads % ranks != 0)
    throw Error(Errc::invalid_argument, block_text(features, heads, ranks) +
                                            " (expected heads dividing the features and the ranks dividing the heads)");
  if (rank < 0 || rank >= ranks)
    throw Error(Errc::invalid_argument, block_text(features, heads, ranks) + " for rank " + std::to_string(rank) +
                                            " (expected a rank in [0, " + std::to_string(ranks) + "))");
  return ranks;
}

}  // namespace

using detail::check_activation;
using detail::gather_tokens;
using detail::row_parallel_backward;
using detail::row_parallel_forward;
using detail::scatter_tokens;
using detail::token_context;

TensorParallelBlock::TensorParallelBlock(std::int64_t features, std::int64_t heads,
                                         std::shared_ptr<comm::Communicator> comm, int rank, float proj_init_std,
                                         float dropout, nn::Recompute recompute, bool sequence_parallel)
    : features_(features),
      heads_(heads),
      comm_(std::move(comm)),
      rank_(rank),
      ranks_(checked_ranks(features, heads, comm_.get(), rank)),
      proj_init_std_(proj_init_std),
      dropout_(dropout),
      recompute_(recompute),
      sequence_parallel_(sequence_parallel),
      attn_drop_(dropout),
      mlp_drop_(dropout),
      ln1_(features),
      ln2_(features),
      qkv_(features, 3 * features / ranks_),
      fc_(features, 4 * features / ranks_) {}

std::string TensorParallelBlock::name() const {
  return "TensorParallelBlock(" + std::to_string(features_) + ", heads " + std::to_string(heads_) + ", rank " +
         std::to_string(rank_) + " of " + std::to_string(ranks_) + ")";
}

std::int64_t TensorParallelBlock::parameter_count() const {
  std::int64_t const c = features_, part = features_ / ranks_;
  return ln1_.parameter_count() + qkv_.parameter_count() + part * c + c + ln2_.parameter_count() +
         fc_.parameter_count() + 4 * part * c + c;
}

std::vector<std::pair<std::int64_t, std::int64_t>> TensorParallelBlock::matrix_ranges() const {
  std::int64_t const c = features_, part = features_ / ranks_;
  std::int64_t const qkv = 2 * c, attn = qkv + qkv_.parameter_count(), fc = attn + part * c + 3 * c,
                     mlp = fc + fc_.parameter_count();
  return {{qkv, qkv + c * 3 * part}, {attn, attn + part * c}, {fc, fc + c * 4 * part}, {mlp, mlp + 4 * part * c}};
}

std::vector<std::pair<std::int64_t, std::int64_t>> TensorParallelBlock::split_ranges() const {
  std::int64_t const c = features_, part = features_ / ranks_;
  std::int64_t const qkv = 2 * c, fc = qkv + qkv_.parameter_count() + part * c + 3 * c;
  // qkv W and b with the attention projection's rows; mlp_fc W and b with mlp_proj's rows.
  return {{qkv, qkv + qkv_.parameter_count() + part * c}, {fc, fc + fc_.parameter_count() + 4 * part * c}};
}

std::vector<std::pair<std::int64_t, std::int64_t>> TensorParallelBlock::partial_ranges() const {
  if (!sequence_parallel_) return {};
  std::int64_t const c = features_, ln2 = 2 * c + qkv_.parameter_count() + (features_ / ranks_) * c + c;
  return {{0, 2 * c}, {ln2, ln2 + 2 * c}};
}

void TensorParallelBlock::bind(Tensor const& params, Tensor const& grads) {
  std::int64_t const c = features_, part = features_ / ranks_;
  params_ = params;
  std::int64_t offset = 0;
  auto const take = [&](std::int64_t n, Shape shape, Tensor& p, Tensor& g) {
    p = params.slice(offset, offset + n).reshape(shape);
    g = grads.slice(offset, offset + n).reshape(shape);
    offset += n;
  };
  auto const layer = [&](nn::Layer& l) {
    std::int64_t const end = offset + l.parameter_count();
    l.bind(params.slice(offset, end), grads.slice(offset, end));
    offset = end;
  };
  layer(ln1_);
  layer(qkv_);
  take(part * c, {part, c}, attn_w_, dattn_w_);
  take(c, {c}, attn_b_, dattn_b_);
  layer(ln2_);
  layer(fc_);
  take(4 * part * c, {4 * part, c}, mlp_w_, dmlp_w_);
  take(c, {c}, mlp_b_, dmlp_b_);
}

void TensorParallelBlock::copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const {
  std::int64_t const c = features_;
  nn::TransformerBlock const reference(features_, heads_, 0.0f, proj_init_std_);
  if (whole.size() != static_cast<std::size_t>(reference.parameter_count()) ||
      shard.size() != static_cast<std::size_t>(parameter_count()))
    throw Error(Errc::invalid_argument, name() + ".copy_shard: " + std::to_string(whole.size()) + " and " +
                                            std::to_string(shard.size()) + " elements (expected " +
                                            std::to_string(reference.parameter_count()) + " and " +
                                            std::to_string(parameter_count()) + ")");
  std::size_t w = 0, s = 0;  // cursors into whole and shard
  auto const move = [&](std::size_t whole_at, std::size_t shard_at) {
    if (to_shard) {
      shard[shard_at] = whole[whole_at];
    } else {
      whole[whole_at] = shard[shard_at];
    }
  };
  auto const same = [&](std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) move(w + static_cast<std::size_t>(i), s + static_cast<std::size_t>(i));
    w += static_cast<std::size_t>(n);
    s += static_cast<std::size_t>(n);
  };
  // rows x cols of the whole, cut into `groups` equal column groups; the shard holds this rank's
  // 1/ranks of each group's columns.
  auto const columns = [&](std::int64_t rows, std::int64_t cols, std::int64_t groups) {
    std::int64_t const group = cols / groups, own = group / ranks_, shard_cols = groups * own;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < shard_cols; ++j)
        move(w + static_cast<std::size_t>(r * cols + (j / own) * group + rank_ * own + j % own),
             s + static_cast<std::size_t>(r * shard_cols + j));
    w += static_cast<std::size_t>(rows * cols);
    s += static_cast<std::size_t>(rows * shard_cols);
  };
  // This rank's 1/ranks of the rows of rows x cols (contiguous).
  auto const own_rows = [&](std::int64_t rows, std::int64_t cols) {
    std::int64_t const own = rows / ranks_;
    for (std::int64_t i = 0; i < own * cols; ++i)
      move(w + static_cast<std::size_t>(rank_ * own * cols + i), s + static_cast<std::size_t>(i));
    w += static_cast<std::size_t>(rows * cols);
    s += static_cast<std::size_t>(own * cols);
  };
  same(2 * c);           // ln_1
  columns(c, 3 * c, 3);  // qkv W: this rank's heads of q, of k and of v
  columns(1, 3 * c, 3);  // qkv b
  own_rows(c, c);        // attention projection W
  same(c + 2 * c);       // its bias, ln_2
  columns(c, 4 * c, 1);  // mlp_fc W
  columns(1, 4 * c, 1);  // mlp_fc b
  own_rows(4 * c, c);    // mlp_proj W
  same(c);               // its bias
}

void TensorParallelBlock::initialize(std::mt19937_64& rng) {
  // The whole block's weights, drawn as nn::TransformerBlock draws them, then this rank's shard.
  auto const host = Allocator::create({DeviceKind::host, 0});
  nn::TransformerBlock whole(features_, heads_, dropout_, proj_init_std_);
  Tensor const params = Tensor::empty({whole.parameter_count()}, DType::float32, *host);
  Tensor const grads = Tensor::empty({whole.parameter_count()}, DType::float32, *host);
  whole.bind(params, grads);
  whole.initialize(rng);
  copy_shard(params.host_span<float>(), params_.host_span<float>(), true);
  nn::TransformerBlock::DropoutSeeds const seeds = whole.dropout_seeds();
  attention_seed_ = seeds.attention;
  attn_drop_.set_seed(seeds.attention_output);
  mlp_drop_.set_seed(seeds.mlp_output);
}

void TensorParallelBlock::set_training(bool training) {
  training_ = training;
  attn_drop_.set_training(training);
  mlp_drop_.set_training(training);
}

void TensorParallelBlock::set_rng_seeds(std::span<std::uint64_t const> seeds) {
  Layer::set_rng_seeds(seeds);  // checks the count
  attention_seed_ = seeds[0];
  attn_drop_.set_seed(seeds[1]);
  mlp_drop_.set_seed(seeds[2]);
}

void TensorParallelBlock::set_rng_counter(std::uint64_t counter) {
  calls_ = counter;
  attn_drop_.set_rng_counter(counter);
  mlp_drop_.set_rng_counter(counter);
}

Tensor TensorParallelBlock::forward(Tensor const& x, nn::Context& ctx) {
  check_activation(name(), x.shape(), features_);
  if (recompute_ != nn::Recompute::full) return forward_layers(x, ctx);
  std::uint64_t const counter = calls_;
  Tensor y = forward_layers(x, ctx);
  // Keep only the input (and where dropout stood); backward reruns forward_layers.
  saved_.erase(ctx.micro_batch);
  for (nn::LayerNorm* norm : {&ln1_, &ln2_}) norm->release(ctx.micro_batch);
  for (nn::Linear* linear : {&qkv_, &fc_}) linear->release(ctx.micro_batch);
  for (nn::Dropout* drop : {&attn_drop_, &mlp_drop_}) drop->release(ctx.micro_batch);
  if (ctx.keep_for_backward) inputs_[ctx.micro_batch] = Input{x, counter, ctx.row_offset};
  return y;
}

Tensor TensorParallelBlock::forward_layers(Tensor const& x, nn::Context& ctx) {
  std::int64_t const batch = x.dim(0), t = sequence_parallel_ ? x.dim(1) * ranks_ : x.dim(1), part = features_ / ranks_;
  nn::Context tokens = token_context(ctx, sequence_parallel_, ranks_, rank_, batch);
  // h = x + attn(LN1(x)): the column-parallel qkv takes the replicated LN1(x) (f: identity), or
  // with sequence parallelism LN1 of the ranks' tokens gathered.
  Tensor const ln1 = ln1_.forward(x, ctx);
  Tensor const qkv = qkv_.forward(sequence_parallel_ ? gather_tokens(ln1, *comm_, rank_, ctx) : ln1,
                                  ctx);  // [B, T, 3 C/T]: this rank's heads
  bool const regather = sequence_parallel_ && ctx.keep_for_backward;
  if (regather) qkv_.release_input(ctx);  // kept as ln1, gathered again in backward
  Tensor y = Tensor::empty({batch, t, part}, x.dtype(), ctx.allocator, ctx.stream);
  Tensor lse = Tensor::empty({batch, heads_ / ranks_, t}, DType::float32, ctx.allocator, ctx.stream);
  ops::AttentionDropout dropout;
  if (training_ && dropout_ > 0.0f) {
    // As nn::CausalSelfAttention's, on this rank's heads among all of them.
    dropout = {dropout_, mgpu::detail::mix64(attention_seed_ + calls_++) | 1u, ctx.row_offset,
               rank_ * (heads_ / ranks_), heads_};
  }
  ops::causal_attention(qkv, y, lse, heads_ / ranks_, ctx.stream, dropout);
  // g: all-reduce (or reduce-scatter); the dropout of the replicated output the same on every rank.
  Tensor const h =
      attn_drop_.forward(row_parallel_forward(y, attn_w_, attn_b_, *comm_, rank_, sequence_parallel_, ctx), tokens);
  // y = h + MLP(LN2(h)), the same split; h = x + the branch, added in place in LN2's pass.
  Tensor const ln2 = ln2_.forward_add(h, x, ctx);
  Tensor const u = fc_.forward(sequence_parallel_ ? gather_tokens(ln2, *comm_, rank_, ctx) : ln2, ctx,
                               ops::ActivationKind::gelu);  // [B, T, 4 C/T]
  if (regather) fc_.release_input(ctx);
  Tensor const m =
      mlp_drop_.forward(row_parallel_forward(u, mlp_w_, mlp_b_, *comm_, rank_, sequence_parallel_, ctx), tokens);
  ops::add_scaled(m, h, 1.0f, ctx.stream);
  if (!ctx.keep_for_backward) return m;
  Tensor const none;
  bool const keep_core = recompute_ != nn::Recompute::selective;
  saved_[ctx.micro_batch] = Saved{qkv,
                                  keep_core ? y : none,
                                  keep_core ? lse : none,
                                  u,
                                  dropout,
                                  sequence_parallel_ ? ln1 : none,
                                  sequence_parallel_ ? ln2 : none};
  return m;
}

Tensor TensorParallelBlock::backward(Tensor const& dy, nn::Context& ctx) {
  std::string const missing = name() + ".backward for micro-batch " + std::to_string(ctx.micro_batch) +
                              " (expected a forward of that micro-batch whose backward has not run)";
  if (recompute_ == nn::Recompute::full) {
    auto const in = inputs_.find(ctx.micro_batch);
    if (in == inputs_.end()) throw Error(Errc::invalid_argument, missing);
    Input const input = std::move(in->second);
    inputs_.erase(in);
    // The forward again, as it ran: its dropout masks and row offset.
    std::uint64_t const counter = calls_;
    set_rng_counter(input.rng_counter);
    nn::Context rerun{ctx.allocator, ctx.stream, input.row_offset, ctx.micro_batch, ctx.accumulate_gradients};
    (void)forward_layers(input.x, rerun);
    set_rng_counter(counter);
  }
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end()) throw Error(Errc::invalid_argument, missing);
  Saved s = std::move(it->second);
  saved_.erase(it);
  if (recompute_ == nn::Recompute::selective) {  // the same kernel on the same qkv and dropout: the same y and lse
    std::int64_t const batch = s.qkv.dim(0), t = s.qkv.dim(1);
    s.y = Tensor::empty({batch, t, features_ / ranks_}, s.qkv.dtype(), ctx.allocator, ctx.stream);
    s.lse = Tensor::empty({batch, heads_ / ranks_, t}, DType::float32, ctx.allocator, ctx.stream);
    ops::causal_attention(s.qkv, s.y, s.lse, heads_ / ranks_, ctx.stream, s.dropout);
  }
  nn::Context tokens = token_context(ctx, sequence_parallel_, ranks_, rank_, dy.dim(0));
  // The gradient of every token (sequence parallelism: gathered from the ranks' tokens), and of
  // the input of the column-parallel Linear that `partial` is this rank's part of: summed over the
  // ranks (f's backward), or with sequence parallelism reduce-scattered to the rank's tokens.
  auto const every_token = [&](Tensor const& d) {
    return sequence_parallel_ ? gather_tokens(d, *comm_, rank_, ctx) : d;
  };
  auto const summed = [&](Tensor const& partial) {
    if (sequence_parallel_) return scatter_tokens(partial, *comm_, rank_, ctx);
    comm_->all_reduce(rank_, partial, partial, ReduceOp::sum, ctx.stream);
    return partial;
  };
  // MLP branch.
  Tensor const du =
      row_parallel_backward(s.mlp_in, every_token(mlp_drop_.backward(dy, tokens)), mlp_w_, dmlp_w_, dmlp_b_, ctx);
  if (sequence_parallel_) fc_.restore_input(gather_tokens(s.ln2, *comm_, rank_, ctx), ctx);
  Tensor const dh = ln2_.backward_add(summed(fc_.backward(du, ctx)), dy, ctx);  // + the residual's gradient
  // Attention branch, the same way.
  Tensor const dattn =
      row_parallel_backward(s.y, every_token(attn_drop_.backward(dh, tokens)), attn_w_, dattn_w_, dattn_b_, ctx);
  Tensor dqkv = Tensor::empty(s.qkv.shape(), s.qkv.dtype(), ctx.allocator, ctx.stream);
  ops::causal_attention_backward(s.qkv, s.y, s.lse, dattn, dqkv, heads_ / ranks_, ctx.stream, s.dropout);
  if (sequence_parallel_) qkv_.restore_input(gather_tokens(s.ln1, *comm_, rank_, ctx), ctx);
  return ln1_.backward_add(summed(qkv_.backward(dqkv, ctx)), dh, ctx);
}

Shape TensorParallelBlock::output_shape(Shape const& input) const {
  check_activation(name(), input, features_);
  return input;
}

std::vector<nn::ParameterRange> partial_ranges(nn::Sequential const& shard, bool sequence_parallel) {
  std::vector<nn::ParameterRange> ranges;
  for (nn::ParameterRange const& range : shard.parameter_ranges()) {
    nn::Layer const& layer = shard.layer(range.layer);
    if (auto const* sharded = dynamic_cast<ShardedLayer const*>(&layer)) {
      for (auto const& [begin, end] : sharded->partial_ranges())
        ranges.push_back({range.layer, range.begin + begin, range.begin + end});
    } else if (sequence_parallel && dynamic_cast<nn::LayerNorm const*>(&layer) != nullptr) {
      ranges.push_back(range);
    }
  }
  return ranges;
}

std::vector<nn::ElementRange> norm_ranges(nn::Sequential const& shard, bool split, bool replicated) {
  std::vector<nn::ElementRange> ranges;
  for (nn::ParameterRange const& range : shard.parameter_ranges()) {
    std::int64_t at = range.begin;
    if (auto const* sharded = dynamic_cast<ShardedLayer const*>(&shard.layer(range.layer))) {
      for (auto const& [begin, end] : sharded->split_ranges()) {
        ranges.push_back({at, range.begin + begin, replicated});
        ranges.push_back({range.begin + begin, range.begin + end, split});
        at = range.begin + end;
      }
    }
    ranges.push_back({at, range.end, replicated});
  }
  return ranges;
}

}  // namespace mgpu::parallel
