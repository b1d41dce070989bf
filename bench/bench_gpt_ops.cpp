// bench_gpt's per-op rows, the step's GEMM calls and activation ops each alone (run by bench_gpt; see
// bench_gpt.cpp for the others):
//   BM_gpt_gemm/<shape>/<call>: one of the float32 GPT step's host GEMM calls alone, at that shape's
//   sizes (M = batch * block rows), as the step issues it (ops::linear with its bias and activation
//   epilogue, ops::gemm with its transposes), repeated on a host stream's worker; timed in turns,
//   each turn followed by the reference 512 x 512 x 512 sgemm (BM_gpt_step's) on the same worker.
//   Both are timed by the worker's own counts (ops::host_gemm_stats, and ops::host_op_seconds'
//   activation family for a GELU epilogue), so enqueueing and synchronizing are not in either. The label names
//   the call (forward qkv/proj/fc/mlp-proj/head, the backward's dx = dz Wᵀ, dW = xᵀ dz, the head's
//   dh and dwte) and its m x n x k:
//     gflops             the call's 2 m n k / its median time per call (GELU epilogue included);
//     sgemm_gflops       the reference sgemm's rate, median over turns;
//     gflops_over_sgemm  gflops / sgemm_gflops per turn (median): the call's rate against the
//                        machine's large-GEMM rate in the same run.
//   BM_gpt_activation/<shape>/<op>: the step's activation ops over its widest activation, [rows, 4 c]
//   (0: GELU forward, the functor of the fc layer's GEMM epilogue, ops::gelu; 1: its backward with
//   the bias gradient, ops::activation_bias_grad; 2: the bias gradient alone, ops::bias_grad, as
//   the layers without activation run it), timed on the worker (ops::host_op_seconds) in turns with
//   two references over the same elements on the same worker: the op's loads and stores with no
//   math (0: a copy, 1: dz = z + dy with the column sums, 2: the column sums), and one exponential
//   per element (exp_in_range, as GELU calls it) with the forward's traffic:
//     ns_per_element          the op's median time / its elements;
//     traffic_ns_per_element  the loads-and-stores reference's, median;
//     exp_ns_per_element      the exponential reference's, median;
//     over_traffic            ns_per_element / traffic_ns_per_element per turn (median): 1 when
//                             the op costs no more than its memory traffic.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/mgpu.hpp>

#include "bench_gpt_support.hpp"

namespace {

using namespace bench::gpt;

// Both shapes; the nano shape alone in a smoke run (GPT-2 small's products take seconds there).
std::vector<std::int64_t> smoke_shapes() { return bench::quick() ? std::vector<std::int64_t>{0} : std::vector<std::int64_t>{0, 1}; }

enum class CallKind { linear, linear_gelu, gemm };

// One GEMM call of the step: C [m, n] = op(A) [m, k] op(B) [k, n], each size in units: 0 = the
// rows (batch * block), -1 = the vocab, u > 0 = u c / 8 for the model's width c (its MLP's is 4 c).
struct Call {
  char const* name;
  CallKind kind;
  bool transpose_a, transpose_b;
  std::int64_t m, n, k;
};
Call const calls[] = {
    {"fwd qkv = x W + b", CallKind::linear, false, false, 0, 24, 8},
    {"fwd attn proj = y W + b", CallKind::linear, false, false, 0, 8, 8},
    {"fwd fc = gelu(x W + b)", CallKind::linear_gelu, false, false, 0, 32, 8},
    {"fwd mlp proj = h W + b", CallKind::linear, false, false, 0, 8, 32},
    {"fwd head = h wte^T", CallKind::gemm, false, true, 0, -1, 8},
    {"bwd head dh = dl wte", CallKind::gemm, false, false, 0, 8, -1},
    {"bwd head dwte = dl^T h", CallKind::gemm, true, false, -1, 8, 0},
    {"bwd mlp proj dx = dz W^T", CallKind::gemm, false, true, 0, 32, 8},
    {"bwd mlp proj dW = h^T dz", CallKind::gemm, true, false, 32, 8, 0},
    {"bwd fc dx = dz W^T", CallKind::gemm, false, true, 0, 8, 32},
    {"bwd fc dW = x^T dz", CallKind::gemm, true, false, 8, 32, 0},
    {"bwd qkv dx = dz W^T", CallKind::gemm, false, true, 0, 8, 24},
    {"bwd qkv dW = x^T dz", CallKind::gemm, true, false, 8, 24, 0},
};

void BM_gpt_gemm(benchmark::State& state) {
  Shape const& shape = shapes[state.range(0)];
  auto const index = static_cast<std::size_t>(state.range(1));
  Call const& call = calls[index];
  std::int64_t const rows = shape.batch * shape.config.block_size, c = shape.config.n_embd;
  auto const size = [&](std::int64_t units) { return units == 0 ? rows : units < 0 ? shape.config.vocab : units * c / 8; };
  std::int64_t const m = size(call.m), n = size(call.n), k = size(call.k);

  mgpu::Device const device{mgpu::DeviceKind::host, 0};
  auto allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto const random = [&](std::int64_t r, std::int64_t cols) {
    mgpu::Tensor t = mgpu::Tensor::empty({r, cols}, mgpu::DType::float32, *allocator);
    for (float& v : t.host_span<float>()) v = normal(rng);
    return t;
  };
  mgpu::Tensor const a = call.transpose_a ? random(k, m) : random(m, k);
  mgpu::Tensor const b = call.transpose_b ? random(n, k) : random(k, n);
  mgpu::Tensor const bias = random(1, n).reshape({n});
  mgpu::Tensor const out = random(m, n), pre = random(m, n);
  auto const run = [&] {
    if (call.kind == CallKind::gemm) mgpu::ops::gemm(a, call.transpose_a, b, call.transpose_b, out, 1.0f, 0.0f, stream);
    else if (call.kind == CallKind::linear) mgpu::ops::linear(a, b, bias, out, mgpu::ops::ActivationKind::identity, {}, stream);
    else mgpu::ops::linear(a, b, bias, out, mgpu::ops::ActivationKind::gelu, pre, stream);
  };
  Sgemm sgemm(*allocator);
  // The worker's seconds in `work`'s GEMMs and their epilogues (a GELU's counts as an activation).
  auto const gemm_seconds = [&](auto&& work) {
    constexpr auto activation = static_cast<std::size_t>(mgpu::ops::HostOpFamily::activation);
    double before = 0, after = 0;
    auto const read = [](double& s) {
      return [&s] { s = mgpu::ops::host_gemm_stats().seconds + mgpu::ops::host_op_seconds().seconds[activation]; };
    };
    stream.enqueue(read(before));
    work();
    stream.enqueue(read(after));
    stream.synchronize();
    return after - before;
  };
  double const flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  // About 50 MFLOP a turn (at least 4 calls), as one step of the nano shape's layers.
  int const repeats = static_cast<int>(std::max(4.0, 5e7 / flops));
  (void)gemm_seconds(run);  // the primitives
  (void)sgemm.seconds(stream);
  std::vector<double> call_s, sgemm_s, ratio;
  for (auto _ : state) {
    double const s = gemm_seconds([&] {
                       for (int r = 0; r < repeats; ++r) run();
                     }) / repeats;
    state.PauseTiming();
    double const reference = gemm_seconds([&] { mgpu::ops::gemm(sgemm.a, false, sgemm.b, false, sgemm.c, 1.0f, 0.0f, stream); });
    state.ResumeTiming();
    call_s.push_back(s);
    sgemm_s.push_back(reference);
    ratio.push_back((flops / s) / (Sgemm::flops() / reference));
  }
  state.SetLabel(std::string(shape.name) + ": " + call.name + ", " + std::to_string(m) + " x " + std::to_string(n) + " x " +
                 std::to_string(k) + ", host GEMM: " + mgpu::host_gemm_backend);
  state.counters["gflops"] = flops / median(call_s) / 1e9;
  state.counters["sgemm_gflops"] = Sgemm::flops() / median(sgemm_s) / 1e9;
  state.counters["gflops_over_sgemm"] = median(ratio);
}
BENCHMARK(BM_gpt_gemm)
    ->ArgsProduct({smoke_shapes(), benchmark::CreateDenseRange(0, static_cast<std::int64_t>(std::size(calls)) - 1, 1)})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->MinTime(bench::min_time(0.5));

void BM_gpt_activation(benchmark::State& state) {
  Shape const& shape = shapes[state.range(0)];
  int const op = static_cast<int>(state.range(1));
  std::int64_t const rows = shape.batch * shape.config.block_size, cols = 4 * shape.config.n_embd, count = rows * cols;
  mgpu::Device const device{mgpu::DeviceKind::host, 0};
  auto allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto const random = [&](std::int64_t n) {
    mgpu::Tensor t = mgpu::Tensor::empty({n}, mgpu::DType::float32, *allocator);
    for (float& v : t.host_span<float>()) v = normal(rng);
    return t;
  };
  mgpu::Tensor const z = random(count).reshape({rows, cols}), dy = random(count).reshape({rows, cols});
  mgpu::Tensor const out = random(count).reshape({rows, cols}), db = random(cols);
  auto const run = [&] {
    if (op == 0) mgpu::ops::gelu(z, out, stream);
    else if (op == 1) mgpu::ops::activation_bias_grad(mgpu::ops::ActivationKind::gelu, z, dy, out, db, stream);
    else mgpu::ops::bias_grad(dy, db, stream);
  };
  auto const op_seconds = [&] {
    std::size_t const activation = static_cast<std::size_t>(mgpu::ops::HostOpFamily::activation);
    double before = 0, after = 0;
    stream.enqueue([&] { before = mgpu::ops::host_op_seconds().seconds[activation]; });
    run();
    stream.enqueue([&] { after = mgpu::ops::host_op_seconds().seconds[activation]; });
    stream.synchronize();
    return after - before;
  };
  // A reference loop over the same elements on the worker, its seconds.
  float const* zp = z.host_span<float>().data();
  float const* dyp = dy.host_span<float>().data();
  float* outp = out.host_span<float>().data();
  std::vector<float> sums(static_cast<std::size_t>(cols));
  auto const worker_seconds = [&](auto const& loop) {
    double s = 0;
    stream.enqueue([&] {
      auto const t0 = Clock::now();
      loop();
      s = seconds_since(t0);
    });
    stream.synchronize();
    return s;
  };
  auto const traffic = [&] {
    float* __restrict acc = sums.data();
    float* __restrict o = outp;
    if (op == 0) {
      for (std::int64_t i = 0; i < count; ++i) o[i] = zp[i];
      return;
    }
    std::fill(sums.begin(), sums.end(), 0.0f);
    for (std::int64_t r = 0; r < rows; ++r) {
      float const* __restrict g = dyp + r * cols;
      if (op == 1) {
        float const* __restrict zr = zp + r * cols;
        for (std::int64_t j = 0; j < cols; ++j) {
          o[r * cols + j] = zr[j] + g[j];
          acc[j] += o[r * cols + j];
        }
      } else {
        for (std::int64_t j = 0; j < cols; ++j) acc[j] += g[j];
      }
    }
    benchmark::DoNotOptimize(sums.data());
  };
  auto const exponential = [&] {
    for (std::int64_t i = 0; i < count; ++i) {
      float const x = zp[i] > -87.0f ? zp[i] : -87.0f;
      outp[i] = mgpu::detail::exp_in_range(x < 88.0f ? x : 88.0f);
    }
  };
  (void)op_seconds();
  std::vector<double> op_s, traffic_s, exp_s, ratio;
  for (auto _ : state) {
    op_s.push_back(op_seconds());
    state.PauseTiming();
    traffic_s.push_back(worker_seconds(traffic));
    exp_s.push_back(worker_seconds(exponential));
    ratio.push_back(op_s.back() / traffic_s.back());
    state.ResumeTiming();
  }
  char const* const names[] = {"GELU forward", "GELU backward + bias gradient", "bias gradient"};
  state.SetLabel(std::string(shape.name) + ": " + names[op] + ", " + std::to_string(rows) + " x " + std::to_string(cols));
  auto const per_element = [&](std::vector<double>& s) { return median(s) / static_cast<double>(count) * 1e9; };
  state.counters["ns_per_element"] = per_element(op_s);
  state.counters["traffic_ns_per_element"] = per_element(traffic_s);
  state.counters["exp_ns_per_element"] = per_element(exp_s);
  state.counters["over_traffic"] = median(ratio);
}
BENCHMARK(BM_gpt_activation)
    ->ArgsProduct({smoke_shapes(), {0, 1, 2}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->MinTime(bench::min_time(0.3));

}  // namespace
