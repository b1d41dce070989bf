// The vocab-parallel parts of a tensor-parallel GPT: VocabParallelEmbedding, VocabParallelLMHead
// and VocabParallelCrossEntropy, and the default loss that takes its logits.
#include <algorithm>
#include <string>
#include <tuple>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

namespace mgpu::parallel {
namespace {

int group_size(comm::Communicator const* comm, std::string const& layer) {
  if (comm == nullptr)
    throw Error(Errc::invalid_argument, layer + " without a communicator (expected the tensor-parallel group's)");
  return comm->size();
}

std::string missing_forward(std::string const& layer, std::int64_t micro_batch) {
  return layer + ".backward for micro-batch " + std::to_string(micro_batch) +
         " (expected a forward of that micro-batch whose backward has not run)";
}

}  // namespace

std::pair<std::int64_t, std::int64_t> vocab_shard(std::int64_t vocab, int ranks, int rank) {
  if (ranks < 1 || vocab < ranks)
    throw Error(Errc::invalid_argument, "a vocab of " + std::to_string(vocab) + " over " + std::to_string(ranks) +
                                            " tensor-parallel ranks (expected at least one token id per rank)");
  if (rank < 0 || rank >= ranks)
    throw Error(Errc::invalid_argument, "vocab shard of rank " + std::to_string(rank) + " (expected a rank in [0, " +
                                            std::to_string(ranks) + "))");
  return {rank * vocab / ranks, (rank + 1) * vocab / ranks};
}

VocabParallelEmbedding::VocabParallelEmbedding(std::int64_t vocab, std::int64_t block_size, std::int64_t features,
                                               std::shared_ptr<comm::Communicator> comm, int rank, float init_std,
                                               bool sequence_parallel)
    : vocab_(vocab),
      block_size_(block_size),
      features_(features),
      comm_(std::move(comm)),
      rank_(rank),
      init_std_(init_std),
      sequence_parallel_(sequence_parallel) {
  std::string const text = "VocabParallelEmbedding(vocab " + std::to_string(vocab) + ", block " +
                           std::to_string(block_size) + ", features " + std::to_string(features) + ")";
  if (vocab < 1 || block_size < 1 || features < 1 || !(init_std >= 0))
    throw Error(Errc::invalid_argument, text + " (expected sizes >= 1 and init_std >= 0)");
  std::tie(begin_, end_) = vocab_shard(vocab, group_size(comm_.get(), text), rank);
}

std::string VocabParallelEmbedding::name() const {
  return "VocabParallelEmbedding(" + std::to_string(vocab_) + ", " + std::to_string(block_size_) + ", " +
         std::to_string(features_) + ", ids [" + std::to_string(begin_) + ", " + std::to_string(end_) + "))";
}

void VocabParallelEmbedding::bind(Tensor const& params, Tensor const& grads) {
  std::int64_t const rows = end_ - begin_, split = rows * features_, end = parameter_count();
  params_ = params;
  wte_ = params.slice(0, split).reshape({rows, features_});
  wpe_ = params.slice(split, end).reshape({block_size_, features_});
  dwte_ = grads.slice(0, split).reshape({rows, features_});
  dwpe_ = grads.slice(split, end).reshape({block_size_, features_});
}

void VocabParallelEmbedding::copy_shard(std::span<float> whole, std::span<float> shard, bool to_shard) const {
  auto const c = static_cast<std::size_t>(features_);
  auto const rows = static_cast<std::size_t>(end_ - begin_), positions = static_cast<std::size_t>(block_size_);
  auto const whole_size = static_cast<std::size_t>(vocab_) * c + positions * c;
  if (whole.size() != whole_size || shard.size() != static_cast<std::size_t>(parameter_count()))
    throw Error(Errc::invalid_argument, name() + ".copy_shard: " + std::to_string(whole.size()) + " and " +
                                            std::to_string(shard.size()) + " elements (expected " +
                                            std::to_string(whole_size) + " and " + std::to_string(parameter_count()) +
                                            ")");
  auto const move = [&](std::size_t whole_at, std::size_t shard_at, std::size_t n) {
    if (to_shard) {
      std::copy_n(whole.begin() + static_cast<std::ptrdiff_t>(whole_at), n,
                  shard.begin() + static_cast<std::ptrdiff_t>(shard_at));
    } else {
      std::copy_n(shard.begin() + static_cast<std::ptrdiff_t>(shard_at), n,
                  whole.begin() + static_cast<std::ptrdiff_t>(whole_at));
    }
  };
  move(static_cast<std::size_t>(begin_) * c, 0, rows * c);              // wte's rows
  move(static_cast<std::size_t>(vocab_) * c, rows * c, positions * c);  // wpe
}

void VocabParallelEmbedding::initialize(std::mt19937_64& rng) {
  // The whole embedding, drawn as nn::Embedding draws it, then this rank's rows.
  auto const host = Allocator::create({DeviceKind::host, 0});
  nn::Embedding whole(vocab_, block_size_, features_, init_std_);
  Tensor const params = Tensor::empty({whole.parameter_count()}, DType::float32, *host);
  Tensor const grads = Tensor::empty({whole.parameter_count()}, DType::float32, *host);
  whole.bind(params, grads);
  whole.initialize(rng);
  copy_shard(params.host_span<float>(), params_.host_span<float>(), true);
}

Tensor VocabParallelEmbedding::forward(Tensor const& ids, nn::Context& ctx) {
  Shape const shape = output_shape(ids.shape());
  if (ids.dtype() != DType::int32)
    throw Error(Errc::invalid_argument,
                name() + ": ids are " + std::string(to_string(ids.dtype())) + " (expected int32 token ids)");
  Tensor y = Tensor::empty({ids.dim(0), ids.dim(1), features_}, wte_.dtype(), ctx.allocator, ctx.stream);
  ops::vocab_shard_embedding(ids, wte_, wpe_, y, begin_, vocab_, rank_ == 0, ctx.stream);
  if (ctx.keep_for_backward) saved_[ctx.micro_batch] = ids;
  if (!sequence_parallel_) {
    comm_->all_reduce(rank_, y, y, ReduceOp::sum, ctx.stream);
    return y;
  }
  Tensor mine = Tensor::empty(shape, y.dtype(), ctx.allocator, ctx.stream);  // the rank's tokens
  comm_->reduce_scatter(rank_, y, mine, ReduceOp::sum, ctx.stream);
  return mine;
}

Tensor VocabParallelEmbedding::backward(Tensor const& dy, nn::Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end()) throw Error(Errc::invalid_argument, missing_forward(name(), ctx.micro_batch));
  Tensor const ids = std::move(it->second);
  saved_.erase(it);
  Tensor whole = dy;
  if (sequence_parallel_) {  // every token's gradient, from the ranks' tokens
    whole = Tensor::empty({ids.dim(0), ids.dim(1), features_}, dy.dtype(), ctx.allocator, ctx.stream);
    comm_->all_gather(rank_, dy, whole, ctx.stream);
  }
  ops::vocab_shard_embedding_backward(ids, whole, dwte_, dwpe_, begin_, vocab_, tied_ || ctx.accumulate_gradients,
                                      ctx.accumulate_gradients, ctx.stream);
  return {};
}

Shape VocabParallelEmbedding::output_shape(Shape const& input) const {
  if (input.size() != 2 || input[1] < 1 || input[1] > block_size_)
    throw Error(Errc::invalid_argument, name() + ": ids of shape " + to_string(input) +
                                            " (expected [B, T] with T <= " + std::to_string(block_size_) + ")");
  if (!sequence_parallel_) return {input[0], input[1], features_};
  std::int64_t const ranks = comm_->size();
  if (input[1] % ranks != 0)
    throw Error(Errc::invalid_argument,
                name() + ": ids of shape " + to_string(input) +
                    " with sequence parallelism (expected a sequence length T divisible by the " +
                    std::to_string(ranks) + " tensor-parallel ranks)");
  return {input[0], input[1] / ranks, features_};
}

VocabParallelLMHead::VocabParallelLMHead(std::int64_t vocab, std::int64_t features,
                                         std::shared_ptr<comm::Communicator> comm, int rank, bool reduce_input_gradient)
    : vocab_(vocab),
      features_(features),
      comm_(std::move(comm)),
      rank_(rank),
      reduce_input_gradient_(reduce_input_gradient) {
  std::string const text = "VocabParallelLMHead(" + std::to_string(vocab) + ", " + std::to_string(features) + ")";
  if (vocab < 1 || features < 1) throw Error(Errc::invalid_argument, text + " (expected sizes >= 1)");
  std::tie(begin_, end_) = vocab_shard(vocab, group_size(comm_.get(), text), rank);
}

std::string VocabParallelLMHead::name() const {
  return "VocabParallelLMHead(" + std::to_string(vocab_) + ", " + std::to_string(features_) + ", ids [" +
         std::to_string(begin_) + ", " + std::to_string(end_) + "))";
}

std::vector<std::pair<std::int64_t, std::int64_t>> VocabParallelLMHead::matrix_ranges() const {
  if (!holds_weight_) return {};
  return {{0, parameter_count()}};
}

void VocabParallelLMHead::bind(Tensor const& params, Tensor const& grads) {
  if (!holds_weight_) return;
  wte_ = params.reshape({end_ - begin_, features_});
  dwte_ = grads.reshape({end_ - begin_, features_});
}

void VocabParallelLMHead::initialize(std::mt19937_64& /*rng*/) {
  if (!holds_weight_) return;
  for (float& v : wte_.host_span<float>()) v = 0.0f;
}

std::unique_ptr<nn::Layer> VocabParallelLMHead::clone() const {
  auto copy = std::make_unique<VocabParallelLMHead>(vocab_, features_, comm_, rank_, reduce_input_gradient_);
  copy->holds_weight_ = holds_weight_;
  return copy;
}

void VocabParallelLMHead::link(nn::Sequential& model) {
  if (holds_weight_) return;
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (auto* embedding = dynamic_cast<VocabParallelEmbedding*>(&model.layer(i));
        embedding != nullptr && embedding->vocab() == vocab_ && embedding->features() == features_ &&
        embedding->vocab_begin() == begin_ && embedding->vocab_end() == end_) {
      embedding->set_tied(true);
      wte_ = embedding->token_weight();
      dwte_ = embedding->token_gradient();
      return;
    }
  }
  throw Error(Errc::invalid_argument, name() +
                                          ": no VocabParallelEmbedding of the same rows in its Sequential "
                                          "(expected the token embedding it is tied to in the same model)");
}

Tensor VocabParallelLMHead::forward(Tensor const& h, nn::Context& ctx) {
  Shape const shape = output_shape(h.shape());
  if (!wte_.defined())
    throw Error(Errc::invalid_argument,
                name() + ".forward before materialize (expected it linked to its VocabParallelEmbedding)");
  Tensor const h2 = h.reshape({h.numel() / features_, features_});
  Tensor logits = Tensor::empty({h2.dim(0), end_ - begin_}, h.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(h2, false, wte_, true, logits, 1.0f, 0.0f, ctx.stream);  // h wte_rᵀ
  if (ctx.keep_for_backward) saved_[ctx.micro_batch] = h2;
  return logits.reshape(shape);
}

Tensor VocabParallelLMHead::backward(Tensor const& dy, nn::Context& ctx) {
  auto const it = saved_.find(ctx.micro_batch);
  if (it == saved_.end()) throw Error(Errc::invalid_argument, missing_forward(name(), ctx.micro_batch));
  Tensor const h2 = std::move(it->second);
  saved_.erase(it);
  Tensor const dy2 = dy.reshape({h2.dim(0), end_ - begin_});
  Shape shape = dy.shape();
  shape.back() = features_;
  Tensor dh = Tensor::empty(shape, dy.dtype(), ctx.allocator, ctx.stream);
  ops::gemm(dy2, false, wte_, false, dh.reshape(h2.shape()), 1.0f, 0.0f, ctx.stream);  // dlogits_r wte_r
  if (reduce_input_gradient_) comm_->all_reduce(rank_, dh, dh, ReduceOp::sum, ctx.stream);
  ops::gemm(dy2, true, h2, false, dwte_, 1.0f, ctx.accumulate_gradients ? 1.0f : 0.0f, ctx.stream);  // dlogits_rᵀ h
  return dh;
}

Shape VocabParallelLMHead::output_shape(Shape const& input) const {
  if (input.size() < 2 || input.back() != features_)
    throw Error(Errc::invalid_argument, name() + ": input of shape " + to_string(input) + " (expected [B, T, " +
                                            std::to_string(features_) + "])");
  Shape out = input;
  out.back() = end_ - begin_;
  return out;
}

VocabParallelCrossEntropy::VocabParallelCrossEntropy(std::int64_t vocab, std::shared_ptr<comm::Communicator> comm,
                                                     int rank, std::int32_t ignore_index)
    : vocab_(vocab), comm_(std::move(comm)), rank_(rank), whole_(ignore_index) {
  std::tie(begin_, end_) =
      vocab_shard(vocab, group_size(comm_.get(), "VocabParallelCrossEntropy(" + std::to_string(vocab) + ")"), rank);
}

void VocabParallelCrossEntropy::check(Shape const& output, Tensor const& targets, std::string const& what) const {
  if (output.size() < 2 || output.back() != end_ - begin_)
    throw Error(Errc::invalid_argument, what + ": a model output of shape " + to_string(output) +
                                            " (expected the logits of token ids [" + std::to_string(begin_) + ", " +
                                            std::to_string(end_) + "), [B, T, " + std::to_string(end_ - begin_) +
                                            "] or [N, " + std::to_string(end_ - begin_) + "])");
  whole_.check(output, targets, what);
}

void VocabParallelCrossEntropy::check_values(Shape const& output, Tensor const& targets,
                                             std::string const& what) const {
  Shape whole = output;
  whole.back() = vocab_;
  whole_.check_values(whole, targets, what);
}

std::int64_t VocabParallelCrossEntropy::count(Tensor const& targets, Stream& stream) const {
  return whole_.count(targets, stream);
}

void VocabParallelCrossEntropy::compute(Tensor const& output, Tensor const& targets, Tensor const& doutput,
                                        Tensor const& loss, std::int64_t divisor, float grad_scale,
                                        Allocator& allocator, Stream& stream) const {
  if (divisor < 1)
    throw Error(Errc::invalid_argument, name() + ": a divisor of " + std::to_string(divisor) +
                                            " (expected the counted units of the whole batch, at least 1)");
  std::int64_t const rows = output.numel() / output.dim(output.rank() - 1);
  Tensor const max = Tensor::empty({rows}, DType::float32, allocator, stream);
  Tensor const sums = Tensor::empty({rows, 2}, DType::float32, allocator, stream);
  ops::vocab_shard_row_max(output, max, stream);
  comm_->all_reduce(rank_, max, max, ReduceOp::max, stream);
  ops::vocab_shard_row_sums(output, targets, max, sums, begin_, stream);
  comm_->all_reduce(rank_, sums, sums, ReduceOp::sum, stream);
  ops::vocab_shard_cross_entropy(output, targets, max, sums, doutput, loss, begin_, vocab_, static_cast<float>(divisor),
                                 stream, whole_.ignore_index(), grad_scale);
}

MakeLoss vocab_parallel_loss(nn::Sequential const& whole, std::string const& who) {
  auto const* head = whole.size() > 0 ? dynamic_cast<nn::TiedLMHead const*>(&whole.layer(whole.size() - 1)) : nullptr;
  if (head == nullptr)
    throw Error(Errc::invalid_argument,
                who + ": a model whose last layer is " +
                    (whole.size() > 0 ? whole.layer(whole.size() - 1).name() : std::string("missing")) +
                    " without a loss (expected an nn::TiedLMHead last, whose vocab-parallel logits "
                    "VocabParallelCrossEntropy takes, or a loss factory)");
  return [vocab = head->vocab()](std::shared_ptr<comm::Communicator> comm, int rank) {
    return std::make_unique<VocabParallelCrossEntropy>(vocab, std::move(comm), rank);
  };
}

}  // namespace mgpu::parallel
