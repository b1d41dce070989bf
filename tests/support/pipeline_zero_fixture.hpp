// The pipeline ZeRO tests' shared fixture (test_pipeline_zero*.cpp): a small tied GPT over a
// data x pipeline grid, its batches, the chunks' AdamW, the executor's options per ZeRO stage, a
// grid's run of a stage in a precision with what it leaves on every device, and the checks the
// stages' tests share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
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
#include "support/nn_env.hpp"

namespace mgpu::test::pipeline_zero {

using mgpu::DType;
using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::worst_relative;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

inline nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32};
inline std::uint64_t const seed = 7;
inline std::int64_t const batch = 7;  // uneven over 2 replicas and over micro-batches
inline int const steps = 10;
inline float const clip = 0.5f;  // below the gradients' norm (checked below), so steps clip
inline mgpu::optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
inline double const curve_tolerance = 1e-5;  // float32 rounding of other summation orders

using Batch = mgpu::test::TokenBatch;

// `count` batches, the rule's seeds from `first`.
inline std::vector<Batch> make_batches(Env& env, int count = steps, unsigned first = 300) {
  std::vector<Batch> batches;
  for (int s = 0; s < count; ++s)
    batches.push_back(mgpu::test::rule_batch(env, batch, config.block_size, config.vocab, first + static_cast<unsigned>(s)));
  return batches;
}

// AdamW decaying each chunk's weight matrices (the head's copy of wte too), as the one device
// decays gpt_decay_ranges; each optimizer made is listed in `made` (replica by replica, chunk by
// chunk, as the executor makes them) when given.
inline pp::ChunkOptimizerFactory chunk_adamw(std::shared_ptr<std::vector<mgpu::optim::Optimizer*>> made = nullptr) {
  return [made](nn::Sequential const& chunk) {
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges = chunk.matrix_ranges();
    auto optimizer = std::make_unique<mgpu::optim::AdamW>(options);
    if (made) made->push_back(optimizer.get());
    return optimizer;
  };
}

struct Grid {
  std::string name;
  pp::Schedule schedule;
  std::vector<std::size_t> cuts;
  int tp = 1;  // tensor-parallel ranks per stage
};

// DP 2 x PP 2 with every schedule, and DP 2 x TP 2 x PP 2 with 1F1B.
inline std::vector<Grid> every_schedule() {
  return {{"DP 2 x PP 2, gpipe", pp::gpipe(2, 2), {0, 3, 6}},
          {"DP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 3, 6}},
          {"DP 2 x PP 2, interleaved 2 x 2 chunks", pp::interleaved_one_f_one_b(2, 2, 2), {0, 2, 3, 4, 6}},
          {"DP 2 x PP 2, zb-h1", pp::zero_bubble_h1(2, 2), {0, 3, 6}},
          {"DP 2 x TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 4, 6}, 2}};
}

inline pp::ExecutorOptions options_for(int zero, int replicas = 2, DType compute = DType::float32) {
  return {.seed = seed,
          .data_parallel = replicas,
          .zero_stage = zero,
          .compute = compute,
          .clip_norm = clip,
          .loss = std::make_shared<nn::TokenCrossEntropy>()};
}

// The values `optimizer` keeps in its state buffers.
inline std::int64_t state_values(mgpu::optim::Optimizer const& optimizer) {
  std::int64_t total = 0;
  for (auto const& named : optimizer.state()) total += named.second.numel();
  return total;
}

// What a run leaves: train() fills losses and weights, run_grid() the rest too.
struct Run {
  int zero = 0;                             // the ZeRO stage
  std::vector<double> losses, weights;      // weights: replica 0's whole model after the steps
  std::vector<std::vector<double>> chunks;  // every pipeline's chunks' master parameters, pipeline by pipeline
  std::vector<std::int64_t> sizes;          // their parameter counts, in the same order
  std::vector<std::int64_t> states;         // each chunk optimizer's state values, in the same order
  std::vector<std::size_t> held, peaks;     // per device: bytes between steps, the peak of the steps after the first
  std::int64_t skipped = 0;
  std::vector<bool> applied;                  // per step
  std::vector<std::int64_t> optimizer_steps;  // per chunk optimizer, after the first step
};

// Replica 0's whole model, gathered from `ex` (with ZeRO-3 each chunk's parameters too).
inline std::vector<double> gathered(Env& env, pp::Executor& ex) {
  nn::Sequential whole = nn::gpt(config);
  whole.materialize(env.ctx, seed + 1);
  ex.gather_parameters(whole, env.stream);
  return as_double(whole.master_parameters());
}

// `steps` of `ex` over `batches` from `from`, then replica 0's weights.
inline Run train(Env& env, pp::Executor& ex, std::vector<Batch> const& batches, std::size_t from = 0, std::size_t to = steps) {
  Run run;
  for (std::size_t s = from; s < to; ++s) run.losses.push_back(ex.step(batches[s].ids, batches[s].targets));
  run.weights = gathered(env, ex);
  return run;
}

// `grid` with ZeRO `zero` in `compute` (float16 with a loss scaler from `initial_scale`) over every
// batch, on 4 x tp host devices of its own.
inline Run run_grid(Env& env, Grid const& grid, int zero, DType compute, std::vector<Batch> const& batches,
                    float initial_scale = 1024.0f) {
  mgpu::DeviceGroup group("host:" + std::to_string(4 * grid.tp));
  auto made = std::make_shared<std::vector<mgpu::optim::Optimizer*>>();
  pp::ExecutorOptions options = options_for(zero, 2, compute);
  if (compute == DType::float16) options.loss_scaler.emplace(initial_scale, 2.0f, 0.5f, 4);
  if (grid.tp > 1) options.tensor_parallel = pp::tensor_parallel_stages(nn::gpt(config), {}, grid.tp);
  pp::Executor ex(nn::gpt(config), group, grid.cuts, grid.schedule, chunk_adamw(made), options);
  Run run;
  run.zero = zero;
  for (std::size_t s = 0; s < batches.size(); ++s) {
    run.losses.push_back(ex.step(batches[s].ids, batches[s].targets));
    run.applied.push_back(ex.last_step_applied());
    if (s > 0) continue;
    for (mgpu::optim::Optimizer const* o : *made) run.optimizer_steps.push_back(o->steps());
    for (int r = 0; r < group.size(); ++r) group.allocator(r).reset_peak();  // AdamW's state made in the first update
  }
  for (int r = 0; r < group.size(); ++r) {
    run.held.push_back(group.allocator(r).stats().allocated);
    run.peaks.push_back(group.allocator(r).stats().peak_allocated);
  }
  run.weights = gathered(env, ex);
  for (int p = 0; p < 2 * grid.tp; ++p)
    for (int c = 0; c < ex.schedule().chunks(); ++c) {
      run.chunks.push_back(as_double(ex.chunk(c, p).master_parameters()));
      run.sizes.push_back(ex.chunk(c, p).parameter_count());
    }
  for (mgpu::optim::Optimizer const* o : *made) run.states.push_back(state_values(*o));
  if (ex.loss_scaler() != nullptr) run.skipped = ex.loss_scaler()->skipped();
  return run;
}

// Each grid's runs of `stages` (run_grid), handed to `check(grid, runs)` in the stages' order.
template <class Check>
void run_stages(Env& env, std::vector<Grid> const& grids, std::vector<int> const& stages, DType compute,
                std::vector<Batch> const& batches, Check const& check) {
  for (Grid const& grid : grids) {
    CAPTURE(grid.name);
    std::vector<Run> runs;
    for (int zero : stages) runs.push_back(run_grid(env, grid, zero, compute, batches));
    check(grid, runs);
  }
}

inline double worst_difference(std::vector<double> const& got, std::vector<double> const& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  return worst;
}

// A float32 run against one device's curve and weights: within float32 rounding.
inline void check_one_device(Grid const& grid, Run const& run, mgpu::test::GptCurve const& one) {
  int const zero = run.zero;
  CAPTURE(zero);
  double const worst = worst_relative(run.losses, one.losses);
  double const weights = worst_difference(run.weights, std::vector<double>(one.weights.begin(), one.weights.end()));
  WARN(grid.name << ", zero " << zero << ": worst relative loss difference " << worst << ", weights " << weights);
  CHECK(worst <= curve_tolerance);
  CHECK(weights < 5e-5);
}

// Every replica's chunks (pipeline p, tensor-parallel rank p % tp) equal replica 0's after the update.
inline void check_replicas_agree(Grid const& grid, Run const& run) {
  auto const tp = static_cast<std::size_t>(grid.tp);
  std::size_t const chunks = run.chunks.size() / (2 * tp);
  for (std::size_t p = tp; p < 2 * tp; ++p)
    for (std::size_t c = 0; c < chunks; ++c) CHECK(run.chunks[p * chunks + c] == run.chunks[(p % tp) * chunks + c]);
}

// AdamW's two state buffers over about half of each chunk's elements (a block of each bucket and
// the few elements past the blocks): 2 x (n / 2 + those few).
inline void check_half_state(Run const& run) {
  REQUIRE(run.states.size() == run.sizes.size());
  for (std::size_t i = 0; i < run.states.size(); ++i) {
    CAPTURE(i);
    CHECK(run.states[i] >= run.sizes[i]);
    CHECK(run.states[i] <= run.sizes[i] + 32);
  }
}

}  // namespace mgpu::test::pipeline_zero
