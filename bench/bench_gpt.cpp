// bench_gpt: one GPT training step on one host device (one worker thread): forward, per-token
// cross-entropy, backward, clipping by global norm (1.0) and AdamW (the step of
// scripts/gpt_peer.py, PyTorch's side of the comparison), for two shapes:
//   nano   nanoGPT's CPU config: n_layer 4, n_head 4, n_embd 128, block 64, batch 12, vocab 256;
//   gpt2s  GPT-2 small's shape: n_layer 12, n_head 12, n_embd 768, block 256, batch 4, vocab 256
//          (85.4 M parameters; a few steps only, a step takes seconds).
// Batches are random token windows (a fixed seed) cycled from a pool. Counters, medians over steps:
//   BM_gpt_step/<shape>:
//     tokens_per_s       batch * block / the median step time;
//     step_ms            the median step time;
//     peak_bytes_device  the device allocator's peak of live bytes over the timed steps
//                        (parameters, gradients, AdamW state and the step's activations);
//     params             the model's parameter count;
//     step_gemm_share    the time in the library's host GEMM calls (ops::host_gemm_stats) / the
//                        step's time, summed over the timed steps;
//     step_<family>_share  the same for each family of ops::HostOpFamily (attention, norm,
//                        activation, loss, optimizer, embedding, elementwise; ops::host_op_seconds);
//     step_other_share   1 - the shares above: what runs outside the ops (enqueueing, allocation,
//                        synchronization, argument checks) and the token id checks;
//     step_gemm_gflops   the step's GEMM flops / the time in its GEMMs;
//     sgemm_gflops       the machine's sgemm in the same run: the library's host GEMM on a float32
//                        512 x 512 x 512 product on the same worker, timed after every step (median);
//     step_gflop         the step's floating-point work: its GEMMs' (counted) plus causal attention's
//                        7 products over the visible (query, key) pairs;
//     sgemm512_time_fraction  step_gflop at sgemm_gflops / the median step time: 1 when everything
//                        but matrix products were free and those ran at the 512³ sgemm's rate (not
//                        a ceiling: the step's own GEMMs, of other shapes, may run faster than
//                        that, and the fraction then exceeds 1).
//   BM_gpt_step_bf16/<shape>: the same step with bfloat16 compute (float32 master weights, AdamW on
//   them; nano only), its counters as BM_gpt_step's except the reference GEMM's:
//     bf16_gemm_gflops   the library's host GEMM on a bfloat16 512 x 512 x 512 product (bf16 in and
//                        out, float32 accumulation) in the same run, timed after every step (median);
//     bf16_gemm512_time_fraction  step_gflop at bf16_gemm_gflops / the median step time.
//   BM_gpt_step_dp/<shape>: the same step data parallel over host:2 (parallel::DataParallel: each
//   device a worker thread with half of every batch, gradients all-reduced in buckets during
//   backward), and the one-device step of BM_gpt_step timed in turn on the same batches:
//     tokens_per_s            batch * block / the median data-parallel step time;
//     one_device_tokens_per_s the one-device step's, from the turns in between;
//     speedup_vs_one_device   median over turns of one-device step time / data-parallel step time;
//     peak_bytes_device       the largest of the two devices' allocator peaks;
//     step_communication_wait_share  median over steps of the devices' mean wait for the gradient
//                             reduces after backward (DataParallelResult::wait_ms) / the step's time
//                             (the communication that backward did not hide).
//   BM_gpt_metrics_update/<shape>: BM_gpt_step_dp's data-parallel step, each followed by what a
//   trainer does for its live metrics (metrics::Registry) at the end of a step: each device's
//   DeviceStep from the times the executor reported to the registry and its allocator, and
//   Registry::record; timed apart:
//     metrics_update_us           the median update time;
//     metrics_update_over_step    median update time / median step time (issue 40 asks < 0.01);
//     exposition_us               the median time of one scrape's text (Registry::exposition);
//     textfile_write_us           the median time of metrics::write_textfile (--metrics-file).
//   BM_gpt_recompute/<mode>: BM_gpt_step on the nano shape with activation recomputation
//   (nn::Recompute: 0 none, 1 selective, 2 full; a short run):
//     tokens_per_s, step_ms, peak_bytes_device  as in BM_gpt_step.
//   BM_gpt_plan: the planner (plan::plan_gpt) on the nano shape over host:2: the costs measured
//   (plan::measure_gpt_costs), a budget per device that the largest quarter of the layouts'
//   predicted peaks exceed, then every layout that fits run through train::Trainer (as --plan
//   auto runs it) and stepped (rounds of 3 steps of each in turn, 3 rounds, after 2 untimed steps):
//     layouts_considered, layouts_fit       what the planner weighed, and kept;
//     spearman_predicted_vs_measured_step_time  Spearman's rank correlation between the predicted
//                         and the measured (median) step times of the layouts that fit;
//     chosen_measured_rank                1 when the planner's choice measured fastest;
//     chosen_measured_step_over_fastest   its measured step time / the fastest measured;
//     budget_bytes_device                 the budget;
//     largest_measured_peak_over_budget   the largest allocator peak of any layout that fit /
//                                         the budget (the memory model's error shows above 1).
// The same binary runs BM_attention (bench_gpt_attention.cpp), BM_gpt_zero (bench_gpt_zero.cpp),
// BM_gpt_layouts (bench_gpt_layouts.cpp), and BM_gpt_gemm and BM_gpt_activation (bench_gpt_ops.cpp).
//   bench_gpt --benchmark_out=gpt.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/ops/transformer.hpp>

#include "bench_gpt_support.hpp"

namespace {

using namespace bench::gpt;

// BM_gpt_step's body for one compute type, its time at the same type's reference GEMM (float32:
// the sgemm; bfloat16: the bf16 GEMM), named by `rate_counter`, and the fraction by
// `fraction_counter`.
void gpt_step(benchmark::State& state, mgpu::DType compute, char const* rate_counter, char const* fraction_counter) {
  Shape const& shape = shapes[state.range(0)];
  GptTrainer trainer(shape, compute);
  Sgemm sgemm(*trainer.allocator, compute);
  trainer.step();  // the allocator's cache, AdamW's state, the GEMM primitives
  (void)sgemm.seconds(trainer.stream);  // its primitive
  trainer.allocator->reset_peak();
  std::vector<double> step_s, sgemm_s;
  // The worker's host GEMM and op totals (read between steps), and their sums over the steps.
  struct Totals {
    mgpu::ops::HostGemmStats gemm;
    mgpu::ops::HostOpSeconds ops;
  };
  auto const read = [&] {
    Totals t;
    trainer.stream.enqueue([&t] { t = {mgpu::ops::host_gemm_stats(), mgpu::ops::host_op_seconds()}; });
    trainer.stream.synchronize();
    return t;
  };
  double gemm_s = 0, gemm_flops = 0;
  mgpu::ops::HostOpSeconds op_s;
  for (auto _ : state) {
    state.PauseTiming();
    Totals const before = read();
    state.ResumeTiming();
    auto const t0 = Clock::now();
    trainer.step();
    step_s.push_back(seconds_since(t0));
    state.PauseTiming();
    Totals const after = read();
    gemm_s += after.gemm.seconds - before.gemm.seconds;
    gemm_flops += after.gemm.flops - before.gemm.flops;
    for (std::size_t f = 0; f < mgpu::ops::host_op_family_count; ++f)
      op_s.seconds[f] += after.ops.seconds[f] - before.ops.seconds[f];
    sgemm_s.push_back(sgemm.seconds(trainer.stream));  // in turn with the steps: under the same load
    state.ResumeTiming();
  }
  double total_s = 0;
  for (double s : step_s) total_s += s;
  double const step = median(step_s);
  auto const steps = static_cast<double>(step_s.size());
  double const sgemm_rate = Sgemm::flops() / median(sgemm_s);
  double const step_flops = gemm_flops / steps + attention_flops(shape.config, shape.batch);
  state.SetLabel(std::string(shape.name) + ", " + std::string(mgpu::to_string(compute)) +
                 " compute, host GEMM: " + mgpu::host_gemm_backend);
  state.counters["tokens_per_s"] = static_cast<double>(trainer.tokens()) / step;
  state.counters["step_ms"] = step * 1e3;
  state.counters["peak_bytes_device"] = static_cast<double>(trainer.allocator->stats().peak_allocated);
  state.counters["params"] = static_cast<double>(trainer.model.parameter_count());
  state.counters["step_gemm_share"] = gemm_s / total_s;
  double accounted = gemm_s;
  for (std::size_t f = 0; f < mgpu::ops::host_op_family_count; ++f) {
    accounted += op_s.seconds[f];
    state.counters[std::string("step_") + mgpu::ops::host_op_family_name(static_cast<mgpu::ops::HostOpFamily>(f)) +
                   "_share"] = op_s.seconds[f] / total_s;
  }
  state.counters["step_other_share"] = 1.0 - accounted / total_s;
  state.counters["step_gemm_gflops"] = gemm_flops / gemm_s / 1e9;
  state.counters[rate_counter] = sgemm_rate / 1e9;
  state.counters["step_gflop"] = step_flops / 1e9;
  state.counters[fraction_counter] = step_flops / sgemm_rate / step;
}
void BM_gpt_step(benchmark::State& state) {
  gpt_step(state, mgpu::DType::float32, "sgemm_gflops", "sgemm512_time_fraction");
}
BENCHMARK(BM_gpt_step)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(8.0));
BENCHMARK(BM_gpt_step)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(bench::iterations(3));

void BM_gpt_step_bf16(benchmark::State& state) {
  gpt_step(state, mgpu::DType::bfloat16, "bf16_gemm_gflops", "bf16_gemm512_time_fraction");
}
BENCHMARK(BM_gpt_step_bf16)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(3.0));

void BM_gpt_recompute(benchmark::State& state) {
  auto const recompute = static_cast<mgpu::nn::Recompute>(state.range(0));
  Shape shape = shapes[0];
  shape.config.recompute = recompute;
  GptTrainer trainer(shape);
  trainer.step();
  trainer.allocator->reset_peak();
  std::vector<double> step_s;
  for (auto _ : state) {
    auto const t0 = Clock::now();
    trainer.step();
    step_s.push_back(seconds_since(t0));
  }
  double const step = median(step_s);
  state.SetLabel(std::string(shape.name) + ", recompute " + std::string(mgpu::nn::to_string(recompute)));
  state.counters["tokens_per_s"] = static_cast<double>(trainer.tokens()) / step;
  state.counters["step_ms"] = step * 1e3;
  state.counters["peak_bytes_device"] = static_cast<double>(trainer.allocator->stats().peak_allocated);
}
BENCHMARK(BM_gpt_recompute)->DenseRange(0, 2)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(0.5));

void BM_gpt_step_dp(benchmark::State& state) {
  Shape const& shape = shapes[state.range(0)];
  GptTrainer one(shape);  // its batches feed both
  mgpu::DeviceGroup group("host:2");
  mgpu::parallel::DataParallelOptions options;
  options.seed = 1;
  options.clip_norm = 1.0f;
  options.loss = std::make_shared<mgpu::nn::TokenCrossEntropy>();
  mgpu::parallel::DataParallel dp(mgpu::nn::gpt(shape.config), group, one.adamw, std::move(options));
  std::int64_t next = 0;
  std::vector<double> wait_ms;  // per step, the devices' mean wait for the gradient reduces after backward
  auto const dp_step = [&] {
    std::int64_t const b = next++ % GptTrainer::pool;
    auto const result = dp.step(one.inputs.slice(b * shape.batch, (b + 1) * shape.batch),
                                one.targets.slice(b * shape.batch, (b + 1) * shape.batch));
    wait_ms.push_back(std::accumulate(result.wait_ms.begin(), result.wait_ms.end(), 0.0) /
                      static_cast<double>(std::max<std::size_t>(1, result.wait_ms.size())));
  };
  one.step();
  dp_step();
  for (int r = 0; r < group.size(); ++r) group.allocator(r).reset_peak();
  wait_ms.clear();
  std::vector<double> dp_s, one_s, speedup;
  for (auto _ : state) {
    auto t0 = Clock::now();
    dp_step();
    dp_s.push_back(seconds_since(t0));
    state.PauseTiming();
    t0 = Clock::now();
    one.step();
    one_s.push_back(seconds_since(t0));
    speedup.push_back(one_s.back() / dp_s.back());
    state.ResumeTiming();
  }
  double peak = 0;
  for (int r = 0; r < group.size(); ++r)
    peak = std::max(peak, static_cast<double>(group.allocator(r).stats().peak_allocated));
  state.SetLabel(std::string(shape.name) + ", host:2 data parallel");
  state.counters["tokens_per_s"] = static_cast<double>(one.tokens()) / median(dp_s);
  state.counters["one_device_tokens_per_s"] = static_cast<double>(one.tokens()) / median(one_s);
  state.counters["speedup_vs_one_device"] = median(speedup);
  state.counters["peak_bytes_device"] = peak;
  std::vector<double> wait_share(dp_s.size());
  for (std::size_t i = 0; i < dp_s.size(); ++i) wait_share[i] = wait_ms[i] / 1e3 / dp_s[i];
  state.counters["step_communication_wait_share"] = median(wait_share);
}
BENCHMARK(BM_gpt_step_dp)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(8.0));
BENCHMARK(BM_gpt_step_dp)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(bench::iterations(3));

void BM_gpt_metrics_update(benchmark::State& state) {
  Shape const& shape = shapes[state.range(0)];
  GptTrainer one(shape);
  mgpu::DeviceGroup group("host:2");
  mgpu::parallel::DataParallelOptions options;
  options.seed = 1;
  options.clip_norm = 1.0f;
  options.loss = std::make_shared<mgpu::nn::TokenCrossEntropy>();
  // The registry the executor reports its ranks' times to, read back as a trainer does.
  auto const registry = std::make_shared<mgpu::metrics::Registry>("bench_gpt", mgpu::metrics::Layout{.dp = 2, .zero = 1});
  options.metrics = registry;
  mgpu::parallel::DataParallel dp(mgpu::nn::gpt(shape.config), group, one.adamw, std::move(options));
  std::filesystem::path const file = std::filesystem::temp_directory_path() / ("bench_gpt_metrics_" + std::to_string(::getpid()) + ".prom");
  std::int64_t next = 0;
  std::vector<double> step_s, update_s, exposition_s, write_s;
  for (auto _ : state) {
    std::int64_t const b = next++ % GptTrainer::pool;
    auto t0 = Clock::now();
    auto const result = dp.step(one.inputs.slice(b * shape.batch, (b + 1) * shape.batch),
                                one.targets.slice(b * shape.batch, (b + 1) * shape.batch));
    step_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    std::vector<mgpu::metrics::DeviceStep> devices(static_cast<std::size_t>(group.size()));
    for (int r = 0; r < group.size(); ++r) {
      auto& d = devices[static_cast<std::size_t>(r)];
      auto const i = static_cast<std::size_t>(r);
      d.device = group.device(r).to_string();
      d.kind = "host";
      d.world_rank = r;
      if (std::optional<mgpu::metrics::DeviceTimes> const times = registry->reported_times(r)) {
        d.compute_seconds = times->compute_seconds;
        d.wait_seconds = times->wait_seconds;
      }
      d.rows = result.rows[i];
      d.tokens = result.rows[i] * shape.config.block_size;
      d.shard_weight = dp.weights()[i];
      mgpu::metrics::read_memory(d, group.allocator(r));
    }
    registry->record({.step = next, .loss = result.loss, .seconds = step_s.back(), .samples = shape.batch,
                     .tokens = shape.batch * shape.config.block_size, .learning_rate = 1e-3, .loss_scale = std::nullopt, .skipped = !result.applied},
                    devices);
    update_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    benchmark::DoNotOptimize(registry->exposition());
    exposition_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    mgpu::metrics::write_textfile(*registry, file);
    write_s.push_back(seconds_since(t0));
  }
  std::filesystem::remove(file);
  state.SetLabel(std::string(shape.name) + ", host:2 data parallel");
  state.counters["step_ms"] = median(step_s) * 1e3;
  state.counters["metrics_update_us"] = median(update_s) * 1e6;
  state.counters["metrics_update_over_step"] = median(update_s) / median(step_s);
  state.counters["exposition_us"] = median(exposition_s) * 1e6;
  state.counters["textfile_write_us"] = median(write_s) * 1e6;
}
BENCHMARK(BM_gpt_metrics_update)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(bench::iterations(20));

// One planned layout run as train_gpt --plan auto runs it (train::Trainer over its own host:2,
// ParallelConfig::from_plan, clipping 1.0), stepped on the batches of `one`.
struct LayoutRun {
  GptTrainer& one;
  mgpu::train::Trainer trainer;
  std::int64_t next = 0;

  LayoutRun(GptTrainer& batches, mgpu::plan::Layout const& layout)
      : one(batches), trainer(one.shape.config, mgpu::DeviceGroup("host:2"), config(layout),
                              {.seed = 1, .adamw = adamw_options, .batch_size = one.shape.batch}) {}
  static mgpu::train::ParallelConfig config(mgpu::plan::Layout const& layout) {
    mgpu::train::ParallelConfig c = mgpu::train::ParallelConfig::from_plan(layout);
    c.clip_norm = 1.0f;
    return c;
  }
  void step() {
    std::int64_t const b = next++ % GptTrainer::pool, rows = one.shape.batch;
    (void)trainer.step(one.inputs.slice(b * rows, (b + 1) * rows), one.targets.slice(b * rows, (b + 1) * rows));
  }
};

// Spearman's rank correlation of two series of equal length (ties get their average rank).
double spearman(std::vector<double> const& a, std::vector<double> const& b) {
  auto const ranks = [](std::vector<double> const& v) {
    std::vector<std::size_t> order(v.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::size_t i, std::size_t j) { return v[i] < v[j]; });
    std::vector<double> rank(v.size());
    for (std::size_t i = 0; i < order.size();) {
      std::size_t j = i;
      while (j + 1 < order.size() && v[order[j + 1]] == v[order[i]]) ++j;
      for (std::size_t k = i; k <= j; ++k) rank[order[k]] = static_cast<double>(i + j) / 2;
      i = j + 1;
    }
    return rank;
  };
  std::vector<double> const ra = ranks(a), rb = ranks(b);
  auto const n = static_cast<double>(a.size());
  double const mean = (n - 1) / 2;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    sab += (ra[i] - mean) * (rb[i] - mean), saa += (ra[i] - mean) * (ra[i] - mean), sbb += (rb[i] - mean) * (rb[i] - mean);
  return sab / std::sqrt(saa * sbb);
}

void BM_gpt_plan(benchmark::State& state) {
  Shape const& shape = shapes[0];
  GptTrainer one(shape);
  mgpu::DeviceGroup group("host:2");
  mgpu::plan::GptCosts const costs = mgpu::plan::measure_gpt_costs(shape.config, group, {1, shape.batch / 2, shape.batch});
  // A budget that the largest quarter of the layouts exceed.
  mgpu::plan::Plan const all = mgpu::plan::plan_gpt(shape.config, shape.batch, group.size(), costs, {});
  std::vector<std::size_t> peaks;
  for (mgpu::plan::Candidate const& c : all.candidates) peaks.push_back(c.peak_bytes);
  std::sort(peaks.begin(), peaks.end());
  std::size_t const budget = peaks[peaks.size() * 3 / 4];
  mgpu::plan::Plan const plan = mgpu::plan::plan_gpt(shape.config, shape.batch, group.size(), costs, {.memory_bytes = budget});
  std::vector<double> predicted, measured;
  double measured_peak = 0;
  for (auto _ : state) {
    // Every layout's trainer (devices of its own), each stepped twice (caches, optimizer state) and
    // its devices' peaks read; then rounds of a few steps of each in turn, so that a change in the
    // machine's load falls on all.
    std::vector<std::unique_ptr<LayoutRun>> runs;
    for (mgpu::plan::Candidate const& c : plan.candidates) {
      runs.push_back(std::make_unique<LayoutRun>(one, c.layout));
      runs.back()->step();
      runs.back()->step();
      for (mgpu::Allocator* a : runs.back()->trainer.allocators())
        measured_peak = std::max(measured_peak, static_cast<double>(a->stats().peak_allocated));
      predicted.push_back(c.step_seconds);
    }
    std::vector<std::vector<double>> step_s(runs.size());
    for (int round = 0; round < 3; ++round)
      for (std::size_t i = 0; i < runs.size(); ++i)
        for (int k = 0; k < 3; ++k) {
          auto const t0 = Clock::now();
          runs[i]->step();
          step_s[i].push_back(seconds_since(t0));
        }
    for (std::vector<double> const& s : step_s) measured.push_back(median(s));
  }
  double const best = *std::min_element(measured.begin(), measured.end());
  state.SetLabel("nano on host:2, " + std::to_string(plan.candidates.size()) + " of " + std::to_string(all.candidates.size()) +
                 " layouts fit; chosen: " + mgpu::plan::to_string(plan.candidates.front().layout));
  state.counters["layouts_considered"] = static_cast<double>(plan.considered);
  state.counters["layouts_fit"] = static_cast<double>(plan.candidates.size());
  state.counters["spearman_predicted_vs_measured_step_time"] = spearman(predicted, measured);
  state.counters["chosen_measured_step_over_fastest"] = measured.front() / best;
  state.counters["chosen_measured_rank"] =
      1 + static_cast<double>(std::count_if(measured.begin(), measured.end(), [&](double m) { return m < measured.front(); }));
  state.counters["budget_bytes_device"] = static_cast<double>(budget);
  state.counters["largest_measured_peak_over_budget"] = measured_peak / static_cast<double>(budget);
}
BENCHMARK(BM_gpt_plan)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(bench::iterations(1));

}  // namespace

BENCHMARK_MAIN();
