// Pipeline checkpoints: a run resumed by a new executor continues bit for bit (weights, AdamW
// state, dropout's RNG, the loss scaler); the file is the one-device format, so it loads into one
// model (the chunks' weights, in order) and into another layout (interleaved, replicated), which
// continues with the same losses; a file of another model is refused and changes nothing. The
// whole model's weights move to and from every replica's chunks.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <mgpu/io/checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

namespace {

nn::GptConfig const config{.vocab = 48, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
std::uint64_t const seed = 5;
std::int64_t const batch = 6;

struct Batch {
  Tensor ids, targets;
};
std::vector<Batch> make_batches(Env& env, int count) {
  std::vector<Batch> out;
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(config.vocab) - 1);
  for (int s = 0; s < count; ++s) {
    Batch b{Tensor::empty({batch, config.block_size}, DType::int32, *env.allocator),
            Tensor::empty({batch, config.block_size}, DType::int32, *env.allocator)};
    for (auto& v : b.ids.host_span<std::int32_t>()) v = token(rng);
    for (auto& v : b.targets.host_span<std::int32_t>()) v = token(rng);
    out.push_back(b);
  }
  return out;
}

pp::ChunkOptimizerFactory adamw() {
  return [](nn::Sequential const& chunk) {
    return std::make_unique<mgpu::optim::AdamW>(
        mgpu::optim::AdamWOptions{.lr = 3e-3f, .weight_decay = 0.1f, .decay_ranges = chunk.matrix_ranges()});
  };
}

pp::ExecutorOptions options(int replicas = 1) {
  pp::ExecutorOptions o{.seed = seed, .data_parallel = replicas, .clip_norm = 1.0f,
                        .loss = std::make_shared<nn::TokenCrossEntropy const>()};
  o.loss_scaler.emplace();  // float32 compute: the scale cancels, its state still moves
  return o;
}

// The whole model's float32 weights from replica `r`'s chunks (a tied head's copy of wte left out).
std::vector<double> gathered(pp::Executor& ex, std::int64_t count, int r = 0) {
  std::vector<double> all;
  for (int c = 0; c < ex.schedule().chunks(); ++c) {
    std::vector<double> const part = as_double(ex.chunk(c, r).master_parameters());
    all.insert(all.end(), part.begin(), part.end());
  }
  all.resize(static_cast<std::size_t>(count));
  return all;
}

std::filesystem::path temp(std::string const& name) { return mgpu::test::temp_path(name); }

}  // namespace

TEST_CASE("a pipeline resumed from its checkpoint continues bit for bit, and the file is the one-device format",
          "[pipeline][checkpoint][gpt]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env, 6);
  nn::Sequential const model = nn::gpt(config);
  std::int64_t const count = model.parameter_count();
  auto const path = temp("mgpu_pipeline_checkpoint.ckpt");

  mgpu::DeviceGroup two("host:2");
  pp::Executor first(model, two, {0, 3, 6}, pp::one_f_one_b(2, 3), adamw(), options());
  for (int s = 0; s < 3; ++s) first.step(batches[s].ids, batches[s].targets);
  first.save(path, {.step = 3, .data_seed = 9});
  two.synchronize();
  std::vector<double> const saved = gathered(first, count);
  auto const scaler = first.loss_scaler()->state();
  std::vector<float> uninterrupted;
  for (int s = 3; s < 6; ++s) uninterrupted.push_back(first.step(batches[s].ids, batches[s].targets));
  two.synchronize();
  std::vector<double> const end = gathered(first, count);

  SECTION("a new executor of the same layout") {
    mgpu::DeviceGroup group("host:2");
    pp::Executor resumed(model, group, {0, 3, 6}, pp::one_f_one_b(2, 3), adamw(), options());
    resumed.step(batches[0].ids, batches[0].targets);  // state that load() must replace
    mgpu::io::TrainingState const state = resumed.load(path);
    CHECK(state.step == 3);
    CHECK(state.data_seed == 9);
    CHECK(resumed.loss_scaler()->state() == scaler);
    group.synchronize();
    CHECK(gathered(resumed, count) == saved);
    for (int s = 3; s < 6; ++s) CHECK(resumed.step(batches[s].ids, batches[s].targets) == uninterrupted[s - 3]);
    group.synchronize();
    CHECK(gathered(resumed, count) == end);  // AdamW's moments, its step count and dropout's draws came back
  }
  SECTION("one model with io::load_training") {
    nn::Sequential one = nn::gpt(config);
    one.materialize(env.ctx, seed + 1);  // other weights, which the file replaces
    mgpu::optim::AdamW optimizer({.lr = 3e-3f, .weight_decay = 0.1f, .decay_ranges = nn::gpt_decay_ranges(config)});
    CHECK(mgpu::io::load_training(path, one, optimizer, *env.allocator, env.stream).step == 3);
    CHECK(as_double(one.master_parameters()) == saved);
    CHECK(optimizer.steps() == 3);
  }
  SECTION("an interleaved pipeline replicated twice, which continues with the same losses") {
    mgpu::DeviceGroup four("host:4");
    pp::Executor other(model, four, {0, 2, 3, 4, 6}, pp::interleaved_one_f_one_b(2, 2, 2), adamw(), options(2));
    other.load(path);
    four.synchronize();
    CHECK(gathered(other, count, 0) == saved);
    CHECK(gathered(other, count, 1) == saved);
    for (int s = 3; s < 6; ++s) {
      float const loss = other.step(batches[s].ids, batches[s].targets);
      CHECK(loss == Approx(uninterrupted[s - 3]).epsilon(1e-5));  // other summation orders
    }
  }
  SECTION("a checkpoint of another model is refused and changes nothing") {
    nn::GptConfig wider = config;
    wider.n_embd = 24;
    nn::Sequential other = nn::gpt(wider);
    other.materialize(env.ctx, seed);
    mgpu::optim::AdamW optimizer(mgpu::optim::AdamWOptions{});
    auto const wrong = temp("mgpu_pipeline_checkpoint_other.ckpt");
    mgpu::io::save_training(wrong, other, optimizer, {}, env.stream);
    mgpu::DeviceGroup group("host:2");
    pp::Executor resumed(model, group, {0, 3, 6}, pp::one_f_one_b(2, 3), adamw(), options());
    resumed.load(path);
    REQUIRE_THROWS_AS(resumed.load(wrong), mgpu::Error);
    group.synchronize();
    CHECK(gathered(resumed, count) == saved);
    std::filesystem::remove(wrong);
  }
  std::filesystem::remove(path);
}

TEST_CASE("gather_parameters and scatter_parameters move the whole model's weights to and from every replica's chunks",
          "[pipeline][gpt]") {
  Env env;
  nn::Sequential const model = nn::gpt(config);
  std::int64_t const count = model.parameter_count();
  mgpu::DeviceGroup four("host:4");
  pp::Executor ex(model, four, {0, 2, 3, 4, 6}, pp::interleaved_one_f_one_b(2, 2, 2), adamw(), options(2));
  nn::Sequential other = nn::gpt(config);
  other.materialize(env.ctx, seed + 7);  // weights the executor does not hold
  env.stream.synchronize();
  std::vector<double> const want = as_double(other.master_parameters());
  ex.scatter_parameters(other, env.stream);
  for (int r = 0; r < 2; ++r) CHECK(gathered(ex, count, r) == want);
  // The last chunk's copy of wte came from wte.
  int const last = ex.schedule().chunks() - 1;
  std::vector<double> const tail = as_double(ex.chunk(last, 1).master_parameters());
  std::int64_t const wte = config.vocab * config.n_embd;
  CHECK(std::vector<double>(tail.end() - wte, tail.end()) == std::vector<double>(want.begin(), want.begin() + wte));

  nn::Sequential back = nn::gpt(config);
  back.materialize(env.ctx, seed);
  ex.gather_parameters(back, env.stream);
  CHECK(as_double(back.master_parameters()) == want);

  nn::GptConfig wider = config;
  wider.n_embd = 24;
  nn::Sequential wrong = nn::gpt(wider);
  wrong.materialize(env.ctx, seed);
  REQUIRE_MGPU_ERROR(ex.gather_parameters(wrong, env.stream), mgpu::Errc::invalid_argument,
                     "Executor::gather_parameters with a model of");
}
