// train::Trainer, the one front door: a small GPT's losses over a few AdamW steps with clipping
// and a learning-rate schedule follow the one-device nn::train_step curve on one device, data
// parallel, tensor parallel, on a data x tensor grid and pipelined (1F1B); the validation loss is
// data::evaluate_lm's of the one-device model, also after whole parameters are scattered into the
// parts; save then load resumes the run bit for bit; impossible layouts are refused before any
// work, naming the field and the value expected.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <mgpu/data/evaluate.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/train/trainer.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"

using mgpu::test::Env;
using mgpu::test::worst_relative;
namespace nn = mgpu::nn;
namespace train = mgpu::train;

namespace {

nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
std::uint64_t const seed = 5;
std::int64_t const rows = 4;
int const steps = 5;
float const clip = 0.5f;
mgpu::optim::AdamWOptions const adamw{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.5f};
// The learning-rate multiplier of step s (a schedule's).
float lr_scale(std::size_t s) { return 1.0f - 0.15f * static_cast<float>(s); }

std::vector<mgpu::test::TokenBatch> make_batches(Env& env) { return mgpu::test::rule_batches(env, steps, rows, config, 40); }

// The validation stream: the rule's sequences, read in order.
mgpu::data::TokenLoader val_loader() {
  std::vector<std::uint16_t> tokens;
  for (int i = 0; i < 400; ++i) tokens.push_back(static_cast<std::uint16_t>((i * 5 + 3) % config.vocab));
  return mgpu::data::TokenLoader({tokens}, config.vocab, {.batch = rows, .block = config.block_size, .sequential = true});
}

struct Curve {
  std::vector<double> losses;
  double val_loss = 0;
};

// The reference: one device, nn::train_step with per-token cross-entropy, AdamW decaying the
// weight matrices, clipping.
Curve one_device(Env& env, std::vector<mgpu::test::TokenBatch> const& batches) {
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed);
  mgpu::optim::AdamWOptions options = adamw;
  options.decay_ranges = model.matrix_ranges();
  mgpu::optim::AdamW optimizer(options);
  nn::TokenCrossEntropy const loss;
  Curve curve;
  for (std::size_t s = 0; s < batches.size(); ++s)
    curve.losses.push_back(mgpu::ops::item(nn::train_step(model, optimizer, batches[s].ids, batches[s].targets, loss, env.ctx,
                                                          {.lr_scale = lr_scale(s), .clip_norm = clip})
                                               .loss,
                                           env.stream));
  curve.val_loss = mgpu::data::evaluate_lm(model, val_loader(), 8, env.ctx);
  return curve;
}

train::Trainer make_trainer(std::string const& devices, train::ParallelConfig parallel) {
  parallel.clip_norm = clip;
  return train::Trainer(config, mgpu::DeviceGroup(devices), parallel, {.seed = seed, .adamw = adamw, .batch_size = rows});
}

struct Layout {
  std::string name, devices;
  train::ParallelConfig parallel;
};

std::vector<Layout> layouts() {
  return {{"one device", "host:1", {}},
          {"DP2", "host:2", {.dp = 2}},
          {"TP2", "host:2", {.tp = 2}},
          {"DP2 x TP2 (ZeRO-1 by default)", "host:4", {.dp = 2, .tp = 2}},
          {"DP2 x TP2, ZeRO-3", "host:4", {.dp = 2, .tp = 2, .zero = 3}},
          {"PP2 1F1B", "host:2", {.stages = 2, .schedule = "1f1b", .micro_batches = 2}}};
}

}  // namespace

TEST_CASE("the trainer follows the one-device curve in every layout, and resumes from its checkpoints", "[train]") {
  Env env;
  std::vector<mgpu::test::TokenBatch> const batches = make_batches(env);
  Curve const want = one_device(env, batches);
  std::vector<Layout> const all = layouts();
  for (std::size_t l = 0; l < all.size(); ++l) {
    Layout const& layout = all[l];
    INFO(layout.name);
    train::Trainer trainer = make_trainer(layout.devices, layout.parallel);
    std::filesystem::path const path = mgpu::test::temp_path("trainer-" + std::to_string(l) + ".ckpt");
    Curve got;
    for (std::size_t s = 0; s < batches.size(); ++s) {
      if (s == 3) trainer.save(path, {.step = 3});
      train::Trainer::StepResult const r = trainer.step(batches[s].ids, batches[s].targets, lr_scale(s));
      CHECK(r.applied);
      got.losses.push_back(r.loss);
    }
    got.val_loss = trainer.evaluate(val_loader(), 8);
    CHECK(worst_relative(got.losses, want.losses) < 1e-4);
    CHECK(worst_relative({got.val_loss}, {want.val_loss}) < 1e-4);
    CHECK(trainer.parameter_count() == nn::gpt(config).parameter_count());

    // Whole parameters scattered into the parts: the model they make evaluates as one device's.
    std::vector<float> half = trainer.parameters();
    REQUIRE(half.size() == static_cast<std::size_t>(trainer.parameter_count()));
    for (float& v : half) v *= 0.5f;
    if (trainer.data_parallel() != nullptr) {
      REQUIRE_MGPU_ERROR(trainer.scatter(half), mgpu::Errc::invalid_argument, "expected the initial parameters");
    } else {
      trainer.scatter(half);
      nn::Sequential reference = nn::gpt(config);
      reference.materialize(env.ctx, seed);
      train::set_parameters(reference, half, env.stream);
      CHECK(worst_relative({trainer.evaluate(val_loader(), 8)}, {mgpu::data::evaluate_lm(reference, val_loader(), 8, env.ctx)}) < 1e-4);
    }

    // A new trainer of the same layout loads the checkpoint and continues as the first did.
    train::Trainer resumed = make_trainer(layout.devices, layout.parallel);
    CHECK(resumed.load(path).step == 3);
    for (std::size_t s = 3; s < batches.size(); ++s)
      CHECK(resumed.step(batches[s].ids, batches[s].targets, lr_scale(s)).loss == static_cast<float>(got.losses[s]));
    std::filesystem::remove_all(path);
  }
}

TEST_CASE("the trainer refuses impossible layouts before any work, naming the field and the value expected", "[train]") {
  using mgpu::Errc;
  REQUIRE_MGPU_ERROR(make_trainer("host:3", {.dp = 2, .tp = 2}), Errc::invalid_argument,
                     "3 devices (expected dp x tp = 4)");
  REQUIRE_MGPU_ERROR(make_trainer("host:3", {.stages = 2}), Errc::invalid_argument, "3 devices (expected stages x dp = 2)");
  REQUIRE_MGPU_ERROR(make_trainer("host:2", {.dp = 2, .zero = 4}), Errc::invalid_argument,
                     "zero 4 (expected 0, the replicated update, 1");
  REQUIRE_MGPU_ERROR(make_trainer("host:1", {.sequence_parallel = true}), Errc::invalid_argument,
                     "sequence_parallel with tp 1 (expected tp 2 or more");
  REQUIRE_MGPU_ERROR(make_trainer("host:1", {.micro_batches = 2}), Errc::invalid_argument,
                     "micro_batches 2 without a pipeline (expected a schedule or stages > 1");
  // A GPT the tensor-parallel ranks cannot split: heads they do not divide, fewer token ids than ranks.
  REQUIRE_MGPU_ERROR(make_trainer("host:4", {.tp = 4}), Errc::invalid_argument,
                     "tp 4 with n_head 2 (expected tp dividing n_head: each device holds whole heads)");
  nn::GptConfig tiny_vocab = config;
  tiny_vocab.vocab = 1;
  REQUIRE_MGPU_ERROR((train::ParallelConfig{.tp = 2}.validate(tiny_vocab, {.devices = 2, .spelling = train::Spelling::flags})),
                     Errc::invalid_argument, "--tp 2 with a vocab of 1 (expected --tp at most the vocab: each device holds at least one token id)");
  // train_gpt's spelling: its flags.
  train::ParallelConfig const layer_split{.stages = 2, .schedule = "layer-split", .micro_batches = 2};
  REQUIRE_MGPU_ERROR(layer_split.validate(config, {.devices = 2, .spelling = train::Spelling::flags}), Errc::invalid_argument,
                     "--schedule layer-split with --micro-batches 2 (expected 1");
  REQUIRE_MGPU_ERROR((train::ParallelConfig{.stages = 2, .micro_batches = 2}.validate(config, {.batch_size = 1, .devices = 2})),
                     Errc::invalid_argument, "batch_size 1 with dp 1 and micro_batches 2 (expected at least 2: one row per replica and micro-batch)");
  REQUIRE_MGPU_ERROR((train::ParallelConfig{.dp = 2}.validate(config, {.batch_size = 1, .devices = 2, .spelling = train::Spelling::flags})),
                     Errc::invalid_argument, "--batch-size 1 with --dp 2 (expected at least 2: one row per replica)");
}
