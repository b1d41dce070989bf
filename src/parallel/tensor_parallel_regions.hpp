// The collectives at the edges of tensor-parallel and sequence-parallel regions, shared by the
// tensor-parallel layers (tensor_parallel_layers.cpp) and the styles (tensor_parallel_styles.cpp):
// tokens gathered and reduce-scattered, the row-parallel matrix product, and the token layers.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/ops/ops.hpp>

namespace mgpu::parallel::detail {

// Throws Error(invalid_argument) naming `layer` unless `shape` is [B, T, features].
inline void check_activation(std::string const& layer, Shape const& shape, std::int64_t features) {
  if (shape.size() != 3 || shape[2] != features)
    throw Error(Errc::invalid_argument, layer + ": input of shape " + to_string(shape) + " (expected [B, T, " +
                                            std::to_string(features) + "])");
}

// Sequence parallelism: every rank's tokens [B, T / ranks, C] gathered into [B, T, C] (rank r's
// are rows [r, r + 1) B T / ranks of the flattened [B T, C]).
inline Tensor gather_tokens(Tensor const& x, comm::Communicator& comm, int rank, nn::Context& ctx) {
  Tensor y = Tensor::empty({x.dim(0), x.dim(1) * comm.size(), x.dim(2)}, x.dtype(), ctx.allocator, ctx.stream);
  comm.all_gather(rank, x, y, ctx.stream);
  return y;
}

// Sequence parallelism: x [B, T, C] summed over the ranks, each keeping its tokens [B, T / ranks, C].
inline Tensor scatter_tokens(Tensor const& x, comm::Communicator& comm, int rank, nn::Context& ctx) {
  Tensor y = Tensor::empty({x.dim(0), x.dim(1) / comm.size(), x.dim(2)}, x.dtype(), ctx.allocator, ctx.stream);
  comm.reduce_scatter(rank, x, y, ReduceOp::sum, ctx.stream);
  return y;
}

// The context of a Dropout on this rank's tokens of a batch of `batch` sequences. Dropout numbers
// an element by its row's global index (ctx.row_offset, counted in rows of its input's shape)
// times the row's size, plus its place in the row; with sequence parallelism the rank's tokens
// [B, T / ranks, C] start at element (row_offset T + rank B T / ranks) C of the whole batch, row
// row_offset ranks + rank B in rows of T / ranks tokens: the same masks as without.
inline nn::Context token_context(nn::Context const& ctx, bool sequence_parallel, int ranks, int rank,
                                 std::int64_t batch) {
  nn::Context tokens = ctx;
  if (sequence_parallel) tokens.row_offset = ctx.row_offset * ranks + rank * batch;
  return tokens;
}

// x [..., K] (this rank's part of the inputs) times W [K, C], summed over the ranks, plus b [C]:
// every row's output, or with sequence parallelism (x [B, T, K]) the rank's tokens [B, T / ranks, C].
inline Tensor row_parallel_forward(Tensor const& x, Tensor const& w, Tensor const& b, comm::Communicator& comm,
                                   int rank, bool sequence_parallel, nn::Context& ctx) {
  std::int64_t const rows = x.numel() / w.dim(0);
  Shape shape = x.shape();
  shape.back() = w.dim(1);
  Tensor y = Tensor::empty(shape, x.dtype(), ctx.allocator, ctx.stream);
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
// and the input gradient dy Wᵀ [..., K]. dy (every row's) is the same on every rank.
inline Tensor row_parallel_backward(Tensor const& x, Tensor const& dy, Tensor const& w, Tensor const& dw,
                                    Tensor const& db, nn::Context& ctx) {
  std::int64_t const rows = x.numel() / w.dim(0);
  Tensor const dy2 = dy.reshape({rows, w.dim(1)});
  ops::bias_grad(dy2, db, ctx.stream, ctx.accumulate_gradients);
  ops::gemm(x.reshape({rows, w.dim(0)}), true, dy2, false, dw, 1.0f, ctx.accumulate_gradients ? 1.0f : 0.0f,
            ctx.stream);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(dy2, false, w, true, dx.reshape({rows, w.dim(0)}), 1.0f, 0.0f, ctx.stream);
  return dx;
}

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

}  // namespace mgpu::parallel::detail
