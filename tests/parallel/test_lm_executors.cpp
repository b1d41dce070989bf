// Language-model training through every executor and every nn::Loss: a small GPT over 20 AdamW
// steps with clipping gives the one-device loss curve data parallel (even and uneven shards),
// pipelined (1F1B and interleaved, the tied LM head in another stage than its embedding) and on a
// data x pipeline grid; per-token cross-entropy with ignored targets and mean squared error give
// the global batch's mean (against float64 references) however the batch is split.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::worst_relative;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

namespace {

nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
std::uint64_t const seed = 3;
std::int64_t const batch = 7;  // uneven over 2 and 3 devices and over micro-batches
int const steps = 20;
float const clip = 0.5f;  // below the gradients' norm (checked below), so steps clip
mgpu::optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};

using Batch = mgpu::test::TokenBatch;

// Sequences that follow a rule (mgpu::test::rule_batch), so the loss falls.
Batch make_batch(Env& env, unsigned draw, std::int32_t ignore_every = 0) {
  std::int64_t const t = config.block_size;
  Batch b = mgpu::test::rule_batch(env, batch, t, config.vocab, 100 + draw);
  auto targets = b.targets.host_span<std::int32_t>();
  // Ignored targets, unevenly spread: every ignore_every-th token, and all of the last row's.
  if (ignore_every > 0) {
    for (std::size_t i = 0; i < targets.size(); ++i) {
      if (i % static_cast<std::size_t>(ignore_every) == 0 || i >= static_cast<std::size_t>((batch - 1) * t))
        targets[i] = -100;
    }
  }
  return b;
}

std::vector<Batch> make_batches(Env& env) {
  std::vector<Batch> batches;
  for (int s = 0; s < steps; ++s) batches.push_back(make_batch(env, static_cast<unsigned>(s)));
  return batches;
}

// The one-device loss curve (train_step with TokenCrossEntropy, AdamW, clipping).
std::vector<double> one_device_curve(Env& env, std::vector<Batch> const& batches) {
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed);
  mgpu::optim::AdamW opt(adamw);
  nn::TokenCrossEntropy const loss;
  std::vector<double> curve;
  for (Batch const& b : batches)
    curve.push_back(mgpu::ops::item(
        nn::train_step(model, opt, b.ids, b.targets, loss, env.ctx, {.clip_norm = clip}).loss, env.stream));
  return curve;
}


// Measured worst relative difference of a 20-step curve from the one device's: 1.1e-7 for every
// executor (summation orders differ: shards, micro-batches, the tied gradient summed across
// stages); the bound leaves room for other kernels' orders.
double const curve_tolerance = 1e-5;

pp::OptimizerFactory adamw_factory() {
  return [] { return std::make_unique<mgpu::optim::AdamW>(adamw); };
}

// The float64 mean per-token cross-entropy of logits [B, T, V] over targets not ignored.
double token_ce_reference(Tensor const& logits, Tensor const& targets) {
  std::vector<double> const l = as_double(logits);
  auto const t = targets.host_span<std::int32_t>();
  auto const v = static_cast<std::size_t>(config.vocab);
  double sum = 0;
  std::int64_t counted = 0;
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i] == -100) continue;
    double max = -INFINITY;
    for (std::size_t j = 0; j < v; ++j) max = std::max(max, l[i * v + j]);
    double z = 0;
    for (std::size_t j = 0; j < v; ++j) z += std::exp(l[i * v + j] - max);
    sum += std::log(z) + max - l[i * v + static_cast<std::size_t>(t[i])];
    ++counted;
  }
  return sum / static_cast<double>(counted);
}

}  // namespace

TEST_CASE("a GPT trains as on one device data parallel, pipelined and on a data x pipeline grid",
          "[parallel][gpt][loss]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  std::vector<double> const want = one_device_curve(env, batches);
  CHECK(want.back() < 0.8 * want.front());  // it learns
  auto const token_ce = std::make_shared<nn::TokenCrossEntropy const>();

  for (int const devices : {2, 3}) {
    CAPTURE(devices);
    mgpu::DeviceGroup group("host:" + std::to_string(devices));
    mgpu::parallel::DataParallel dp(nn::gpt(config), group, mgpu::optim::AdamW(adamw),
                                    {.seed = seed, .clip_norm = clip, .loss = token_ce});
    std::vector<double> got;
    for (Batch const& b : batches) got.push_back(dp.step(b.ids, b.targets).loss);
    double const worst = worst_relative(got, want);
    WARN("data parallel over host:" << devices << ": worst relative loss difference " << worst);
    CHECK(worst <= curve_tolerance);
  }

  nn::Sequential const model = nn::gpt(config);  // Embedding, Dropout, 2 blocks, LayerNorm, head
  struct Pipelined {
    std::string name;
    pp::Schedule schedule;
    std::vector<std::size_t> cuts;
    int data_parallel;
  };
  std::vector<Pipelined> const runs{
      {"1f1b over 2 stages", pp::one_f_one_b(2, 3), {0, 3, 6}, 1},
      {"interleaved, 2 devices x 2 chunks", pp::interleaved_one_f_one_b(2, 2, 4), {0, 2, 3, 4, 6}, 1},
      {"2 replicas x 1f1b over 2 stages", pp::one_f_one_b(2, 2), {0, 3, 6}, 2},
  };
  for (Pipelined const& run : runs) {
    CAPTURE(run.name);
    mgpu::DeviceGroup group("host:" + std::to_string(run.schedule.devices * run.data_parallel));
    pp::Executor ex(model, group, run.cuts, run.schedule, adamw_factory(),
                    {.seed = seed, .data_parallel = run.data_parallel, .clip_norm = clip, .loss = token_ce});
    int const last = ex.schedule().chunks() - 1;
    auto const* head = dynamic_cast<nn::TiedLMHead const*>(&ex.chunk(last).layer(ex.chunk(last).size() - 1));
    REQUIRE(head != nullptr);
    CHECK(head->holds_weight());
    std::vector<double> got;
    for (Batch const& b : batches) got.push_back(ex.step(b.ids, b.targets));
    double const worst = worst_relative(got, want);
    WARN(run.name << ": worst relative loss difference " << worst);
    CHECK(worst <= curve_tolerance);
    // The first stage's wte and the last stage's copy took the same updates: still equal, bit for bit.
    group.synchronize();
    auto const elements = config.vocab * config.n_embd;
    for (int r = 0; r < run.data_parallel; ++r) {
      std::vector<double> const wte = as_double(ex.chunk(0, r).master_parameters().slice(0, elements));
      std::vector<double> const copy = as_double(ex.chunk(last, r).master_parameters().slice(
          ex.chunk(last, r).parameter_count() - elements, ex.chunk(last, r).parameter_count()));
      CHECK(wte == copy);
    }
  }
}

TEST_CASE("per-token cross-entropy with ignored targets is the global mean over counted tokens on any split",
          "[parallel][gpt][loss]") {
  Env env;
  Batch const b = make_batch(env, 7, 3);  // a third of the tokens and the whole last row ignored
  nn::TokenCrossEntropy const loss;
  CHECK(loss.count(b.targets, env.stream) < batch * config.block_size * 2 / 3);

  // One device: the loss against float64 from the model's logits, and the gradients.
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed);
  Tensor const logits = model.forward(b.ids, env.ctx);
  env.stream.synchronize();
  double const reference = token_ce_reference(logits, b.targets);
  mgpu::optim::SGD sgd({.lr = 0.1f});
  double const one =
      mgpu::ops::item(nn::train_step(model, sgd, b.ids, b.targets, loss, env.ctx, {.lr_scale = 0.0f}).loss, env.stream);
  CHECK(one == Approx(reference).epsilon(1e-6));
  CHECK(mgpu::optim::global_norm(model.master_gradients(), *env.allocator, env.stream) > clip);
  std::vector<double> const want = as_double(model.master_gradients());
  auto const close = [](std::vector<double> const& got, std::vector<double> const& expected) {
    REQUIRE(got.size() == expected.size());
    double scale = 0;
    for (double const v : expected) scale = std::max(scale, std::abs(v));
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(std::abs(got[i] - expected[i]) <= 1e-5 * scale);
  };

  // Three uneven shards (3, 2, 2 rows; the last one's second row has no counted token).
  auto const shared = std::make_shared<nn::TokenCrossEntropy const>();
  mgpu::DeviceGroup three("host:3");
  mgpu::parallel::DataParallel dp(nn::gpt(config), three, mgpu::optim::SGD({.lr = 0.1f}),
                                  {.zero_stage = 0, .seed = seed, .loss = shared});
  auto const result = dp.step(b.ids, b.targets, 0.0f);
  CHECK(result.rows == std::vector<std::int64_t>{3, 2, 2});
  CHECK(result.loss == Approx(reference).epsilon(1e-6));
  three.synchronize();
  close(as_double(dp.replica(0).master_gradients()), want);

  // Micro-batches of 2, 2, 2 and 1 rows on a 2-stage pipeline.
  mgpu::DeviceGroup two("host:2");
  nn::Sequential const whole = nn::gpt(config);
  pp::Executor ex(whole, two, {0, 3, 6}, pp::one_f_one_b(2, 4),
                  [] { return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.1f}); },
                  {.seed = seed, .loss = shared});
  CHECK(ex.compute_gradients(b.ids, b.targets) == Approx(reference).epsilon(1e-6));
  two.synchronize();
  // The stages' gradients in the whole model's layout; the head's wte gradient is the summed one.
  std::vector<double> got = as_double(ex.chunk(0).gradients());
  std::vector<double> const tail = as_double(ex.chunk(1).gradients());
  got.insert(got.end(), tail.begin(), tail.end() - config.vocab * config.n_embd);
  close(got, want);
  std::vector<double> const head(tail.end() - config.vocab * config.n_embd, tail.end());
  CHECK(head == std::vector<double>(got.begin(), got.begin() + config.vocab * config.n_embd));

  // Targets the loss refuses, before any work.
  Tensor bad = Tensor::empty(b.targets.shape(), DType::int32, *env.allocator);
  std::copy(b.targets.host_span<std::int32_t>().begin(), b.targets.host_span<std::int32_t>().end(),
            bad.host_span<std::int32_t>().begin());
  bad.host_span<std::int32_t>()[20] = 64;
  REQUIRE_MGPU_ERROR(
      dp.step(b.ids, bad), mgpu::Errc::invalid_argument,
      "DataParallel::step: target 64 at row 1, position 4 of the batch (expected a token id in [0, 64) or the ignore index -100)");
  REQUIRE_MGPU_ERROR(ex.step(b.ids, b.ids.slice(0, 3)), mgpu::Errc::invalid_argument,
                     "pipeline batch: targets of shape [3, 16]");
  Tensor const float_targets = Tensor::empty({batch, config.block_size}, DType::float32, *env.allocator);
  REQUIRE_MGPU_ERROR(dp.step(b.ids, float_targets), mgpu::Errc::invalid_argument, "(expected int32 token ids [7, 16])");
}

TEST_CASE("mean squared error is the global mean on one device, uneven shards and micro-batches", "[parallel][loss]") {
  Env env;
  std::int64_t const rows = 7;
  Tensor const x = env.random({rows, 5}, 1);
  Tensor const target = env.random({rows, 3}, 2);
  auto const make = [] { return nn::Sequential::mlp({5, 8, 3}, "gelu"); };
  nn::Sequential model = make();
  model.materialize(env.ctx, seed);
  Tensor const out = model.forward(x, env.ctx);
  env.stream.synchronize();
  std::vector<double> const y = as_double(out);
  std::vector<double> const t = as_double(target);
  double reference = 0;
  for (std::size_t i = 0; i < y.size(); ++i) reference += (y[i] - t[i]) * (y[i] - t[i]);
  reference /= static_cast<double>(y.size());

  auto const mse = std::make_shared<nn::MeanSquaredError const>();
  mgpu::optim::SGD sgd({.lr = 0.1f});
  CHECK(mgpu::ops::item(nn::train_step(model, sgd, x, target, *mse, env.ctx).loss, env.stream) ==
        Approx(reference).epsilon(1e-6));
  env.stream.synchronize();
  std::vector<double> const want = as_double(model.master_parameters());

  mgpu::DeviceGroup three("host:3");
  mgpu::parallel::DataParallel dp(make(), three, mgpu::optim::SGD({.lr = 0.1f}), {.seed = seed, .loss = mse});
  CHECK(dp.step(x, target).loss == Approx(reference).epsilon(1e-6));
  three.synchronize();
  std::vector<double> const got = as_double(dp.replica(0).master_parameters());
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-6));

  mgpu::DeviceGroup two("host:2");
  nn::Sequential const whole = make();
  pp::Executor ex(whole, two, {0, 2, 3}, pp::one_f_one_b(2, 3),
                  [] { return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.1f}); },
                  {.seed = seed, .loss = mse});
  CHECK(ex.step(x, target) == Approx(reference).epsilon(1e-6));
  two.synchronize();
  std::vector<double> stages = as_double(ex.chunk(0).master_parameters());
  std::vector<double> const tail = as_double(ex.chunk(1).master_parameters());
  stages.insert(stages.end(), tail.begin(), tail.end());
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(stages[i] == Approx(want[i]).margin(1e-6));
  REQUIRE_MGPU_ERROR(dp.step(x, x), mgpu::Errc::invalid_argument,
                     "targets of shape [7, 5] and dtype float32 (expected float32 [7, 3]");
}

TEST_CASE("the pipeline clips by the global norm over every stage as one device does", "[parallel][pipeline][loss]") {
  Env env;
  auto const make = [] { return nn::Sequential::mlp({6, 16, 16, 3}); };
  Tensor const y = env.clusters(12, 3).second;
  Tensor const wide = env.random({12, 6}, 4, 3.0f);
  nn::Sequential model = make();
  model.materialize(env.ctx, seed);
  mgpu::optim::SGD sgd({.lr = 0.1f, .momentum = 0.9f});
  for (int s = 0; s < 3; ++s) nn::classification_step(model, sgd, wide, y, env.ctx, {.clip_norm = 0.05f});
  env.stream.synchronize();
  std::vector<double> const want = as_double(model.master_parameters());
  mgpu::DeviceGroup group("host:3");
  pp::Executor ex(
      make(), group, {0, 2, 4, 5}, pp::one_f_one_b(3, 4),
      [] { return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.1f, .momentum = 0.9f}); },
      {.seed = seed, .clip_norm = 0.05f});
  for (int s = 0; s < 3; ++s) ex.step(wide, y);
  group.synchronize();
  std::vector<double> got;
  for (int c = 0; c < 3; ++c) {
    std::vector<double> const part = as_double(ex.chunk(c).master_parameters());
    got.insert(got.end(), part.begin(), part.end());
  }
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-6));
  REQUIRE_MGPU_ERROR(pp::Executor(make(), group, {0, 2, 4, 5}, pp::one_f_one_b(3, 4),
                                  [] { return std::make_unique<mgpu::optim::SGD>(); }, {.clip_norm = -1.0f}),
                     mgpu::Errc::invalid_argument, "(expected 0 for no clipping, or a finite norm > 0)");
}

TEST_CASE("pipeline chunks decay their own weight matrices as the one-device model decays gpt_decay_ranges",
          "[parallel][pipeline][gpt][optim]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  mgpu::optim::AdamWOptions strong = adamw;  // a decay large enough to tell the groupings apart
  strong.lr = 1e-2f, strong.weight_decay = 2.0f;
  auto const one_device = [&](mgpu::optim::AdamWOptions const& options) {
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, seed);
    mgpu::optim::AdamW opt(options);
    nn::TokenCrossEntropy const loss;
    for (int s = 0; s < 3; ++s) nn::train_step(model, opt, batches[s].ids, batches[s].targets, loss, env.ctx);
    env.stream.synchronize();
    return as_double(model.master_parameters());
  };
  mgpu::optim::AdamWOptions grouped = strong;
  grouped.decay_ranges = nn::gpt_decay_ranges(config);
  std::vector<double> const want = one_device(grouped), decay_all = one_device(strong);

  mgpu::DeviceGroup two("host:2");
  nn::Sequential const whole = nn::gpt(config);
  pp::ChunkOptimizerFactory const per_chunk = [&](nn::Sequential const& chunk) {
    mgpu::optim::AdamWOptions options = strong;
    options.decay_ranges = chunk.matrix_ranges();
    return std::make_unique<mgpu::optim::AdamW>(options);
  };
  pp::Executor ex(whole, two, {0, 2, 3, 4, 6}, pp::interleaved_one_f_one_b(2, 2, 4), per_chunk,
                  {.seed = seed, .loss = std::make_shared<nn::TokenCrossEntropy const>()});
  for (int s = 0; s < 3; ++s) ex.step(batches[s].ids, batches[s].targets);
  two.synchronize();
  std::vector<double> got;
  for (int c = 0; c < ex.schedule().chunks(); ++c) {
    std::vector<double> const part = as_double(ex.chunk(c).master_parameters());
    got.insert(got.end(), part.begin(), part.end());
  }
  got.resize(want.size());  // without the last chunk's copy of wte
  double worst = 0, apart = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - want[i]));
    apart = std::max(apart, std::abs(decay_all[i] - want[i]));
  }
  WARN("pipeline vs one device with decay groups: max |difference| " << worst << "; decaying everything moves "
                                                                     << apart);
  // Measured 1.6e-5: AdamW's m / sqrt(v) turns the rounding of gradients near zero (summed in
  // another order across micro-batches) into steps of up to lr; a wrong grouping moves 0.06.
  CHECK(worst <= 1e-4);
  CHECK(apart > 1e-2);
}
