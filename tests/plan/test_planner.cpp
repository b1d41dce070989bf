// plan::plan_gpt and its step-time model on given costs (what it enumerates, what fits, how it
// ranks), and measure_gpt_costs on host devices. How well the ranking follows measured step times
// is bench_gpt's BM_gpt_plan (a Spearman correlation over the layouts that fit).
#include <mgpu/plan/planner.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/parallel/memory_model.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

namespace plan = mgpu::plan;
using mgpu::nn::Recompute;

namespace {

mgpu::nn::GptConfig const config{.vocab = 64, .block_size = 8, .n_layer = 4, .n_head = 4, .n_embd = 32};

// Costs of a machine whose devices compute on their own: a block 1 us per token, recomputation
// more; no fixed costs, free collectives, tensor parallelism halving a block.
plan::GptCosts free_costs() {
  plan::GptCosts costs;
  costs.block[0] = {0, 1e-6};
  costs.block[1] = {0, 1.1e-6};
  costs.block[2] = {0, 1.33e-6};
  costs.embedding = {0, 1e-7};
  costs.head = {0, 4e-7};
  costs.tensor_parallel = {{2, {0, 0.5e-6}, {0, 0.25e-6}}, {4, {0, 0.25e-6}, {0, 0.125e-6}}};
  costs.collective_seconds = 0;
  costs.collective_bytes_per_second = 1e30;
  return costs;
}

std::size_t predicted_peak(plan::Layout const& layout, std::int64_t rows, mgpu::nn::GptConfig c = config) {
  c.recompute = layout.recompute;
  std::size_t peak = 0;
  for (mgpu::parallel::GptMemory const& m : mgpu::parallel::predict_gpt_memory(
           c, rows,
           {.data_parallel = layout.data_parallel,
            .tensor_parallel = layout.tensor_parallel,
            .zero_stage = layout.zero_stage,
            .cuts = layout.cuts,
            .micro_batches = layout.micro_batches,
            .sequence_parallel = layout.sequence_parallel}))
    peak = std::max(peak, m.total());
  return peak;
}

}  // namespace

TEST_CASE("the step-time model: one device's sum of its parts, data parallelism's split rows and shared compute",
          "[plan]") {
  plan::GptCosts costs = free_costs();
  costs.update_seconds_per_element = 1e-9;
  double const tokens = 6 * config.block_size;
  double const params = static_cast<double>(mgpu::nn::gpt(config).parameter_count());
  // One device: four blocks, the embedding, the head, AdamW over every parameter.
  double const one = plan::predict_step_seconds(config, 6, {}, costs);
  CHECK(one == Approx(4 * 1e-6 * tokens + 1e-7 * tokens + 4e-7 * tokens + 1e-9 * params).epsilon(1e-3));
  // Two replicas of their own: half the rows each, half the update each (ZeRO-1).
  plan::Layout const dp{.data_parallel = 2, .zero_stage = 1};
  double const two = plan::predict_step_seconds(config, 6, dp, costs);
  CHECK(two == Approx(one / 2).epsilon(0.02));
  // The same two sharing one device's compute take as long as one device.
  costs.concurrency = 1;
  CHECK(plan::predict_step_seconds(config, 6, dp, costs) == Approx(one).epsilon(0.02));
  // Rows that do not split evenly: the larger replica sets the pace (4 of 7 rows).
  costs.concurrency = 0;
  double const seven = plan::predict_step_seconds(config, 7, dp, costs);
  CHECK(seven > plan::predict_step_seconds(config, 6, dp, costs));
  CHECK(seven == Approx(plan::predict_step_seconds(config, 8, dp, costs)).epsilon(0.02));
  // A collective with a latency makes the replicas pay it; the one device does not.
  costs.collective_seconds = 1e-3;
  CHECK(plan::predict_step_seconds(config, 6, dp, costs) > two + 1e-3);
  // ZeRO-3 gathers the parameters again: more collectives than ZeRO-1.
  CHECK(plan::predict_step_seconds(config, 6, {.data_parallel = 2, .zero_stage = 3}, costs) >
        plan::predict_step_seconds(config, 6, dp, costs));
  CHECK(plan::predict_step_seconds(config, 6, {}, costs) == Approx(one));
}

TEST_CASE("the step-time model: data parallelism from its measured step when there is one", "[plan]") {
  plan::GptCosts costs = free_costs();
  costs.update_seconds_per_element = 1e-9;
  costs.collective_seconds = 1e-3;  // within the measured step: not added again
  costs.data_parallel = {{2, {1e-5, 2e-6}, {3e-5, 1e-6}}};
  double const tokens = 3 * config.block_size;  // a replica's rows
  double const measured = 3e-5 + 1e-6 * tokens + 4 * (1e-5 + 2e-6 * tokens);
  CHECK(plan::predict_step_seconds(config, 6, {.data_parallel = 2, .zero_stage = 1}, costs) == Approx(measured).epsilon(1e-9));
  // Full recomputation: each replica reruns every block's forward, as slow as the measured
  // replicas' block is against one device's.
  double const slowdown = (1e-5 + 2e-6 * tokens) / (1e-6 * tokens);
  CHECK(plan::predict_step_seconds(config, 6, {.data_parallel = 2, .zero_stage = 1, .recompute = Recompute::full}, costs) ==
        Approx(measured + 4 * (1.33e-6 - 1e-6) * tokens * slowdown).epsilon(1e-9));
  // ZeRO-0 updates the other half of the parameters too.
  double const params = static_cast<double>(mgpu::nn::gpt(config).parameter_count());
  CHECK(plan::predict_step_seconds(config, 6, {.data_parallel = 2, .zero_stage = 0}, costs) ==
        Approx(measured + params / 2 * 1e-9).epsilon(0.01));
  // Two replicas measured sharing one device's compute: a replica's own compute is half of it, and
  // together they take the measured time.
  costs.concurrency = 1;
  CHECK(plan::predict_step_seconds(config, 6, {.data_parallel = 2, .zero_stage = 1}, costs) == Approx(measured).epsilon(1e-9));
  // A degree without a measured step is composed from the parts, with its collectives.
  costs.concurrency = 0;
  costs.data_parallel.clear();
  CHECK(plan::predict_step_seconds(config, 6, {.data_parallel = 2, .zero_stage = 1}, costs) > 1e-3);
}

TEST_CASE("the step-time model: a pipeline's bubble shrinks with micro-batches until their fixed costs dominate",
          "[plan]") {
  plan::GptCosts costs = free_costs();
  std::size_t const layers = mgpu::nn::gpt(config).size();  // embedding, dropout, 4 blocks, LayerNorm, head
  auto const pipeline = [&](int micro_batches) {
    return plan::Layout{.stages = 2, .micro_batches = micro_batches, .cuts = {0, 4, layers}};
  };
  double const one = plan::predict_step_seconds(config, 8, {}, costs);
  double const m2 = plan::predict_step_seconds(config, 8, pipeline(2), costs);
  double const m8 = plan::predict_step_seconds(config, 8, pipeline(8), costs);
  // Two stages of about half the work: (m + 1) / m halves, less than one device's time.
  CHECK(m2 < one);
  CHECK(m8 < m2);
  CHECK(m2 == Approx(one / 2 * 3 / 2).epsilon(0.15));
  // A fixed cost per block call: eight micro-batches pay it eight times per stage.
  costs.block[0].fixed = 1e-3;
  CHECK(plan::predict_step_seconds(config, 8, pipeline(8), costs) > plan::predict_step_seconds(config, 8, pipeline(2), costs));
  // The cuts must be the stages'.
  REQUIRE_MGPU_ERROR(plan::predict_step_seconds(config, 8, {.stages = 3, .micro_batches = 2, .cuts = {0, 4, layers}}, costs),
                     mgpu::Errc::invalid_argument, "stages + 1 cuts");
}

TEST_CASE("the step-time model: tensor parallelism from its measured costs, refused without them", "[plan]") {
  plan::GptCosts costs = free_costs();
  double const one = plan::predict_step_seconds(config, 4, {}, costs);
  double const tp2 = plan::predict_step_seconds(config, 4, {.tensor_parallel = 2}, costs);
  double const tp4 = plan::predict_step_seconds(config, 4, {.tensor_parallel = 4}, costs);
  CHECK(tp2 < one);
  CHECK(tp4 == Approx(tp2 / 2).epsilon(0.05));
  // Measured costs are of the ranks alone, sharing what they share: four ranks on two devices'
  // compute take what was measured; two groups of two ranks on them take twice their measure.
  costs.concurrency = 2;
  CHECK(plan::predict_step_seconds(config, 4, {.tensor_parallel = 4}, costs) == Approx(tp4).epsilon(1e-6));
  costs.concurrency = 0;
  double const half = plan::predict_step_seconds(config, 2, {.tensor_parallel = 2}, costs);  // a replica's rows
  costs.concurrency = 2;
  CHECK(plan::predict_step_seconds(config, 4, {.data_parallel = 2, .tensor_parallel = 2}, costs) == Approx(2 * half).epsilon(0.01));
  // Two stages of two ranks each, four micro-batches: faster than the one stage of two ranks.
  std::size_t const layers = mgpu::nn::gpt(config).size();
  costs.concurrency = 0;
  CHECK(plan::predict_step_seconds(config, 4, {.tensor_parallel = 2, .stages = 2, .micro_batches = 4, .cuts = {0, 4, layers}}, costs) <
        tp2);
  costs.tensor_parallel.pop_back();
  REQUIRE_MGPU_ERROR(plan::predict_step_seconds(config, 4, {.tensor_parallel = 4}, costs), mgpu::Errc::invalid_argument,
                     "costs.tensor_parallel to hold its costs");
}

TEST_CASE("plan_gpt enumerates every layout over the devices and keeps those that fit, fastest first", "[plan]") {
  plan::GptCosts const costs = free_costs();
  plan::Plan const all = plan::plan_gpt(config, 8, 4, costs, {});
  // dp 4 (ZeRO 0-3), dp 2 x tp 2 (ZeRO 0-3) and tp 4, each tensor-parallel one with and without
  // sequence parallelism; pipelines of 2 stages (2 replicas, ZeRO 0-3; micro-batches 2, 4), of 4
  // (micro-batches 4, 8), and of 2 stages of tp 2 (micro-batches 2, 4, 8; with and without
  // sequence parallelism): 4 + 8 + 2 + 8 + 2 + 6 layouts, each with 3 recomputation modes.
  CHECK(all.considered == 90);
  REQUIRE(all.candidates.size() == 90);
  std::set<std::string> names;
  for (std::size_t i = 0; i < all.candidates.size(); ++i) {
    plan::Candidate const& c = all.candidates[i];
    plan::Layout const& l = c.layout;
    names.insert(plan::to_string(l));
    CHECK(l.data_parallel * l.tensor_parallel * l.stages == 4);
    CHECK((l.zero_stage == 0 || (l.data_parallel > 1 && l.zero_stage <= 3)));
    CHECK((!l.sequence_parallel || l.tensor_parallel > 1));
    CHECK(l.cuts.size() == (l.stages > 1 ? static_cast<std::size_t>(l.stages) + 1 : 0));
    CHECK(c.peak_bytes == predicted_peak(l, 8));  // the memory model's largest device
    CHECK(c.step_seconds == plan::predict_step_seconds(config, 8, l, costs));
    if (i > 0) CHECK(all.candidates[i - 1].step_seconds <= c.step_seconds);
  }
  CHECK(names.size() == 90);
  // Free collectives and devices of their own: data parallelism over four devices is fastest.
  CHECK(all.candidates.front().layout.data_parallel == 4);

  // A budget between the smallest and the largest peak: exactly the layouts at or below it remain.
  std::vector<std::size_t> peaks;
  for (plan::Candidate const& c : all.candidates) peaks.push_back(c.peak_bytes);
  std::sort(peaks.begin(), peaks.end());
  std::size_t const budget = peaks[peaks.size() / 2];
  plan::Plan const some = plan::plan_gpt(config, 8, 4, costs, {.memory_bytes = budget});
  CHECK(some.considered == 90);
  CHECK(some.candidates.size() == static_cast<std::size_t>(std::count_if(peaks.begin(), peaks.end(), [&](std::size_t p) { return p <= budget; })));
  for (plan::Candidate const& c : some.candidates) CHECK(c.peak_bytes <= budget);

  // Options leave layouts out; a degree without costs is not weighed.
  plan::Plan const data_only = plan::plan_gpt(config, 8, 4, costs, {.tensor_parallel = false, .pipeline = false, .zero = false});
  CHECK(data_only.considered == 3);
  plan::GptCosts no_tp = costs;
  no_tp.tensor_parallel.clear();
  CHECK(plan::plan_gpt(config, 8, 4, no_tp, {}).considered == 42);  // dp 4 (4), pipelines of 2 x 2 (8) and of 4 (2), x 3
}

TEST_CASE("the step-time model: ZeRO over tensor-parallel replicas shares their update, with data parallelism's collectives",
          "[plan]") {
  plan::GptCosts costs = free_costs();
  costs.update_seconds_per_element = 1e-9;
  auto const tp = [](int zero) { return plan::Layout{.data_parallel = 2, .tensor_parallel = 2, .zero_stage = zero}; };
  auto const dp = [](int zero) { return plan::Layout{.data_parallel = 2, .zero_stage = zero}; };
  // Free collectives: each rank updates half its shard (about a quarter of the model) instead of all
  // of it (about: the memory model's allocator blocks round the small tensors up).
  double const whole = static_cast<double>(mgpu::nn::gpt(config).parameter_count());
  double const replicated = plan::predict_step_seconds(config, 4, tp(0), costs);
  for (int zero = 1; zero <= 3; ++zero)
    CHECK(replicated - plan::predict_step_seconds(config, 4, tp(zero), costs) == Approx(whole / 4 * 1e-9).epsilon(0.1));
  // Collectives of a latency: each stage's reduce-scatters and all-gathers over the replicas cost
  // what they cost plain data parallelism (composed from its parts, without an update to weigh).
  costs.update_seconds_per_element = 0;
  costs.collective_seconds = 1e-3;
  for (int zero = 1; zero <= 3; ++zero) {
    double const tensor = plan::predict_step_seconds(config, 4, tp(zero), costs) - plan::predict_step_seconds(config, 4, tp(0), costs);
    double const data = plan::predict_step_seconds(config, 4, dp(zero), costs) - plan::predict_step_seconds(config, 4, dp(0), costs);
    CHECK(tensor > 1.99e-3);  // at least a reduce-scatter and an all-gather more than the all-reduce
    CHECK(tensor == Approx(data).epsilon(1e-9));
  }
}

TEST_CASE("plan_gpt plans ZeRO over tensor-parallel replicas where only they fit", "[plan]") {
  // Two heads (no tp 4) and two rows (no dp 4, no pipeline of replicas) on 4 devices: dp 2 x tp 2
  // with ZeRO 0-3 and 2 stages of tp 2 (2 micro-batches), each with and without sequence
  // parallelism, each with 3 recomputation modes. A large vocab: the embedding's AdamW state
  // dominates, which ZeRO shards over the replicas and the pipeline keeps whole on both ends (the
  // embedding and the tied head's copy).
  mgpu::nn::GptConfig const wide{.vocab = 4096, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 64};
  plan::GptCosts const costs = free_costs();
  plan::Plan const all = plan::plan_gpt(wide, 2, 4, costs, {});
  CHECK(all.considered == 30);
  REQUIRE(all.candidates.size() == 30);
  std::size_t sharded = std::numeric_limits<std::size_t>::max(), others = sharded;
  for (plan::Candidate const& c : all.candidates) {
    plan::Layout const& l = c.layout;
    CHECK(c.peak_bytes == predicted_peak(l, 2, wide));
    std::size_t& need = l.data_parallel == 2 && l.tensor_parallel == 2 && l.zero_stage >= 1 ? sharded : others;
    need = std::min(need, c.peak_bytes);
  }
  REQUIRE(sharded < others);
  plan::Plan const tight = plan::plan_gpt(wide, 2, 4, costs, {.memory_bytes = sharded});
  REQUIRE(!tight.candidates.empty());
  for (plan::Candidate const& c : tight.candidates) {
    CHECK(c.layout.data_parallel == 2);
    CHECK(c.layout.tensor_parallel == 2);
    CHECK(c.layout.zero_stage >= 1);
    CHECK(c.peak_bytes <= sharded);
  }
  // Without ZeRO nothing fits: the error names the smallest need of the rest.
  REQUIRE_MGPU_ERROR(plan::plan_gpt(wide, 2, 4, costs, {.memory_bytes = sharded, .zero = false}), mgpu::Errc::out_of_memory,
                     "needs " + std::to_string(others));
}

TEST_CASE("plan_gpt trades compute for memory: recomputation when only it fits, an error naming the smallest need",
          "[plan]") {
  plan::GptCosts const costs = free_costs();
  // One device: full recomputation has the smallest peak and the largest step time.
  plan::Plan const one = plan::plan_gpt(config, 8, 1, costs, {});
  REQUIRE(one.candidates.size() == 3);
  CHECK(one.candidates.front().layout.recompute == Recompute::none);
  CHECK(one.candidates.back().layout.recompute == Recompute::full);
  std::size_t const full = predicted_peak({.recompute = Recompute::full}, 8);
  std::size_t const selective = predicted_peak({.recompute = Recompute::selective}, 8);
  REQUIRE(full < selective);
  plan::Plan const tight = plan::plan_gpt(config, 8, 1, costs, {.memory_bytes = full});
  REQUIRE(tight.candidates.size() == 1);
  CHECK(tight.candidates.front().layout.recompute == Recompute::full);
  REQUIRE_MGPU_ERROR(plan::plan_gpt(config, 8, 1, costs, {.memory_bytes = full - 1}), mgpu::Errc::out_of_memory,
                     "needs " + std::to_string(full));
  REQUIRE_MGPU_ERROR(plan::plan_gpt(config, 8, 0, costs, {}), mgpu::Errc::invalid_argument, "expected at least one of each");
  // 3 devices, 2 rows, 4 heads: neither 3 replicas, 3 ranks nor 3 stages of 3 micro-batches.
  REQUIRE_MGPU_ERROR(plan::plan_gpt(config, 2, 3, costs, {}), mgpu::Errc::invalid_argument,
                     "plan_gpt: no layout over 3 devices for 2 rows and n_head 4");
  REQUIRE_MGPU_ERROR(plan::plan_gpt(config, 0, 2, costs, {}), mgpu::Errc::invalid_argument, "expected at least one of each");
}

TEST_CASE("measure_gpt_costs measures every part on host devices, and tensor parallelism for the degrees that divide",
          "[plan]") {
  mgpu::DeviceGroup group("host:2");
  plan::GptCosts const costs = plan::measure_gpt_costs(config, group, {1, 4}, 1);
  CHECK(costs.concurrency == static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  for (plan::CostLine const& line : {costs.block[0], costs.block[1], costs.block[2], costs.embedding, costs.head}) {
    CHECK(line.fixed >= 0);
    CHECK(line.per_token >= 0);
    CHECK(line.at(32) > 0);
  }
  CHECK(costs.update_seconds_per_element > 0);
  CHECK(costs.collective_seconds > 0);
  CHECK(costs.collective_bytes_per_second > 0);
  REQUIRE(costs.tensor_parallel.size() == 1);
  CHECK(costs.tensor_parallel[0].ranks == 2);
  CHECK(costs.tensor_parallel[0].block.at(32) + costs.tensor_parallel[0].rest.at(32) > 0);
  REQUIRE(costs.data_parallel.size() == 1);
  CHECK(costs.data_parallel[0].ranks == 2);
  CHECK(costs.data_parallel[0].block.at(32) + costs.data_parallel[0].rest.at(32) > 0);
  // What it measured plans a layout.
  CHECK(plan::plan_gpt(config, 4, 2, costs, {}).candidates.size() == plan::plan_gpt(config, 4, 2, costs, {}).considered);
  REQUIRE_MGPU_ERROR(plan::measure_gpt_costs(config, group, {}), mgpu::Errc::invalid_argument, "at least one count");
  REQUIRE_MGPU_ERROR(plan::measure_gpt_costs(config, group, {0}), mgpu::Errc::invalid_argument, "each >= 1");
  REQUIRE_MGPU_ERROR(plan::measure_gpt_costs(config, group, {1}, 0), mgpu::Errc::invalid_argument, "repeats >= 1");
}
