// TensorParallelBlock, tensor_parallel_gpt and the TensorParallel executor.
#include <mgpu/parallel/tensor_parallel.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <numeric>
#include <string>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>

#include "comm/renewable.hpp"

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

void check_activation(std::string const& layer, Shape const& shape, std::int64_t features) {
  if (shape.size() != 3 || shape[2] != features)
    throw Error(Errc::invalid_argument, layer + ": input of shape " + to_string(shape) + " (expected [B, T, " +
                                            std::to_string(features) + "])");
}

// Sequence parallelism: every rank's tokens [B, T / ranks, C] gathered into [B, T, C] (rank r's
// are rows [r, r + 1) B T / ranks of the flattened [B T, C]).
Tensor gather_tokens(Tensor const& x, comm::Communicator& comm, int rank, nn::Context& ctx) {
  Tensor y = Tensor::empty({x.dim(0), x.dim(1) * comm.size(), x.dim(2)}, x.dtype(), ctx.allocator, ctx.stream);
  comm.all_gather(rank, x, y, ctx.stream);
  return y;
}

// Sequence parallelism: x [B, T, C] summed over the ranks, each keeping its tokens [B, T / ranks, C].
Tensor scatter_tokens(Tensor const& x, comm::Communicator& comm, int rank, nn::Context& ctx) {
  Tensor y = Tensor::empty({x.dim(0), x.dim(1) / comm.size(), x.dim(2)}, x.dtype(), ctx.allocator, ctx.stream);
  comm.reduce_scatter(rank, x, y, ReduceOp::sum, ctx.stream);
  return y;
}

// The context of a Dropout on this rank's tokens of a batch of `batch` sequences. Dropout numbers
// an element by its row's global index (ctx.row_offset, counted in rows of its input's shape)
// times the row's size, plus its place in the row; with sequence parallelism the rank's tokens
// [B, T / ranks, C] start at element (row_offset T + rank B T / ranks) C of the whole batch, row
// row_offset ranks + rank B in rows of T / ranks tokens: the same masks as without.
nn::Context token_context(nn::Context const& ctx, bool sequence_parallel, int ranks, int rank, std::int64_t batch) {
  nn::Context tokens = ctx;
  if (sequence_parallel) tokens.row_offset = ctx.row_offset * ranks + rank * batch;
  return tokens;
}

// x [B, T, K] (this rank's part of the inputs) times W [K, C], summed over the ranks, plus b [C]:
// every token's output, or with sequence parallelism the rank's tokens [B, T / ranks, C].
Tensor row_parallel_forward(Tensor const& x, Tensor const& w, Tensor const& b, comm::Communicator& comm, int rank,
                            bool sequence_parallel, nn::Context& ctx) {
  std::int64_t const rows = x.dim(0) * x.dim(1);
  Tensor y = Tensor::empty({x.dim(0), x.dim(1), w.dim(1)}, x.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(x.reshape({rows, w.dim(0)}), false, w, false, y.reshape({rows, w.dim(1)}), 1.0f, 0.0f, ctx.stream);
  if (sequence_parallel) {
    y = scatter_tokens(y, comm, rank, ctx);
  } else {
    comm.all_reduce(rank, y, y, ReduceOp::sum, ctx.stream);
  }
  ops::add_bias(y.reshape({y.numel() / w.dim(1), w.dim(1)}), b, ctx.stream);
  return y;
}

// The gradients of row_parallel_forward: db and dW (written, or added with accumulate_gradients)
// and the input gradient dy Wᵀ [B, T, K]. dy (every token's) is the same on every rank.
Tensor row_parallel_backward(Tensor const& x, Tensor const& dy, Tensor const& w, Tensor const& dw, Tensor const& db,
                             nn::Context& ctx) {
  std::int64_t const rows = x.dim(0) * x.dim(1);
  Tensor const dy2 = dy.reshape({rows, w.dim(1)});
  ops::bias_grad(dy2, db, ctx.stream, ctx.accumulate_gradients);
  ops::gemm(x.reshape({rows, w.dim(0)}), true, dy2, false, dw, 1.0f, ctx.accumulate_gradients ? 1.0f : 0.0f,
            ctx.stream);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(dy2, false, w, true, dx.reshape({rows, w.dim(0)}), 1.0f, 0.0f, ctx.stream);
  return dx;
}

}  // namespace

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
  ops::add_scaled(h, x, 1.0f, ctx.stream);
  // y = h + MLP(LN2(h)), the same split.
  Tensor const ln2 = ln2_.forward(h, ctx);
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
  Tensor const dh = ln2_.backward(summed(fc_.backward(du, ctx)), ctx);
  ops::add_scaled(dh, dy, 1.0f, ctx.stream);
  // Attention branch, the same way.
  Tensor const dattn =
      row_parallel_backward(s.y, every_token(attn_drop_.backward(dh, tokens)), attn_w_, dattn_w_, dattn_b_, ctx);
  Tensor dqkv = Tensor::empty(s.qkv.shape(), s.qkv.dtype(), ctx.allocator, ctx.stream);
  ops::causal_attention_backward(s.qkv, s.y, s.lse, dattn, dqkv, heads_ / ranks_, ctx.stream, s.dropout);
  if (sequence_parallel_) qkv_.restore_input(gather_tokens(s.ln1, *comm_, rank_, ctx), ctx);
  Tensor const dx = ln1_.backward(summed(qkv_.backward(dqkv, ctx)), ctx);
  ops::add_scaled(dx, dh, 1.0f, ctx.stream);
  return dx;
}

Shape TensorParallelBlock::output_shape(Shape const& input) const {
  check_activation(name(), input, features_);
  return input;
}

namespace {

// Sequence parallelism: nn::Dropout on the rank's tokens [B, T / ranks, C], dropping what it drops
// on those tokens of the whole [B, T, C] (token_context).
class TokenDropout final : public nn::Layer {
 public:
  TokenDropout(float p, int ranks, int rank) : p_(p), ranks_(ranks), rank_(rank), dropout_(p) {}
  std::string name() const override { return "TokenDropout(" + dropout_.name() + ")"; }
  void initialize(std::mt19937_64& rng) override { dropout_.initialize(rng); }
  void set_training(bool training) override { dropout_.set_training(training); }
  std::uint64_t rng_counter() const override { return dropout_.rng_counter(); }
  void set_rng_counter(std::uint64_t counter) override { dropout_.set_rng_counter(counter); }
  std::vector<std::uint64_t> rng_seeds() const override { return dropout_.rng_seeds(); }
  void set_rng_seeds(std::span<std::uint64_t const> seeds) override { dropout_.set_rng_seeds(seeds); }
  Tensor forward(Tensor const& x, nn::Context& ctx) override {
    nn::Context tokens = token_context(ctx, true, ranks_, rank_, x.rank() > 0 ? x.dim(0) : 0);
    return dropout_.forward(x, tokens);
  }
  Tensor backward(Tensor const& dy, nn::Context& ctx) override { return dropout_.backward(dy, ctx); }
  std::size_t saved_micro_batches() const override { return dropout_.saved_micro_batches(); }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<TokenDropout>(p_, ranks_, rank_); }

 private:
  float p_;
  int ranks_, rank_;
  nn::Dropout dropout_;
};

// Sequence parallelism, before the LM head: every rank's tokens [B, T / ranks, C] gathered into
// [B, T, C]; backward reduce-scatters the head's partial input gradients to the rank's tokens.
class TokenGather final : public nn::Layer {
 public:
  TokenGather(std::int64_t features, std::shared_ptr<comm::Communicator> comm, int rank)
      : features_(features), comm_(std::move(comm)), rank_(rank) {}
  std::string name() const override {
    return "TokenGather(" + std::to_string(features_) + ", rank " + std::to_string(rank_) + " of " +
           std::to_string(comm_->size()) + ")";
  }
  Tensor forward(Tensor const& x, nn::Context& ctx) override {
    check_activation(name(), x.shape(), features_);
    return gather_tokens(x, *comm_, rank_, ctx);
  }
  Tensor backward(Tensor const& dy, nn::Context& ctx) override { return scatter_tokens(dy, *comm_, rank_, ctx); }
  Shape output_shape(Shape const& input) const override {
    check_activation(name(), input, features_);
    return {input[0], input[1] * comm_->size(), features_};
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<TokenGather>(features_, comm_, rank_); }

 private:
  std::int64_t features_;
  std::shared_ptr<comm::Communicator> comm_;
  int rank_;
};

}  // namespace

nn::Sequential tensor_parallel_gpt(nn::GptConfig const& config, std::shared_ptr<comm::Communicator> comm, int rank,
                                   bool sequence_parallel) {
  nn::Sequential const whole = nn::gpt(config);  // checks the config
  int const ranks = comm != nullptr ? comm->size() : 0;
  if (ranks < 1 || config.n_head % ranks != 0)
    throw Error(Errc::invalid_argument, "tensor_parallel_gpt: " + std::to_string(config.n_head) + " heads over " +
                                            std::to_string(ranks) +
                                            " tensor-parallel ranks (expected a group size dividing n_head)");
  if (config.vocab < ranks)
    throw Error(Errc::invalid_argument, "tensor_parallel_gpt: a vocab of " + std::to_string(config.vocab) + " over " +
                                            std::to_string(ranks) +
                                            " tensor-parallel ranks (expected at least one token id per rank)");
  float const proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(config.n_layer));
  nn::Sequential model;
  model.add(std::make_unique<VocabParallelEmbedding>(config.vocab, config.block_size, config.n_embd, comm, rank, 0.02f,
                                                     sequence_parallel));
  if (sequence_parallel) {
    model.add(std::make_unique<TokenDropout>(config.dropout, ranks, rank));
  } else {
    model.add(std::make_unique<nn::Dropout>(config.dropout));
  }
  for (std::int64_t l = 0; l < config.n_layer; ++l)
    model.add(std::make_unique<TensorParallelBlock>(config.n_embd, config.n_head, comm, rank, proj_std, config.dropout,
                                                    config.recompute, sequence_parallel));
  model.add(std::make_unique<nn::LayerNorm>(config.n_embd));
  if (sequence_parallel) model.add(std::make_unique<TokenGather>(config.n_embd, comm, rank));
  model.add(std::make_unique<VocabParallelLMHead>(config.vocab, config.n_embd, comm, rank, !sequence_parallel));
  return model;
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

std::vector<nn::OwnedRange> norm_ranges(nn::Sequential const& shard, bool split, bool replicated) {
  std::vector<nn::OwnedRange> ranges;
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

namespace {

// `t`'s float32 values on the host, once `stream` has written them.
std::vector<float> host_copy(Tensor const& t, Stream& stream) {
  auto const host = Allocator::create({DeviceKind::host, 0});
  Tensor const copy = Tensor::empty(t.shape(), DType::float32, *host);
  copy_async(copy, t, stream);
  stream.synchronize();
  auto const span = copy.host_span<float>();
  return {span.begin(), span.end()};
}

// Within a replica nothing is left to reduce between backward and the update (the blocks'
// all-reduces leave every gradient complete on its rank); across replicas (`data`, when set) each
// layer's gradients are summed over the ranks of the same tensor-parallel index as backward writes
// them (every replica's loss is divided by the whole batch's count). For apply_update, the rank's
// whole buffer as owned ranges, split ranges counted on every rank and replicated ones on the
// replica's rank 0 only, and sums over the replica's ranks by all-reduce: the replicas hold the
// same gradients, so each computes the same global norm. With sequence parallelism the LayerNorms'
// gradients (the blocks' partial_ranges() and the final LayerNorm) are each rank's tokens' part:
// ready() first sums them over the replica's ranks.
class TensorParallelSync final : public nn::GradientSync {
 public:
  TensorParallelSync(nn::Sequential const& shard, comm::Communicator& comm, int rank, comm::Communicator* data,
                     int data_rank, comm::Communicator& all, int all_rank, bool sequence_parallel)
      : shard_(shard),
        comm_(comm),
        rank_(rank),
        data_(data),
        data_rank_(data_rank),
        all_(all),
        all_rank_(all_rank),
        owned_(norm_ranges(shard, true, rank == 0)) {
    for (nn::ParameterRange const& partial : partial_ranges(shard, sequence_parallel))
      partial_[partial.layer].emplace_back(partial.begin, partial.end);
  }
  /// Before a step: nothing updated yet (begin() comes only once forward has been enqueued).
  void start_step() noexcept { updated_.store(false, std::memory_order_relaxed); }
  void begin(Stream& /*compute*/, nn::RangeUpdate update) override {
    update_ = std::move(update);
    pending_.clear();
  }
  /// Whether the step's updates may have begun on this rank (every rank had finished its backward).
  [[nodiscard]] bool updated() const noexcept { return updated_.load(std::memory_order_acquire); }
  void ready(nn::ParameterRange const& range, Stream& compute) override {
    if (auto const it = partial_.find(range.layer); it != partial_.end()) {
      for (auto const& [begin, end] : it->second) {
        Tensor const grads = shard_.master_gradients().slice(begin, end);
        comm_.all_reduce(rank_, grads, grads, ReduceOp::sum, compute);
      }
    }
    if (data_ != nullptr) {
      Tensor const grads = shard_.master_gradients().slice(range.begin, range.end);
      data_->all_reduce(data_rank_, grads, grads, ReduceOp::sum, compute);
    }
    if (update_) pending_.emplace_back(range.begin, range.end);
  }
  // The commit point: a barrier over every rank, so the updates (here, or apply_update's after it)
  // run on every rank or, when any rank failed before it, on none (a failed stream skips them).
  void finish(Stream& compute) override {
    all_.barrier(all_rank_, compute);
    // On a host stream the mark runs only if the barrier did; a CUDA stream runs later kernels
    // after a failed callback, so there the updates count as begun once enqueued.
    if (compute.device().kind == DeviceKind::host) {
      compute.enqueue([this] { updated_.store(true, std::memory_order_release); });
    } else {
      updated_.store(true, std::memory_order_release);
    }
    for (auto const& [begin, end] : pending_) update_(begin, end, compute);
    pending_.clear();
  }
  std::vector<nn::OwnedRange> owned() const override { return owned_; }
  void sum_over_ranks(Tensor const& values, Stream& compute) override {
    comm_.all_reduce(rank_, values, values, ReduceOp::sum, compute);
  }

 private:
  nn::Sequential const& shard_;
  comm::Communicator& comm_;
  int rank_;
  comm::Communicator* data_;  // over the replicas' ranks of this tensor-parallel index; null for one replica
  int data_rank_;
  comm::Communicator& all_;  // over every rank of the grid
  int all_rank_;
  std::vector<nn::OwnedRange> owned_;
  std::map<std::size_t, std::vector<std::pair<std::int64_t, std::int64_t>>> partial_;  // by layer
  nn::RangeUpdate update_;
  std::vector<std::pair<std::int64_t, std::int64_t>> pending_;  // ranges whose update waits for finish()
  std::atomic<bool> updated_{false};
};

}  // namespace

struct TensorParallel::Impl {
  DeviceGroup* group = nullptr;
  nn::GptConfig config;
  TensorParallelOptions options;
  int replicas = 1, ranks = 1;  // A and T
  int first = 0;                // the grid rank of the group's rank 0 (across processes, its world rank)
  // Across processes: over every rank of the world (null in one process).
  std::shared_ptr<comm::Communicator> world;
  // Each replica's tensor-parallel group, and (A > 1) each tensor-parallel index's replicas; across
  // processes null where this process drives none of the ranks.
  std::vector<std::shared_ptr<comm::Communicator>> comms;
  std::vector<std::unique_ptr<comm::Communicator>> data;
  // Over every rank (the world's across processes; comms[0] for one replica): the step's commit point.
  std::shared_ptr<comm::Communicator> all;
  std::vector<nn::Sequential> shards;
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers;
  std::vector<std::unique_ptr<TensorParallelSync>> syncs;
  std::vector<VocabParallelCrossEntropy> losses;
  // Within one process: the communicators above, made anew after a failed step.
  std::vector<comm::detail::Renewable*> renewable;
  // Why the executor cannot be used (empty: it can).
  std::string broken;
  // After a step failed inside: waits for every stream; within one process, when no rank had passed
  // the step's commit point (TensorParallelSync::finish), makes the communicators anew and puts
  // back the shards' RNG and the optimizers' step counts (`rng`, `steps`: as the step found them);
  // otherwise the executor cannot be used. Rethrows `failure`.
  [[noreturn]] void recover(std::exception_ptr failure, std::vector<std::vector<std::uint64_t>> const& rng,
                            std::vector<std::int64_t> const& steps);
};

void TensorParallel::Impl::recover(std::exception_ptr failure, std::vector<std::vector<std::uint64_t>> const& rng,
                                   std::vector<std::int64_t> const& steps) {
  std::string cause = "an unknown error";
  try {
    std::rethrow_exception(failure);
  } catch (std::exception const& e) {
    cause = e.what();
  } catch (...) {  // only the message is wanted here; the failure itself is rethrown below
  }
  try {
    for (int rank = 0; rank < group->size(); ++rank) {
      try {
        group->stream(rank).synchronize();
      } catch (Error const&) {  // the failure's own consequences, reported by it
      }
    }
    bool updated = false;  // past the step's commit point somewhere
    for (auto const& sync : syncs) updated = updated || sync->updated();
    if (world) {
      broken = "the executor cannot be used after a step failed across processes, whose communicators cannot be made "
               "again while a peer may be gone (expected a new job); the step failed with " + cause;
    } else if (updated) {
      broken = "the executor cannot be used after a step failed once updates had begun, leaving the shards partly updated "
               "(expected a new executor); the step failed with " + cause;
    } else {
      for (comm::detail::Renewable* comm : renewable) comm->renew();  // the failure aborted them
      for (std::size_t r = 0; r < shards.size(); ++r) {
        shards[r].set_rng_state(rng[r]);
        optimizers[r]->set_steps(steps[r]);
      }
    }
  } catch (Error const& e) {  // an executor that cannot be put back is as unusable as a partly updated one
    broken = "the executor cannot be used after a step failed and it could not be put back (" + std::string(e.what()) +
             "); the step failed with " + cause;
  }
  std::rethrow_exception(failure);
}

TensorParallel::TensorParallel(DeviceGroup& group, nn::GptConfig const& config, TensorParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  if (!options.adamw.decay_ranges.empty())
    throw Error(Errc::invalid_argument, "TensorParallel: AdamW with " +
                                            std::to_string(options.adamw.decay_ranges.size()) +
                                            " decay ranges (expected none: each rank decays its shard's 2-D weights)");
  if (!(options.clip_norm == 0 || (options.clip_norm > 0 && std::isfinite(options.clip_norm))))
    throw Error(Errc::invalid_argument, "TensorParallel: clip_norm " + std::to_string(options.clip_norm) +
                                            " (expected 0 for no clipping, or a finite norm > 0)");
  int const replicas = options.data_parallel;
  bool const across = static_cast<bool>(options.make_communicator);
  if (across) {
    im.world = options.make_communicator(group, options.comm);
    im.first = im.world->first_rank();
  }
  int const size = across ? im.world->size() : group.size();
  if (replicas < 1 || size % replicas != 0)
    throw Error(Errc::invalid_argument, "TensorParallel: data_parallel " + std::to_string(replicas) + " over " +
                                            (across ? "the world's " : "a group of ") + std::to_string(size) +
                                            " devices (expected a replica count >= 1 dividing the " +
                                            (across ? "world's" : "group") + " size)");
  if (across && replicas > 1 && !options.make_subset_communicator)
    throw Error(Errc::invalid_argument, "TensorParallel: data_parallel " + std::to_string(replicas) +
                                            " across processes without make_subset_communicator (expected "
                                            "dist::subset_communicator_factory(world) with make_communicator)");
  im.group = &group;
  im.config = config;
  im.options = std::move(options);
  im.replicas = replicas;
  im.ranks = size / replicas;
  // A communicator over the grid ranks `ranks` (across processes, made only where this process
  // drives one of them).
  auto const subset = [&](std::vector<int> const& ranks) -> std::unique_ptr<comm::Communicator> {
    if (!across) {
      auto made = std::make_unique<comm::detail::Renewable>(
          [g = &group, ranks, options = im.options.comm] { return comm::make_communicator(*g, ranks, options); });
      im.renewable.push_back(made.get());
      return made;
    }
    bool const here = std::any_of(ranks.begin(), ranks.end(), [&](int r) { return r >= im.first && r < im.first + group.size(); });
    return here ? im.options.make_subset_communicator(group, ranks, im.options.comm) : nullptr;
  };
  if (replicas == 1) {
    if (across) {
      im.comms.push_back(im.world);
    } else {
      auto made = std::make_shared<comm::detail::Renewable>(
          [g = &group, options = im.options.comm] { return comm::make_communicator(*g, options); });
      im.renewable.push_back(made.get());
      im.comms.push_back(std::move(made));
    }
  } else {
    for (int a = 0; a < replicas; ++a) {
      std::vector<int> ranks;
      for (int t = 0; t < im.ranks; ++t) ranks.push_back(a * im.ranks + t);
      im.comms.push_back(subset(ranks));
    }
    for (int t = 0; t < im.ranks; ++t) {
      std::vector<int> ranks;
      for (int a = 0; a < replicas; ++a) ranks.push_back(a * im.ranks + t);
      im.data.push_back(subset(ranks));
    }
  }
  if (across) {
    im.all = im.world;
  } else if (replicas == 1) {
    im.all = im.comms[0];
  } else {
    std::vector<int> ranks(static_cast<std::size_t>(size));
    std::iota(ranks.begin(), ranks.end(), 0);
    im.all = subset(ranks);
  }
  im.shards.reserve(static_cast<std::size_t>(group.size()));  // the syncs keep references
  for (int r = 0; r < group.size(); ++r) {
    int const a = (im.first + r) / im.ranks, t = (im.first + r) % im.ranks;
    std::shared_ptr<comm::Communicator> const& comm = im.comms[static_cast<std::size_t>(a)];
    im.shards.push_back(tensor_parallel_gpt(config, comm, t, im.options.sequence_parallel));
    if (im.options.optimizer) {
      im.optimizers.push_back(im.options.optimizer(im.shards.back()));
    } else {
      optim::AdamWOptions adamw = im.options.adamw;
      adamw.decay_ranges = im.shards.back().matrix_ranges();
      im.optimizers.push_back(std::make_unique<optim::AdamW>(adamw));
    }
    comm::Communicator* const data = replicas > 1 ? im.data[static_cast<std::size_t>(t)].get() : nullptr;
    im.syncs.push_back(
        std::make_unique<TensorParallelSync>(im.shards.back(), *comm, t, data, a, *im.all, im.first + r, im.options.sequence_parallel));
    im.losses.emplace_back(config.vocab, comm, t);
  }
  group.run([&](int rank, Device /*device*/, Stream& stream) {
    nn::Context ctx{group.allocator(rank), stream};
    im.shards[static_cast<std::size_t>(rank)].materialize(ctx, im.options.seed);
  });
}

TensorParallel::~TensorParallel() = default;

int TensorParallel::size() const noexcept { return impl_->replicas * impl_->ranks; }
int TensorParallel::data_parallel() const noexcept { return impl_->replicas; }
int TensorParallel::tensor_parallel() const noexcept { return impl_->ranks; }

nn::Sequential& TensorParallel::shard(int rank) { return impl_->shards.at(static_cast<std::size_t>(rank)); }

TensorParallel::StepResult TensorParallel::step(Tensor const& ids, Tensor const& targets, float lr_scale) {
  Impl& im = *impl_;
  if (!im.broken.empty()) throw Error(Errc::invalid_argument, "TensorParallel::step: " + im.broken);
  nn::Loss const& loss = im.losses[0];
  // Before any rank starts: a bad batch found inside the step would abort the communicators.
  nn::check_batch(im.shards[0], loss, ids, targets, {lr_scale, DType::float32, false}, "TensorParallel::step");
  std::int64_t const rows = ids.rank() > 0 ? ids.dim(0) : 0;
  if (rows < im.replicas)
    throw Error(Errc::invalid_argument, "TensorParallel::step: a batch of " + std::to_string(rows) + " rows over " +
                                            std::to_string(im.replicas) +
                                            " data-parallel replicas (expected at least one row per replica)");
  std::int64_t const units = loss.count(targets, im.group->stream(0));
  // Replica a's rows [offsets[a], offsets[a + 1]): the first rows mod A replicas take one more.
  std::vector<std::int64_t> offsets{0};
  for (std::int64_t const n : shard_sizes(rows, im.replicas)) offsets.push_back(offsets.back() + n);
  std::vector<double> shares(static_cast<std::size_t>(size()), 0.0);  // each grid rank's: its replica's part of the mean
  StepResult result;
  std::vector<std::vector<std::uint64_t>> rng;  // what a failed step puts back
  std::vector<std::int64_t> steps;
  for (std::size_t r = 0; r < im.shards.size(); ++r) {
    rng.push_back(im.shards[r].rng_state());
    steps.push_back(im.optimizers[r]->steps());
    im.syncs[r]->start_step();
  }
  try {
    im.group->run([&](int rank, Device device, Stream& stream) {
      Allocator& allocator = im.group->allocator(rank);
      int const g = im.first + rank;
      auto const a = static_cast<std::size_t>(g / im.ranks);
      auto const local = [&](Tensor const& t) {
        Tensor const rows_of = im.replicas == 1 ? t : t.slice(offsets[a], offsets[a + 1]);
        if (rows_of.device() == device) return rows_of;
        Tensor copy = Tensor::empty(rows_of.shape(), rows_of.dtype(), allocator);
        copy_async(copy, rows_of, stream);
        return copy;
      };
      auto const r = static_cast<std::size_t>(rank);
      nn::Context ctx{allocator, stream, offsets[a]};
      nn::StepResult const step =
          nn::train_step(im.shards[r], *im.optimizers[r], local(ids), local(targets), im.losses[r], ctx,
                         {.lr_scale = lr_scale,
                          .clip_norm = im.options.clip_norm,
                          .global_units = units,
                          .sync = im.syncs[r].get(),
                          .rank = g});
      if (im.world) {  // across processes: every rank's share, from every process
        Tensor const all = Tensor::empty({size()}, DType::float32, allocator);
        im.world->all_gather(g, step.loss.reshape({1}), all, stream);
        if (rank == 0) {
          std::vector<float> const values = host_copy(all, stream);
          std::copy(values.begin(), values.end(), shares.begin());
        }
      } else if (g % im.ranks == 0) {
        shares[static_cast<std::size_t>(g)] = ops::item(step.loss, stream);
      }
      if (rank == 0) result.applied = step.applied;  // the same on every rank
    });
  } catch (...) {
    im.recover(std::current_exception(), rng, steps);
  }
  for (int a = 0; a < im.replicas; ++a) result.loss += shares[static_cast<std::size_t>(a * im.ranks)];
  return result;
}

namespace {

// Calls fn(whole layer span, shard layer span, sharded layer or nullptr) for each layer with
// parameters.
template <typename Fn>
void for_each_layer(nn::Sequential const& shard, std::span<float> params,
                    std::vector<nn::ParameterRange> const& whole_ranges, std::span<float> whole, Fn&& fn) {
  std::vector<nn::ParameterRange> const ranges = shard.parameter_ranges();
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    nn::ParameterRange const& s = ranges[i];
    nn::ParameterRange const& w = whole_ranges[i];
    fn(whole.subspan(static_cast<std::size_t>(w.begin), static_cast<std::size_t>(w.size())),
       params.subspan(static_cast<std::size_t>(s.begin), static_cast<std::size_t>(s.size())),
       dynamic_cast<ShardedLayer const*>(&shard.layer(s.layer)));
  }
}

}  // namespace

std::vector<float> TensorParallel::gather_parameters() {
  Impl& im = *impl_;
  nn::Sequential const whole_model = nn::gpt(im.config);
  std::vector<float> whole(static_cast<std::size_t>(whole_model.parameter_count()));
  // Replica 0's shards: in one process its own; across processes every rank's shard (padded to the
  // largest) all-gathered over the world, laid out by shards made here for each index.
  std::vector<nn::Sequential> layouts;
  std::vector<float> gathered;
  std::int64_t padded = 0;
  if (im.world) {
    std::shared_ptr<comm::Communicator> const& comm = im.comms[static_cast<std::size_t>(im.first / im.ranks)];
    for (int t = 0; t < im.ranks; ++t) {
      layouts.push_back(tensor_parallel_gpt(im.config, comm, t, im.options.sequence_parallel));
      padded = std::max(padded, layouts.back().parameter_count());
    }
    im.group->run([&](int rank, Device /*device*/, Stream& stream) {
      Allocator& allocator = im.group->allocator(rank);
      nn::Sequential const& shard = im.shards[static_cast<std::size_t>(rank)];
      Tensor const mine = Tensor::empty({padded}, DType::float32, allocator);
      fill_async(mine, 0.0f, stream);
      copy_async(mine.slice(0, shard.parameter_count()), shard.master_parameters(), stream);
      Tensor const all = Tensor::empty({padded * size()}, DType::float32, allocator);
      im.world->all_gather(im.first + rank, mine, all, stream);
      if (rank == 0) gathered = host_copy(all, stream);
    });
  }
  // Rank 0 last, so the replicated parameters are its.
  for (int rank = im.ranks - 1; rank >= 0; --rank) {
    nn::Sequential const& shard = im.world ? layouts[static_cast<std::size_t>(rank)] : im.shards[static_cast<std::size_t>(rank)];
    std::vector<float> values;
    if (im.world) {
      auto const begin = gathered.begin() + static_cast<std::ptrdiff_t>(rank * padded);
      values.assign(begin, begin + static_cast<std::ptrdiff_t>(shard.parameter_count()));
    } else {
      values = host_copy(shard.master_parameters(), im.group->stream(rank));
    }
    for_each_layer(shard, values, whole_model.parameter_ranges(), whole,
                   [](std::span<float> w, std::span<float> s, ShardedLayer const* sharded) {
                     if (sharded != nullptr) {
                       sharded->copy_shard(w, s, false);
                     } else {
                       std::copy(s.begin(), s.end(), w.begin());
                     }
                   });
  }
  return whole;
}

void TensorParallel::scatter_parameters(std::span<float const> values) {
  Impl& im = *impl_;
  nn::Sequential const whole_model = nn::gpt(im.config);
  if (values.size() != static_cast<std::size_t>(whole_model.parameter_count()))
    throw Error(Errc::invalid_argument, "TensorParallel::scatter_parameters: " + std::to_string(values.size()) +
                                            " values (expected gpt(config)'s " +
                                            std::to_string(whole_model.parameter_count()) + ")");
  std::vector<float> whole(values.begin(), values.end());
  auto const host = Allocator::create({DeviceKind::host, 0});
  for (int rank = 0; rank < im.group->size(); ++rank) {
    nn::Sequential& shard = im.shards[static_cast<std::size_t>(rank)];
    Tensor const params = Tensor::empty({shard.parameter_count()}, DType::float32, *host);
    for_each_layer(shard, params.host_span<float>(), whole_model.parameter_ranges(), whole,
                   [](std::span<float> w, std::span<float> s, ShardedLayer const* sharded) {
                     if (sharded != nullptr) {
                       sharded->copy_shard(w, s, true);
                     } else {
                       std::copy(w.begin(), w.end(), s.begin());
                     }
                   });
    Stream& stream = im.group->stream(rank);
    copy_async(shard.master_parameters(), params, stream);
    shard.sync_parameters(stream);
    stream.synchronize();
  }
}

}  // namespace mgpu::parallel
