// DataParallel's ZeRO stages against the replicated update (zero_stage 0) as the reference: the
// same loss curve and weights over 20 AdamW steps with clipping (a GPT and an MLP on 2 to 4 host
// devices), the whole optimizer state gathered by optimizer() mid-run, and bad stages; stage 2 and 3
// against stage 1 and 2 bit for bit. Their bytes and stage 3's gather schedule are in
// test_zero_memory.cpp, checkpoints across stages and device counts in test_zero_checkpoint.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/zero_fixture.hpp"

namespace nn = mgpu::nn;
using namespace mgpu::test::zero;

namespace {

// What one run gives: its loss curve, rank 0's final weights, and the whole optimizer state that
// optimizer(last rank) gathers at step 10 (the run then goes on with its state sharded again).
struct Run {
  std::vector<float> losses, weights, mid_state;
};

template <class Step>
Run run(DataParallel& dp, Step const& step) {
  Run out;
  for (int s = 0; s < steps; ++s) {
    out.losses.push_back(step(s));
    if (s != steps / 2) continue;
    int const last = static_cast<int>(dp.ranks().size()) - 1;
    for (auto const& [name, tensor] : dp.optimizer(last).state()) {
      std::vector<float> const v = host_values(tensor, dp.group().stream(last));
      out.mid_state.insert(out.mid_state.end(), v.begin(), v.end());
    }
  }
  out.weights = host_values(dp.replica(0).master_parameters(), dp.group().stream(0));
  return out;
}

// One run of the MLP over `data`.
Run mlp_run(DataParallel& dp, MlpBatches const& data) {
  return run(dp, [&](int s) { return dp.step(data.xs[static_cast<std::size_t>(s)], data.ys[static_cast<std::size_t>(s)]).loss; });
}

// Measured (stage 1 against 0): losses within 8e-8 (GPT) and 3e-6 (MLP on 4 devices) relative,
// weights within 6e-6 of 1 + |w|, optimizer state within 1.5e-4 of 1e-6 + |s| (the clipping norm,
// summed block by block, differs in its last bits, and AdamW's m and v of elements whose gradients
// nearly cancel carry that further); the bounds leave room for other kernels' orders.
void check_close(Run const& got, Run const& want, double state_bound = 1e-3) {
  double const losses = worst_relative(got.losses, want.losses);
  double const weights = worst_relative(got.weights, want.weights, 1);
  double const state = worst_relative(got.mid_state, want.mid_state, 1e-6);
  WARN("worst relative differences: losses " << losses << ", weights " << weights << ", optimizer state " << state);
  CHECK(losses <= 1e-5);
  CHECK(weights <= 1e-4);
  CHECK(state <= state_bound);
}

// One run's losses and final weights at `stage` (GPT on `devices` host devices).
Run gpt_run(int devices, int stage, int accumulation, std::vector<mgpu::test::TokenBatch> const& batches, float dropout = 0,
            nn::Recompute recompute = nn::Recompute::none) {
  nn::GptConfig model = config;
  model.dropout = dropout;
  model.recompute = recompute;
  mgpu::DeviceGroup group("host:" + std::to_string(devices));
  DataParallelOptions options = gpt_options(stage);
  options.accumulation_steps = accumulation;
  DataParallel dp(nn::gpt(model), group, gpt_adamw(), options);
  return run(dp, [&](int s) {
    auto const& b = batches[static_cast<std::size_t>(s)];
    return dp.step(b.ids, b.targets).loss;
  });
}

}  // namespace

TEST_CASE("zero_stage 1 gives the replicated update's GPT loss curve, weights and optimizer state",
          "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env, 200);
  for (int const devices : {2, 3}) {
    std::vector<Run> runs;
    for (int const stage : {0, 1}) {
      CAPTURE(devices, stage);
      runs.push_back(gpt_run(devices, stage, 1, batches));
    }
    CAPTURE(devices);
    CHECK(runs[0].losses.back() < 0.8f * runs[0].losses.front());  // it learns
    check_close(runs[1], runs[0]);
  }
}

TEST_CASE("zero_stage 1 gives the replicated update's MLP loss curve on 2 and 4 devices", "[parallel][dp][zero]") {
  Env env;
  MlpBatches const data = mlp_batches(env, 29, 40);
  for (int const devices : {2, 4}) {
    std::vector<Run> runs;
    for (int const stage : {0, 1}) {
      CAPTURE(devices, stage);
      mgpu::DeviceGroup group("host:" + std::to_string(devices));
      DataParallel dp(mlp(), group, mlp_adamw(), mlp_options(stage));
      runs.push_back(mlp_run(dp, data));
    }
    CAPTURE(devices);
    check_close(runs[1], runs[0]);
  }
}

TEST_CASE("DataParallel refuses a zero_stage outside 0..3, and at 2 and 3 what they do not shard", "[parallel][dp][zero]") {
  mgpu::DeviceGroup group("host:2");
  for (int const stage : {-1, 4}) {
    CAPTURE(stage);
    REQUIRE_MGPU_ERROR(DataParallel(nn::Sequential::mlp({2, 4, 3}), group, mgpu::optim::SGD{}, {.zero_stage = stage}),
                       mgpu::Errc::invalid_argument, "zero_stage " + std::to_string(stage) + " (expected 0");
  }
  // Each sharded stage refuses a comm hook and overlap off.
  for (int const stage : {2, 3}) {
    std::string const what = "zero_stage " + std::to_string(stage);
    CAPTURE(stage);
    REQUIRE_MGPU_ERROR(DataParallel(nn::Sequential::mlp({2, 4, 3}), group, mgpu::optim::SGD{},
                                    {.zero_stage = stage, .comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>()}),
                       mgpu::Errc::invalid_argument, what + " with the comm hook bf16-compression (expected none");
    REQUIRE_MGPU_ERROR(DataParallel(nn::Sequential::mlp({2, 4, 3}), group, mgpu::optim::SGD{}, {.overlap = false, .zero_stage = stage}),
                       mgpu::Errc::invalid_argument, what + " without overlap (expected overlap on");
  }
}

// Stage 2 reduces the same staging values as stage 1 reduces in place, in the same order, and
// clips and updates the same owned ranges: the same bits.
TEST_CASE("zero_stage 2 gives zero_stage 1's GPT losses, weights and optimizer state bit for bit", "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env, 200);
  for (int const devices : {2, 3}) {
    CAPTURE(devices);
    Run const one = gpt_run(devices, 1, 1, batches);
    Run const two = gpt_run(devices, 2, 1, batches);
    CHECK(one.losses.back() < 0.8f * one.losses.front());  // it learns
    CHECK(two.losses == one.losses);
    CHECK(two.weights == one.weights);
    CHECK(two.mid_state == one.mid_state);
  }
}

// With accumulation stage 2 reduces each micro-batch and adds the reduced gradients, where stage 1
// adds the micro-batches first: the same sums in another order. Measured: losses within 7e-8
// relative, weights 3e-6, optimizer state 2.3e-3 of 1e-6 + |s| (m and v of elements whose
// gradients nearly cancel).
TEST_CASE("zero_stage 2 with 2 accumulated micro-batches gives zero_stage 1's GPT loss curve", "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env, 200);
  for (int const devices : {2, 3}) {
    CAPTURE(devices);
    check_close(gpt_run(devices, 2, 2, batches), gpt_run(devices, 1, 2, batches), 1e-2);
  }
}

// Stage 3 reduces, clips and updates as stage 2 does (the same reduce-scatters of the same values,
// the same owned ranges), its layers reading gathered copies of the same parameters: the same bits.
TEST_CASE("zero_stage 2 gives zero_stage 1's MLP loss curve bit for bit on 2 and 3 devices, and with accumulation within fp32; "
          "zero_stage 3 gives zero_stage 2's and its count_correct bit for bit",
          "[parallel][dp][zero]") {
  Env env;
  MlpBatches const data = mlp_batches(env, 29, 40);
  for (int const devices : {2, 3}) {
    for (int const accumulation : {1, 2}) {
      std::vector<Run> runs;
      std::vector<std::int64_t> correct;
      for (int const stage : {1, 2, 3}) {
        CAPTURE(devices, accumulation, stage);
        mgpu::DeviceGroup group("host:" + std::to_string(devices));
        DataParallel dp(mlp(), group, mlp_adamw(), mlp_options(stage, accumulation));
        runs.push_back(mlp_run(dp, data));
        correct.push_back(dp.count_correct(data.xs[0], data.ys[0]));
      }
      CAPTURE(devices, accumulation);
      CHECK(runs[2].losses == runs[1].losses);
      CHECK(runs[2].weights == runs[1].weights);
      CHECK(runs[2].mid_state == runs[1].mid_state);
      CHECK(correct[2] == correct[1]);
      if (accumulation == 1) {
        CHECK(runs[1].losses == runs[0].losses);
        CHECK(runs[1].weights == runs[0].weights);
      } else {
        check_close(runs[1], runs[0]);
      }
    }
  }
}

// The other paths through the step: the update inside backward (no clipping, no loss scaler), a
// loss scaler (its unscaling and overflow check on the staging and owned gradients, a power of two
// so the scale is exact) and a rank without rows (its zero gradients written into the staging).
TEST_CASE("zero_stage 2 and 3 give zero_stage 1's MLP run bit for bit without clipping, with a loss scaler and with an empty shard",
          "[parallel][dp][zero]") {
  Env env;
  MlpBatches const data = mlp_batches(env, 29, 90, 10), small_data = mlp_batches(env, 2, 120, 10);  // 2 rows over 3 devices
  for (std::string const variant : {"update in backward", "loss scaler", "empty shard"}) {
    std::vector<Run> runs;
    for (int const stage : {1, 2, 3}) {
      CAPTURE(variant, stage);
      mgpu::DeviceGroup group("host:3");
      DataParallelOptions options = mlp_options(stage);
      if (variant == "loss scaler") options.loss_scaler.emplace(1024.0f);
      if (variant != "empty shard") options.clip_norm = 0;
      DataParallel dp(mlp(), group, mlp_adamw(), options);
      bool const small = variant == "empty shard";
      Run out;
      for (int s = 0; s < 10; ++s) {
        auto const i = static_cast<std::size_t>(s);
        MlpBatches const& d = small ? small_data : data;
        auto const r = dp.step(d.xs[i], d.ys[i]);
        if (small) CHECK(r.rows[2] == 0);
        out.losses.push_back(r.loss);
      }
      out.weights = host_values(dp.replica(0).master_parameters(), group.stream(0));
      runs.push_back(out);
    }
    CAPTURE(variant);
    CHECK(runs[1].losses == runs[0].losses);
    CHECK(runs[1].weights == runs[0].weights);
    CHECK(runs[2].losses == runs[0].losses);
    CHECK(runs[2].weights == runs[0].weights);
  }
}

// Stage 3 runs stage 2's reduces and updates on the owned parameters, and its layers read gathered
// copies of the same values: the same bits, through optimizer()'s whole gather at step 10 (after
// which the next step shards again), with 2 accumulated micro-batches, with dropout, and with full
// recomputation (each block's forward rerun inside its backward, from the buffers gathered for it).
TEST_CASE("zero_stage 3 gives zero_stage 2's GPT losses, weights and optimizer state bit for bit", "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env, 200);
  struct Case {
    int devices, accumulation;
    float dropout;
    nn::Recompute recompute;
  };
  nn::Recompute const none = nn::Recompute::none;
  for (Case const c : {Case{2, 1, 0.0f, none}, Case{3, 1, 0.0f, none}, Case{2, 2, 0.0f, none}, Case{3, 1, 0.1f, none},
                       Case{2, 1, 0.1f, nn::Recompute::full}}) {
    CAPTURE(c.devices, c.accumulation, c.dropout, std::string(nn::to_string(c.recompute)));
    Run const two = gpt_run(c.devices, 2, c.accumulation, batches, c.dropout, c.recompute);
    Run const three = gpt_run(c.devices, 3, c.accumulation, batches, c.dropout, c.recompute);
    if (c.accumulation == 1) CHECK(two.losses.back() < 0.8f * two.losses.front());  // it learns
    CHECK(three.losses == two.losses);
    CHECK(three.weights == two.weights);
    CHECK(three.mid_state == two.mid_state);
  }
}
