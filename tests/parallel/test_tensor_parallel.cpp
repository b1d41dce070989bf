// Tensor parallelism (Megatron-style) for the GPT on host devices: 2 and 4 ranks give the
// one-device loss curve over 20 AdamW steps with clipping, and the gathered weights after them are
// the one device's; so are the gathered gradients of a step; the clipping norm counts replicated
// parameters once (an SGD step, whose update shows the clipping factor); each rank holds 1/T of
// the split matrices and of the vocab; a vocab the ranks do not divide, with ignored targets,
// gives the one device's gradients and losses; with dropout the losses are the one device's too,
// and recomputation changes no bit; data-parallel replicas of the tensor-parallel model (DP 2 x TP
// 2, uneven rows) give the one-device and the TP 2 loss curves and stay bitwise equal; bad splits
// and layouts are refused; a forward that no backward follows keeps nothing. Sequence parallelism:
// test_sequence_parallel.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/tp_fixture.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace par = mgpu::parallel;
using namespace mgpu::test::tp;

TEST_CASE("a tensor-parallel GPT trains as on one device over 2 and 4 ranks, clipping by the global norm",
          "[parallel][tensor]") {
  Env env;
  std::vector<Batch> batches;
  for (int s = 0; s < steps; ++s) batches.push_back(make_batch(env, static_cast<unsigned>(s)));
  REQUIRE(gradient_norm(env, batches[0]) > 2 * clip);  // the steps do clip

  auto const [want, want_weights] = one_device_curve(env, batches);
  REQUIRE(want.back() < 0.8 * want.front());  // it learns

  for (int const ranks : {2, 4}) {
    CAPTURE(ranks);
    mgpu::DeviceGroup group("host:" + std::to_string(ranks));
    par::TensorParallel tp(group, nn::gpt(config), {.seed = seed, .adamw = adamw, .clip_norm = clip});
    // Before any step the shards together are the one-device model materialized from the seed.
    nn::Sequential fresh = nn::gpt(config);
    fresh.materialize(env.ctx, seed);
    CHECK(tp.gather_parameters() == host_values(fresh.master_parameters()));
    double worst = 0;
    for (int s = 0; s < steps; ++s) {
      double const got =
          tp.step(batches[static_cast<std::size_t>(s)].ids, batches[static_cast<std::size_t>(s)].targets).loss;
      worst = std::max(worst, std::abs(got - want[static_cast<std::size_t>(s)]) / want[static_cast<std::size_t>(s)]);
    }
    CHECK(worst < 1e-5);
    // Measured: 1.7e-5 at worst, in attn_qkv (the key bias's gradient is 0 in exact arithmetic and
    // AdamW scales its rounding noise up to steps of its own), at most 5.4e-6 elsewhere; the
    // weights moved by up to 0.058.
    CHECK(worst_difference(tp.gather_parameters(), want_weights) < 5e-5);
    // The replicated parameters stay bitwise equal on every rank.
    for (int r = 1; r < ranks; ++r) {
      nn::Sequential const& shard = tp.shard(r);
      auto const mine = shard.master_parameters().host_span<float>();
      auto const first = tp.shard(0).master_parameters().host_span<float>();
      for (nn::ParameterRange const& range : shard.parameter_ranges()) {
        std::vector<std::pair<std::int64_t, std::int64_t>> split;
        if (auto const* sharded = dynamic_cast<par::ShardedLayer const*>(&shard.layer(range.layer)))
          split = sharded->split_ranges();
        for (std::int64_t i = 0; i < range.size(); ++i) {
          bool const is_split =
              std::any_of(split.begin(), split.end(), [&](auto const& s) { return i >= s.first && i < s.second; });
          auto const k = static_cast<std::size_t>(range.begin + i);
          if (!is_split && mine[k] != first[k])
            FAIL("rank " << r << " element " << k << ": " << mine[k] << " != " << first[k]);
        }
      }
    }
  }
}

TEST_CASE(
    "with dropout a tensor-parallel GPT drops what one device drops: the same losses over 2 and 4 ranks, "
    "and over DP 2 x TP 2",
    "[parallel][tensor]") {
  // The embedding's and the residual branches' dropout (replicated) draw one mask on every rank,
  // the attention probabilities' dropout each rank's heads' part of the whole mask.
  nn::GptConfig dropped = config;
  dropped.dropout = 0.2f;
  Env env;
  std::vector<Batch> batches;
  for (int s = 0; s < 8; ++s) batches.push_back(make_batch(env, static_cast<unsigned>(40 + s)));
  auto const one_device = [&](nn::GptConfig const& c) {
    return mgpu::test::gpt_one_device_curve(env, c, seed, adamw, clip, batches).losses;
  };
  std::vector<double> const want = one_device(dropped), undropped = one_device(config);
  REQUIRE(std::abs(want[0] - undropped[0]) > 1e-3 * undropped[0]);  // the dropout changes the loss

  for (int const ranks : {2, 4}) {
    CAPTURE(ranks);
    mgpu::DeviceGroup group("host:" + std::to_string(ranks));
    par::TensorParallel tp(group, nn::gpt(dropped), {.seed = seed, .adamw = adamw, .clip_norm = clip});
    double worst = 0;
    for (std::size_t s = 0; s < batches.size(); ++s)
      worst = std::max(worst, std::abs(tp.step(batches[s].ids, batches[s].targets).loss - want[s]) / want[s]);
    CHECK(worst < 1e-5);
    // The replicated parameters stay bitwise equal on every rank (their gradients went through
    // the same masks).
    auto const first = tp.shard(0).master_parameters().host_span<float>();
    for (int r = 1; r < ranks; ++r) {
      nn::Sequential const& shard = tp.shard(r);
      auto const mine = shard.master_parameters().host_span<float>();
      for (nn::ParameterRange const& range : shard.parameter_ranges()) {
        std::vector<std::pair<std::int64_t, std::int64_t>> split;
        if (auto const* sharded = dynamic_cast<par::ShardedLayer const*>(&shard.layer(range.layer)))
          split = sharded->split_ranges();
        for (std::int64_t i = 0; i < range.size(); ++i) {
          bool const is_split =
              std::any_of(split.begin(), split.end(), [&](auto const& sp) { return i >= sp.first && i < sp.second; });
          auto const k = static_cast<std::size_t>(range.begin + i);
          if (!is_split && mine[k] != first[k])
            FAIL("rank " << r << " element " << k << ": " << mine[k] << " != " << first[k]);
        }
      }
    }
  }
  // Data-parallel replicas (DP 2 x TP 2) drop what one device drops on their rows too (each
  // replica's dropout starts at its first row's offset in the batch).
  mgpu::DeviceGroup group("host:4");
  par::TensorParallel grid(group, nn::gpt(dropped), {.seed = seed, .adamw = adamw, .clip_norm = clip, .data_parallel = 2});
  double worst = 0;
  for (std::size_t s = 0; s < batches.size(); ++s)
    worst = std::max(worst, std::abs(grid.step(batches[s].ids, batches[s].targets).loss - want[s]) / want[s]);
  CHECK(worst < 1e-5);
}

TEST_CASE("tensor-parallel recomputation, selective and full, gives the losses and weights of none bit for bit",
          "[parallel][tensor]") {
  // With dropout, so the full rerun must replay the masks (its dropout count and row offset).
  Env env;
  std::vector<Batch> batches;
  for (int s = 0; s < 4; ++s) batches.push_back(make_batch(env, static_cast<unsigned>(60 + s)));
  mgpu::DeviceGroup group("host:2");
  auto const run = [&](nn::Recompute recompute) {
    nn::GptConfig c = config;
    c.dropout = 0.2f;
    c.recompute = recompute;
    par::TensorParallel tp(group, nn::gpt(c), {.seed = seed, .adamw = adamw, .clip_norm = clip});
    std::vector<double> losses;
    for (Batch const& b : batches) losses.push_back(tp.step(b.ids, b.targets).loss);
    // Nothing kept past the step.
    for (int r = 0; r < 2; ++r)
      for (std::size_t l = 0; l < tp.shard(r).size(); ++l) CHECK(tp.shard(r).layer(l).saved_micro_batches() == 0);
    return std::pair{losses, tp.gather_parameters()};
  };
  auto const none = run(nn::Recompute::none);
  for (nn::Recompute const recompute : {nn::Recompute::selective, nn::Recompute::full}) {
    CAPTURE(nn::to_string(recompute));
    auto const got = run(recompute);
    CHECK(got.first == none.first);
    CHECK(got.second == none.second);
  }
}

TEST_CASE("tensor-parallel gradients gathered from the shards are the one device's", "[parallel][tensor]") {
  Env env;
  Batch const b = make_batch(env, 11);
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed);
  mgpu::optim::SGD sgd({.lr = 0.0f});
  nn::train_step(model, sgd, b.ids, b.targets, nn::TokenCrossEntropy{}, env.ctx);
  env.stream.synchronize();
  std::vector<float> const want = host_values(model.master_gradients());

  mgpu::DeviceGroup group("host:2");
  par::TensorParallel tp(group, nn::gpt(config), {.seed = seed, .adamw = adamw});
  tp.step(b.ids, b.targets, 0.0f);  // AdamW at lr 0 leaves the weights as they are
  std::vector<float> const got = gathered_gradients(tp, model);
  double scale = 0;
  for (float const g : want) scale = std::max(scale, std::abs(static_cast<double>(g)));
  REQUIRE(scale > 1e-3);
  // Every element written (no NaN left) and equal up to summation order (measured: 2.4e-7 of the
  // largest gradient).
  CHECK(std::none_of(got.begin(), got.end(), [](float g) { return std::isnan(g); }));
  CHECK(worst_difference(got, want) < 2e-6 * scale);
}

TEST_CASE(
    "a vocab the ranks do not divide: uneven vocab shards, ignored targets, the one device's gradients and losses",
    "[parallel][tensor]") {
  // 67 ids over 4 ranks: [0, 16), [16, 33), [33, 50), [50, 67); every rank sees only its logits.
  nn::GptConfig odd = config;
  odd.vocab = 67;
  Env env;
  std::vector<Batch> const batches = mgpu::test::rule_batches(env, 6, batch, odd, 300);
  for (std::size_t s = 0; s < batches.size(); ++s) {
    auto const t = batches[s].targets.host_span<std::int32_t>();
    for (std::size_t i = s; i < t.size(); i += 7) t[i] = -100;  // ignored
  }
  mgpu::test::OneDeviceGpt one(env, odd, seed, adamw);
  std::vector<float> grads;
  std::vector<double> want;
  for (Batch const& b : batches) {
    want.push_back(one.step(b, 0.0f));
    if (grads.empty()) grads = host_values(one.model.master_gradients());
  }

  mgpu::DeviceGroup group("host:4");
  par::TensorParallel tp(group, nn::gpt(odd), {.seed = seed, .adamw = adamw});
  std::int64_t const firsts[] = {0, 16, 33, 50, 67};
  for (int r = 0; r < 4; ++r) {
    CHECK(par::vocab_shard(odd.vocab, 4, r) == std::pair{firsts[r], firsts[r + 1]});
    CHECK(tp.shard(r).output_shape({batch, odd.block_size}) ==
          mgpu::Shape{batch, odd.block_size, firsts[r + 1] - firsts[r]});
  }
  double worst = 0;
  for (std::size_t s = 0; s < batches.size(); ++s) {
    worst = std::max(worst, std::abs(tp.step(batches[s].ids, batches[s].targets).loss - want[s]) / want[s]);
    if (s > 0) continue;
    // The first step's gradients, gathered from the shards (the embedding's rows from each rank).
    std::vector<float> const got = gathered_gradients(tp, one.model);
    double scale = 0;
    for (float const g : grads) scale = std::max(scale, std::abs(static_cast<double>(g)));
    CHECK(std::none_of(got.begin(), got.end(), [](float g) { return std::isnan(g); }));
    CHECK(worst_difference(got, grads) < 2e-6 * scale);
  }
  CHECK(worst < 1e-5);
}

TEST_CASE("tensor-parallel clipping counts replicated parameters once and split ones on every rank",
          "[parallel][tensor]") {
  // With SGD the update is lr * clip / norm * g: a norm that counted replicated parameters on
  // every rank, or split ones on one rank only, would move the weights by another amount.
  Env env;
  Batch const b = make_batch(env, 7);
  float const sgd_clip = 0.1f;
  REQUIRE(gradient_norm(env, b) > 2 * sgd_clip);
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed);
  mgpu::optim::SGD sgd({.lr = 1.0f});
  nn::train_step(model, sgd, b.ids, b.targets, nn::TokenCrossEntropy{}, env.ctx, {.clip_norm = sgd_clip});
  env.stream.synchronize();
  std::vector<float> const want = host_values(model.master_parameters());

  nn::Sequential fresh = nn::gpt(config);
  fresh.materialize(env.ctx, seed);
  double const moved = worst_difference(want, host_values(fresh.master_parameters()));
  REQUIRE(moved > 1e-3);  // the step moved the weights by far more than the tolerance below

  mgpu::DeviceGroup group("host:2");
  par::TensorParallel tp(group, nn::gpt(config),
                         {.seed = seed,
                          .optimizer =
                              [](nn::Sequential const&) {
                                return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 1.0f});
                              },
                          .clip_norm = sgd_clip});
  tp.step(b.ids, b.targets);
  CHECK(worst_difference(tp.gather_parameters(), want) < 1e-6);
}

TEST_CASE("each tensor-parallel rank holds 1/T of the split matrices, and scattered weights give their loss",
          "[parallel][tensor]") {
  Env env;
  mgpu::DeviceGroup group("host:4");
  par::TensorParallel tp(group, nn::gpt(config), {.seed = seed});
  std::int64_t const c = config.n_embd, v = config.vocab, p = config.block_size;
  std::int64_t const split = 3 * c * c + 3 * c + c * c + 4 * c * c + 4 * c + 4 * c * c;  // per block
  std::int64_t const replicated = p * c + config.n_layer * (2 * c + c + 2 * c + c) + 2 * c;
  // The token embedding (and the tied head) split by vocab rows: 16 of the 64 ids per rank.
  for (int r = 0; r < 4; ++r)
    CHECK(tp.shard(r).parameter_count() == replicated + config.n_layer * split / 4 + v / 4 * c);
  CHECK(nn::gpt(config).parameter_count() == replicated + config.n_layer * split + v * c);

  // Another seed's weights scattered into the shards: gathered back unchanged, and the loss of
  // the one-device model holding them.
  nn::Sequential other = nn::gpt(config);
  other.materialize(env.ctx, seed + 1);
  std::vector<float> const weights = host_values(other.master_parameters());
  tp.scatter_parameters(weights);
  CHECK(tp.gather_parameters() == weights);
  Batch const b = make_batch(env, 3);
  mgpu::optim::SGD sgd({.lr = 0.0f});
  double const want =
      mgpu::ops::item(nn::train_step(other, sgd, b.ids, b.targets, nn::TokenCrossEntropy{}, env.ctx).loss, env.stream);
  CHECK(tp.step(b.ids, b.targets, 0.0f).loss == Approx(want).epsilon(1e-6));
  REQUIRE_MGPU_ERROR(tp.scatter_parameters(std::span<float const>(weights).first(10)), mgpu::Errc::invalid_argument,
                     "10 values (expected the whole model's");
}

TEST_CASE(
    "data-parallel replicas of a tensor-parallel GPT (DP 2 x TP 2) train as one device and as TP 2, "
    "staying bitwise equal",
    "[parallel][tensor]") {
  // A batch of 3 rows: replica 0 takes two rows, replica 1 one, and the loss is still the mean over
  // the whole batch's tokens.
  Env env;
  std::vector<Batch> batches;
  for (int s = 0; s < steps; ++s) batches.push_back(make_batch(env, static_cast<unsigned>(s)));
  REQUIRE(gradient_norm(env, batches[0]) > 2 * clip);  // the steps do clip
  auto const [want, want_weights] = one_device_curve(env, batches);

  mgpu::DeviceGroup pair("host:2");
  par::TensorParallel tp(pair, nn::gpt(config), {.seed = seed, .adamw = adamw, .clip_norm = clip});
  mgpu::DeviceGroup group("host:4");
  par::TensorParallel grid(group, nn::gpt(config), {.seed = seed, .adamw = adamw, .clip_norm = clip, .data_parallel = 2});
  CHECK(grid.data_parallel() == 2);
  CHECK(grid.tensor_parallel() == 2);
  double worst = 0, worst_tp = 0;
  for (int s = 0; s < steps; ++s) {
    Batch const& b = batches[static_cast<std::size_t>(s)];
    double const got = grid.step(b.ids, b.targets).loss;
    double const whole = tp.step(b.ids, b.targets).loss;
    worst = std::max(worst, std::abs(got - want[static_cast<std::size_t>(s)]) / want[static_cast<std::size_t>(s)]);
    worst_tp = std::max(worst_tp, std::abs(got - whole) / whole);
  }
  CHECK(worst < 1e-5);
  CHECK(worst_tp < 1e-5);
  std::vector<float> const got_weights = grid.gather_parameters();
  CHECK(worst_difference(got_weights, want_weights) < 5e-5);
  CHECK(worst_difference(got_weights, tp.gather_parameters()) < 5e-5);
  // Replica 1's shards hold bitwise replica 0's parameters (split and replicated alike).
  for (int t = 0; t < 2; ++t) {
    CAPTURE(t);
    CHECK(host_values(grid.shard(2 + t).master_parameters()) == host_values(grid.shard(t).master_parameters()));
  }
}

TEST_CASE("a data-parallel count that does not divide the group, or a batch with fewer rows than replicas, is refused",
          "[parallel][tensor]") {
  mgpu::DeviceGroup four("host:4");
  REQUIRE_MGPU_ERROR(
      par::TensorParallel(four, nn::gpt(config), {.data_parallel = 3}), mgpu::Errc::invalid_argument,
      "data_parallel 3 over a group of 4 devices (expected a replica count >= 1 dividing the group size)");
  REQUIRE_MGPU_ERROR(par::TensorParallel(four, nn::gpt(config), {.data_parallel = 0}), mgpu::Errc::invalid_argument,
                     "data_parallel 0 over a group of 4 devices");
  Env env;
  par::TensorParallel replicas(four, nn::gpt(config), {.seed = seed, .data_parallel = 4});
  Batch const b = make_batch(env, 0);
  REQUIRE_MGPU_ERROR(replicas.step(b.ids, b.targets), mgpu::Errc::invalid_argument,
                     "a batch of 3 rows over 4 data-parallel replicas (expected at least one row per replica)");
}

TEST_CASE("a tensor-parallel split that does not divide the heads, or a vocab below the ranks, is refused",
          "[parallel][tensor]") {
  mgpu::DeviceGroup three("host:3");
  REQUIRE_MGPU_ERROR(par::TensorParallel(three, nn::gpt(config)), mgpu::Errc::invalid_argument,
                     "TensorParallelBlock(32 features, 4 heads, 3 ranks) (expected heads dividing the features and "
                     "the ranks dividing the heads)");
  mgpu::DeviceGroup four("host:4");
  nn::GptConfig tiny_vocab = config;
  tiny_vocab.vocab = 3;
  REQUIRE_MGPU_ERROR(par::TensorParallel(four, nn::gpt(tiny_vocab)), mgpu::Errc::invalid_argument,
                     "a vocab of 3 over 4 tensor-parallel ranks (expected at least one token id per rank)");
  mgpu::DeviceGroup two("host:2");
  mgpu::optim::AdamWOptions decayed = adamw;
  decayed.decay_ranges = nn::gpt_decay_ranges(config);
  REQUIRE_MGPU_ERROR(par::TensorParallel(two, nn::gpt(config), {.adamw = decayed}), mgpu::Errc::invalid_argument,
                     "(expected none: each rank decays its shard's 2-D weights)");
}

TEST_CASE("Tensor-parallel shards keep nothing for backward in a forward that none follows", "[parallel][tensor][memory]") {
  nn::GptConfig const small{.vocab = 30, .block_size = 8, .n_layer = 2, .n_head = 4, .n_embd = 32};
  for (bool const sequence : {false, true})
    for (nn::Recompute const recompute : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
      INFO("sequence parallel " << sequence << ", recompute " << nn::to_string(recompute));
      nn::GptConfig c = small;
      c.recompute = recompute;
      mgpu::DeviceGroup group("host:2");
      std::shared_ptr<mgpu::comm::Communicator> const comm = mgpu::comm::make_communicator(group);
      std::vector<nn::Sequential> shards;
      for (int r = 0; r < 2; ++r)
        shards.push_back(par::parallelize(nn::gpt(c), {.sequence_parallel = sequence}, comm, r));
      std::vector<Tensor> ids;  // the same ids on each rank's device
      for (int r = 0; r < 2; ++r) {
        ids.push_back(Tensor::empty({2, c.block_size}, DType::int32, group.allocator(r)));
        auto const span = ids.back().host_span<std::int32_t>();
        for (std::size_t i = 0; i < span.size(); ++i) span[i] = static_cast<std::int32_t>(i * 7 % 30);
      }
      std::vector<std::size_t> before(2);
      group.run([&](int r, mgpu::Device, mgpu::Stream& stream) {
        nn::Context ctx{group.allocator(r), stream};
        shards[static_cast<std::size_t>(r)].materialize(ctx, 3);
        stream.synchronize();
        before[static_cast<std::size_t>(r)] = group.allocator(r).stats().allocated;
      });
      // A forward on both ranks (their collectives meet), keeping for backward or not; then each
      // rank's saved micro-batches and allocated bytes.
      auto const forward = [&](bool keep) {
        std::vector<std::size_t> saved(2), allocated(2);
        group.run([&](int r, mgpu::Device, mgpu::Stream& stream) {
          nn::Context ctx{group.allocator(r), stream, 0, 0, false, keep};
          (void)shards[static_cast<std::size_t>(r)].forward(ids[static_cast<std::size_t>(r)], ctx);
          stream.synchronize();
          for (std::size_t l = 0; l < shards[static_cast<std::size_t>(r)].size(); ++l)
            saved[static_cast<std::size_t>(r)] += shards[static_cast<std::size_t>(r)].layer(l).saved_micro_batches();
          allocated[static_cast<std::size_t>(r)] = group.allocator(r).stats().allocated;
        });
        return std::make_pair(saved, allocated);
      };
      auto const [none, none_bytes] = forward(false);
      CHECK(none == std::vector<std::size_t>{0, 0});
      CHECK(none_bytes == before);
      // A training forward keeps them: the checks above can tell.
      auto const [kept, kept_bytes] = forward(true);
      CHECK(kept[0] > 0);
      CHECK(kept_bytes[0] > before[0]);
    }
}
