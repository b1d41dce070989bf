// A step's inputs are checked on the host before any device work, by one routine (nn::check_batch)
// shared by every executor: a bad token id or target, float32 ids, an empty batch or a bad
// learning-rate scale is refused as itself, naming the first bad value and its place in the batch,
// and changes nothing: each executor then goes on exactly as a twin that never saw the bad step
// (with dropout, so a step that moved the RNG would show). Optimizers refuse bad hyper-parameters;
// checkpoints keep the dropout seeds, so a resume into a model built with another seed continues
// bit for bit; llm.c model files load in one call.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/llmc.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/gpt_layouts.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;
namespace par = mgpu::parallel;

namespace {

using mgpu::test::layouts::adamw;
using mgpu::test::layouts::config;
using mgpu::test::layouts::seed;
std::int64_t const batch = 4;

using Batch = mgpu::test::TokenBatch;

Batch copy_of(Env& env, Batch const& b) {
  Batch c{Tensor::empty(b.ids.shape(), DType::int32, *env.allocator), Tensor::empty(b.targets.shape(), DType::int32, *env.allocator)};
  std::copy(b.ids.host_span<std::int32_t>().begin(), b.ids.host_span<std::int32_t>().end(), c.ids.host_span<std::int32_t>().begin());
  std::copy(b.targets.host_span<std::int32_t>().begin(), b.targets.host_span<std::int32_t>().end(),
            c.targets.host_span<std::int32_t>().begin());
  return c;
}

// Every layout of `family` refuses each bad batch, naming it, and then follows a twin.
void check_bad_batches(std::string const& family) {
  Env env;
  std::vector<Batch> const batches = mgpu::test::rule_batches(env, 4, batch, config, 40);
  Batch const& good = batches[0];
  std::int64_t const t = config.block_size;
  // A bad id or target in the batch's last row (the last micro-batch of every pipeline).
  auto const with = [&](bool ids, std::int64_t position, std::int32_t value) {
    Batch b = copy_of(env, good);
    (ids ? b.ids : b.targets).host_span<std::int32_t>()[static_cast<std::size_t>((batch - 1) * t + position)] = value;
    return b;
  };
  Batch const id_at_vocab = with(true, 3, static_cast<std::int32_t>(config.vocab));
  Batch const negative_id = with(true, 0, -1);
  Batch const target_at_vocab = with(false, 5, static_cast<std::int32_t>(config.vocab));
  Tensor const float_ids = Tensor::empty(good.ids.shape(), DType::float32, *env.allocator);
  mgpu::fill_async(float_ids, 1.0f, env.stream);
  Tensor const empty = Tensor::empty({0, t}, DType::int32, *env.allocator);
  env.stream.synchronize();
  std::string const row = "row " + std::to_string(batch - 1);

  std::vector<mgpu::test::layouts::Layout> const chosen = mgpu::test::layouts::of(family);
  REQUIRE(!chosen.empty());
  for (mgpu::test::layouts::Layout const& layout : chosen) {
    INFO(layout.name);
    mgpu::test::layouts::Trainer const twin_trainer = layout.make();
    mgpu::test::layouts::Trainer const trainer = layout.make();
    mgpu::test::layouts::Step const& twin = twin_trainer.step;
    mgpu::test::layouts::Step const& step = trainer.step;
    CHECK(step(batches[0].ids, batches[0].targets, 1.0f) == twin(batches[0].ids, batches[0].targets, 1.0f));
    REQUIRE_MGPU_ERROR(step(id_at_vocab.ids, id_at_vocab.targets, 1.0f), mgpu::Errc::invalid_argument,
                       "token id 64 at " + row + ", position 3 of the batch (expected an id in [0, 64))");
    REQUIRE_MGPU_ERROR(step(negative_id.ids, negative_id.targets, 1.0f), mgpu::Errc::invalid_argument,
                       "token id -1 at " + row + ", position 0 of the batch");
    REQUIRE_MGPU_ERROR(step(target_at_vocab.ids, target_at_vocab.targets, 1.0f), mgpu::Errc::invalid_argument,
                       "target 64 at " + row + ", position 5 of the batch (expected a token id in [0, 64)");
    REQUIRE_MGPU_ERROR(step(float_ids, good.targets, 1.0f), mgpu::Errc::invalid_argument,
                       "x of dtype float32 for ");
    REQUIRE_MGPU_ERROR(step(float_ids, good.targets, 1.0f), mgpu::Errc::invalid_argument, "(expected int32 token ids in [0, 64))");
    REQUIRE_MGPU_ERROR(step(empty, empty, 1.0f), mgpu::Errc::invalid_argument, "an empty batch of shape [0, 8] (expected at least one row)");
    for (float lr_scale : {std::numeric_limits<float>::quiet_NaN(), -1.0f, std::numeric_limits<float>::infinity()})
      REQUIRE_MGPU_ERROR(step(good.ids, good.targets, lr_scale), mgpu::Errc::invalid_argument, "(expected a finite lr_scale >= 0)");
    // Nothing moved: weights, optimizer state and step count, dropout's RNG.
    for (std::size_t s = 1; s < batches.size(); ++s) {
      CAPTURE(s);
      CHECK(step(batches[s].ids, batches[s].targets, 1.0f) == twin(batches[s].ids, batches[s].targets, 1.0f));
    }
  }
}

}  // namespace

TEST_CASE("one device refuses a bad batch before any work, naming it, and goes on as if it had not been called", "[inputs]") {
  check_bad_batches("one device");
}
TEST_CASE("data parallel refuses a bad batch before any work, naming it, and goes on as if it had not been called",
          "[parallel][inputs]") {
  check_bad_batches("data parallel");
}
TEST_CASE("every pipeline schedule refuses a bad batch before any work, naming it, and goes on as if it had not been called",
          "[pipeline][inputs]") {
  check_bad_batches("pipeline");
}
TEST_CASE("tensor parallelism refuses a bad batch before any work, naming it, and goes on as if it had not been called",
          "[tp][inputs]") {
  check_bad_batches("tensor");
}

TEST_CASE("optimizers refuse learning rates and hyper-parameters that are not finite or out of range, naming them", "[optim][inputs]") {
  using mgpu::optim::AdamW;
  using mgpu::optim::SGD;
  float const nan = std::numeric_limits<float>::quiet_NaN();
  float const inf = std::numeric_limits<float>::infinity();
  for (float lr : {nan, inf, -0.1f}) {
    REQUIRE_MGPU_ERROR(SGD({.lr = lr}), mgpu::Errc::invalid_argument, "SGD lr ");
    REQUIRE_MGPU_ERROR(AdamW({.lr = lr}), mgpu::Errc::invalid_argument, "(expected a finite lr >= 0)");
  }
  REQUIRE_MGPU_ERROR(SGD({.lr = 0.1f, .momentum = -0.5f}), mgpu::Errc::invalid_argument, "SGD momentum -0.5");
  REQUIRE_MGPU_ERROR(SGD({.lr = 0.1f, .weight_decay = nan}), mgpu::Errc::invalid_argument, "SGD weight_decay nan");
  REQUIRE_MGPU_ERROR(SGD({.lr = 0.1f, .nesterov = true}), mgpu::Errc::invalid_argument, "(expected a momentum > 0 for Nesterov momentum)");
  REQUIRE_MGPU_ERROR(AdamW({.beta1 = 1.0f}), mgpu::Errc::invalid_argument, "AdamW beta1 1.0");
  REQUIRE_MGPU_ERROR(AdamW({.beta2 = nan}), mgpu::Errc::invalid_argument, "AdamW beta2 nan (expected a beta2 in [0, 1))");
  REQUIRE_MGPU_ERROR(AdamW({.eps = -1e-8f}), mgpu::Errc::invalid_argument, "AdamW eps -0.0");
  REQUIRE_MGPU_ERROR(AdamW({.eps = inf}), mgpu::Errc::invalid_argument, "AdamW eps inf (expected a finite eps >= 0)");
  REQUIRE_MGPU_ERROR(AdamW({.weight_decay = -1.0f}), mgpu::Errc::invalid_argument, "AdamW weight_decay -1.0");

  // set_lr: refused values change nothing; a new rate applies from the next step (against SGD's
  // formula p - lr g, and against an optimizer made with that rate).
  Env env;
  Tensor const p = env.make({3}, {1.0f, 2.0f, 3.0f});
  Tensor const q = env.make({3}, {1.0f, 2.0f, 3.0f});
  Tensor const g = env.make({3}, {0.5f, -1.0f, 2.0f});
  SGD sgd({.lr = 0.1f});
  for (float lr : {nan, -1.0f, inf}) REQUIRE_MGPU_ERROR(sgd.set_lr(lr), mgpu::Errc::invalid_argument, "SGD lr ");
  CHECK(sgd.lr() == 0.1f);
  sgd.set_lr(0.5f);
  CHECK(sgd.lr() == 0.5f);
  sgd.step(p, g, *env.allocator, env.stream);
  SGD fresh({.lr = 0.5f});
  fresh.step(q, g, *env.allocator, env.stream);
  env.stream.synchronize();
  std::vector<float> const want = {1.0f - 0.5f * 0.5f, 2.0f + 0.5f * 1.0f, 3.0f - 0.5f * 2.0f};
  for (std::size_t i = 0; i < want.size(); ++i) {
    CHECK(p.host_span<float>()[i] == want[i]);
    CHECK(q.host_span<float>()[i] == want[i]);
  }
  AdamW adam(adamw);
  REQUIRE_MGPU_ERROR(adam.set_lr(nan), mgpu::Errc::invalid_argument, "AdamW lr nan (expected a finite lr >= 0)");
  CHECK(adam.lr() == adamw.lr);
  adam.set_lr(0.0f);
  CHECK(adam.lr() == 0.0f);
}

TEST_CASE("a checkpoint keeps the dropout seeds: a resume into a model built with another seed continues bit for bit",
          "[io][parallel][pipeline][inputs]") {
  Env env;
  auto const dir = mgpu::test::temp_path("mgpu_dropout_seed_test");
  std::filesystem::create_directories(dir);
  std::vector<Batch> const batches = mgpu::test::rule_batches(env, 5, batch, config, 60);
  nn::TokenCrossEntropy const token_loss;
  auto const shared_loss = std::make_shared<nn::TokenCrossEntropy const>();

  // One device: 2 steps, save, 3 more; the same 3 from the file in a model of another seed.
  std::vector<double> straight, resumed;
  {
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, seed);
    mgpu::optim::AdamW opt(adamw);
    for (std::size_t s = 0; s < batches.size(); ++s) {
      if (s == 2) mgpu::io::save_training(dir / "one.ckpt", model, opt, {.step = 2}, env.stream);
      double const loss = mgpu::ops::item(nn::train_step(model, opt, batches[s].ids, batches[s].targets, token_loss, env.ctx).loss, env.stream);
      if (s >= 2) straight.push_back(loss);
    }
  }
  {
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, seed + 100);
    mgpu::optim::AdamW opt(adamw);
    REQUIRE(model.rng_seeds().size() == 1 + 3 * static_cast<std::size_t>(config.n_layer));  // the Dropout's, 3 per block
    mgpu::io::load_training(dir / "one.ckpt", model, opt, *env.allocator, env.stream);
    for (std::size_t s = 2; s < batches.size(); ++s)
      resumed.push_back(mgpu::ops::item(nn::train_step(model, opt, batches[s].ids, batches[s].targets, token_loss, env.ctx).loss, env.stream));
  }
  CHECK(resumed == straight);

  // Data parallel (host:2) and a 2-stage pipeline load the one-device file into executors of
  // another seed and follow the same curve as one device does (within float32 rounding of the
  // reductions' order), so the masks are the file's.
  {
    mgpu::DeviceGroup group("host:2");
    par::DataParallel dp(nn::gpt(config), group, mgpu::optim::AdamW(adamw),
                         {.zero_stage = 0, .seed = seed + 7, .loss = shared_loss});
    dp.load(dir / "one.ckpt");
    for (std::size_t s = 2; s < batches.size(); ++s)
      CHECK(dp.step(batches[s].ids, batches[s].targets).loss == Approx(straight[s - 2]).epsilon(1e-5));
  }
  {
    mgpu::DeviceGroup group("host:2");
    pp::Executor ex(nn::gpt(config), group, {0, 3, 6}, pp::one_f_one_b(2, 2),
                    [] { return std::make_unique<mgpu::optim::AdamW>(adamw); }, {.seed = seed + 9, .loss = shared_loss});
    ex.load(dir / "one.ckpt");
    std::vector<double> piped;
    for (std::size_t s = 2; s < 4; ++s) piped.push_back(ex.step(batches[s].ids, batches[s].targets));
    for (std::size_t i = 0; i < piped.size(); ++i) CHECK(piped[i] == Approx(straight[i]).epsilon(1e-5));
    // Saved again by the pipeline (whose own seed differs): the file's seeds go on.
    ex.save(dir / "pipe.ckpt", {.step = 4});
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, seed + 200);
    mgpu::optim::AdamW opt(adamw);
    mgpu::io::load_training(dir / "pipe.ckpt", model, opt, *env.allocator, env.stream);
    double const last = mgpu::ops::item(nn::train_step(model, opt, batches[4].ids, batches[4].targets, token_loss, env.ctx).loss, env.stream);
    CHECK(last == Approx(straight[2]).epsilon(1e-5));
  }
  // The seeds' count is checked like the counters'.
  nn::Sequential model = nn::gpt(config);
  std::vector<std::uint64_t> const three(3, 1);
  REQUIRE_MGPU_ERROR(model.set_rng_seeds(three), mgpu::Errc::invalid_argument, "RNG seeds of 3 values (expected 7");
  std::filesystem::remove_all(dir);
}

TEST_CASE("load_llmc_into reads an llm.c model file into a model in one call, refusing another architecture", "[io][inputs]") {
  Env env;
  auto const dir = mgpu::test::temp_path("mgpu_llmc_into_test");
  std::filesystem::create_directories(dir);
  nn::GptConfig plain = config;
  plain.dropout = 0;
  nn::Sequential source = nn::gpt(plain);
  source.materialize(env.ctx, seed);
  env.stream.synchronize();
  std::vector<float> const weights(source.master_parameters().host_span<float>().begin(), source.master_parameters().host_span<float>().end());
  mgpu::io::write_llmc_model(dir / "model.bin", plain, weights);

  nn::Sequential model = nn::gpt(config);  // with dropout: the file holds none, the layers with parameters match
  model.materialize(env.ctx, seed + 1, DType::bfloat16);
  nn::GptConfig const read = mgpu::io::load_llmc_into(model, dir / "model.bin", env.stream);
  CHECK(read.n_layer == config.n_layer);
  std::vector<float> const loaded(model.master_parameters().host_span<float>().begin(), model.master_parameters().host_span<float>().end());
  CHECK(loaded == weights);
  // The compute-type copy follows.
  std::vector<double> const low = mgpu::test::widened(env, model.parameters());
  CHECK(low[0] == Approx(weights[0]).epsilon(1e-2));

  nn::GptConfig deeper = plain;
  deeper.n_layer = 3;
  nn::Sequential other = nn::gpt(deeper);
  other.materialize(env.ctx, seed);
  std::vector<float> const before(other.master_parameters().host_span<float>().begin(), other.master_parameters().host_span<float>().end());
  REQUIRE_MGPU_ERROR(mgpu::io::load_llmc_into(other, dir / "model.bin", env.stream), mgpu::Errc::invalid_argument,
                     "layer 3 with parameters of the model is TransformerBlock(16, heads 2)");
  std::vector<float> const after(other.master_parameters().host_span<float>().begin(), other.master_parameters().host_span<float>().end());
  CHECK(after == before);
  std::filesystem::remove_all(dir);
}
