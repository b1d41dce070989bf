// Activation recomputation (nn::Recompute): the gradients and losses equal the no-recompute run's
// bit for bit (one device with micro-batches in flight and dropout, the split backward, data
// parallel, a zero-bubble pipeline), and the allocator's peak shows what it saves.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Errc;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::random_ids;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

namespace {

nn::GptConfig with(nn::GptConfig config, nn::Recompute recompute) {
  config.recompute = recompute;
  return config;
}

std::size_t saved(nn::Sequential const& model) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < model.size(); ++i) n += model.layer(i).saved_micro_batches();
  return n;
}

nn::Recompute const recomputing[] = {nn::Recompute::selective, nn::Recompute::full};

}  // namespace

TEST_CASE(
    "activation recomputation: the gradients of the no-recompute run, bit for bit, with dropout and "
    "micro-batches in flight",
    "[nn][gpt][recompute]") {
  Env env;
  nn::GptConfig const config{.vocab = 29, .block_size = 8, .n_layer = 3, .n_head = 2, .n_embd = 16, .dropout = 0.2f};
  Tensor const ids = random_ids(env, {4, 8}, config.vocab, 1);
  Tensor const dy = env.random({4, 8, config.vocab}, 2);
  // Two micro-batches (rows 0-1 and 2-3) forward, then backward in reverse order, accumulated, so
  // a rerun forward must replay its own dropout masks after the other micro-batch's forward
  // advanced the count; `split`: backward_input of both, then backward_weight of both.
  auto const run = [&](nn::Recompute recompute, bool split) {
    nn::Sequential model = nn::gpt(with(config, recompute));
    model.materialize(env.ctx, 5);
    model.zero_gradients(env.stream);
    std::vector<Tensor> logits;
    for (std::int64_t m = 0; m < 2; ++m) {
      nn::Context ctx{*env.allocator, env.stream, 2 * m, m, true};
      logits.push_back(model.forward(ids.slice(2 * m, 2 * m + 2), ctx));
    }
    for (std::int64_t m = 2; m-- > 0;) {
      nn::Context ctx{*env.allocator, env.stream, 2 * m, m, true};
      if (split)
        (void)model.backward_input(dy.slice(2 * m, 2 * m + 2), ctx, false);
      else
        (void)model.backward(dy.slice(2 * m, 2 * m + 2), ctx, false);
    }
    for (std::int64_t m = 0; split && m < 2; ++m) {
      nn::Context ctx{*env.allocator, env.stream, 2 * m, m, true};
      model.backward_weight(ctx);
    }
    env.stream.synchronize();
    CHECK(saved(model) == 0);  // nothing left behind
    std::vector<double> out = as_double(logits[0]);
    for (double const v : as_double(logits[1])) out.push_back(v);
    return std::pair{out, as_double(model.gradients())};
  };
  for (bool const split : {false, true}) {
    CAPTURE(split);
    auto const [logits, grads] = run(nn::Recompute::none, split);
    for (nn::Recompute const recompute : recomputing) {
      CAPTURE(nn::to_string(recompute));
      auto const [got_logits, got_grads] = run(recompute, split);
      CHECK(got_logits == logits);
      CHECK(got_grads == grads);
    }
  }
}

TEST_CASE("activation recomputation: the same losses and weights data parallel and through a zero-bubble pipeline",
          "[nn][gpt][recompute][parallel]") {
  Env env;
  nn::GptConfig const config{.vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  mgpu::optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
  auto const loss = std::make_shared<nn::TokenCrossEntropy const>();
  std::vector<std::pair<Tensor, Tensor>> batches;
  for (unsigned s = 0; s < 3; ++s)
    batches.emplace_back(random_ids(env, {6, 8}, config.vocab, 10 + s), random_ids(env, {6, 8}, config.vocab, 20 + s));

  SECTION("data parallel over host:2") {
    auto const run = [&](nn::Recompute recompute) {
      mgpu::DeviceGroup group("host:2");
      mgpu::parallel::DataParallel dp(nn::gpt(with(config, recompute)), group, mgpu::optim::AdamW(adamw),
                                      {.seed = 3, .clip_norm = 0.5f, .loss = loss});
      std::vector<double> losses;
      for (auto const& [x, y] : batches) losses.push_back(dp.step(x, y).loss);
      group.synchronize();
      return std::pair{losses, as_double(dp.replica(1).master_parameters())};
    };
    auto const [losses, weights] = run(nn::Recompute::none);
    for (nn::Recompute const recompute : recomputing) {
      CAPTURE(nn::to_string(recompute));
      auto const [got_losses, got_weights] = run(recompute);
      CHECK(got_losses == losses);
      CHECK(got_weights == weights);
    }
  }
  SECTION("ZB-H1 over 2 stages, 4 micro-batches (backward_input and backward_weight apart)") {
    auto const run = [&](nn::Recompute recompute) {
      mgpu::DeviceGroup group("host:2");
      nn::Sequential const model = nn::gpt(with(config, recompute));  // Embedding, Dropout, 2 blocks, LayerNorm, head
      pp::Executor ex(model, group, {0, 3, 6}, pp::zero_bubble_h1(2, 4),
                      [&] { return std::make_unique<mgpu::optim::AdamW>(adamw); },
                      {.seed = 3, .clip_norm = 0.5f, .loss = loss});
      std::vector<double> losses;
      for (auto const& [x, y] : batches) losses.push_back(ex.step(x, y));
      group.synchronize();
      std::vector<double> weights = as_double(ex.chunk(0).master_parameters());
      for (double const w : as_double(ex.chunk(1).master_parameters())) weights.push_back(w);
      return std::pair{losses, weights};
    };
    auto const [losses, weights] = run(nn::Recompute::none);
    for (nn::Recompute const recompute : recomputing) {
      CAPTURE(nn::to_string(recompute));
      auto const [got_losses, got_weights] = run(recompute);
      CHECK(got_losses == losses);
      CHECK(got_weights == weights);
    }
  }
}

// The measured quantities, in allocator bytes (block sizes) on one device, for a GPT of n blocks
// running one forward and backward (dlogits given) from a base of
// parameters, gradients, ids and dlogits:
//   stored(mode) = allocated after forward - base: what forward leaves for backward (and the logits);
//   peak(mode)   = the peak of allocated over forward and backward - base;
//   block activations S = stored(none) - stored(full): what the n blocks keep beyond their inputs
//                  (full keeps only those).
// Full recomputation holds one block's activations at a time, so it must cut the peak by at least
// (n - 1) / n of S (measured: exactly that, as the rerun holds what that block's forward held);
// selective lies strictly in between.
TEST_CASE(
    "activation recomputation: full cuts the peak by at least (n_layer - 1) / n_layer of the stored block "
    "activations, selective by less",
    "[nn][gpt][recompute][memory]") {
  Env env;
  nn::GptConfig const config{.vocab = 64, .block_size = 32, .n_layer = 4, .n_head = 4, .n_embd = 64};
  Tensor const ids = random_ids(env, {4, 32}, config.vocab, 3);
  Tensor const dy = env.random({4, 32, config.vocab}, 4);
  struct Measured {
    double stored, peak;
  };
  auto const measure = [&](nn::Recompute recompute) {
    nn::Sequential model = nn::gpt(with(config, recompute));
    model.materialize(env.ctx, 1);
    env.stream.synchronize();
    // The ops run on the stream's worker, behind this thread: the allocator counts a temporary for
    // as long as the code holds it (blocks are reused in stream order), however far behind the work
    // is, so the peak does not depend on the worker's timing.
    auto const base = static_cast<double>(env.allocator->stats().allocated);
    env.allocator->reset_peak();
    double stored = 0;
    {
      Tensor const logits = model.forward(ids, env.ctx);
      env.stream.synchronize();
      stored = static_cast<double>(env.allocator->stats().allocated) - base;
    }
    (void)model.backward(dy, env.ctx, false);
    env.stream.synchronize();
    return Measured{stored, static_cast<double>(env.allocator->stats().peak_allocated) - base};
  };
  Measured const none = measure(nn::Recompute::none);
  Measured const selective = measure(nn::Recompute::selective);
  Measured const full = measure(nn::Recompute::full);
  double const blocks = none.stored - full.stored;
  double const n = static_cast<double>(config.n_layer);
  WARN("stored bytes none " << none.stored << ", selective " << selective.stored << ", full " << full.stored
                            << "; peak bytes none " << none.peak << ", selective " << selective.peak << ", full "
                            << full.peak << "; block activations " << blocks);
  CHECK(blocks > 0);
  CHECK(none.peak - full.peak >= (n - 1) / n * blocks);
  CHECK(selective.stored < none.stored);
  CHECK(selective.stored > full.stored);
  CHECK(selective.peak < none.peak);
  CHECK(selective.peak > full.peak);
}

TEST_CASE("activation recomputation: a backward without its forward, and a bad restored input, throw mgpu::Error",
          "[nn][gpt][recompute]") {
  Env env;
  for (nn::Recompute const recompute : recomputing) {
    CAPTURE(nn::to_string(recompute));
    nn::Sequential model;
    model.add(std::make_unique<nn::TransformerBlock>(8, 2, 0.0f, 0.02f, recompute));
    model.materialize(env.ctx, 1);
    REQUIRE_MGPU_ERROR(model.backward(env.random({1, 3, 8}, 1), env.ctx), Errc::invalid_argument,
                       "for micro-batch 0 (expected a forward of that micro-batch");
  }
  nn::Sequential model;
  model.add(std::make_unique<nn::Linear>(4, 3));
  model.materialize(env.ctx, 1);
  auto& linear = static_cast<nn::Linear&>(model.layer(0));
  (void)linear.forward(env.random({2, 4}, 1), env.ctx);
  linear.release_input(env.ctx);
  REQUIRE_MGPU_ERROR(linear.backward(env.random({2, 3}, 2), env.ctx), Errc::invalid_argument,
                     "after release_input (expected restore_input first)");
  REQUIRE_MGPU_ERROR(linear.restore_input(env.random({2, 3}, 3), env.ctx), Errc::invalid_argument, "[..., 4]");
}
