// ZeRO-1 and ZeRO-2 over a pipeline's data-parallel replicas (pipeline::ExecutorOptions::zero_stage)
// on host devices: DP 2 x PP 2 (ZeRO-1: 1F1B and interleaved; ZeRO-2: GPipe, 1F1B, interleaved and
// zero bubble) and DP 2 x TP 2 x PP 2 with a tied GPT give the one-device loss curve and weights
// over AdamW steps with clipping, as ZeRO-0 and ZeRO-1 do, each device keeping the optimizer state
// of about half its chunks' elements; ZeRO-2 holds no more than ZeRO-1 between steps and at its
// peak (activations or gradients outweighing), and ZeRO-1 peaks below ZeRO-0; bf16 with ZeRO-1
// follows bf16 with ZeRO-0; a checkpoint saved with ZeRO-1 or ZeRO-2 resumes bit for bit and loads into a pipeline
// without replicas; stages outside 0 to 3 are refused (ZeRO-2 in 16 bits: test_pipeline_zero16.cpp;
// ZeRO-3: test_pipeline_zero3.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/pipeline_zero_fixture.hpp"
#include "support/temp_path.hpp"

using mgpu::DType;
using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::worst_relative;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

using namespace mgpu::test::pipeline_zero;

TEST_CASE("ZeRO-1 over a data x pipeline grid trains a GPT as one device and as ZeRO-0, each replica keeping half the state",
          "[pipeline][zero]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  REQUIRE(mgpu::test::gpt_gradient_norm(env, config, seed, batches[0]) > 2 * clip);  // the steps do clip
  mgpu::test::GptCurve const one = mgpu::test::gpt_one_device_curve(env, config, seed, adamw, clip, batches);
  std::vector<double> const one_weights(one.weights.begin(), one.weights.end());
  std::vector<Grid> const grids{{"DP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 3, 6}},
                                {"DP 2 x PP 2, interleaved 2 x 2 chunks", pp::interleaved_one_f_one_b(2, 2, 2), {0, 2, 3, 4, 6}},
                                {"DP 2 x TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 4, 6}, 2}};
  for (Grid const& grid : grids) {
    CAPTURE(grid.name);
    std::vector<Run> runs;
    for (int zero : {0, 1}) {
      CAPTURE(zero);
      mgpu::DeviceGroup group("host:" + std::to_string(4 * grid.tp));
      auto made = std::make_shared<std::vector<mgpu::optim::Optimizer*>>();
      pp::ExecutorOptions options = options_for(zero);
      if (grid.tp > 1) options.tensor_parallel = pp::tensor_parallel_stages(nn::gpt(config), {}, grid.tp);
      pp::Executor ex(nn::gpt(config), group, grid.cuts, grid.schedule, chunk_adamw(made), options);
      runs.push_back(train(env, ex, batches));
      double const worst = worst_relative(runs.back().losses, one.losses);
      double const weights = worst_difference(runs.back().weights, one_weights);
      WARN(grid.name << ", zero " << zero << ": worst relative loss difference " << worst << ", weights " << weights);
      CHECK(worst <= curve_tolerance);
      CHECK(weights < 5e-5);
      int const last = ex.schedule().chunks() - 1;
      int const pipelines = 2 * grid.tp;  // replica a's tensor-parallel rank t: pipeline a x tp + t
      for (int replica = 0; replica < pipelines; ++replica) {
        CAPTURE(replica);
        // The replicas' chunks are equal after the update's gather, and the head's copy of wte the embedding's.
        for (int c = 0; c <= last; ++c)
          CHECK(as_double(ex.chunk(c, replica).master_parameters()) == as_double(ex.chunk(c, replica % grid.tp).master_parameters()));
        std::int64_t const rows = config.vocab / grid.tp * config.n_embd;
        std::int64_t const n = ex.chunk(last, replica).parameter_count();
        CHECK(as_double(ex.chunk(0, replica).master_parameters().slice(0, rows)) ==
              as_double(ex.chunk(last, replica).master_parameters().slice(n - rows, n)));
      }
      // AdamW's two state buffers: over every element of a chunk with ZeRO-0, about half of them
      // (a block of each bucket, and the few elements past the blocks) with ZeRO-1.
      auto const chunks = static_cast<std::size_t>(last + 1);
      REQUIRE(made->size() == static_cast<std::size_t>(pipelines) * chunks);
      for (std::size_t i = 0; i < made->size(); ++i) {
        CAPTURE(i);
        std::int64_t const n = ex.chunk(static_cast<int>(i % chunks), static_cast<int>(i / chunks)).parameter_count();
        std::int64_t const values = state_values(*(*made)[i]);
        if (zero == 0) {
          CHECK(values == 2 * n);
        } else {
          CHECK(values >= n);
          CHECK(values <= n + 32);  // 2 x (n / 2 + the few past the blocks)
        }
      }
    }
    CHECK(worst_relative(runs[1].losses, runs[0].losses) <= curve_tolerance);
  }
}

TEST_CASE("ZeRO-1 over a data x pipeline grid in bf16 follows ZeRO-0 in bf16", "[pipeline][zero]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  std::vector<Run> runs;
  for (int zero : {0, 1}) {
    mgpu::DeviceGroup group("host:4");
    pp::Executor ex(nn::gpt(config), group, {0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(zero, 2, DType::bfloat16));
    runs.push_back(train(env, ex, batches, 0, 5));
  }
  double const worst = worst_relative(runs[1].losses, runs[0].losses);
  WARN("bf16, ZeRO-1 against ZeRO-0: worst relative loss difference " << worst);
  CHECK(worst <= 1e-3);  // the same bf16 compute; only the norm's summation order differs
  CHECK(runs[1].losses.back() < runs[1].losses.front());
}

TEST_CASE("a pipeline with ZeRO-1 or ZeRO-2 resumes from its checkpoint bit for bit and loads into a pipeline without replicas",
          "[pipeline][zero]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  auto const path = mgpu::test::temp_path("mgpu_pipeline_zero.ckpt");
  std::vector<std::size_t> const cuts{0, 3, 6};
  for (int zero : {1, 2}) {
    CAPTURE(zero);
    mgpu::DeviceGroup group("host:4");
    pp::Executor first(nn::gpt(config), group, cuts, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(zero));
    train(env, first, batches, 0, 4);
    first.save(path, {.step = 4});
    Run const want = train(env, first, batches, 4, 8);  // the state sharded again after save
    {
      pp::Executor resumed(nn::gpt(config), group, cuts, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(zero));
      CHECK(resumed.load(path).step == 4);
      Run const got = train(env, resumed, batches, 4, 8);
      CHECK(got.losses == want.losses);
      CHECK(got.weights == want.weights);
    }
    {  // the same steps on one pipeline of 2 devices: the replicas' mean over the whole batch
      mgpu::DeviceGroup two("host:2");
      pp::Executor other(nn::gpt(config), two, cuts, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(0, 1));
      CHECK(other.load(path).step == 4);
      Run const got = train(env, other, batches, 4, 8);
      CHECK(worst_relative(got.losses, want.losses) <= curve_tolerance);
      CHECK(worst_difference(got.weights, want.weights) < 5e-5);
    }
    std::filesystem::remove(path);
  }
}

TEST_CASE("ZeRO-2 over a data x pipeline grid trains as one device and as ZeRO-1 with every schedule, each replica keeping half "
          "the state and no more than ZeRO-1's gradients",
          "[pipeline][zero]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  mgpu::test::GptCurve const one = mgpu::test::gpt_one_device_curve(env, config, seed, adamw, clip, batches);
  std::vector<double> const one_weights(one.weights.begin(), one.weights.end());
  std::vector<Grid> const grids{{"DP 2 x PP 2, gpipe", pp::gpipe(2, 2), {0, 3, 6}},
                                {"DP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 3, 6}},
                                {"DP 2 x PP 2, interleaved 2 x 2 chunks", pp::interleaved_one_f_one_b(2, 2, 2), {0, 2, 3, 4, 6}},
                                {"DP 2 x PP 2, zero bubble", pp::zero_bubble_h1(2, 2), {0, 3, 6}},
                                {"DP 2 x TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 4, 6}, 2}};
  for (Grid const& grid : grids) {
    CAPTURE(grid.name);
    std::vector<Run> runs;
    std::vector<std::vector<std::size_t>> held;  // per stage: each device's bytes between steps
    for (int zero : {1, 2}) {
      CAPTURE(zero);
      mgpu::DeviceGroup group("host:" + std::to_string(4 * grid.tp));
      auto made = std::make_shared<std::vector<mgpu::optim::Optimizer*>>();
      pp::ExecutorOptions options = options_for(zero);
      if (grid.tp > 1) options.tensor_parallel = pp::tensor_parallel_stages(nn::gpt(config), {}, grid.tp);
      pp::Executor ex(nn::gpt(config), group, grid.cuts, grid.schedule, chunk_adamw(made), options);
      runs.push_back(train(env, ex, batches));
      double const worst = worst_relative(runs.back().losses, one.losses);
      double const weights = worst_difference(runs.back().weights, one_weights);
      WARN(grid.name << ", zero " << zero << ": worst relative loss difference " << worst << ", weights " << weights);
      CHECK(worst <= curve_tolerance);
      CHECK(weights < 5e-5);
      int const pipelines = 2 * grid.tp;
      for (int replica = grid.tp; replica < pipelines; ++replica)  // equal to replica 0's after the update's gather
        for (int c = 0; c < ex.schedule().chunks(); ++c)
          CHECK(as_double(ex.chunk(c, replica).master_parameters()) == as_double(ex.chunk(c, replica % grid.tp).master_parameters()));
      auto const chunks = static_cast<std::size_t>(ex.schedule().chunks());
      REQUIRE(made->size() == static_cast<std::size_t>(pipelines) * chunks);
      for (std::size_t i = 0; i < made->size(); ++i) {  // AdamW's state of about half of each chunk
        std::int64_t const n = ex.chunk(static_cast<int>(i % chunks), static_cast<int>(i / chunks)).parameter_count();
        CHECK(state_values(*(*made)[i]) >= n);
        CHECK(state_values(*(*made)[i]) <= n + 32);
      }
      held.emplace_back();
      for (int r = 0; r < group.size(); ++r) held.back().push_back(group.allocator(r).stats().allocated);
    }
    // ZeRO-2 holds the whole gradients as ZeRO-1 does (the owned ones packed at their front), and
    // nothing more: between steps each device holds what it holds with ZeRO-1.
    for (std::size_t r = 0; r < held[0].size(); ++r) {
      CAPTURE(r, held[0][r], held[1][r]);
      CHECK(held[1][r] == held[0][r]);
    }
    // ZeRO-1's buckets and owners: the same sums, norm and updates, bit for bit.
    CHECK(runs[1].losses == runs[0].losses);
    CHECK(runs[1].weights == runs[0].weights);
  }
}

TEST_CASE("a pipeline's ZeRO-2 steps as its ZeRO-1 without clipping and peaks no higher, and ZeRO-1 below ZeRO-0",
          "[pipeline][zero]") {
  Env env;
  struct Shape {
    std::string name;
    std::int64_t rows, tokens;
  };
  // The test's batches, whose activations outweigh half the gradients, and batches of one token a
  // micro-batch, whose gradients outweigh the activations: there ZeRO-2's reduce, were it to hold
  // its owned gradients beside the whole ones, would peak above ZeRO-1.
  for (Shape const& shape : {Shape{"7 rows of 16 tokens", batch, config.block_size}, Shape{"4 rows of 1 token", 4, 1}}) {
    CAPTURE(shape.name);
    std::vector<Batch> batches;
    for (unsigned s = 0; s < 3; ++s) batches.push_back(mgpu::test::rule_batch(env, shape.rows, shape.tokens, config.vocab, 400 + s));
    std::vector<std::vector<std::size_t>> peaks;  // per stage, per device: the peak of steps 2 and 3
    std::vector<std::vector<double>> losses;      // per stage
    for (int zero : {0, 1, 2}) {
      mgpu::DeviceGroup group("host:4");
      pp::ExecutorOptions options = options_for(zero);
      options.clip_norm = 0;  // the update without clipping: nn::apply_update over the owned gradients
      pp::Executor ex(nn::gpt(config), group, {0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(), options);
      losses.push_back({ex.step(batches[0].ids, batches[0].targets)});  // AdamW makes its state in the first update
      for (int r = 0; r < 4; ++r) group.allocator(r).reset_peak();
      for (std::size_t s = 1; s < 3; ++s) losses.back().push_back(ex.step(batches[s].ids, batches[s].targets));
      peaks.emplace_back();
      for (int r = 0; r < 4; ++r) peaks.back().push_back(group.allocator(r).stats().peak_allocated);
    }
    for (std::size_t r = 0; r < 4; ++r) {
      CAPTURE(r, peaks[0][r], peaks[1][r], peaks[2][r]);
      WARN(shape.name << ", device " << r << ": peak bytes " << peaks[0][r] << " (ZeRO-0), " << peaks[1][r] << " (ZeRO-1), "
                      << peaks[2][r] << " (ZeRO-2)");
      CHECK(peaks[1][r] < peaks[0][r]);   // half of AdamW's state
      CHECK(peaks[2][r] <= peaks[1][r]);  // reduced in place, the owned gradients packed at the front of the whole
    }
    CHECK(losses[2] == losses[1]);  // the same sums: reduced in the same blocks, updated by the same owner
    CHECK(worst_relative(losses[1], losses[0]) <= curve_tolerance);
  }
}

TEST_CASE("a pipeline refuses ZeRO stages outside 0 to 3", "[pipeline][zero]") {
  mgpu::DeviceGroup group("host:4");
  for (int zero : {4, -1})
    REQUIRE_MGPU_ERROR(pp::Executor(nn::gpt(config), group, {0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(zero)),
                       mgpu::Errc::invalid_argument,
                       "pipeline: zero_stage " + std::to_string(zero) + " (expected 0, replicated update, 1, sharded update and "
                       "optimizer state, 2, sharded gradients too, or 3, sharded parameters too)");
}
