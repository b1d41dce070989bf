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
//     gemm_limit_fraction  step_gflop at sgemm_gflops / the median step time: 1 when everything but
//                        matrix products were free and those ran at the sgemm rate.
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
//   BM_gpt_layouts/<layout>: one training step (clipping 1.0, AdamW) of a mid-sized GPT
//   (n_layer 4, n_head 4, n_embd 256, block 128, batch 8, vocab 256: 3.2 M parameters) in each
//   layout the library has, on host devices: 0 one device, 1 data parallel over host:2 with the
//   replicated update (zero_stage 0), 2 the same with ZeRO-1, 3 ZeRO-1 with full recomputation,
//   4 tensor parallel over host:2 (vocab-parallel embedding, head and loss), 5 a 1F1B pipeline of
//   2 stages and 4 micro-batches over host:2, 6 two data-parallel replicas of tensor parallel over
//   host:2 each (host:4), 7 ZeRO-2 over host:2 (a gradient bucket per block), 8 tensor parallel
//   over host:2 with sequence parallelism, 9 two pipeline stages of tensor parallel 2 each
//   (host:4, 1F1B, 4 micro-batches), 10 ZeRO-3 over host:2 (a bucket per block, each block's
//   parameters gathered before its forward and backward). A short run each:
//     tokens_per_s        batch * block / the median step time;
//     peak_bytes_device   the largest device allocator peak over the timed steps (parameters,
//                         gradients, optimizer state, activations, buffers; as train_gpt --json's
//                         peak_bytes; blocks are reused in stream order, as on a GPU);
//     predicted_peak_bytes_device  the memory model's prediction of that peak
//                         (parallel::predict_gpt_memory);
//     devices             how many devices the layout uses.
//   BM_gpt_plan: the planner (plan::plan_gpt) on the nano shape over host:2: the costs measured
//   (plan::measure_gpt_costs), a budget per device that the largest quarter of the layouts'
//   predicted peaks exceed, then every layout that fits built and stepped (rounds of 3 steps of
//   each in turn, 3 rounds, after 2 untimed steps):
//     layouts_considered, layouts_fit       what the planner weighed, and kept;
//     spearman_predicted_vs_measured_step_time  Spearman's rank correlation between the predicted
//                         and the measured (median) step times of the layouts that fit;
//     chosen_measured_rank                1 when the planner's choice measured fastest;
//     chosen_measured_step_over_fastest   its measured step time / the fastest measured;
//     budget_bytes_device                 the budget;
//     largest_measured_peak_over_budget   the largest allocator peak of any layout that fit /
//                                         the budget (the memory model's error shows above 1).
//   BM_attention/<shape>/<queries>/<keys>: causal attention forward + backward alone on that
//   shape's qkv, in tiles of `queries` query rows x `keys` keys (ops::set_host_attention_tiles;
//   0/0: the library's choice per shape, the rows the choice is read from follow it):
//     online_ms               ops::causal_attention + causal_attention_backward (tiled online
//                             softmax, per-row log-sum-exp kept);
//     gflops                  attention's floating-point work (7 products over the visible
//                             (query, key) pairs, as in step_gflop) / online_ms;
//     sgemm_gflops            the same run's sgemm (as BM_gpt_step's), timed after each turn;
//     gflops_over_sgemm       gflops / sgemm_gflops per turn (median);
//     online_extra_bytes      the per-row log-sum-exp the online path keeps;
//   and for the library's choice, timed in turn with the same through the whole [B, H, T, T]
//   probability matrix (Eigen GEMMs per head, softmax over full rows):
//     naive_tt_ms, naive_tt_time_ratio (naive_tt_ms / online_ms per turn: > 1, the online path
//                             is faster), naive_tt_extra_bytes (the naive path's P and dP),
//     max_abs_diff_y          max |y_online - y_naive| (a check that both compute the same thing).
//
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

#include "bench_support.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Stride = Eigen::OuterStride<>;
using Map = Eigen::Map<Matrix, 0, Stride>;

struct Shape {
  char const* name;
  mgpu::nn::GptConfig config;
  std::int64_t batch;
};
Shape const shapes[] = {
    {"nano", {.vocab = 256, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128}, 12},
    {"gpt2s", {.vocab = 256, .block_size = 256, .n_layer = 12, .n_head = 12, .n_embd = 768}, 4},
};

using bench::median;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

mgpu::optim::AdamWOptions const adamw_options{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

struct GptTrainer {
  static constexpr std::int64_t pool = 8;  // batches of random windows, used in turn
  mgpu::Device device{mgpu::DeviceKind::host, 0};
  std::shared_ptr<mgpu::Allocator> allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  mgpu::nn::Context ctx{*allocator, stream};
  Shape shape;
  mgpu::nn::Sequential model;
  mgpu::optim::AdamW adamw{adamw_options};
  mgpu::nn::TokenCrossEntropy const loss_fn{};
  mgpu::Tensor inputs, targets;
  std::int64_t next = 0;

  explicit GptTrainer(Shape const& s) : shape(s), model(mgpu::nn::gpt(s.config)) {
    model.materialize(ctx, 1);
    std::int64_t const t = s.config.block_size;
    inputs = mgpu::Tensor::empty({pool * s.batch, t}, mgpu::DType::int32, *allocator);
    targets = mgpu::Tensor::empty({pool * s.batch, t}, mgpu::DType::int32, *allocator);
    std::mt19937 rng(7);
    std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(s.config.vocab) - 1);
    auto in = inputs.host_span<std::int32_t>();
    auto out = targets.host_span<std::int32_t>();
    for (std::int64_t w = 0; w < pool * s.batch; ++w) {  // a window of t + 1 tokens: inputs, then targets
      std::int32_t previous = token(rng);
      for (std::int64_t i = 0; i < t; ++i) {
        std::int32_t const following = token(rng);
        in[static_cast<std::size_t>(w * t + i)] = previous;
        out[static_cast<std::size_t>(w * t + i)] = following;
        previous = following;
      }
    }
  }
  [[nodiscard]] std::int64_t tokens() const { return shape.batch * shape.config.block_size; }
  void step() {
    std::int64_t const b = next++ % pool;
    mgpu::Tensor const x = inputs.slice(b * shape.batch, (b + 1) * shape.batch);
    mgpu::Tensor const y = targets.slice(b * shape.batch, (b + 1) * shape.batch);
    (void)mgpu::nn::train_step(model, adamw, x, y, loss_fn, ctx, {.clip_norm = 1.0f});  // the trainers' own step
    stream.synchronize();
  }
};

// The reference sgemm: the library's host GEMM on a float32 512 x 512 x 512 product, run on a
// stream's worker like the step's GEMMs.
struct Sgemm {
  static constexpr std::int64_t n = 512;
  mgpu::Tensor a, b, c;
  explicit Sgemm(mgpu::Allocator& allocator) {
    a = mgpu::Tensor::empty({n, n}, mgpu::DType::float32, allocator);
    b = mgpu::Tensor::empty({n, n}, mgpu::DType::float32, allocator);
    c = mgpu::Tensor::empty({n, n}, mgpu::DType::float32, allocator);
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (mgpu::Tensor const* t : {&a, &b})
      std::generate(t->host_span<float>().begin(), t->host_span<float>().end(), [&] { return d(rng); });
  }
  [[nodiscard]] static double flops() { return 2.0 * n * n * n; }
  // Seconds of one product on the stream's worker.
  double seconds(mgpu::Stream& stream) {
    auto const t0 = Clock::now();
    mgpu::ops::gemm(a, false, b, false, c, 1.0f, 0.0f, stream);
    stream.synchronize();
    return seconds_since(t0);
  }
};

// The floating-point operations of causal attention's forward and backward over `batch`
// sequences: 2 d per visible (query, key) pair for each of its 7 products (forward QK^T and PV;
// backward QK^T again, dY V^T, dV, dK and dQ).
double attention_flops(mgpu::nn::GptConfig const& config, std::int64_t batch) {
  double const t = static_cast<double>(config.block_size), d = static_cast<double>(config.n_embd / config.n_head);
  return 7.0 * 2.0 * d * t * (t + 1) / 2 * static_cast<double>(batch * config.n_head * config.n_layer);
}

void BM_gpt_step(benchmark::State& state) {
  Shape const& shape = shapes[state.range(0)];
  GptTrainer trainer(shape);
  Sgemm sgemm(*trainer.allocator);
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
  state.SetLabel(std::string(shape.name) + ", host GEMM: " + mgpu::host_gemm_backend);
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
  state.counters["sgemm_gflops"] = sgemm_rate / 1e9;
  state.counters["step_gflop"] = step_flops / 1e9;
  state.counters["gemm_limit_fraction"] = step_flops / sgemm_rate / step;
}
BENCHMARK(BM_gpt_step)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(8.0);
BENCHMARK(BM_gpt_step)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

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
BENCHMARK(BM_gpt_recompute)->DenseRange(0, 2)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.5);

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
BENCHMARK(BM_gpt_step_dp)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(8.0);
BENCHMARK(BM_gpt_step_dp)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

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
BENCHMARK(BM_gpt_metrics_update)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(20);

// Causal attention through the whole [B, H, T, T] probability matrix: the path the online softmax
// replaces. Forward S = q kᵀ / sqrt(d) masked, P = softmax(S), y = P v; backward dP = dy vᵀ,
// dS = P (dP - rowsum(P dP)), dq = dS k / sqrt(d), dk = dSᵀ q / sqrt(d), dv = Pᵀ dy.
struct NaiveAttention {
  std::int64_t batch, t, c, heads;
  std::vector<float> p, dp;  // [B, H, T, T]
  NaiveAttention(std::int64_t b, std::int64_t t_, std::int64_t c_, std::int64_t h)
      : batch(b), t(t_), c(c_), heads(h), p(static_cast<std::size_t>(b * h * t_ * t_)), dp(p.size()) {}
  [[nodiscard]] std::int64_t d() const { return c / heads; }
  Map part(float* base, std::int64_t b, std::int64_t h, std::int64_t which, std::int64_t width) const {
    return {base + b * t * width + which * c + h * d(), t, d(), Stride(width)};
  }
  Map probs(std::vector<float>& m, std::int64_t b, std::int64_t h) const {
    return {m.data() + (b * heads + h) * t * t, t, t, Stride(t)};
  }
  void forward(float* qkv, float* y) {
    float const scale = 1.0f / std::sqrt(static_cast<float>(d()));
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < heads; ++h) {
        Map s = probs(p, b, h);
        s.noalias() = part(qkv, b, h, 0, 3 * c) * part(qkv, b, h, 1, 3 * c).transpose() * scale;
        for (std::int64_t i = 0; i < t; ++i) {
          float const max = s.row(i).head(i + 1).maxCoeff();
          s.row(i).head(i + 1) = (s.row(i).head(i + 1).array() - max).exp();
          s.row(i).head(i + 1) /= s.row(i).head(i + 1).sum();
          s.row(i).tail(t - i - 1).setZero();
        }
        part(y, b, h, 0, c).noalias() = s * part(qkv, b, h, 2, 3 * c);
      }
  }
  void backward(float* qkv, float* dy, float* dqkv) {
    float const scale = 1.0f / std::sqrt(static_cast<float>(d()));
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < heads; ++h) {
        Map const s = probs(p, b, h);
        Map ds = probs(dp, b, h);
        ds.noalias() = part(dy, b, h, 0, c) * part(qkv, b, h, 2, 3 * c).transpose();
        for (std::int64_t i = 0; i < t; ++i) {
          float const row = s.row(i).dot(ds.row(i));
          ds.row(i) = s.row(i).array() * (ds.row(i).array() - row) * scale;
        }
        part(dqkv, b, h, 0, 3 * c).noalias() = ds * part(qkv, b, h, 1, 3 * c);
        part(dqkv, b, h, 1, 3 * c).noalias() = ds.transpose() * part(qkv, b, h, 0, 3 * c);
        part(dqkv, b, h, 2, 3 * c).noalias() = s.transpose() * part(dy, b, h, 0, c);
      }
  }
};

// One layout's executor for a GPT on a group (plan::Layout's degrees over all of its devices),
// stepped on the batches of `one` (which trains itself when the layout is one device's).
struct LayoutRun {
  GptTrainer& one;
  std::unique_ptr<mgpu::parallel::DataParallel> dp;
  std::unique_ptr<mgpu::parallel::TensorParallel> tp;
  std::unique_ptr<mgpu::pipeline::Executor> pp;
  std::int64_t next = 0;

  // `bucket_cap`: DataParallelOptions' caps (0: its defaults).
  LayoutRun(GptTrainer& trainer, mgpu::DeviceGroup& group, mgpu::plan::Layout const& layout, std::size_t bucket_cap = 0)
      : one(trainer) {
    mgpu::nn::GptConfig config = one.shape.config;
    config.recompute = layout.recompute;
    if (layout.stages > 1) {
      pp = std::make_unique<mgpu::pipeline::Executor>(
          mgpu::nn::gpt(config), group, layout.cuts, mgpu::pipeline::one_f_one_b(layout.stages, layout.micro_batches),
          [](mgpu::nn::Sequential const& chunk) {
            mgpu::optim::AdamWOptions options = adamw_options;
            options.decay_ranges = chunk.matrix_ranges();
            return std::make_unique<mgpu::optim::AdamW>(options);
          },
          mgpu::pipeline::ExecutorOptions{
              .seed = 1,
              .data_parallel = layout.data_parallel,
              .clip_norm = 1.0f,
              .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>(),
              .tensor_parallel = layout.tensor_parallel > 1 ? mgpu::pipeline::tensor_parallel_stages(config, layout.tensor_parallel,
                                                                                                   layout.sequence_parallel)
                                                            : mgpu::pipeline::TensorParallelStages{}});
    } else if (layout.tensor_parallel > 1) {
      tp = std::make_unique<mgpu::parallel::TensorParallel>(
          group, config,
          mgpu::parallel::TensorParallelOptions{.adamw = adamw_options,
                                                .clip_norm = 1.0f,
                                                .data_parallel = layout.data_parallel,
                                                .sequence_parallel = layout.sequence_parallel});
    } else if (group.size() > 1) {
      mgpu::parallel::DataParallelOptions options;
      options.seed = 1;
      options.clip_norm = 1.0f;
      options.zero_stage = layout.zero_stage;
      if (bucket_cap > 0) options.bucket_cap_bytes = options.first_bucket_cap_bytes = bucket_cap;
      options.loss = std::make_shared<mgpu::nn::TokenCrossEntropy>();
      dp = std::make_unique<mgpu::parallel::DataParallel>(mgpu::nn::gpt(config), group, one.adamw, std::move(options));
    }
  }
  void step() {
    std::int64_t const b = next++ % GptTrainer::pool, rows = one.shape.batch;
    mgpu::Tensor const x = one.inputs.slice(b * rows, (b + 1) * rows);
    mgpu::Tensor const y = one.targets.slice(b * rows, (b + 1) * rows);
    if (dp) {
      (void)dp->step(x, y);
    } else if (tp) {
      (void)tp->step(x, y);
    } else if (pp) {
      (void)pp->step(x, y);
    } else {
      one.step();
    }
  }
};

// The median seconds of `state`'s steps of `run` after one untimed step, and each device's largest
// allocator peak over them (`allocators`).
struct Timed {
  double step_s = 0;
  double peak_bytes = 0;
};
Timed time_steps(benchmark::State& state, LayoutRun& run, std::vector<mgpu::Allocator*> const& allocators) {
  run.step();
  for (mgpu::Allocator* a : allocators) a->reset_peak();
  std::vector<double> step_s;
  for (auto _ : state) {
    auto const t0 = Clock::now();
    run.step();
    step_s.push_back(seconds_since(t0));
  }
  Timed timed{median(step_s), 0.0};
  for (mgpu::Allocator* a : allocators) timed.peak_bytes = std::max(timed.peak_bytes, static_cast<double>(a->stats().peak_allocated));
  return timed;
}

void BM_gpt_layouts(benchmark::State& state) {
  // Each layout: its name, devices, degrees (data, tensor, pipeline with 4 micro-batches), ZeRO
  // stage, sequence parallelism, recomputation, and a bucket per block (ZeRO-2 and 3: 1 MiB caps).
  struct Row {
    char const* name;
    char const* devices;
    int data, tensor, stages, zero;
    bool sequence_parallel;
    mgpu::nn::Recompute recompute;
    bool bucket_per_block;
  };
  using R = mgpu::nn::Recompute;
  static Row const rows[] = {
      {"one device", "host:1", 1, 1, 1, 0, false, R::none, false},
      {"host:2 data parallel, replicated update", "host:2", 2, 1, 1, 0, false, R::none, false},
      {"host:2 data parallel, ZeRO-1", "host:2", 2, 1, 1, 1, false, R::none, false},
      {"host:2 ZeRO-1, full recomputation", "host:2", 2, 1, 1, 1, false, R::full, false},
      {"host:2 tensor parallel", "host:2", 1, 2, 1, 0, false, R::none, false},
      {"host:2 pipeline, 1F1B x 4 micro-batches", "host:2", 1, 1, 2, 0, false, R::none, false},
      {"host:4 data parallel 2 x tensor parallel 2", "host:4", 2, 2, 1, 0, false, R::none, false},
      {"host:2 ZeRO-2, a bucket per block", "host:2", 2, 1, 1, 2, false, R::none, true},
      {"host:2 tensor parallel, sequence parallel", "host:2", 1, 2, 1, 0, true, R::none, false},
      {"host:4 tensor parallel 2 x pipeline 2, 1F1B x 4 micro-batches", "host:4", 1, 2, 2, 0, false, R::none, false},
      {"host:2 ZeRO-3, a bucket per block", "host:2", 2, 1, 1, 3, false, R::none, true},
  };
  Row const& row = rows[state.range(0)];
  Shape shape{"mid", {.vocab = 256, .block_size = 128, .n_layer = 4, .n_head = 4, .n_embd = 256}, 8};
  GptTrainer one(shape);  // its batches feed every layout; it trains only on one device
  mgpu::DeviceGroup group(row.devices);
  mgpu::plan::Layout model{.data_parallel = row.data,
                           .tensor_parallel = row.tensor,
                           .stages = row.stages,
                           .zero_stage = row.zero,
                           .sequence_parallel = row.sequence_parallel,
                           .recompute = row.recompute};
  if (row.stages > 1) {  // two stages cut at the middle cut point, 4 micro-batches
    mgpu::nn::Sequential const whole = mgpu::nn::gpt(shape.config);
    std::vector<std::size_t> const points = whole.cut_points();
    std::size_t const middle = *std::min_element(points.begin(), points.end(), [&](std::size_t a, std::size_t b) {
      auto const off = [&](std::size_t p) { return std::abs(static_cast<double>(p) - static_cast<double>(whole.size()) / 2); };
      return off(a) < off(b);
    });
    model.micro_batches = 4, model.cuts = {0, middle, whole.size()};
  }
  std::size_t const bucket_cap = row.bucket_per_block ? std::size_t{1} << 20 : 0;  // below a block: a bucket each
  LayoutRun run(one, group, model, bucket_cap);
  std::vector<mgpu::Allocator*> allocators;
  for (int r = 0; r < group.size(); ++r) allocators.push_back(group.size() == 1 ? one.allocator.get() : &group.allocator(r));
  Timed const timed = time_steps(state, run, allocators);
  state.SetLabel(std::string(shape.name) + ", " + row.name);
  state.counters["tokens_per_s"] = static_cast<double>(one.tokens()) / timed.step_s;
  state.counters["peak_bytes_device"] = timed.peak_bytes;
  mgpu::nn::GptConfig config = shape.config;
  config.recompute = model.recompute;
  mgpu::parallel::DataParallelOptions const defaults;
  double predicted = 0;
  for (mgpu::parallel::GptMemory const& m : mgpu::parallel::predict_gpt_memory(
           config, shape.batch,
           {.data_parallel = model.data_parallel,
            .tensor_parallel = model.tensor_parallel,
            .zero_stage = model.zero_stage,
            .bucket_cap_bytes = bucket_cap > 0 ? bucket_cap : defaults.bucket_cap_bytes,
            .first_bucket_cap_bytes = bucket_cap > 0 ? bucket_cap : defaults.first_bucket_cap_bytes,
            .cuts = model.cuts,
            .micro_batches = model.micro_batches,
            .sequence_parallel = model.sequence_parallel}))
    predicted = std::max(predicted, static_cast<double>(m.total()));
  state.counters["predicted_peak_bytes_device"] = predicted;
  state.counters["devices"] = static_cast<double>(allocators.size());
}
BENCHMARK(BM_gpt_layouts)->DenseRange(0, 10)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(4);

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
  std::vector<mgpu::Allocator*> allocators;
  for (int r = 0; r < group.size(); ++r) allocators.push_back(&group.allocator(r));
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
    // Every layout's executor, each stepped twice (caches, optimizer state) and its peak read (above
    // what the executors made before it hold); then rounds of a few steps of each in turn, so that a
    // change in the machine's load falls on all.
    std::vector<std::unique_ptr<LayoutRun>> runs;
    for (mgpu::plan::Candidate const& c : plan.candidates) {
      std::vector<double> held;
      for (mgpu::Allocator* a : allocators) {
        a->reset_peak();
        held.push_back(static_cast<double>(a->stats().allocated));
      }
      runs.push_back(std::make_unique<LayoutRun>(one, group, c.layout));
      runs.back()->step();
      runs.back()->step();
      for (std::size_t d = 0; d < allocators.size(); ++d)
        measured_peak = std::max(measured_peak, static_cast<double>(allocators[d]->stats().peak_allocated) - held[d]);
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
BENCHMARK(BM_gpt_plan)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);

void BM_attention(benchmark::State& state) {
  Shape const& shape = shapes[state.range(0)];
  mgpu::ops::AttentionTiles const tiles{state.range(1), state.range(2)};
  bool const chosen = tiles.queries == 0;  // the library's choice: also timed against the naive path
  std::int64_t const batch = shape.batch, t = shape.config.block_size, c = shape.config.n_embd,
                     heads = shape.config.n_head;
  mgpu::Device const device{mgpu::DeviceKind::host, 0};
  auto allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  auto tensor = [&](mgpu::Shape s, float stddev) {
    mgpu::Tensor x = mgpu::Tensor::empty(std::move(s), mgpu::DType::float32, *allocator);
    std::mt19937 rng(static_cast<unsigned>(x.numel()));
    std::normal_distribution<float> n(0.0f, stddev);
    for (float& v : x.host_span<float>()) v = n(rng);
    return x;
  };
  mgpu::Tensor const qkv = tensor({batch, t, 3 * c}, 1.0f);
  mgpu::Tensor const dy = tensor({batch, t, c}, 1.0f);
  mgpu::Tensor const y = tensor({batch, t, c}, 0.0f);
  mgpu::Tensor const dqkv = tensor({batch, t, 3 * c}, 0.0f);
  mgpu::Tensor const lse = mgpu::Tensor::empty({batch, heads, t}, mgpu::DType::float32, *allocator);
  NaiveAttention naive(chosen ? batch : 0, t, c, heads);
  std::vector<float> naive_y(static_cast<std::size_t>(batch * t * c)), naive_dqkv(static_cast<std::size_t>(qkv.numel()));
  Sgemm sgemm(*allocator);
  mgpu::ops::set_host_attention_tiles(tiles);
  auto online = [&] {
    mgpu::ops::causal_attention(qkv, y, lse, heads, stream);
    mgpu::ops::causal_attention_backward(qkv, y, lse, dy, dqkv, heads, stream);
    stream.synchronize();
  };
  auto reference = [&] {  // on the stream's worker too, so both run on one thread in turn
    stream.enqueue([&] {
      naive.forward(qkv.host_span<float>().data(), naive_y.data());
      naive.backward(qkv.host_span<float>().data(), dy.host_span<float>().data(), naive_dqkv.data());
    });
    stream.synchronize();
  };
  online();
  if (chosen) reference();
  (void)sgemm.seconds(stream);
  double const flops = attention_flops({.block_size = t, .n_layer = 1, .n_head = heads, .n_embd = c}, batch);
  std::vector<double> online_s, naive_s, ratio, sgemm_ratio, sgemm_s;
  for (auto _ : state) {
    auto t0 = Clock::now();
    online();
    online_s.push_back(seconds_since(t0));
    state.PauseTiming();
    sgemm_s.push_back(sgemm.seconds(stream));  // in turn: the same load
    sgemm_ratio.push_back(flops / online_s.back() / (Sgemm::flops() / sgemm_s.back()));
    state.ResumeTiming();
    if (!chosen) continue;
    t0 = Clock::now();
    reference();
    naive_s.push_back(seconds_since(t0));
    ratio.push_back(naive_s.back() / online_s.back());
  }
  mgpu::ops::set_host_attention_tiles({});
  state.SetLabel(std::string(shape.name) +
                 (chosen ? ", the library's tiles"
                         : ", tiles " + std::to_string(tiles.queries) + " x " + std::to_string(tiles.keys)));
  state.counters["online_ms"] = median(online_s) * 1e3;
  state.counters["gflops"] = flops / median(online_s) / 1e9;
  state.counters["sgemm_gflops"] = Sgemm::flops() / median(sgemm_s) / 1e9;
  state.counters["gflops_over_sgemm"] = median(sgemm_ratio);
  state.counters["online_extra_bytes"] = static_cast<double>(lse.numel() * 4);
  if (!chosen) return;
  float max_diff = 0.0f;
  auto const got = y.host_span<float>();
  for (std::size_t i = 0; i < naive_y.size(); ++i) max_diff = std::max(max_diff, std::abs(got[i] - naive_y[i]));
  state.counters["naive_tt_ms"] = median(naive_s) * 1e3;
  state.counters["naive_tt_time_ratio"] = median(ratio);
  state.counters["naive_tt_extra_bytes"] = static_cast<double>(2 * naive.p.size() * sizeof(float));
  state.counters["max_abs_diff_y"] = max_diff;
}
BENCHMARK(BM_attention)->Args({0, 0, 0})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_attention)->Args({1, 0, 0})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
// The tiles the choice was measured among (queries x keys).
BENCHMARK(BM_attention)
    ->ArgsProduct({{0, 1}, {16, 32, 64, 128}, {32, 64, 128, 256}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
