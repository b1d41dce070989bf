// ZeRO-3 over a pipeline's data-parallel replicas (pipeline::ExecutorOptions::zero_stage 3) on host
// devices: DP 2 x PP 2 with GPipe, 1F1B, interleaved and zero-bubble schedules and DP 2 x TP 2 x PP 2 give the
// one-device loss curve and weights over AdamW steps with clipping, ZeRO-2's bit for bit (the same
// reduce and owned pieces; only where the parameters live differs) and ZeRO-1's within float32
// rounding; on a model whose parameters outweigh its activations each device holds less than with
// ZeRO-2 between steps and at its peak, by what the memory model predicts; a checkpoint saved with
// ZeRO-3 resumes bit for bit and loads into ZeRO-1 (16-bit compute: test_pipeline_zero16.cpp).
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/parallel/memory_model.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"
#include "support/pipeline_zero_fixture.hpp"
#include "support/temp_path.hpp"

using mgpu::test::worst_relative;
using namespace mgpu::test::pipeline_zero;

TEST_CASE("ZeRO-3 over a data x pipeline grid trains as one device, as ZeRO-2 and as ZeRO-1, with every schedule",
          "[pipeline][zero]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  mgpu::test::GptCurve const one = mgpu::test::gpt_one_device_curve(env, config, seed, adamw, clip, batches);
  std::vector<double> const one_weights(one.weights.begin(), one.weights.end());
  std::vector<Grid> const grids{{"DP 2 x PP 2, gpipe", pp::gpipe(2, 2), {0, 3, 6}},
                                {"DP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 3, 6}},
                                {"DP 2 x PP 2, interleaved 2 x 2 chunks", pp::interleaved_one_f_one_b(2, 2, 2), {0, 2, 3, 4, 6}},
                                {"DP 2 x PP 2, zb-h1 (the input half of a backward gathers, the weight half reads none)",
                                 pp::zero_bubble_h1(2, 2), {0, 3, 6}},
                                {"DP 2 x TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 4, 6}, 2}};
  for (Grid const& grid : grids) {
    CAPTURE(grid.name);
    std::vector<Run> runs;  // ZeRO-1, 2, 3
    for (int zero : {1, 2, 3}) {
      CAPTURE(zero);
      mgpu::DeviceGroup group("host:" + std::to_string(4 * grid.tp));
      auto made = std::make_shared<std::vector<mgpu::optim::Optimizer*>>();
      pp::ExecutorOptions options = options_for(zero);
      if (grid.tp > 1) options.tensor_parallel = pp::tensor_parallel_stages(mgpu::nn::gpt(config), {}, grid.tp);
      pp::Executor ex(nn::gpt(config), group, grid.cuts, grid.schedule, chunk_adamw(made), options);
      runs.push_back(train(env, ex, batches));  // gathers the parameters whole at the end
      double const worst = worst_relative(runs.back().losses, one.losses);
      double const weights = worst_difference(runs.back().weights, one_weights);
      WARN(grid.name << ", zero " << zero << ": worst relative loss difference " << worst << ", weights " << weights);
      CHECK(worst <= curve_tolerance);
      CHECK(weights < 5e-5);
      if (zero < 3) continue;
      int const pipelines = 2 * grid.tp;
      for (int replica = grid.tp; replica < pipelines; ++replica)  // every replica gathers the same parameters
        for (int c = 0; c < ex.schedule().chunks(); ++c)
          CHECK(as_double(ex.chunk(c, replica).master_parameters()) == as_double(ex.chunk(c, replica % grid.tp).master_parameters()));
      auto const chunks = static_cast<std::size_t>(ex.schedule().chunks());
      REQUIRE(made->size() == static_cast<std::size_t>(pipelines) * chunks);
      for (std::size_t i = 0; i < made->size(); ++i) {  // AdamW's state of about half of each chunk
        std::int64_t const n = ex.chunk(static_cast<int>(i % chunks), static_cast<int>(i / chunks)).parameter_count();
        CHECK(state_values(*(*made)[i]) >= n);
        CHECK(state_values(*(*made)[i]) <= n + 32);
      }
    }
    for (int below : {0, 1}) {  // ZeRO-1 and 2 own the buckets' pieces, ZeRO-3 the units': the norm summed in other pieces
      CHECK(worst_relative(runs[2].losses, runs[below].losses) <= 1e-6);
      CHECK(worst_difference(runs[2].weights, runs[below].weights) < 1e-5);
    }
  }
}

TEST_CASE("a pipeline's ZeRO-3 in float32 and bfloat16 holds less than its ZeRO-2 between steps and at its peak where the "
          "parameters outweigh the activations",
          "[pipeline][zero]") {
  Env env;
  // Twelve blocks, six a stage: the owned half of a stage's parameters and the two units gathered
  // at a time are less than the whole stage. Batches of one token a row: activations are small.
  nn::GptConfig const deep{.vocab = 64, .block_size = 16, .n_layer = 12, .n_head = 4, .n_embd = 32};
  nn::Sequential const model = nn::gpt(deep);
  std::vector<std::size_t> const points = model.cut_points();
  std::vector<std::size_t> const cuts{0, points[points.size() / 2], model.size()};
  std::vector<Batch> batches;
  for (unsigned s = 0; s < 3; ++s) batches.push_back(mgpu::test::rule_batch(env, 4, 1, deep.vocab, 500 + s));
  DType const compute = GENERATE(DType::float32, DType::bfloat16);  // bf16: the units' 16-bit copies and a float32 staging
  CAPTURE(mgpu::to_string(compute));
  std::vector<std::vector<std::size_t>> peaks, held;  // per stage, per device: the peak of steps 2 and 3, what is held after
  std::vector<std::vector<double>> losses;
  for (int zero : {2, 3}) {
    mgpu::DeviceGroup group("host:4");
    pp::ExecutorOptions options = options_for(zero, 2, compute);
    options.clip_norm = 0;
    pp::Executor ex(nn::gpt(deep), group, cuts, pp::one_f_one_b(2, 2), chunk_adamw(), options);
    losses.push_back({ex.step(batches[0].ids, batches[0].targets)});  // AdamW makes its state in the first update
    for (int r = 0; r < 4; ++r) group.allocator(r).reset_peak();
    for (std::size_t s = 1; s < 3; ++s) losses.back().push_back(ex.step(batches[s].ids, batches[s].targets));
    peaks.emplace_back();
    held.emplace_back();
    for (int r = 0; r < 4; ++r) {
      peaks.back().push_back(group.allocator(r).stats().peak_allocated);
      held.back().push_back(group.allocator(r).stats().allocated);
    }
  }
  std::vector<std::vector<mgpu::parallel::GptMemory>> predicted;  // per stage, per device
  for (int zero : {2, 3})
    predicted.push_back(mgpu::parallel::predict_gpt_memory(
        deep, 4, {.data_parallel = 2, .zero_stage = zero, .cuts = cuts, .micro_batches = 2, .compute = compute}));
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r, peaks[0][r], peaks[1][r], held[0][r], held[1][r], predicted[0][r].total(), predicted[1][r].total());
    WARN("device " << r << ": peak bytes " << peaks[0][r] << " (ZeRO-2), " << peaks[1][r] << " (ZeRO-3); between steps "
                   << held[0][r] << ", " << held[1][r]);
    CHECK(peaks[1][r] < peaks[0][r]);
    CHECK(held[1][r] < held[0][r]);  // the owned half of the parameters, no unit
    // The saving is the memory model's (owned parameters and two gathered units against the
    // whole; in bf16 their copies and a float32 staging), within two of the allocator's smallest
    // blocks (in bf16 four: 1.5 and 2 KB measured, the model's side the smaller).
    auto const saved = static_cast<double>(peaks[0][r]) - static_cast<double>(peaks[1][r]);
    auto const predicted_saving = static_cast<double>(predicted[0][r].total()) - static_cast<double>(predicted[1][r].total());
    CHECK(std::abs(saved - predicted_saving) <= (compute == DType::float32 ? 1024 : 2048));
  }
  CHECK(losses[1] == losses[0]);
}

TEST_CASE("a pipeline with ZeRO-3 resumes from its checkpoint bit for bit and loads into ZeRO-1", "[pipeline][zero]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  auto const path = mgpu::test::temp_path("mgpu_pipeline_zero3.ckpt");
  std::vector<std::size_t> const cuts{0, 3, 6};
  mgpu::DeviceGroup group("host:4");
  pp::Executor first(nn::gpt(config), group, cuts, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(3));
  train(env, first, batches, 0, 4);
  first.save(path, {.step = 4});
  Run const want = train(env, first, batches, 4, 8);  // sharded again after save
  {
    pp::Executor resumed(nn::gpt(config), group, cuts, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(3));
    CHECK(resumed.load(path).step == 4);
    Run const got = train(env, resumed, batches, 4, 8);
    CHECK(got.losses == want.losses);
    CHECK(got.weights == want.weights);
  }
  {
    pp::Executor other(nn::gpt(config), group, cuts, pp::one_f_one_b(2, 2), chunk_adamw(), options_for(1));
    CHECK(other.load(path).step == 4);
    Run const got = train(env, other, batches, 4, 8);
    CHECK(worst_relative(got.losses, want.losses) <= 1e-6);
    CHECK(worst_difference(got.weights, want.weights) < 1e-6);
  }
  std::filesystem::remove(path);
}
